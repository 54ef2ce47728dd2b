"""Daytona sandboxes on the `daytona` SDK's `AsyncDaytona`: the production backend.

- Images: the task's `environment/Dockerfile` with its build context (`Image.from_dockerfile`, so
  Daytona builds and caches it as a snapshot), or `docker_image`; either way one layer is added that
  prepares `/logs/{verifier,agent,artifacts}` as root, so a create needs no extra round trip.
- Isolation and size: `network_block_all` unless the task allows internet (a task's
  `allowed_hosts` become Daytona's `domain_allow_list`, which Daytona enforces); cpu, memory and
  disk from task.toml rounded up to whole units, with floors.
- Lifetime: labels (run id, task id, launcher, owner) let `reap_daytona` find what a dead process
  left behind; auto-stop, auto-delete and a TTL are backstops; a keepalive refreshes activity while
  the model thinks (model latency is not sandbox activity, so auto-stop would otherwise fire
  mid-episode). Sandboxes are deleted on close, on cancellation (shielded) and at interpreter exit.
- Create under load: a concurrency limit, jittered exponential backoff on throttling and transient
  errors, `SandboxQuotaError` (never retried) for quota and limit errors with the provider's
  message. Each attempt has a unique name, so a create that is cancelled or times out midway is
  found by name and deleted.
- exec: one POSIX `sh` wrapper per command runs it with bash under `timeout` (its own process group,
  so a timeout or a cancellation kills everything it started), as the requested user, in `cwd`,
  with `env`; stdout and stderr are captured to files inside the sandbox, bounded there (head +
  tail) and sent back framed by a random nonce, so one `process.exec` round trip returns both
  streams and the exit code. Commands that may outlive `exec_limit_s` (the HTTP request of
  `process.exec`) run the same wrapper through a session command with `run_async` and polling.
  The agent's commands (no cwd, env or user) share a shell session (`shellstate.py`) kept in a
  directory of the sandbox that only they read; other commands start clean.
- Terminal: `open_terminal` runs tmux in the sandbox through the same exec (`terminal.py`).
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import io
import logging
import math
import os
import re
import shlex
import socket
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from daytona import (
    AsyncDaytona,
    CreateSandboxFromImageParams,
    DaytonaError,
    DaytonaNotFoundError,
    FileDownloadRequest,
    FileUpload,
    Image,
    ListSandboxesQuery,
    Resources,
    SessionExecuteRequest,
)
from daytona.common.errors import DaytonaConnectionError, DaytonaTimeoutError
from daytona_toolbox_api_client_async import ExecuteRequest as ToolboxExecuteRequest
from daytona_toolbox_api_client_async import ExecuteResponse as ToolboxExecuteResponse
from daytona_toolbox_api_client_async import SessionCommandLogsResponse as ToolboxSessionLogs
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from agentrl.errors import AgentRLError
from agentrl.sandbox import shellstate
from agentrl.sandbox.base import (
    DEFAULT_OUTPUT_LIMIT,
    SYSTEM_PREFIXES,
    ExecResult,
    ImageBuildError,
    Sandbox,
    SandboxCreateError,
    SandboxError,
    SandboxPolicyError,
    SandboxProvider,
    SandboxTransportError,
    TerminalSession,
    bound_output,
    tampered,
)
from agentrl.sandbox.credentials import DaytonaCredentials
from agentrl.sandbox.terminal import INSTALL_TMUX, TmuxTerminal
from agentrl.tasks.config import resolve_env_templates

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


class DaytonaSandbox(Sandbox):
    """One started Daytona sandbox; created by `DaytonaProvider.create`."""

    def __init__(
        self, provider: DaytonaProvider, sdk_sandbox: Any, task_id: str, workdir: str | None
    ) -> None:
        self.provider = provider
        self.sdk = sdk_sandbox
        self.sandbox_id: str = sdk_sandbox.id
        self.task_id = task_id
        self.workdir = workdir
        self.output_limit = provider.output_limit
        self._closed = False
        self._session_id: str | None = None
        self._session_lock = asyncio.Lock()
        self._last_activity = time.monotonic()
        self._keepalive: asyncio.Task[None] | None = None
        self.created_at = time.time()
        self._core: dict[str, str | None] | None = None  # see record_baseline
        self._core_clean: bool | None = None  # compared after the verifier's kill: unchanged
        self._started_clock: int | None = None  # the sandbox's clock (epoch s) before the agent ran
        self._infra: dict[str, tuple[str, str]] | None = None
        self._state_dir = _new_state_dir()  # the agent's shell session (shellstate.py)
        self._terminals: list[TmuxTerminal] = []

    def __repr__(self) -> str:
        return f"DaytonaSandbox({self.sandbox_id!r}, task={self.task_id!r})"

    # -- exec ------------------------------------------------------------------------------------
    def _script(
        self,
        cmd: str,
        nonce: str,
        *,
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
        user: str | int | None,
        session: bool = False,
    ) -> str:
        for key in env or {}:
            if not _ENV_NAME.match(key):
                raise AgentRLError(f"environment variable name {key!r} is not a valid shell name")
        if user is not None and not _USER_NAME.match(str(user)):
            raise AgentRLError(f"user {user!r} is not a valid user name or uid")
        seconds = NO_TIMEOUT_S if timeout is None else max(timeout, 0.01)
        assigns = " ".join(shlex.quote(f"{k}={v}") for k, v in (env or {}).items())
        # `$__ar_sh` (bash, or sh where an image has no bash) is expanded by the wrapper's subshell.
        inner = f'env {assigns} "$__ar_sh" -c {shlex.quote(cmd)}'
        if user is not None and str(user) not in ("root", "0"):
            u = shlex.quote(str(user))
            su_arg = (
                shlex.quote(f"exec env {assigns} ") + '"$__ar_sh"' + shlex.quote(f" -c {shlex.quote(cmd)}")
            )
            run = (
                f"if command -v runuser >/dev/null 2>&1; then exec timeout -k 5 {seconds:.3f} runuser -u {u} "
                f"-- {inner}; else exec timeout -k 5 {seconds:.3f} su -s /bin/sh {u} -c {su_arg}; fi"
            )
        else:
            run = f"exec timeout -k 5 {seconds:.3f} {inner}"
        commit = ""
        if session:
            # bash only (a shell without `declare` keeps no session); the state is adopted unless
            # the command was killed by its timeout (124, 137) or saved nothing.
            state = shlex.quote(self._state_dir)
            run = (
                f'if [ "$__ar_sh" = bash ]; then exec timeout -k 5 {seconds:.3f} bash -c '
                f"{shlex.quote(SESSION_SCRIPT)} bash {state} $d {shlex.quote(cmd)}; else {run}; fi"
            )
            commit = (
                f'if [ "$rc" != 124 ] && [ "$rc" != 137 ] && [ -s $d/st/s ]; then '
                f"rm -rf {state} && mv $d/st {state}; fi\n"
            )
        cd = f"cd -- {shlex.quote(cwd)} || exit 1; " if cwd else ""
        half = self.output_limit // 2
        d = f"/tmp/.agentrl-exec-{nonce}"
        return (
            f"d={d}; mkdir -p $d/st || exit 125\n"
            "if command -v bash >/dev/null 2>&1; then __ar_sh=bash; else __ar_sh=sh; fi\n"
            f"( {cd}{run} ) </dev/null >$d/o 2>$d/e &\n"
            f"echo $! >$d/p; wait $!; rc=$?\n{commit}"
            f'emit() {{ s=$(wc -c <"$1"); if [ "$s" -gt {2 * half} ]; then head -c {half} "$1"; '
            f'printf \'\\n__AGENTRL_CUT_{nonce} %s\\n\' "$s"; tail -c {half} "$1"; '
            'else cat "$1"; fi; }\n'
            f"printf '__AGENTRL_OUT_{nonce}\\n'; emit $d/o; printf '\\n__AGENTRL_ERR_{nonce}\\n'; emit $d/e; "
            f"printf '\\n__AGENTRL_END_{nonce} %s\\n' \"$rc\"; rm -rf $d\n"
        )

    def _section(self, text: str, nonce: str) -> str:
        cut = re.search(rf"\n__AGENTRL_CUT_{nonce} (\d+)\n", text)
        if cut is None:
            return bound_output(text, self.output_limit)
        head, tail = text[: cut.start()], text[cut.end() :]
        omitted = int(cut.group(1)) - 2 * (self.output_limit // 2)
        return f"{head}\n[... {omitted} bytes omitted ...]\n{tail}"

    def _parse(self, raw: str, nonce: str) -> tuple[str, str, int]:
        out_tag, err_tag = f"__AGENTRL_OUT_{nonce}\n", f"\n__AGENTRL_ERR_{nonce}\n"
        end = re.search(rf"\n__AGENTRL_END_{nonce} (-?\d+)", raw)
        i, j = raw.find(out_tag), raw.find(err_tag)
        if i < 0 or j < i or end is None or end.start() < j:
            # The toolbox answered, so the sandbox is there: the command itself broke the wrapper
            # (killed it, filled the disk, wrote into its stdout). A policy outcome, never infra.
            raise SandboxPolicyError(
                f"daytona sandbox {self.sandbox_id}: the command wrapper's reply is incomplete "
                f"(the command killed its shell, filled the disk or wrote into the reply): {raw[-500:]!r}",
                cause="shell_protocol",
            )
        out = raw[i + len(out_tag) : j]
        err = raw[j + len(err_tag) : end.start()]
        return self._section(out, nonce), self._section(err, nonce), int(end.group(1))

    async def _exec(
        self,
        cmd: str,
        *,
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
        user: str | int | None,
        session: bool,
    ) -> ExecResult:
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        nonce = uuid.uuid4().hex
        script = self._script(
            cmd, nonce, timeout=timeout, cwd=cwd or self.workdir, env=env, user=user, session=session
        )
        wrapped = f"sh -c {shlex.quote(script)}"
        start = time.monotonic()
        self._last_activity = start
        try:
            if timeout is not None and timeout <= self.provider.exec_limit_s:
                raw = await self._exec_request(wrapped, timeout)
            else:
                raw = await self._exec_session(wrapped, timeout)
        except asyncio.CancelledError:
            self._kill_in_background(nonce)
            raise
        except TimeoutError as exc:
            self._kill_in_background(nonce)
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: no reply to a command within its timeout plus grace"
            ) from exc
        except DaytonaError as exc:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: exec failed: {exc.message}"
            ) from exc
        except (
            aiohttp.ClientError,
            ConnectionError,
        ) as exc:  # the toolbox calls made without the SDK's wrapper
            raise SandboxTransportError(f"daytona sandbox {self.sandbox_id}: exec failed: {exc!r}") from exc
        finally:
            self._last_activity = time.monotonic()
        out, err, rc = self._parse(raw, nonce)
        duration = time.monotonic() - start
        timed_out = timeout is not None and rc in (124, 137) and duration >= timeout * 0.98
        return ExecResult(out, err, None if timed_out else rc, timed_out, duration)

    async def _exec_request(self, wrapped: str, timeout: float) -> str:
        grace = self.provider.exec_grace_s
        server_timeout = math.ceil(timeout + grace)
        api = self.sdk.process._api_client  # the toolbox's generated `ProcessApi`, as `process.exec` uses it
        request = ToolboxExecuteRequest(command=wrapped, timeout=server_timeout)

        async def call() -> str:
            resp = await api.execute_command_without_preload_content(
                request=request, _request_timeout=float(server_timeout + 5)
            )
            body = await self._bounded_body(resp, "a command")
            if resp.status == 408:
                raise TimeoutError(body[:300].decode(errors="replace"))
            if resp.status != 200:
                raise SandboxTransportError(
                    f"daytona sandbox {self.sandbox_id}: exec failed: HTTP {resp.status}: "
                    f"{body[:500].decode(errors='replace')}"
                )
            return ToolboxExecuteResponse.from_json(body.decode(errors="replace")).result or ""

        return await asyncio.wait_for(call(), timeout + 2 * grace)

    def reply_limit(self) -> int:
        """The largest reply a command's wrapper can send: two streams bounded inside the sandbox
        to `output_limit` bytes each, JSON-escaped (up to 6 bytes a byte), and the frame. Anything
        longer was written into the reply by the command itself."""
        return 12 * self.output_limit + 64 * 1024

    async def _bounded_body(self, resp: Any, what: str) -> bytes:
        """Read an HTTP reply of the toolbox without ever holding more than `reply_limit` bytes:
        the SDK's own calls read whole bodies, and a command can write gigabytes into its reply."""
        limit = self.reply_limit()
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := await resp.content.read(1 << 16):
                size += len(chunk)
                if size > limit:
                    resp.close()  # drop the connection rather than drain it
                    raise SandboxPolicyError(
                        f"daytona sandbox {self.sandbox_id}: the reply to {what} is over {limit} bytes "
                        "(the command wrote into its wrapper's output)",
                        cause="shell_protocol",
                    )
                chunks.append(chunk)
        finally:
            resp.release()
        return b"".join(chunks)

    async def _session(self) -> str:
        async with self._session_lock:
            if self._session_id is None:
                sid = f"agentrl-{uuid.uuid4().hex[:12]}"
                await asyncio.wait_for(self.sdk.process.create_session(sid, request_timeout=60), 90)
                self._session_id = sid
            return self._session_id

    async def _exec_session(self, wrapped: str, timeout: float | None) -> str:
        """Long commands: start asynchronously in a session, poll for the exit code, read the logs."""
        sid = await self._session()
        resp = await asyncio.wait_for(
            self.sdk.process.execute_session_command(
                sid, SessionExecuteRequest(command=wrapped, run_async=True), timeout=60
            ),
            90,
        )
        limit = NO_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + limit + self.provider.exec_grace_s
        poll = self.provider.session_poll_s
        while True:
            command = await asyncio.wait_for(
                self.sdk.process.get_session_command(sid, resp.cmd_id, request_timeout=60), 90
            )
            if command.exit_code is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"session command {resp.cmd_id} still running past its timeout")
            await asyncio.sleep(poll)
            poll = min(poll * 1.5, self.provider.session_poll_max_s)
        api = self.sdk.process._api_client

        async def logs() -> str:
            reply = await api.get_session_command_logs_without_preload_content(
                session_id=sid, command_id=resp.cmd_id, _request_timeout=120.0
            )
            body = await self._bounded_body(reply, "a session command's logs")
            if reply.status != 200:
                raise SandboxTransportError(
                    f"daytona sandbox {self.sandbox_id}: reading a command's logs failed: HTTP {reply.status}: "
                    f"{body[:500].decode(errors='replace')}"
                )
            parsed = ToolboxSessionLogs.from_json(body.decode(errors="replace"))
            return parsed.stdout if parsed.stdout is not None else (parsed.output or "")

        return await asyncio.wait_for(logs(), 150)

    def _kill_in_background(self, nonce: str) -> None:
        """The client gave up on a command; the command itself still runs inside. Kill its process
        group without making the cancelled caller wait."""
        if self._closed:
            return
        d = f"/tmp/.agentrl-exec-{nonce}"
        script = f'p=$(cat {d}/p 2>/dev/null) && {{ kill -9 "-$p" 2>/dev/null || kill -9 "$p"; }}; rm -rf {d}'
        self.provider._spawn(self.sdk.process.exec(f"sh -c {shlex.quote(script)}", timeout=30), 45)

    # -- terminal ---------------------------------------------------------------------------------
    async def open_terminal(self, *, width: int = 160, height: int = 40) -> TerminalSession:
        """A tmux session in the sandbox, every tmux command one clean `exec` round trip. Daytona's
        own PTY sessions are not used: Terminus-2's semantics are tmux's (key names, the screen
        as `capture-pane` renders it, the scrollback), which a raw PTY stream does not give."""
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        term = await TmuxTerminal.start(
            self._exec_clean_for_terminal,
            width=width,
            height=height,
            where=f"daytona sandbox {self.sandbox_id}",
            hint="the Daytona image layer that installs it found no package manager or no mirror",
        )
        self._terminals.append(term)
        return term

    async def _exec_clean_for_terminal(self, cmd: str, timeout: float) -> ExecResult:
        return await self._exec_clean(cmd, timeout=timeout)

    def _end_terminals(self) -> None:
        for term in self._terminals:
            term.mark_closed()
        self._terminals.clear()

    # -- the verifier's trusted view (file API only) ------------------------------------------------
    async def record_baseline(self, core: dict[str, str | None] | None = None) -> dict[str, str | None]:
        """Before the agent's first command: the processes the sandbox runs by itself (toolbox
        daemon, init, their helpers) and the content of the verifier's core files (`CORE_TOOLS`
        with their libraries and loader, `SHADOW_PATHS`). `core` reuses a record made on another
        sandbox of the same image; the record is returned for that purpose."""
        probe = await self._exec_clean(
            ("date +%s; " + CORE_PROBE) if core is None else "date +%s", timeout=120
        )
        first, _, rest = probe.stdout.partition("\n")
        self._started_clock = int(first) if first.strip().isdigit() else None
        if core is None:
            found = {p for p in rest.splitlines() if p.startswith("/")}
            core = await self._digests(sorted(found | set(SHADOW_PATHS)))
        self._core = core
        self._infra = await self._processes()
        return core

    async def _digests(self, paths: list[str]) -> dict[str, str | None]:
        """sha256 of each path's content as the daemon reads it (symlinks followed), None if absent."""
        requests = [FileDownloadRequest(source=p) for p in paths]
        try:
            responses = await asyncio.wait_for(
                self.sdk.fs.download_files(requests, timeout=self.provider.transfer_timeout_s),
                self.provider.transfer_timeout_s + 30,
            )
        except (DaytonaError, TimeoutError) as exc:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: reading the verifier's core files failed: {exc}"
            ) from exc
        digests: dict[str, str | None] = {}
        for path, resp in zip(paths, responses, strict=True):
            if resp.error or resp.result is None:
                digests[path] = None
                continue
            data = resp.result if isinstance(resp.result, bytes) else Path(resp.result).read_bytes()
            digests[path] = hashlib.sha256(data).hexdigest()
        return digests

    async def _processes(self) -> dict[str, tuple[str, str]]:
        """Live processes as {pid: (state, comm)} from `/proc` through the file API."""
        try:
            entries = await asyncio.wait_for(self.sdk.fs.list_files("/proc", request_timeout=60), 90)
            pids = [e.name for e in entries if e.name.isdigit()]
            responses = await asyncio.wait_for(
                self.sdk.fs.download_files(
                    [FileDownloadRequest(source=f"/proc/{p}/stat") for p in pids], timeout=60
                ),
                90,
            )
        except (DaytonaError, TimeoutError) as exc:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: listing /proc failed: {exc}"
            ) from exc
        found: dict[str, tuple[str, str]] = {}
        for pid, resp in zip(pids, responses, strict=True):
            if resp.error or resp.result is None:
                continue  # exited between the listing and the read
            data = resp.result if isinstance(resp.result, bytes) else Path(resp.result).read_bytes()
            stat = data.decode(errors="replace")
            # `pid (comm) state ...`; comm may hold spaces and parentheses: split at the last ')'.
            head, _, rest = stat.rpartition(")")
            comm = head.partition("(")[2]
            state = rest.split()[0] if rest.split() else "?"
            found[pid] = (state, comm)
        return found

    async def _core_changes(self) -> list[str]:
        if self._core is None:
            return []
        now = await self._digests(sorted(self._core))
        return sorted(p for p, digest in now.items() if digest != self._core[p])

    async def stop_processes(self) -> None:
        """Kill what the agent started, then check from outside that it worked: the kill runs the
        sandbox's own shell, so core files changed since the start, or a process of the agent's
        still alive afterwards (other than a server listening on a socket, which is kept), mean
        the agent subverted it (`tampered`, a policy outcome). The core files are compared after
        the kill, when nothing of the agent's can change them back any more."""
        self._end_terminals()
        try:
            res = await self._exec_clean(STOP_PROCESSES, timeout=120)
        except SandboxPolicyError:
            # The kill's own shell gave no proper reply: a replaced shell says why more precisely.
            changed = await self._core_changes() if self._core is not None else []
            if changed:
                raise SandboxPolicyError(
                    f"daytona sandbox {self.sandbox_id}: files the verifier runs were replaced: "
                    + ", ".join(changed[:10]),
                    cause="system_files",
                ) from None
            raise
        kept = set(re.findall(r"^__agentrl_(?:kept|frozen) (\d+)$", res.stdout, re.MULTILINE))
        self._session_id = None  # its shell was killed with the rest
        self._state_dir = _new_state_dir()  # the verifier never sees the agent's shell session
        if self._core is not None and self._core_clean is None:
            changed = await self._core_changes()
            if changed:
                raise SandboxPolicyError(
                    f"daytona sandbox {self.sandbox_id}: files the verifier runs were replaced: "
                    + ", ".join(changed[:10]),
                    cause="system_files",
                )
            self._core_clean = True  # for tampered_paths: nothing of the agent's runs any more
        if self._infra is None:
            return
        infra_names = {comm for _, comm in self._infra.values()}
        survivors: dict[str, tuple[str, str]] = {}
        for _ in range(3):
            live = await self._processes()
            survivors = {
                pid: (state, comm)
                for pid, (state, comm) in live.items()
                if pid not in self._infra
                and pid not in kept
                and state not in ("Z", "X")
                and comm not in infra_names
            }
            if not survivors:
                return
            await asyncio.sleep(0.5)
        shown = ", ".join(f"{pid} ({comm}, {state})" for pid, (state, comm) in sorted(survivors.items())[:10])
        raise SandboxPolicyError(
            f"daytona sandbox {self.sandbox_id}: processes survived the verifier's kill: {shown}",
            cause="system_files",
        )

    async def tampered_paths(self) -> list[str] | None:
        """Daytona has no `diff` against the image. First the core files (`record_baseline`),
        compared through the file API; with those intact, the sandbox's own `find` can be trusted
        for the rest: files whose status changed since the sandbox was created (`find -newerct`: a
        ctime cannot be set back) under the system prefixes, and suspicious additions anywhere."""
        if not self._core_clean:
            changed_core = await self._core_changes()
            if changed_core:
                return changed_core
        # The sandbox's own clock when it started (`record_baseline`), else the host's with slack.
        since = self._started_clock - 1 if self._started_clock is not None else int(self.created_at) - 120
        prune = " -o ".join(f"-path {p}" for p in ("/proc", "/sys", "/dev", "/run", "/tmp", "/logs"))
        name = f".agentrl-tamper-{uuid.uuid4().hex}"
        # The list travels as a file through the file API: the exec reply passes the sandbox's `cat`.
        await self._exec_clean(
            f"find / -xdev \\( {prune} \\) -prune -o ! -type d -newerct @{since} -print > /tmp/{name} 2>/dev/null",
            timeout=300,
        )
        with tempfile.TemporaryDirectory(prefix="agentrl-tamper-") as tmp:
            if not await self.fetch_files("/tmp", [name], Path(tmp)):
                return ["/tmp (the list of changed files could not be written)"]
            listing = (Path(tmp) / name).read_text(errors="replace")
        await self._exec_clean(f"rm -f /tmp/{name}", timeout=60)
        paths = [p for p in listing.splitlines() if p.startswith("/")]
        changed = [p for p in paths if p.startswith(SYSTEM_PREFIXES) and not p.startswith("/usr/local/")]
        return tampered(changed, [], paths)

    async def fetch_files(self, directory: str, names: list[str], dst: Path) -> list[str]:
        """All files in one request to the toolbox's file API: no `test` or `tar` run by the
        sandbox, whose binaries the agent may have replaced."""
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        requests = [FileDownloadRequest(source=f"{directory.rstrip('/')}/{n}") for n in names]
        try:
            responses = await asyncio.wait_for(
                self.sdk.fs.download_files(requests, timeout=self.provider.transfer_timeout_s),
                self.provider.transfer_timeout_s + 30,
            )
        except (DaytonaError, TimeoutError) as exc:
            raise SandboxTransportError(f"daytona sandbox {self.sandbox_id}: download failed: {exc}") from exc
        dst.mkdir(parents=True, exist_ok=True)
        present = []
        for name, resp in zip(names, responses, strict=True):
            if resp.error or resp.result is None:
                continue
            data = resp.result if isinstance(resp.result, bytes) else Path(resp.result).read_bytes()
            (dst / name).write_bytes(data)
            present.append(name)
        return present

    # -- files -----------------------------------------------------------------------------------
    async def _checked(self, cmd: str, what: str) -> ExecResult:
        res = await self._exec_clean(cmd, timeout=120)
        if res.exit_code != 0:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: {what} failed: {(res.stderr or res.stdout)[-500:]}"
            )
        return res

    async def upload(self, src: Path, dst: str) -> None:
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        src = Path(src)
        if not src.exists():
            raise AgentRLError(f"upload source {src} does not exist")
        if src.is_dir():
            files = sorted(p for p in src.rglob("*") if p.is_file())
            pairs = [(p, f"{dst.rstrip('/')}/{p.relative_to(src).as_posix()}") for p in files]
            dirs = {dst} | {
                f"{dst.rstrip('/')}/{p.relative_to(src).as_posix()}" for p in src.rglob("*") if p.is_dir()
            }
        else:
            pairs = [(src, dst)]
            dirs = set()
        dirs |= {os.path.dirname(remote) or "/" for _, remote in pairs}
        await self._checked("mkdir -p " + " ".join(shlex.quote(d) for d in sorted(dirs)), f"mkdir for {dst}")
        if pairs:
            try:
                await asyncio.wait_for(
                    self.sdk.fs.upload_files(
                        [FileUpload(source=str(p), destination=remote) for p, remote in pairs],
                        timeout=self.provider.transfer_timeout_s,
                    ),
                    self.provider.transfer_timeout_s + 30,
                )
            except (DaytonaError, TimeoutError) as exc:
                raise SandboxTransportError(
                    f"daytona sandbox {self.sandbox_id}: upload {src} -> {dst} failed: {exc}"
                ) from exc
        executable = [remote for p, remote in pairs if os.access(p, os.X_OK)]
        if executable:
            await self._checked("chmod +x " + " ".join(shlex.quote(r) for r in executable), "chmod")

    async def download(self, src: str, dst: Path) -> None:
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        dst = Path(dst)
        q = shlex.quote(src)
        kind = (
            await self._exec_clean(
                f"if [ -d {q} ]; then echo dir; elif [ -e {q} ]; then echo file; fi", timeout=60
            )
        ).stdout.strip()
        if kind not in ("dir", "file"):
            raise SandboxTransportError(f"daytona sandbox {self.sandbox_id}: {src} does not exist")
        remote = src
        if kind == "dir":
            # One archive instead of one request per file; extracted with tarfile's `data` filter,
            # so links or absolute paths inside cannot write outside `dst`.
            remote = f"/tmp/.agentrl-download-{uuid.uuid4().hex}.tar"
            await self._checked(f"tar -C {q} -cf {shlex.quote(remote)} .", f"archiving {src}")
        try:
            responses = await asyncio.wait_for(
                self.sdk.fs.download_files(
                    [FileDownloadRequest(source=remote)], timeout=self.provider.transfer_timeout_s
                ),
                self.provider.transfer_timeout_s + 30,
            )
        except (DaytonaError, TimeoutError) as exc:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: download {src} failed: {exc}"
            ) from exc
        finally:
            if kind == "dir":
                await self._exec_clean(f"rm -f {shlex.quote(remote)}", timeout=60)
        (resp,) = responses
        if resp.error or resp.result is None:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: download {src} failed: {resp.error}"
            )
        data = resp.result if isinstance(resp.result, bytes) else Path(resp.result).read_bytes()
        if kind == "file":
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            return
        dst.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(dst, filter="data")

    # -- lifetime --------------------------------------------------------------------------------
    def start_keepalive(self, interval_s: float) -> None:
        if interval_s > 0:
            self._keepalive = asyncio.get_running_loop().create_task(
                self._keep_alive(interval_s), name=f"daytona-keepalive-{self.sandbox_id}"
            )

    async def _keep_alive(self, interval_s: float) -> None:
        """Refresh Daytona's activity timer while no command runs (the model may think for minutes)."""
        while True:
            idle = time.monotonic() - self._last_activity
            await asyncio.sleep(max(interval_s - idle, 0.05))
            if time.monotonic() - self._last_activity < interval_s:
                continue
            try:
                await asyncio.wait_for(self.sdk.refresh_activity(request_timeout=30), 45)
                self._last_activity = time.monotonic()
            except (DaytonaError, TimeoutError) as exc:
                log.warning("daytona sandbox %s: keepalive failed: %s", self.sandbox_id, exc)
                self._last_activity = time.monotonic()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end_terminals()
        if self._keepalive is not None:
            self._keepalive.cancel()
        # Shielded: a cancelled owner must still not leave a (billed) sandbox behind.
        await asyncio.shield(self.provider._delete(self))
        if self._keepalive is not None:
            await asyncio.wait([self._keepalive], timeout=5)


class DaytonaProvider(SandboxProvider):
    """Creates `DaytonaSandbox`es. Every option is a keyword with a default, so
    `make_provider("daytona")` works from the environment's credentials alone.

    `client_factory` returns an `AsyncDaytona`-compatible client (tests pass a fake); by default an
    `AsyncDaytona` is built from `credentials` (default: `DaytonaCredentials.from_env()`).

    `trusted_checks` records each sandbox's starting state through the file API
    (`DaytonaSandbox.record_baseline`) so the verifier can check its kill and its tamper scan from
    outside; off (only for toolboxes that cannot answer, such as record-only test doubles), both
    trust the sandbox's own shell and `find`, which an agent can replace.
    """

    def __init__(
        self,
        *,
        credentials: DaytonaCredentials | None = None,
        client_factory: DaytonaClientFactory | None = None,
        launcher: str = DEFAULT_LAUNCHER,
        allow_network: bool | None = None,
        max_concurrent_creates: int = 8,
        create_attempts: int = 6,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        create_timeout_s: float | None = None,
        min_cpus: int = 1,
        min_memory_gb: int = 1,
        min_disk_gb: int = 3,
        auto_stop_minutes: int = 15,
        auto_delete_minutes: int = 0,
        ttl_minutes: int = 24 * 60,
        keepalive_s: float = 120.0,
        exec_limit_s: float = 600.0,
        exec_grace_s: float = 15.0,
        session_poll_s: float = 0.2,
        session_poll_max_s: float = 2.0,
        transfer_timeout_s: int = 600,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        os_user: str | None = "root",
        target: str | None = None,
        trusted_checks: bool = True,
    ) -> None:
        if client_factory is None:
            creds = credentials or DaytonaCredentials.from_env()
            client_factory = _sdk_client_factory(creds)
        if max_concurrent_creates < 1 or create_attempts < 1:
            raise AgentRLError("max_concurrent_creates and create_attempts must be at least 1")
        if keepalive_s and auto_stop_minutes and keepalive_s >= auto_stop_minutes * 60:
            raise AgentRLError(
                f"keepalive_s={keepalive_s} must be shorter than auto_stop_minutes={auto_stop_minutes} "
                "or a thinking model's sandbox stops under it"
            )
        self.client_factory = client_factory
        self.launcher = launcher
        self.allow_network = allow_network
        self.create_attempts = create_attempts
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.create_timeout_s = create_timeout_s
        self.min_cpus, self.min_memory_gb, self.min_disk_gb = min_cpus, min_memory_gb, min_disk_gb
        self.auto_stop_minutes = auto_stop_minutes
        self.auto_delete_minutes = auto_delete_minutes
        self.ttl_minutes = ttl_minutes
        self.keepalive_s = keepalive_s
        self.exec_limit_s = exec_limit_s
        self.exec_grace_s = exec_grace_s
        self.session_poll_s = session_poll_s
        self.session_poll_max_s = session_poll_max_s
        self.transfer_timeout_s = transfer_timeout_s
        self.output_limit = output_limit
        # Per task: the verifier's core files as its image ships them (`DaytonaSandbox.record_baseline`).
        self._core_records: dict[str, dict[str, str | None]] = {}
        self.trusted_checks = trusted_checks
        self.os_user = os_user
        self.target = target
        self._create_slots = asyncio.Semaphore(max_concurrent_creates)
        self._client: Any = None
        self._client_lock = asyncio.Lock()
        self._live: dict[str, DaytonaSandbox] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self.create_attempts_made = 0

    def __repr__(self) -> str:
        return f"DaytonaProvider(launcher={self.launcher!r}, live={len(self._live)})"

    # -- parameters ------------------------------------------------------------------------------
    def resources_for(self, task: Task) -> Resources:
        env = task.config.environment
        cpu = max(self.min_cpus, math.ceil(env.cpus or 0))
        memory = max(self.min_memory_gb, math.ceil((env.memory_mb or 0) / 1024))
        disk = max(self.min_disk_gb, math.ceil((env.storage_mb or 0) / 1024))
        return Resources(cpu=cpu, memory=memory, disk=disk, gpu=env.gpus or None)

    def network_for(self, task: Task) -> dict[str, Any]:
        env = task.config.environment
        allowed = env.internet_allowed if self.allow_network is None else self.allow_network
        if allowed:
            return {"network_block_all": False}
        if env.allowed_hosts and self.allow_network is None:
            return {"network_block_all": False, "domain_allow_list": ",".join(env.allowed_hosts)}
        return {"network_block_all": True}

    def labels_for(self, task: Task, run_id: str) -> dict[str, str]:
        return {
            LABEL_RUN: run_id[:63],
            LABEL_TASK: task.task_id[:63],
            LABEL_LAUNCHER: self.launcher,
            LABEL_OWNER: f"{socket.gethostname()}:{os.getpid()}"[:63],
        }

    def params_for(self, task: Task, run_id: str) -> CreateSandboxFromImageParams:
        """The SDK's create parameters for a task (a fresh unique name on every call)."""
        env = task.config.environment
        name = f"agentrl-{_sanitize(run_id, 16)}-{_sanitize(task.task_id, 24)}-{uuid.uuid4().hex[:10]}"
        return CreateSandboxFromImageParams(
            name=name,
            image=image_for(task),
            resources=self.resources_for(task),
            labels=self.labels_for(task, run_id),
            env_vars=resolve_env_templates(env.env, str(task.path / "task.toml")),
            os_user=self.os_user,
            auto_stop_interval=self.auto_stop_minutes,
            auto_delete_interval=self.auto_delete_minutes,
            ttl_minutes=self.ttl_minutes,
            target=self.target,
            **self.network_for(task),
        )

    def create_timeout_for(self, task: Task) -> float:
        if self.create_timeout_s is not None:
            return self.create_timeout_s
        return task.config.environment.build_timeout_sec + 120.0

    # -- create ----------------------------------------------------------------------------------
    async def client(self) -> Any:
        async with self._client_lock:
            if self._client is None:
                self._client = self.client_factory()
            return self._client

    def _wait(self, retry_state: Any) -> float:
        jitter = wait_random_exponential(multiplier=self.backoff_initial_s, max=self.backoff_max_s)(
            retry_state
        )
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        after = getattr(exc, "retry_after_s", None)
        return max(jitter, min(after, self.backoff_max_s)) if after else jitter

    async def create(self, task: Task, *, run_id: str) -> Sandbox:
        timeout = self.create_timeout_for(task)
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.create_attempts),
            wait=self._wait,
            retry=retry_if_exception_type(_TransientCreateError),
            reraise=True,
            before_sleep=lambda state: log.info(
                "retrying a Daytona create (attempt %d): %s",
                state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            ),
        )
        attempt = 0
        try:
            async for attempt_state in retrying:
                with attempt_state:
                    attempt += 1
                    async with self._create_slots:
                        sdk_sandbox = await self._create_once(task, run_id, timeout)
        except _TransientCreateError as exc:
            raise SandboxCreateError(f"{exc} (gave up after {attempt} attempts)") from exc
        sandbox = DaytonaSandbox(self, sdk_sandbox, task.task_id, task.config.environment.workdir)
        log.debug("daytona sandbox %s started for %s (attempt %d)", sandbox.sandbox_id, task.task_id, attempt)
        self._live[sandbox.sandbox_id] = sandbox
        _LIVE[sandbox.sandbox_id] = self.client_factory
        try:
            if self.trusted_checks:
                self._core_records[task.task_id] = await sandbox.record_baseline(
                    self._core_records.get(task.task_id)
                )
        except BaseException as exc:
            await sandbox.close()
            if isinstance(exc, SandboxError):
                raise SandboxCreateError(
                    f"daytona sandbox for {task.task_id}: recording its starting state failed: {exc}"
                ) from exc
            raise
        sandbox.start_keepalive(self.keepalive_s)
        return sandbox

    async def _create_once(self, task: Task, run_id: str, timeout: float) -> Any:
        params = self.params_for(task, run_id)
        client = await self.client()
        self.create_attempts_made += 1
        try:
            return await asyncio.wait_for(client.create(params, timeout=timeout), timeout + 30)
        except BaseException as exc:
            # The request may have created the sandbox before failing or being cancelled (the
            # server does not know the client gave up): find it by its unique name and delete it.
            await asyncio.shield(self._delete_orphan(params.name or "", exc))
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
            if isinstance(exc, AgentRLError):
                raise
            raise classify_create_error(exc, task.task_id) from exc

    async def _delete_orphan(self, name: str, exc: BaseException) -> None:
        status = getattr(exc, "status_code", None)
        if isinstance(exc, DaytonaError) and status is not None and 400 <= status < 500:
            return  # the API refused the request: nothing was created
        sandbox_id = getattr(exc, "sandbox_id", None) or name
        ambiguous = isinstance(
            exc, asyncio.CancelledError | TimeoutError | DaytonaConnectionError | DaytonaTimeoutError
        )
        client = await self.client()
        for i in range(3 if ambiguous else 1):
            try:
                found = await asyncio.wait_for(client.get(sandbox_id, request_timeout=20), 30)
            except DaytonaNotFoundError:
                if i < 2 and ambiguous:
                    await asyncio.sleep(0.5 * (i + 1))
                continue
            except (DaytonaError, TimeoutError) as lookup:
                log.warning("could not look up half-created Daytona sandbox %s: %s", sandbox_id, lookup)
                return
            await self._delete_sdk(found)
            return

    async def _delete_sdk(self, sdk_sandbox: Any) -> bool:
        try:
            await asyncio.wait_for(sdk_sandbox.delete(timeout=60), 90)
        except DaytonaNotFoundError:
            return True
        except (DaytonaError, TimeoutError) as exc:
            log.warning(
                "deleting Daytona sandbox %s failed (%s); auto-delete and `agentrl sandbox reap "
                "--backend daytona` remove it later",
                sdk_sandbox.id,
                exc,
            )
            return False
        return True

    async def _delete(self, sandbox: DaytonaSandbox) -> None:
        try:
            if await self._delete_sdk(sandbox.sdk):
                _LIVE.pop(sandbox.sandbox_id, None)
                log.debug("daytona sandbox %s deleted", sandbox.sandbox_id)
        finally:
            self._live.pop(sandbox.sandbox_id, None)

    def _spawn(self, coro: Any, timeout: float) -> None:
        async def bounded() -> None:
            try:
                await asyncio.wait_for(coro, timeout)
            except (DaytonaError, TimeoutError) as exc:
                log.debug("daytona background call failed: %s", exc)

        t = asyncio.get_running_loop().create_task(bounded())
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    def live_sandboxes(self) -> int:
        return len(self._live)

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for sandbox in list(self._live.values()):
            await sandbox.close()
        if self._client is not None:
            client, self._client = self._client, None
            await asyncio.wait_for(client.close(), 30)


def _sdk_client_factory(credentials: DaytonaCredentials) -> DaytonaClientFactory:
    def factory() -> AsyncDaytona:
        return AsyncDaytona(credentials.sdk_config())

    return factory


# Sandboxes this process created and has not deleted, with a way to reach their API; deleted at
# interpreter exit (Daytona bills while they run; auto-delete and the TTL are the slower backstop).
_LIVE: dict[str, DaytonaClientFactory] = {}


async def _delete_ids(items: list[tuple[str, DaytonaClientFactory]]) -> None:
    by_factory: dict[int, tuple[DaytonaClientFactory, list[str]]] = {}
    for sandbox_id, factory in items:
        by_factory.setdefault(id(factory), (factory, []))[1].append(sandbox_id)
    for factory, ids in by_factory.values():
        client = factory()
        try:
            for sandbox_id in ids:
                try:
                    sdk_sandbox = await asyncio.wait_for(client.get(sandbox_id, request_timeout=20), 30)
                    await asyncio.wait_for(sdk_sandbox.delete(timeout=30), 45)
                except DaytonaNotFoundError:
                    pass
                except (DaytonaError, TimeoutError) as exc:
                    log.warning("could not delete Daytona sandbox %s at exit: %s", sandbox_id, exc)
                    continue
                _LIVE.pop(sandbox_id, None)
        finally:
            await asyncio.wait_for(client.close(), 30)


def _delete_live_at_exit() -> None:
    if not _LIVE:
        return
    # A fresh loop on a thread: the program's own loop is closed (or still running) by now.
    worker = threading.Thread(target=lambda: asyncio.run(_delete_ids(list(_LIVE.items()))), daemon=True)
    worker.start()
    worker.join(timeout=120)


atexit.register(_delete_live_at_exit)


async def reap_daytona(
    *,
    run_id: str | None = None,
    older_than_s: float | None = None,
    launcher: str = DEFAULT_LAUNCHER,
    client: Any = None,
) -> int:
    """Delete agentrl's Daytona sandboxes by label: of one run, older than a cutoff, or all of this
    launcher's. Returns how many were deleted. `client` defaults to one built from the environment."""
    labels = {LABEL_LAUNCHER: launcher}
    if run_id is not None:
        labels[LABEL_RUN] = run_id
    query = ListSandboxesQuery(labels=labels)
    if older_than_s is not None:
        query.created_at_before = datetime.now(UTC) - timedelta(seconds=older_than_s)
    own = client is None
    if own:
        client = _sdk_client_factory(DaytonaCredentials.from_env())()
    removed = 0
    try:
        doomed = [sb async for sb in client.list(query, request_timeout=60)]
        for sdk_sandbox in doomed:
            try:
                await asyncio.wait_for(sdk_sandbox.delete(timeout=60), 90)
            except DaytonaNotFoundError:
                continue
            except (DaytonaError, TimeoutError) as exc:
                log.warning("reap: could not delete Daytona sandbox %s: %s", sdk_sandbox.id, exc)
                continue
            removed += 1
    finally:
        if own:
            await asyncio.wait_for(client.close(), 30)
    return removed
