"""What the Daytona sandbox and provider share: labels, the verifier-side scripts run through the
SDK (stopping the agent's processes, the core-tool probe), the session script, and how an SDK error
is classified (quota, transient, create failure)."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from daytona import (
    DaytonaError,
    Image,
)
from daytona.common.errors import DaytonaConnectionError, DaytonaTimeoutError

from agentrl.sandbox import shellstate
from agentrl.sandbox.base import (
    ImageBuildError,
    SandboxCreateError,
)
from agentrl.sandbox.terminal import INSTALL_TMUX

if TYPE_CHECKING:
    from agentrl.tasks.task import Task

log = logging.getLogger(__name__)


LABEL_RUN = "agentrl.run-id"


LABEL_TASK = "agentrl.task-id"


LABEL_LAUNCHER = "agentrl.launcher"


LABEL_OWNER = "agentrl.owner"


DEFAULT_LAUNCHER = "agentrl"


# Kills every process but PID 1, the toolbox daemon's (same executable as PID 1), this script's
# own ancestors (the daemon's exec chain) and servers listening on a TCP port (tasks ask for services
# their tests talk to; podman keeps them too), which it names on its output. Unix-socket listeners
# (a terminal's tmux server among them) are not kept. Stopping first, three sweeps, so a fork loop cannot
# outrun it; the daemon must survive, or the sandbox stops answering.
STOP_PROCESSES = r"""
keep=" 1 $$ "; p=$$
while [ "$p" -gt 1 ] 2>/dev/null; do
  p=$(sed -n 's/^PPid:[[:space:]]*//p' /proc/$p/status 2>/dev/null); [ -n "$p" ] || break; keep="$keep$p "
done
daemon=$(readlink /proc/1/exe 2>/dev/null)
listen=" "
for f in /proc/net/tcp /proc/net/tcp6; do
  [ -r $f ] || continue
  while read -r sl local rem st txrx trtm retr uid tmo inode rest; do
    [ "$st" = "0A" ] && listen="$listen$inode "
  done < $f
done
for e in /proc/[0-9]*; do
  q=${e#/proc/}
  case "$keep" in *" $q "*) continue;; esac
  for fd in $e/fd/*; do
    l=$(readlink $fd 2>/dev/null) || continue
    case "$l" in "socket:["*"]") i=${l#socket:[}; i=${i%]}; case "$listen" in *" $i "*)
      keep="$keep$q "; echo "__agentrl_kept $q"; break;; esac;; esac
  done
done
# A kept server's ancestors (a terminal's shell and tmux) are frozen, not killed: their end would
# hang up the server's terminal and end it too.
freeze=" "
for q in $keep; do
  a=$q
  while :; do
    a=$(sed -n 's/^PPid:[[:space:]]*//p' /proc/$a/status 2>/dev/null); [ -n "$a" ] && [ "$a" -gt 1 ] || break
    case "$keep$freeze" in *" $a "*) break;; esac
    [ -n "$daemon" ] && [ "$(readlink /proc/$a/exe 2>/dev/null)" = "$daemon" ] && break
    freeze="$freeze$a "; echo "__agentrl_frozen $a"
  done
done
for sig in STOP STOP STOP KILL KILL; do
  for e in /proc/[0-9]*; do
    q=${e#/proc/}
    case "$keep" in *" $q "*) continue;; esac
    case "$freeze" in *" $q "*) [ $sig = STOP ] || continue;; esac
    [ -n "$daemon" ] && [ "$(readlink $e/exe 2>/dev/null)" = "$daemon" ] && continue
    kill -$sig $q 2>/dev/null
  done
done
true
"""


# The verifier's own steps (the kill above, the `find` of `tampered_paths`, the exec wrapper) run the
# sandbox's shells and tools, which the agent may have replaced. So their content is recorded when
# the sandbox starts, before the agent's first command, and compared before verifying; both reads go
# through the toolbox daemon's file API (Go `os.Open` + `io.Copy` in `fs/download_files.go`,
# `os.ReadDir` in `fs/list_files.go` of daytonaio/daytona), never through a sandbox binary.
CORE_TOOLS = (
    "sh", "bash", "dash", "zsh", "env", "timeout", "find", "sed", "readlink", "cat", "rm", "mkdir",
    "chmod", "tar", "wc", "head", "tail", "kill", "runuser", "su",
)  # fmt: skip


PATH_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


# Each tool's resolved file and the shared libraries it loads (`ldd`), printed one path a line.
CORE_PROBE = (
    f'for t in {" ".join(CORE_TOOLS)}; do p=$(command -v "$t" 2>/dev/null) || continue; '
    'case "$p" in /*) ;; *) continue;; esac; readlink -f "$p"; '
    "ldd \"$p\" 2>/dev/null | sed -n 's|.*=> \\(/[^ ]*\\) (.*|\\1|p; s|^[[:space:]]*\\(/[^ ]*\\) (.*|\\1|p'; "
    "done; true"
)


# Paths whose appearance alone hijacks the verifier: every PATH spelling of a core tool (a new
# `/usr/local/bin/sh` shadows `/usr/bin/sh`) and the dynamic loader's preload list.
SHADOW_PATHS = tuple(f"{d}/{t}" for d in PATH_DIRS for t in CORE_TOOLS) + ("/etc/ld.so.preload",)


PREPARE_LOGS = "mkdir -p /logs/verifier /logs/agent /logs/artifacts && chmod 777 /logs /logs/*"


NO_TIMEOUT_S = 7 * 24 * 3600  # `timeout` still runs, for its process group, when the caller sets none


# An agent's command in its shell session (`shellstate.py`): `bash -c SESSION_SCRIPT bash STATE DIR
# CMD` restores the state committed in STATE, runs CMD and saves its state into DIR/st, which the
# wrapper adopts as STATE unless the command was killed.
SESSION_SCRIPT = (
    "__ar_S=$1 __ar_D=$2 __ar_c=$3; set --\n"
    + shellstate.FUNCTIONS
    + '__ar_names "$__ar_D/n"; shopt -u extglob; shopt -s expand_aliases; __ar_u="unset -v ${__ar_vs[*]}"; '
    + "unset __ar_vs\n"
    + shellstate.save_on_exit("$__ar_D/st")
    + "\n"
    + shellstate.restore("$__ar_S")
    + "\n"
    + shellstate.RUN
    + "\n"
)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


_USER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\$?$")


_QUOTA = re.compile(
    r"quota|limit exceeded|exceeds? (?:the )?(?:maximum|limit)|maximum allowed|depleted|suspended|"
    r"insufficient (?:credits|funds)|payment required",
    re.IGNORECASE,
)


_TRY_LATER = re.compile(r"try again later|temporarily", re.IGNORECASE)


DaytonaClientFactory = Callable[[], Any]


def _new_state_dir() -> str:
    return f"/tmp/.agentrl-session-{uuid.uuid4().hex}"


class SandboxQuotaError(SandboxCreateError):
    """Daytona refused a sandbox for quota or limit reasons (org cpu/memory/disk totals, per-sandbox
    maximums, credits). Never retried: waiting does not help; free capacity or raise the limits."""

    cause = "sandbox_quota"


class _TransientCreateError(SandboxCreateError):
    """A create attempt that failed in a way worth retrying (throttling, 5xx, connection, timeout)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _sanitize(value: str, limit: int = 63) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:limit] or "x"


def _retry_after(exc: DaytonaError) -> float | None:
    raw = {k.lower(): v for k, v in exc.headers.items()}.get("retry-after")
    try:
        return float(raw) if raw is not None else None
    except (TypeError, ValueError):
        return None


def classify_create_error(exc: BaseException, task_id: str) -> SandboxCreateError:
    """Map an SDK failure of `create` to agentrl's typed error; `_TransientCreateError` is retried."""
    msg = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    status = getattr(exc, "status_code", None)
    where = f"creating a Daytona sandbox for {task_id}"
    if isinstance(exc, DaytonaError):
        if status == 402 or (_QUOTA.search(msg) and not _TRY_LATER.search(msg)):
            return SandboxQuotaError(
                f"{where} was refused for quota or limits (HTTP {status}): {msg} -- free capacity "
                "(`agentrl sandbox reap --backend daytona`), lower the task's resources, or raise the "
                "organization's limits at https://app.daytona.io/dashboard/limits"
            )
        if _TRY_LATER.search(msg):
            return _TransientCreateError(f"{where}: HTTP {status}: {msg}", retry_after_s=_retry_after(exc))
        if status in (401, 403):
            return SandboxCreateError(
                f"{where} was refused (HTTP {status}): {msg} -- check DAYTONA_API_KEY / "
                "DAYTONA_API_KEY_FILE and DAYTONA_API_URL"
            )
        if status == 429 or (status is not None and status >= 500) or status == 408:
            return _TransientCreateError(f"{where}: HTTP {status}: {msg}", retry_after_s=_retry_after(exc))
        if isinstance(exc, DaytonaConnectionError | DaytonaTimeoutError):
            return _TransientCreateError(f"{where}: {type(exc).__name__}: {msg}")
        if "build" in msg.lower() and "fail" in msg.lower():
            return ImageBuildError(f"{where}: the image build failed: {msg}")
        return SandboxCreateError(f"{where} failed (HTTP {status}): {msg}")
    if isinstance(exc, TimeoutError | ConnectionError | OSError):
        return _TransientCreateError(f"{where}: {type(exc).__name__}: {msg}")
    return SandboxCreateError(f"{where} failed: {type(exc).__name__}: {msg}")


def _last_user(dockerfile: str) -> str | None:
    user = None
    for line in dockerfile.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0].upper() == "USER":
            user = parts[1].strip()
    return user


def image_for(task: Task) -> Image:
    """The Daytona image of a task: its Dockerfile (with build context) or its `docker_image`, plus
    root layers that prepare /logs and install tmux where it is missing (for `open_terminal`;
    Daytona's builder has the network); the task's last `USER` is restored after them."""
    env = task.config.environment
    if task.dockerfile is not None:
        image = Image.from_dockerfile(task.dockerfile.resolve(), strict_context=True)
    elif env.docker_image:
        image = Image.base(env.docker_image)
    else:
        raise SandboxCreateError(
            f"{task.task_id}: no environment/Dockerfile and no docker_image in task.toml: give the task one"
        )
    user = _last_user(image.dockerfile())
    # Appended text is glued onto a last line that has no newline: start with an empty line then.
    lines = [] if image.dockerfile().endswith("\n") else [""]
    lines += ["USER root", f"RUN {PREPARE_LOGS}", f"RUN {INSTALL_TMUX}"]
    if user and user not in ("root", "0", "0:0"):
        lines.append(f"USER {user}")
    image.dockerfile_commands(lines)
    return image
