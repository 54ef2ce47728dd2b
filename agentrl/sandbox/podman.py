"""Local sandboxes on podman, written against the docker-compatible CLI (`docker` works the same:
`--cli docker` or `AGENTRL_CONTAINER_CLI=docker`).

- Images: built from the task's `environment/` context, tagged by a content hash of that context,
  so an unchanged task reuses its image; one build per tag at a time; a `FROM` whose base is
  neither local nor pullable is rewritten to the offline stand-in that serves its repository (in a
  temporary Dockerfile, never by re-tagging a real name; `images.py`), the rewrite part of the tag,
  and every build then runs with `--pull=never`; the build timeout from task.toml; the
  host CA bundle handed to pip in build steps (a pip.conf in a read-only mount at /etc/xdg/pip,
  which leaves nothing in the image) so `pip install` works behind TLS-intercepting proxies.
  Mounting the bundle over /etc/ssl/certs/ca-certificates.crt instead breaks every build that
  runs update-ca-certificates.
- Isolation: `--network=none` unless the task allows internet (or the user overrides), no host
  mounts but a read-only static init, no host environment (podman's proxy passthrough is off);
  tests/ and solution/ are never inside during the agent phase. Limits: the task's cpus, memory
  and storage, else 1 CPU, 2 GiB and 10 GiB; 1024 pids; storage by the storage driver where it
  can, else measured from the host (docs/failures.md). PID 1 is catatonit in pause mode: it reaps
  orphans and cannot be killed from inside. Labels (run id, task id, created-at) let `agentrl
  sandbox reap` find what a dead process left behind; containers are removed on close, on
  cancellation and at exit.
- Fast exec: commands go through one persistent `bash` per container over a pipe (~1-2 ms a
  command instead of ~150 ms for `podman exec`), with output captured to files, bounded head+tail
  inside the container, and sent back in one length-prefixed frame per command under a fresh
  random nonce (`_BOOTSTRAP` explains why the agent cannot forge it). Clean commands (cwd, env or
  user given: the verifier's, agentrl's own) each run in a subshell under a timeout. The agent's
  commands run in its session shell: one long-lived bash that runs them at its own top level, so
  the shell state persists as in a terminal, snapshotted for when a timeout has to kill it
  (`shellstate.py`, `_SESSION_SHELL`). A shell that dies between commands is replaced (with a new
  session); one that fails during a command is a typed error, never a second run of the command:
  infrastructure when the container is gone or the host's client died, a `SandboxPolicyError` when
  the command could have done it. If no shell starts at all, the sandbox falls back to one
  `podman exec` per command (output streamed and bounded on the host, no session) and says so once.
- Terminal: `open_terminal` starts tmux in the container (`terminal.py`), every tmux command a
  clean command of the persistent shell. Images get tmux from a layer built once per image where
  it is missing (`terminal_image`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import hashlib
import io
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.sandbox import images, shellstate
from agentrl.sandbox.base import (
    DEFAULT_CPUS,
    DEFAULT_MEMORY_MB,
    DEFAULT_OUTPUT_LIMIT,
    DEFAULT_PIDS_LIMIT,
    DEFAULT_STORAGE_MB,
    HARMLESS,
    KILL_ALL,
    SUSPICIOUS_ADDITIONS,
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
)
from agentrl.sandbox.terminal import INSTALL_TMUX, NO_TMUX, TmuxTerminal
from agentrl.tasks.config import resolve_env_templates

if TYPE_CHECKING:
    from agentrl.tasks.task import Task

log = logging.getLogger(__name__)
_UNRESOLVED_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*\S*\$", re.IGNORECASE | re.MULTILINE)

LABEL_RUN = "agentrl.run-id"
LABEL_TASK = "agentrl.task-id"
LABEL_CREATED = "agentrl.created-at"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_PIP_DIR = "/etc/xdg/pip"  # on pip's site-wide config path; mounted only during builds


def build_ca_dir(bundle: Path = HOST_CA_BUNDLE) -> Path | None:
    """A directory with the host CA bundle and a pip.conf pointing at it, for build mounts."""
    if not bundle.is_file():
        return None
    data = bundle.read_bytes()
    cache = Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))
    directory = cache / f"build-ca-{hashlib.sha256(data).hexdigest()[:12]}"
    if not (directory / "pip.conf").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "host-ca.crt").write_bytes(data)
        (directory / "pip.conf").write_text(f"[global]\ncert = {BUILD_PIP_DIR}/host-ca.crt\n")
    return directory


def is_podman(cli: str) -> bool:
    return "podman" in Path(cli).name


def rm_args(cli: str) -> list[str]:
    """Force removal at once: PID 1 (sleep) ignores SIGTERM, so do not wait for it to stop."""
    return ["rm", "-f", "-t", "0"] if is_podman(cli) else ["rm", "-f"]


@functools.cache
def cli_cwd() -> str:
    """Working directory for container CLI processes (so host paths passed to it must be absolute). podman's conmon writes a file named `oom`
    into its working directory when a process in the container is OOM-killed; run it here so that
    never lands in the user's directory."""
    path = Path(tempfile.gettempdir()) / f"agentrl-cli-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


INIT_PATH = "/run/agentrl-init"
_INIT_CANDIDATES = (
    "/usr/libexec/podman/catatonit",
    "/usr/libexec/catatonit/catatonit",
    "/usr/local/libexec/podman/catatonit",
    "/usr/bin/catatonit",
)


@functools.cache
def find_init() -> str | None:
    """A static catatonit on the host (where podman's own `--init` finds it), or None."""
    for path in (*_INIT_CANDIDATES, shutil.which("catatonit")):
        if path and os.access(path, os.X_OK):
            return os.path.realpath(path)
    return None


# Containers this process started and has not removed; removed synchronously at interpreter exit.
_LIVE: dict[str, str] = {}


def _remove_live_at_exit() -> None:
    for name, cli in list(_LIVE.items()):
        subprocess.run(
            [cli, *rm_args(cli), name], capture_output=True, timeout=60, check=False, cwd=cli_cwd()
        )
        _LIVE.pop(name, None)


atexit.register(_remove_live_at_exit)


async def run_cli(
    cli: str, *args: str, timeout: float = 120, stdin: bytes | None = None
) -> tuple[int, str, str]:
    """Run a container CLI command; kill it on timeout or cancellation."""
    try:
        proc = await asyncio.create_subprocess_exec(
            cli,
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cli_cwd(),
        )
    except FileNotFoundError:
        raise SandboxError(
            f"container CLI {cli!r} not found: run `bash sandbox_images/setup_host.sh`, or pick another"
            " with AGENTRL_CONTAINER_CLI / --backend"
        ) from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


def context_hash(directory: Path) -> str:
    """Content hash of a build context: relative paths, modes and bytes of every file."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(directory).as_posix()
        h.update(rel.encode() + b"\0" + oct(path.lstat().st_mode).encode() + b"\0")
        h.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


# Defined once per persistent shell (F, the framing shell). Clean commands each run in a subshell
# of F (one fork) under a watchdog that waits with `read -t` on a FIFO (a second fork, only when a
# timeout is set); the output is read with `read -N`; `stat`/`tail` run only for outputs over the
# limit.
#
# Framing. The agent's command runs as root next to this shell, so it can write anything to the
# shell's stdout (`/proc/$PPID/fd/1`) at any time. The host therefore trusts nothing but one exact
# frame per command: `__AGENTRL_<nonce> rc timed_out out_size out_head out_tail err_size err_head
# err_tail`, the four byte strings of exactly those lengths, then `__AGENTRL_END_<nonce>`. The
# nonce is fresh per command (128 random bits) and travels on its own line after the command line:
# the shell reads it only after handing the command over (to its subshell or to the session
# shell), so it is in no variable, argument, environment or file the command can see. Anything
# else on the pipe (a forged or stray frame, garbage, an endless line) is a typed error, read
# within a fixed memory bound.
#
# The watchdog reports a timeout by its exit status (7), and ignores the TERM that ends it once it
# has fired: this shell wakes from `wait` as soon as the watchdog's kill lands.
#
# A clean command: the host sends `__ar_a TIMEOUT CWD CMD EXPORTS; ( BODY ) ... & __ar_z`, then
# the nonce. The agent's session (`shellstate.py`) is one long-lived bash, S (`_SESSION_SHELL`),
# started by F on the first session command and again after S died: the host sends `__ar_s
# TIMEOUT CWD CMD HINT` and the nonce; F hands HINT and CMD to S over a FIFO, and S runs the
# command itself, at its top level, so the state persists with no restore. S answers on a second
# FIFO `d RC SLOT` (`x RC SLOT` from its EXIT trap: `exit`, `set -e`); F times the command itself
# against a deadline (`EPOCHREALTIME`; counted where bash has none) in `read -t` slices of at most
# a second, no watchdog process, and checks between slices that S lives (a dead S answers with its
# exit status: `kill -9 $$`, `exec prog`). On
# a timeout F kills what the command runs (`__ar_ks`: S, stopped first, and every process group of
# F's session created since the command began, by the namespace's last pid in /proc/loadavg: the
# command's own jobs, fg or bg, but not those of earlier commands) and the next session command
# starts a new S from the last snapshot. Snapshots (`__ar_dump`, two slots, SLOT is the one just
# completed) are written by S after each command unless HINT says the command could not change
# the state (`_stateless_words`) and S confirms that none of its command words is a function or
# an alias; a killed command thus leaves the session as it was, as before. F never sources
# anything S or a command wrote: it reads S's reply line (digits only) and /proc.
_KILL_SESSION = r"""
__ar_ks() {
  local s=$1 w=$2 sid=$3 f st p
  [ -n "$s" ] && [ -n "$w" ] && [ -n "$sid" ] || return 0
  kill -STOP "$s" 2>/dev/null || return 0
  for f in /proc/[0-9]*/stat; do
    { read -r st < "$f"; } 2>/dev/null || continue
    st=${st##*) }; set -- $st
    if [ "$4" = "$sid" ] && [ "$3" -gt "$w" ]; then kill -KILL -- "-$3" 2>/dev/null; fi
  done
  kill -KILL -- "-$s" 2>/dev/null || kill -KILL "$s" 2>/dev/null
}
"""
# S: `bash -c _SESSION_SHELL bash STATE_DIR OUT_DIR CWD LC_ALL SLOT`. Its own steps run with the
# session's errexit, nounset, xtrace, verbose, noclobber and noglob off (`__ar_fl` holds them for
# the command); the loop is re-entered after a command's `break`, and a `continue` still reaches
# `__ar_fin` (which ends the previous command at the top of the loop).
_SESSION_SHELL = (
    r"""
unset __ar_ss; __ar_d=$1 __ar_o=$2 __ar_k=$5 __ar_p=0 __ar_fl=
if [ "$4" = __unset__ ]; then unset LC_ALL; else export LC_ALL="$4"; fi
[ -z "$3" ] || builtin cd -- "$3" 2>/dev/null
set --
"""
    + shellstate.FUNCTIONS
    + r"""
__ar_names "$__ar_d/n"; shopt -s expand_aliases; __ar_u="unset -v ${__ar_vs[*]}"; unset __ar_vs
exec {__ar_in}<"$__ar_d/si" {__ar_out}<>"$__ar_d/so" 2>/dev/null
if [ "$__ar_k" -ge 0 ]; then """
    + shellstate.restore("$__ar_d/$__ar_k")
    + r"""; else __ar_k=1; fi
__ar_fl=${-//[^euvxCf]/}${__ar_xt:+x}; unset __ar_xt; [ -z "$__ar_fl" ] || set +$__ar_fl
set -m
__ar_fin() {
  [ "$__ar_p" = 1 ] || return 0
  __ar_p=0 __ar_fl=${-//[^euvxCf]/}
  [ -z "$__ar_fl" ] || set +$__ar_fl
  local IFS=' ' w save= k=-1
  if [ "$__ar_hint" = - ]; then save=1; else
    for w in $__ar_hint; do
      if [ -n "${BASH_ALIASES[$w]+x}" ] || declare -F -- "$w" >/dev/null; then save=1; break; fi
    done
  fi
  case $- in *m*) ;; *) set -m;; esac
  if [ -n "$save" ]; then
    k=$((1 - __ar_k)); [ -z "$__ar_fl" ] || set -$__ar_fl
    __ar_dump "$__ar_d/$k"; __ar_k=$k
  fi
  printf 'd %d %d\n' "$__ar_rc" "$k" >&$__ar_out
}
__ar_get() {
  IFS= read -r -d '' -u $__ar_in __ar_hint && IFS= read -r -d '' -u $__ar_in __ar_c || return 1
  __ar_p=1
  [ -z "$__ar_fl" ] || set -$__ar_fl
}
__ar_bye() {
  local rc=$1 k
  [ "$__ar_p" = 1 ] || return 0
  k=$((1 - __ar_k)); __ar_dump "$__ar_d/$k"
  printf 'x %d %d\n' "$rc" "$k" 1<>"$__ar_d/so"
}
trap '{ __ar_bye $?; } 2>/dev/null' EXIT
__ar_loop='while :; do __ar_fin; __ar_get || exit 0; __ar_rc=0; eval -- "$__ar_c" </dev/null >|"$__ar_o/o" 2>|"$__ar_o/e" {__ar_in}<&- {__ar_out}>&-; __ar_rc=$?; done; __ar_fin; eval "$__ar_loop"'
eval "$__ar_loop"
"""
)
_BOOTSTRAP = (
    r"""
__ar_lc=${LC_ALL-__unset__}; export LC_ALL=C; set -m
for __ar_i in 1 2 3 4 5 6 7 8; do __ar_o=/tmp/.agentrl-shell-$$-$RANDOM$RANDOM; mkdir -m 700 $__ar_o 2>/dev/null && break; done
__ar_d=/dev/shm/${__ar_o#/tmp/}; mkdir -m 700 $__ar_d 2>/dev/null || __ar_d=$__ar_o
mkdir -p $__ar_d/0 $__ar_d/1; mkfifo $__ar_d/f $__ar_d/si $__ar_d/so; exec {__ar_fd}<>$__ar_d/f {__ar_si}<>$__ar_d/si {__ar_so}<>$__ar_d/so
__ar_k=0 __ar_h=0 __ar_S=
read -r __ar_i < /proc/$$/stat; __ar_i=${__ar_i##*) }; __ar_i=(${__ar_i}); __ar_sid=${__ar_i[3]}
__ar_ss=__SESSION_SHELL__
"""
    + _KILL_SESSION
    + r"""
__ar_grab() {
  local f=$1 fd m=
  __ar_h0= __ar_t0= __ar_s=0
  { exec {fd}<"$f"; } 2>/dev/null || return 0
  IFS= read -r -N __LIMIT__ __ar_h0 <&$fd; IFS= read -r -N 1 m <&$fd
  exec {fd}<&-
  __ar_s=${#__ar_h0}
  if [ -n "$m" ]; then
    __ar_s=$(stat -c %s "$f" 2>/dev/null); case $__ar_s in ''|*[!0-9]*) __ar_s=0;; esac
    __ar_h0=${__ar_h0:0:__HALF__}
    IFS= read -r -N __HALF__ __ar_t0 < <(tail -c __HALF__ "$f" 2>/dev/null)
  fi
}
__ar_pre() {
  exec {__ar_fd}>&- {__ar_si}>&- {__ar_so}>&-  # F's FIFOs are not the command's (nor its jobs')
  if [ "$__ar_lc" = __unset__ ]; then unset LC_ALL; else export LC_ALL="$__ar_lc"; fi
  if [ -n "$__ar_cwd" ]; then cd -- "$__ar_cwd" || return 1; fi
  eval "$__ar_x"
}
__ar_dirs() {
  [ -d $__ar_d/1 ] && [ -d $__ar_o ] || mkdir -p $__ar_d/0 $__ar_d/1 $__ar_o 2>/dev/null
}
__ar_a() {
  __ar_t=$1 __ar_cwd=$2 __ar_c=$3 __ar_x=$4
  __ar_dirs
}
__ar_frame() {
  local n=$1 rc=$2 to=$3 oh ot os
  __ar_grab $__ar_o/o; oh=$__ar_h0 ot=$__ar_t0 os=$__ar_s
  __ar_grab $__ar_o/e
  printf '__AGENTRL_%s %d %d %d %d %d %d %d %d\n%s%s%s%s__AGENTRL_END_%s\n' "$n" "$rc" "$to" \
    "$os" "${#oh}" "${#ot}" "$__ar_s" "${#__ar_h0}" "${#__ar_t0}" "$oh" "$ot" "$__ar_h0" "$__ar_t0" "$n"
}
__ar_z() {
  local p=$! n= w= rc to=0
  echo $p >| $__ar_d/p
  IFS= read -r n
  if [ -n "$__ar_t" ]; then
    ( read -t "$__ar_t" -u $__ar_fd; trap '' TERM; kill -KILL -- -$p || kill -KILL $p; exit 7 ) >&- 2>&- &
    w=$!
  fi
  wait $p; rc=$?
  if [ -n "$w" ]; then kill $w 2>/dev/null; wait $w; [ $? = 7 ] && to=1; fi
  : >| $__ar_d/p
  __ar_frame "$n" $rc $to
}
__ar_alive() {
  local st=
  [ -n "$__ar_S" ] && kill -0 $__ar_S 2>/dev/null || return 1
  { read -r st < /proc/$__ar_S/stat; } 2>/dev/null || return 0
  case ${st##*) } in Z*|X*) return 1;; esac
}
__ar_start() {
  local r=-1
  [ "$__ar_h" = 1 ] && r=$__ar_k
  if [ -n "$__ar_S" ]; then wait $__ar_S 2>/dev/null; fi
  while IFS= read -r -d '' -t 0.001 -u $__ar_si __ar_i; do :; done
  while IFS= read -r -t 0.001 -u $__ar_so __ar_i; do :; done
  __ar_ss=$__ar_ss "$BASH" --noprofile --norc -c 'eval "$__ar_ss"' bash "$__ar_d" "$__ar_o" "$1" "$__ar_lc" "$r" </dev/null >/dev/null 2>&1 {__ar_fd}>&- {__ar_si}>&- {__ar_so}>&- &
  __ar_S=$!; echo $__ar_S >| $__ar_d/sp
}
__ar_s() {
  local n= dl= now left slice frac line to=0 rc=0
  __ar_dirs
  __ar_alive || __ar_start "$2"
  read -r __ar_i __ar_i __ar_i __ar_i __ar_wm < /proc/loadavg
  echo "$__ar_S $__ar_wm $__ar_sid" >| $__ar_d/sp
  now=${EPOCHREALTIME/./}
  printf '%s\0%s\0' "$4" "$3" >&$__ar_si
  IFS= read -r n
  # The deadline in microseconds (EPOCHREALTIME, bash >= 5; else counted in slices of `read -t`).
  if [ -n "$1" ]; then left=${1/./}000; left=$((10#$left)); [ -n "$now" ] && dl=$((now + left)); fi
  while :; do
    slice=1
    if [ -n "$1" ]; then
      if [ -n "$dl" ]; then now=${EPOCHREALTIME/./}; left=$((dl - now)); fi
      if [ $left -le 0 ]; then
        __ar_ks $__ar_S $__ar_wm $__ar_sid; wait $__ar_S 2>/dev/null; __ar_S=; to=1 rc=137; break
      fi
      if [ $left -lt 1000000 ]; then printf -v frac %06d $left; slice=0.$frac; fi
      if [ -z "$dl" ]; then if [ $slice = 1 ]; then left=$((left - 1000000)); else left=0; fi; fi
    fi
    if IFS= read -r -t $slice -u $__ar_so line; then
      [[ $line =~ ^([dx])\ ([0-9]{1,3})\ (-1|0|1)$ ]] || continue
      rc=${BASH_REMATCH[2]}
      if [ "${BASH_REMATCH[3]}" != -1 ]; then __ar_k=${BASH_REMATCH[3]} __ar_h=1; fi
      if [ "${BASH_REMATCH[1]}" = x ]; then wait $__ar_S 2>/dev/null; __ar_S=; fi
      break
    fi
    if ! __ar_alive; then wait $__ar_S 2>/dev/null; rc=$?; __ar_S=; break; fi
  done
  __ar_frame "$n" $rc $to
}
echo __AGENTRL_READY $__ar_d $__ar_o
"""
)
# The clean command's subshell (text of the line the host sends, so this shell parses it before
# the fork and the subshell only evaluates the command itself).
_CLEAN_BODY = '__ar_pre || exit 1; eval -- "$__ar_c"'
_HEADER_LIMIT = 4096  # bytes a frame header may take; more is a protocol error, never a buffer
_STREAM_LIMIT = 64 * 1024  # asyncio's read buffer for the shell's stdout: host memory per sandbox


# Bash builtins and keywords that can change a shell's state (or run something that can): a
# command that starts with one of them, or with anything but a plain word, always saves the session.
_STATEFUL_WORDS = frozenset(
    "alias bg bind break builtin caller cd command compgen complete compopt continue coproc declare "
    "dirs disown enable eval exec exit export fc fg function getopts hash history jobs let local "
    "logout mapfile popd printf pushd read readarray readonly return select set shift shopt source "
    "suspend time trap typeset ulimit umask unalias unset wait if then else elif fi case esac for "
    "while until do done in .".split()
)
_PLAIN_WORD = r"(?:[A-Za-z0-9_./:,+%@^=~*?\[\]-]|'[^'\n]*'|\"[^\"$`\\!\n]*\")+"
_FIRST_WORD = re.compile(r"[ \t]*([A-Za-z0-9_./][A-Za-z0-9_./+-]*)")
_REDIRECT = r"(?:[0-9]?(?:>>?|<|>&|<&)[ \t]*" + _PLAIN_WORD + r"|&>>?[ \t]*" + _PLAIN_WORD + ")"
_SIMPLE = r"[ \t]*[A-Za-z0-9_./][A-Za-z0-9_./+-]*(?:[ \t]+(?:" + _REDIRECT + "|" + _PLAIN_WORD + r"))*[ \t]*"
_STATELESS = re.compile(_SIMPLE + r"(?:(?:\|\||&&|\||;|&)" + _SIMPLE + r")*[;&]?[ \t]*")


def _stateless_words(cmd: str) -> list[str] | None:
    """The command words of `cmd` when its text alone shows it cannot change the shell's state:
    simple commands of plain words (no expansion, no assignment, no glob or quote in the command
    word), joined by pipes, `;`, `&&`, `||` or `&`, none starting with a state-changing builtin
    or keyword. None when it might. The session shell still saves when one of the words names a
    function or an alias there (`_SESSION_SHELL`)."""
    if len(cmd) > 4096 or not _STATELESS.fullmatch(cmd):
        return None
    words = []
    for part in re.split(r"[|&;]", cmd):
        m = _FIRST_WORD.match(part)
        if m is None:
            if part.strip():
                return None
            continue
        if m.group(1) in _STATEFUL_WORDS:
            return None
        words.append(m.group(1))
    return words


class _NotSent(Exception):
    """The command never reached the persistent shell, so running it another way is safe."""


class _FrameError(SandboxTransportError):
    """The persistent shell's reply was not the one frame expected for the command."""


class _Shell:
    """One persistent bash inside the container, driven over a pipe with length-prefixed replies."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lock = asyncio.Lock()
        self.state_dir = ""  # the shell's control files (tmpfs where the sandbox has /dev/shm)
        self.out_dir = ""  # the commands' output files (the sandbox's disk: outputs can be large)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def start(self, limit: int, wait: float = 30.0) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        half = limit // 2
        script = _BOOTSTRAP.replace("__LIMIT__", str(2 * half)).replace("__HALF__", str(half))
        script = script.replace("__SESSION_SHELL__", shlex.quote(_SESSION_SHELL))
        self.proc.stdin.write(script.encode())
        await self.proc.stdin.drain()
        try:
            line = await asyncio.wait_for(self.proc.stdout.readuntil(b"\n"), wait)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise SandboxTransportError(f"persistent shell did not start: {exc!r}") from exc
        parts = line.split()
        if len(parts) != 3 or parts[0] != b"__AGENTRL_READY":
            raise SandboxTransportError(f"persistent shell did not start: {line[:200]!r}")
        self.state_dir, self.out_dir = parts[1].decode(errors="replace"), parts[2].decode(errors="replace")

    async def run(
        self, line: str, nonce: str, wait: float, limit: int
    ) -> tuple[bytes, bytes, int, bytes, bytes, int, int, bool]:
        """Send one command, read its frame: (out head, out tail, out size, err head, err tail,
        err size, exit code, timed out)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        async with self.lock:
            if not self.alive:
                raise _NotSent("the persistent shell has exited")
            try:
                self.proc.stdin.write(f"{line}{nonce}\n".encode())
                await self.proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise _NotSent(repr(exc)) from exc
            header = await asyncio.wait_for(self.proc.stdout.readuntil(b"\n"), wait)
            fields = self._header(header, nonce, limit)
            rc, to, out_size, oh, ot, err_size, eh, et = fields
            body = await asyncio.wait_for(self.proc.stdout.readexactly(oh + ot + eh + et), 30.0)
            trailer = f"__AGENTRL_END_{nonce}\n".encode()
            end = await asyncio.wait_for(self.proc.stdout.readexactly(len(trailer)), 30.0)
            if end != trailer:
                raise _FrameError(f"persistent shell frame has a bad trailer: {end[:80]!r}")
            o1, o2 = body[:oh], body[oh : oh + ot]
            e1, e2 = body[oh + ot : oh + ot + eh], body[oh + ot + eh :]
            return o1, o2, out_size, e1, e2, err_size, rc, to == 1

    @staticmethod
    def _header(header: bytes, nonce: str, limit: int) -> list[int]:
        parts = header.split()
        if len(header) > _HEADER_LIMIT or len(parts) != 9 or parts[0] != f"__AGENTRL_{nonce}".encode():
            raise _FrameError(
                f"persistent shell sent something other than this command's frame: {header[:120]!r}"
            )
        try:
            fields = [int(p) for p in parts[1:]]
        except ValueError:
            raise _FrameError(f"persistent shell frame header is not numeric: {header[:120]!r}") from None
        _rc, to, _out_size, oh, ot, _err_size, eh, et = fields
        if min(fields[2:]) < 0 or oh + ot > limit or eh + et > limit or to not in (0, 1):
            raise _FrameError(f"persistent shell frame header is out of range: {header[:120]!r}")
        return fields

    def kill(self) -> None:
        """Kill the client and close its pipes now: a dead shell's unread output (up to the
        stream limit) would otherwise keep its transport open past the event loop's end."""
        if self.alive:
            self.proc.kill()
        # Close the pipes only: closing the subprocess transport itself polls (waitpid) the child
        # and steals its exit status from asyncio's child watcher ("Unknown child process").
        transport = getattr(self.proc, "_transport", None)
        if transport is not None:
            for fd in (0, 1, 2):
                pipe = transport.get_pipe_transport(fd)
                if pipe is not None:
                    pipe.close()


def _bounded(head: bytes, tail: bytes, size: int) -> str:
    """Head and tail of an output of `size` bytes, with a marker for what was cut in between."""
    omitted = size - len(head) - len(tail)
    if omitted <= 0 and not tail:
        return head.decode(errors="replace")
    return (
        f"{head.decode(errors='replace')}\n[... {max(omitted, 0)} bytes omitted ...]\n"
        f"{tail.decode(errors='replace')}"
    )


class _HeadTail:
    """Keeps the first and last `half` bytes of a stream and counts the rest (bounded memory)."""

    def __init__(self, half: int) -> None:
        self.half = half
        self.head = bytearray()
        self.tail = bytearray()
        self.size = 0

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[: max(0, len(self.tail) - self.half)]

    def text(self) -> str:
        return _bounded(bytes(self.head), bytes(self.tail), self.size)


async def run_cli_bounded(
    cli: str, *args: str, timeout: float, limit: int = DEFAULT_OUTPUT_LIMIT
) -> tuple[int, str, str]:
    """`run_cli` for commands whose output the agent controls: stdout and stderr are streamed and
    kept as head + tail within `limit` characters each, so host memory stays bounded."""
    proc = await asyncio.create_subprocess_exec(
        cli,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cli_cwd(),
    )
    out, err = _HeadTail(limit // 2), _HeadTail(limit // 2)

    async def pump(stream: asyncio.StreamReader | None, sink: _HeadTail) -> None:
        assert stream is not None
        while chunk := await stream.read(64 * 1024):
            sink.feed(chunk)

    try:
        await asyncio.wait_for(
            asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err), proc.wait()), timeout
        )
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    return proc.returncode or 0, out.text(), err.text()


class _DiffScan:
    """`tampered()` over a `podman diff` listing (`C|A|D path` lines) fed one line at a time,
    holding only the candidate entries (at most `cap`, beyond which the rest are only counted)."""

    def __init__(self, cap: int = 10_000) -> None:
        self.cap = cap
        self.candidates: dict[str, bool] = {}  # path -> is a directory (a parent of another entry)
        self.extra = 0

    def feed(self, line: str) -> None:
        kind, _, path = line.partition(" ")
        if not path.startswith("/"):
            return
        parent = path.rsplit("/", 1)[0]
        while parent:
            if parent in self.candidates:
                self.candidates[parent] = True
            parent = parent.rsplit("/", 1)[0]
        system = path.startswith(SYSTEM_PREFIXES)
        suspicious = (kind in ("C", "D") and system) or (kind == "A" and SUSPICIOUS_ADDITIONS.search(path))
        if suspicious and not HARMLESS.search(path) and path not in self.candidates:
            if len(self.candidates) < self.cap:
                self.candidates[path] = False
            else:
                self.extra += 1

    def result(self, is_dir: Callable[[str], bool] = lambda path: False) -> list[str]:
        """The candidates that are files: `podman diff` does not order a directory before its
        entries, so a candidate seen only before its children is asked of `is_dir`."""
        found = sorted(p for p, seen_as_dir in self.candidates.items() if not seen_as_dir and not is_dir(p))
        if self.extra:
            found.append(f"... and up to {self.extra} more")
        return found


class PodmanSandbox(Sandbox):
    def __init__(
        self,
        provider: PodmanProvider,
        name: str,
        workdir: str | None,
        *,
        storage_mb: int | None = None,
        upper_dir: str | None = None,
        image: str = "",
    ) -> None:
        self.provider = provider
        self.cli = provider.cli
        self.sandbox_id = name
        self.workdir = workdir
        self.image = image
        self._terminals: list[TmuxTerminal] = []
        self.output_limit = provider.output_limit
        self.shell_grace_s = provider.shell_grace_s
        self._shell: _Shell | None = None
        self._fallback_noted = False
        self._closed = False
        self.storage_mb = storage_mb
        self._upper_dir = upper_dir
        self._storage_used: int | None = None  # bytes, set once the limit was exceeded
        self._monitor: asyncio.Task[None] | None = None
        self._init_pid: int | None = None  # host pid of the container's init, once looked up
        if storage_mb is not None and upper_dir is not None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch_storage())

    async def _start_shell(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            self.cli,
            "exec",
            "-i",
            self.sandbox_id,
            "bash",
            "--noprofile",
            "--norc",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            limit=_STREAM_LIMIT,
            cwd=cli_cwd(),
        )
        self._shell = _Shell(proc)
        try:
            await self._shell.start(self.output_limit)
        except BaseException:
            self._retire(self._shell)
            self._shell = None
            raise

    @staticmethod
    def _line(
        cmd: str, *, timeout: float | None, cwd: str | None, env: dict[str, str] | None, session: bool
    ) -> str:
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
        t = "" if timeout is None else f"{max(timeout, 0.001):.3f}"
        args = [shlex.quote(t), shlex.quote(cwd or ""), shlex.quote(cmd), shlex.quote(exports)]
        if session:
            hint = shlex.quote(" ".join(words) if (words := _stateless_words(cmd)) is not None else "-")
            return f"__ar_s {' '.join(args[:3])} {hint}\n"
        return f"__ar_a {' '.join(args)}; ( {_CLEAN_BODY} ) </dev/null >$__ar_o/o 2>$__ar_o/e & __ar_z\n"

    def _check_storage(self) -> None:
        if self._storage_used is not None:
            raise SandboxPolicyError(
                f"sandbox {self.sandbox_id} wrote {self._storage_used / 2**20:.0f} MiB, over its "
                f"storage limit of {self.storage_mb} MiB; its processes were killed",
                cause="storage_exceeded",
            )

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
            raise SandboxError(f"sandbox {self.sandbox_id} is closed")
        self._check_storage()
        cwd = cwd or self.workdir
        if user not in (None, "root", 0, "0") or self._fallback_noted:
            return await self._exec_cli(cmd, timeout=timeout, cwd=cwd, env=env, user=user)
        for attempt in range(2):
            if self._shell is None or not self._shell.alive:
                # A shell that died between commands (or never started) is replaced: nothing of a
                # command was sent to it, so a fresh one runs the command once (in a new session).
                if self._shell is not None:
                    self._kill_inside(self._shell)
                    self._shell = None
                try:
                    await self._start_shell()
                except (TimeoutError, SandboxTransportError, OSError) as exc:
                    return await self._fall_back(exc, cmd, timeout=timeout, cwd=cwd, env=env)
            try:
                return await self._exec_shell(cmd, timeout=timeout, cwd=cwd, env=env, session=session)
            except _NotSent as exc:
                if attempt:
                    return await self._fall_back(exc, cmd, timeout=timeout, cwd=cwd, env=env)
        raise AssertionError("unreachable")

    async def _exec_shell(
        self,
        cmd: str,
        *,
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
        session: bool,
    ) -> ExecResult:
        shell = self._shell
        assert shell is not None
        nonce = secrets.token_hex(16)
        start = time.monotonic()
        wait = (timeout or 3600.0) + self.shell_grace_s
        try:
            oh, ot, out_size, eh, et, err_size, rc, timed_out = await shell.run(
                self._line(cmd, timeout=timeout, cwd=cwd, env=env, session=session),
                nonce,
                wait,
                self.output_limit,
            )
        except _NotSent:
            raise
        except (
            TimeoutError,
            SandboxTransportError,
            OSError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
        ) as exc:
            # The command may have run, partly or fully: never run it a second time.
            raise await self._shell_failed(shell, exc, session=session) from exc
        except asyncio.CancelledError:
            # The shell is mid-command: its framing can no longer be trusted. Killing the client
            # does not stop the command inside, so its process group is killed in the background.
            self._retire(shell)
            self._kill_inside(shell, session=session)
            self._shell = None
            raise
        duration = time.monotonic() - start
        return ExecResult(
            _bounded(oh, ot, out_size),
            _bounded(eh, et, err_size),
            None if timed_out else rc,
            timed_out,
            duration,
        )

    async def _shell_failed(self, shell: _Shell, exc: BaseException, *, session: bool) -> Exception:
        """Classify a persistent shell that failed during a command (docs/failures.md): the
        container gone or the host's client killed is infrastructure; the shell inside killed,
        stopped or writing anything but its frame is something the command could have done."""
        if shell.alive and isinstance(exc, asyncio.IncompleteReadError):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shell.proc.wait(), 5)
        client_rc = shell.proc.returncode
        self._retire(shell)
        self._kill_inside(shell, session=session)
        if self._shell is shell:
            self._shell = None
        if not await self._running():
            return SandboxTransportError(f"exec in {self.sandbox_id}: the container is gone: {exc!r}")
        if client_rc is not None and client_rc < 0:
            return SandboxTransportError(
                f"exec in {self.sandbox_id}: its persistent shell failed mid-command (the host's "
                f"`{self.cli} exec` client died of signal {-client_rc}): {exc!r}"
            )
        self._check_storage()  # the storage watch killed the command's processes
        if isinstance(exc, TimeoutError):
            cause, what = "shell_unresponsive", "stopped answering (stopped or hung by the command)"
        elif isinstance(exc, asyncio.IncompleteReadError):
            cause, what = "shell_killed", "was killed during the command"
        else:
            cause, what = "shell_protocol", "sent a forged or garbled reply"
        return SandboxPolicyError(
            f"exec in {self.sandbox_id}: the sandbox's shell {what}: {exc!r}; a fresh shell runs the next command",
            cause=cause,
        )

    def _retire(self, shell: _Shell) -> None:
        shell.kill()

    def _note_fallback(self, exc: BaseException) -> None:
        if not self._fallback_noted:
            log.warning(
                "persistent shell of %s could not start (%r); using one `%s exec` per command from now on",
                self.sandbox_id,
                exc,
                self.cli,
            )
            self._fallback_noted = True

    async def _fall_back(
        self,
        exc: BaseException,
        cmd: str,
        *,
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
    ) -> ExecResult:
        if self._shell is not None:
            self._retire(self._shell)
            self._shell = None
        self._note_fallback(exc)
        return await self._exec_cli(cmd, timeout=timeout, cwd=cwd, env=env, user=None)

    async def _exec_cli(
        self,
        cmd: str,
        *,
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
        user: str | int | None,
    ) -> ExecResult:
        args = ["exec"]
        if cwd:
            args += ["-w", cwd]
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        if user is not None:
            args += ["--user", str(user)]
        inner = (
            cmd if timeout is None else f"timeout -k 2 {max(timeout, 0.01):.3f} bash -c {shlex.quote(cmd)}"
        )
        start = time.monotonic()
        try:
            rc, out, err = await run_cli_bounded(
                self.cli,
                *args,
                self.sandbox_id,
                "bash",
                "-c",
                inner,
                timeout=(timeout or 3600.0) + self.shell_grace_s,
                limit=self.output_limit,
            )
        except TimeoutError as exc:
            if not await self._running():
                raise SandboxTransportError(f"container {self.sandbox_id} is gone") from exc
            raise SandboxPolicyError(
                f"`{self.cli} exec` into {self.sandbox_id} did not return within the command's timeout "
                "plus grace (a command outlived its own timeout)",
                cause="shell_unresponsive",
            ) from exc
        duration = time.monotonic() - start
        if rc in (125, 126) and "no such container" in err.lower():
            raise SandboxTransportError(f"container {self.sandbox_id} is gone: {err.strip()[-300:]}")
        timed_out = timeout is not None and rc in (124, 137) and duration >= timeout * 0.98
        return ExecResult(out, err, None if timed_out else rc, timed_out, duration)

    def _kill_inside(self, shell: _Shell, *, session: bool = False) -> None:
        """Kill, in the background, what the shell's command in flight runs (a session command:
        the session shell and the process groups it made since the command began; a clean one:
        its process group) and remove the shell's directories. Between commands (`session`
        False, no clean command in flight) only the directories go: a session shell whose framing
        shell is gone reads the end of its input and exits, its background jobs live on."""
        if not shell.state_dir or self._closed:
            return
        d, o = shell.state_dir, shell.out_dir
        kill_session = f"{_KILL_SESSION}\n__ar_ks $(cat {d}/sp 2>/dev/null); " if session else ""
        script = f"{kill_session}kill -KILL -- -$(cat {d}/p 2>/dev/null) 2>/dev/null; rm -rf {d} {o}"
        t = asyncio.get_running_loop().create_task(
            run_cli(self.cli, "exec", self.sandbox_id, "bash", "-c", script, timeout=30)
        )
        self.provider._background.add(t)
        t.add_done_callback(self.provider._background.discard)

    async def _running(self) -> bool:
        rc, out, _ = await run_cli(
            self.cli, "inspect", "--format", "{{.State.Running}}", self.sandbox_id, timeout=30
        )
        return rc == 0 and out.strip() == "true"

    # -- terminal ---------------------------------------------------------------------------------
    async def open_terminal(self, *, width: int = 160, height: int = 40) -> TerminalSession:
        """A tmux session in the container, driven through the persistent shell (clean commands)."""
        if self._closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed")
        note = self.provider._terminal_notes.get(self.image)
        if not self.provider.terminal_tools:
            hint = "or create the provider with PodmanProvider(terminal_tools=True), which installs it"
        elif note:
            hint = f"installing it when the image was built failed: {note}"
        else:
            hint = (
                "the layer PodmanProvider adds to install it where it is missing found no package manager "
                "that could (see the warning when the image was built); the offline stand-in base images "
                "have it (`make bases`)"
            )
        term = await TmuxTerminal.start(
            self._terminal_run, width=width, height=height, where=self.sandbox_id, hint=hint
        )
        self._terminals.append(term)
        return term

    async def _terminal_run(self, cmd: str, timeout: float) -> ExecResult:
        # Timed from the host: a watchdog inside would cost a fork per keystroke batch, and tmux
        # answers at once unless the agent stopped it (then the shell is replaced, as on a cancel).
        start = time.monotonic()
        try:
            return await asyncio.wait_for(self._exec_clean(cmd, timeout=None), timeout)
        except TimeoutError:
            return ExecResult("", "", None, True, time.monotonic() - start)

    def _end_terminals(self) -> None:
        for term in self._terminals:
            term.mark_closed()
        self._terminals.clear()

    # -- verification support ---------------------------------------------------------------------
    async def stop_processes(self) -> None:
        """Kill every process in the container but its init and the servers listening on a socket
        (a task may ask for a service its tests talk to; a tmux server is never kept), the
        persistent shell and its session included (a new one starts on the next exec) and every
        terminal. From the host where it can (stopped, then killed, by PID namespace: no tool
        inside the container takes part, and a fork bomb that filled the pids limit cannot block
        it), else through a fresh `exec` (which kills the listeners too)."""
        self._end_terminals()
        if self._shell is not None:
            self._retire(self._shell)
            self._shell = None
        await self._measure_storage()
        self._check_storage()
        if self._init_pid is None:
            rc, out, _ = await run_cli(
                self.cli, "inspect", "--format", "{{.State.Pid}}", self.sandbox_id, timeout=60
            )
            self._init_pid = int(out.strip()) if rc == 0 and out.strip().isdigit() else 0
        if self._init_pid > 0 and await asyncio.to_thread(_kill_namespace, self._init_pid):
            return
        script = f"{KILL_ALL}; rm -rf /tmp/.agentrl-shell-* /dev/shm/.agentrl-shell-*"
        try:
            rc, _, err = await run_cli(self.cli, "exec", self.sandbox_id, "bash", "-c", script, timeout=60)
        except TimeoutError as exc:
            raise SandboxTransportError(f"killing the processes of {self.sandbox_id} hung") from exc
        if rc != 0 and not await self._running():
            raise SandboxTransportError(f"container {self.sandbox_id} is gone: {err.strip()[-300:]}")

    async def fetch_files(self, directory: str, names: list[str], dst: Path) -> list[str]:
        """One `cp` of the directory as a tar stream to the host (no tool inside the container
        takes part), keeping only `names`, each at most its last `FETCH_LIMIT` bytes, regular
        files only: host memory and disk stay bounded whatever the sandbox wrote there."""
        proc = await asyncio.create_subprocess_exec(
            self.cli,
            "cp",
            f"{self.sandbox_id}:{directory.rstrip('/')}/.",
            "-",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cli_cwd(),
        )
        assert proc.stdout is not None and proc.stderr is not None
        dst.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        reader = _StreamFile(proc.stdout, loop)
        try:
            found, err = await asyncio.wait_for(
                asyncio.gather(asyncio.to_thread(_untar_tails, reader, names, dst), proc.stderr.read()), 300
            )
            await asyncio.wait_for(proc.wait(), 60)
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
            raise
        if proc.returncode != 0:
            text = err.decode(errors="replace")
            if "could not be found on container" in text or "no such file" in text.lower():
                return []
            raise SandboxTransportError(f"copying {directory} out of {self.sandbox_id} failed: {text[-300:]}")
        return found

    async def tampered_paths(self) -> list[str] | None:
        """The container's changes against its image, as the storage driver sees them on the
        host (`podman diff`): no tool inside the container takes part. The listing is streamed a
        line at a time and only suspicious entries are kept, so an agent that created millions of
        files costs time, never host memory."""
        proc = await asyncio.create_subprocess_exec(
            self.cli,
            "diff",
            self.sandbox_id,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cli_cwd(),
        )
        scan = _DiffScan()

        async def read() -> bytes:
            assert proc.stdout is not None and proc.stderr is not None
            while line := await proc.stdout.readline():
                scan.feed(line.decode(errors="replace").rstrip("\n"))
            return await proc.stderr.read(64 * 1024)

        try:
            err, _ = await asyncio.wait_for(asyncio.gather(read(), proc.wait()), 300)
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
            raise
        if proc.returncode != 0:
            raise SandboxTransportError(
                f"`{self.cli} diff {self.sandbox_id}` failed: {err.decode(errors='replace').strip()[-300:]}"
            )
        return scan.result(self._is_dir_in_layer)

    def _is_dir_in_layer(self, path: str) -> bool:
        """Whether `path` is a directory in the container's writable layer (copied up when its
        entries changed), looked at from the host without following links."""
        if self._upper_dir is None:
            return False
        try:
            return stat.S_ISDIR(os.lstat(self._upper_dir + path).st_mode)
        except (OSError, ValueError):
            return False

    # -- storage -------------------------------------------------------------------------------------
    async def _measure_storage(self) -> None:
        if self.storage_mb is None or self._upper_dir is None or self._storage_used is not None:
            return
        limit = self.storage_mb * 2**20
        used = await asyncio.to_thread(_tree_bytes, self._upper_dir, limit)
        if used > limit:
            self._storage_used = used

    async def _watch_storage(self) -> None:
        """Where the storage driver cannot cap a container's writable layer (overlay on ext4), the
        layer is measured from the host, more rarely the longer a measurement takes; over the limit,
        every process in the container is killed and the next exec is a policy failure."""
        while not self._closed and self._storage_used is None:
            start = time.monotonic()
            try:
                await self._measure_storage()
            except OSError as exc:
                log.debug("measuring the storage of %s failed: %s", self.sandbox_id, exc)
            spent = time.monotonic() - start
            if self._storage_used is not None:
                log.warning("%s exceeded its storage limit of %s MiB", self.sandbox_id, self.storage_mb)
                with contextlib.suppress(SandboxError, TimeoutError):
                    await run_cli(self.cli, "exec", self.sandbox_id, "bash", "-c", KILL_ALL, timeout=60)
                return
            await asyncio.sleep(max(self.provider.storage_check_s, 20 * spent))

    async def upload(self, src: Path, dst: str) -> None:
        src = Path(src).resolve()  # the CLI runs in cli_cwd()
        if src.is_dir():
            await self._exec_clean(f"mkdir -p {shlex.quote(dst)}")
            rc, _, err = await run_cli(self.cli, "cp", f"{src}/.", f"{self.sandbox_id}:{dst}", timeout=300)
        else:
            await self._exec_clean(f"mkdir -p {shlex.quote(os.path.dirname(dst) or '/')}")
            rc, _, err = await run_cli(self.cli, "cp", str(src), f"{self.sandbox_id}:{dst}", timeout=300)
        if rc != 0:
            raise SandboxTransportError(f"upload {src} -> {dst} failed: {err.strip()[-500:]}")

    async def download(self, src: str, dst: Path) -> None:
        # A directory's contents land in dst, like upload, whether or not dst exists yet (when it
        # does not, `cp` gives that for a directory and a file alike, with no exec inside).
        dst = Path(dst).resolve()  # the CLI runs in cli_cwd()
        is_dir = (
            dst.exists()
            and (await self._exec_clean(f"test -d {shlex.quote(src)}", timeout=30)).exit_code == 0
        )
        dst.parent.mkdir(parents=True, exist_ok=True)
        source = f"{src.rstrip('/')}/." if is_dir else src
        rc, _, err = await run_cli(self.cli, "cp", f"{self.sandbox_id}:{source}", str(dst), timeout=300)
        if rc != 0:
            raise SandboxTransportError(f"download {src} -> {dst} failed: {err.strip()[-500:]}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end_terminals()
        if self._monitor is not None:
            self._monitor.cancel()
        shell, self._shell = self._shell, None
        if shell is not None:
            shell.kill()
        # Shielded: a cancelled owner must still not leave the container behind.
        await asyncio.shield(self.provider._remove(self.sandbox_id))
        if shell is not None:  # reaped here, so no pipe outlives the event loop
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shell.proc.wait(), 10)

    async def alive(self) -> bool:
        if self._closed:
            return False
        try:
            res = await self._exec_clean("true", timeout=10)
        except (SandboxError, SandboxPolicyError):
            return False
        return res.exit_code == 0


def _listening_inodes(pid: int) -> set[str]:
    """Socket inodes in LISTEN state in the network namespace of `pid` (TCP, TCP6, unix)."""
    found: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as fh:
                next(fh, None)
                for line in fh:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A":
                        found.add(cols[9])
        except OSError:
            continue
    try:
        with open(f"/proc/{pid}/net/unix") as fh:
            next(fh, None)
            for line in fh:
                cols = line.split()
                if len(cols) > 6 and int(cols[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
                    found.add(cols[6])
    except (OSError, ValueError):
        pass
    return found


def _is_listener(pid: int, listening: set[str]) -> bool:
    try:
        fds = os.scandir(f"/proc/{pid}/fd")
    except OSError:
        return False
    with fds:
        for fd in fds:
            try:
                link = os.readlink(fd.path)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in listening:
                return True
    return False


def _is_tmux(pid: int) -> bool:
    """A tmux server (the agent's terminal, or one it started): never kept as a service, since it
    can start processes of its own (hooks, `run-shell`) after the others are gone."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            comm = fh.read().strip()
    except OSError:
        comm = ""
    return os.path.basename(exe).split(" ")[0] == "tmux" or comm.startswith("tmux")


def _stat_fields(pid: int) -> list[str]:
    """`/proc/PID/stat` after the command name: state, ppid, pgrp, session, tty_nr, tpgid, ..."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()
    except OSError:
        return []


def _terminal_holders(servers: set[int]) -> set[int]:
    """For servers with a controlling terminal: their session leader and, when it is a tmux
    pane's shell, the tmux server (its parent)."""
    found: set[int] = set()
    for pid in servers:
        fields = _stat_fields(pid)
        if len(fields) < 5 or fields[4] == "0" or not fields[3].isdigit():
            continue
        leader = int(fields[3])
        if leader in servers or leader <= 1:
            continue
        found.add(leader)
        parent = _stat_fields(leader)
        if len(parent) > 1 and parent[1].isdigit() and _is_tmux(int(parent[1])):
            found.add(int(parent[1]))
    return found


def _kill_namespace(init_pid: int, keep_listeners: bool = True) -> bool:
    """SIGSTOP, then SIGKILL, every host process in the PID namespace of `init_pid` but the init
    itself (and, with `keep_listeners`, the servers listening on a socket but tmux: tasks ask for
    services the tests talk to; such a server's terminal, if it has one, is stopped rather than
    killed, see `_terminal_holders`), sweeping until none is left. False when this host cannot see that
    namespace (another user's, a remote engine): the caller kills from inside instead."""
    try:
        ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    except OSError:
        return False
    kept: set[int] = set()
    holders: set[int] = set()
    listening = _listening_inodes(init_pid) if keep_listeners else set()

    def members() -> list[int]:
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and int(entry.name) not in kept and int(entry.name) != init_pid:
                try:
                    if os.readlink(f"/proc/{entry.name}/ns/pid") != ns:
                        continue
                except OSError:
                    continue  # gone, a zombie, or not ours to inspect
                # A zombie (of a stopped terminal's shell, say) is dead already.
                if _stat_fields(int(entry.name))[:1] not in (["Z"], ["X"]):
                    found.append(int(entry.name))
        return found

    if listening:
        kept.update(p for p in members() if _is_listener(p, listening) and not _is_tmux(p))
        # A server in a terminal's foreground dies of SIGHUP when its terminal goes (its session
        # leader, the pane's shell, or the tmux server holding the pty): those are stopped, never
        # killed, so they cannot act (a tmux hook, say) and the server keeps serving.
        holders = _terminal_holders(kept)
        for pid in holders:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        kept.update(holders)
    for _ in range(100):
        alive = members()
        if not alive:
            # The kernel continues a stopped process group that its peers' deaths leave orphaned
            # (SIGHUP + SIGCONT): a terminal holder must stay stopped, so stop it again.
            for pid in holders:
                if _stat_fields(pid)[:1] not in (["T"], ["t"], ["Z"], ["X"], []):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGSTOP)
            return True
        stopped: set[int] = set()
        while new := [p for p in alive if p not in stopped]:  # frozen before any can fork again
            for pid in new:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGSTOP)
            stopped.update(new)
            alive = members()
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return not members()


FETCH_LIMIT = 1 << 20


class _StreamFile(io.RawIOBase):
    """A blocking file over an asyncio stream, for `tarfile` running in a worker thread."""

    def __init__(self, stream: asyncio.StreamReader, loop: asyncio.AbstractEventLoop) -> None:
        self.stream, self.loop = stream, loop

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = asyncio.run_coroutine_threadsafe(self.stream.read(len(buffer)), self.loop).result()
        buffer[: len(data)] = data
        return len(data)


def _untar_tails(fileobj: io.RawIOBase, names: list[str], dst: Path) -> list[str]:
    """Write the last `FETCH_LIMIT` bytes of each regular file `names` of a tar stream to `dst`;
    read the stream to its end (so `cp` exits)."""
    found = []
    wanted = {f"./{n}" for n in names} | set(names)
    with tarfile.open(fileobj=io.BufferedReader(fileobj), mode="r|") as tar:
        for member in tar:
            if member.name not in wanted or not member.isreg():
                continue
            src = tar.extractfile(member)
            assert src is not None
            tail = bytearray()
            while chunk := src.read(1 << 16):
                tail += chunk
                del tail[: max(0, len(tail) - FETCH_LIMIT)]
            name = member.name.removeprefix("./")
            (dst / name).write_bytes(bytes(tail))
            found.append(name)
    while fileobj.read(1 << 16):
        pass
    return found


def _tree_bytes(root: str, stop_above: int) -> int:
    """Disk bytes under `root` (allocated blocks; links not followed), stopping once over `stop_above`."""
    total = 0
    stack = [root]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                if total > stop_above:
                    return total
    return total


class PodmanProvider(SandboxProvider):
    """Creates `PodmanSandbox`es for tasks; optionally keeps a warm pool per task."""

    def __init__(
        self,
        *,
        cli: str | None = None,
        allow_network: bool | None = None,
        pids_limit: int = DEFAULT_PIDS_LIMIT,
        inject_ca: bool = True,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        warm_pool: int = 0,
        default_cpus: float | None = DEFAULT_CPUS,
        default_memory_mb: int | None = DEFAULT_MEMORY_MB,
        default_storage_mb: int | None = DEFAULT_STORAGE_MB,
        storage_check_s: float = 2.0,
        shell_grace_s: float = 30.0,
        init: str | None = None,
        terminal_tools: bool = True,
    ) -> None:
        """Limits: a task's own `cpus` / `memory_mb` / `storage_mb` win; when it is silent the
        defaults apply (None: no limit). `init` is a static init run as PID 1 in pause mode
        (default: catatonit, found like podman finds it): it reaps zombies and cannot be killed from
        inside, so `kill -9 -1` ends the agent's processes but never the container.
        `terminal_tools`: sandboxes run the task's image plus one layer that installs tmux where it
        is missing (built once per image, with the build network), so `open_terminal` works."""
        self.cli = cli or os.environ.get("AGENTRL_CONTAINER_CLI", "podman")
        self.allow_network = allow_network  # None: the task decides; True/False: user override
        self.pids_limit = pids_limit
        # docker build has no build-time mounts; podman's `-v` on build is what makes this work.
        self._podman = is_podman(self.cli)
        self._ca_dir = build_ca_dir() if inject_ca and self._podman else None
        self.output_limit = output_limit
        self.warm_pool = warm_pool
        self.default_cpus = default_cpus
        self.default_memory_mb = default_memory_mb
        self.default_storage_mb = default_storage_mb
        self.storage_check_s = storage_check_s
        self.shell_grace_s = shell_grace_s
        self.init = init if init is not None else find_init()
        self.terminal_tools = terminal_tools
        self._terminal_images: dict[str, str] = {}
        self._terminal_notes: dict[str, str] = {}  # image -> why its tmux layer is missing
        self._storage_opt: bool | None = None  # whether the storage driver caps a container's size
        self._build_locks: dict[str, asyncio.Lock] = {}
        self._unpullable: set[str] = set()
        self._standins_said: set[tuple[str, str]] = set()  # warned once per provider
        self._live: set[str] = set()
        self._pool: dict[str, list[PodmanSandbox]] = {}
        self._pool_tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()

    # -- images ---------------------------------------------------------------------------------
    async def image_for(self, task: Task) -> str:
        """The image to run `task` in: `docker_image` when it is local or can be pulled (Harbor's
        default), else the image built from environment/Dockerfile."""
        env = task.config.environment
        if env.docker_image:
            if await self._have_or_pull(env.docker_image):
                return env.docker_image
            if task.dockerfile is None:
                raise SandboxCreateError(
                    f"{task.task_id}: docker_image {env.docker_image!r} is neither local nor pullable"
                    " and there is no environment/Dockerfile to build instead"
                )
            log.info("%s: %s unavailable; building environment/Dockerfile", task.task_id, env.docker_image)
        if task.dockerfile is None:
            raise SandboxCreateError(f"{task.task_id}: no environment/Dockerfile and no docker_image")
        dockerfile = await self._dockerfile_offline(task)
        key = context_hash(task.environment_dir)
        if dockerfile is not None:
            # the rewrite names the stand-in with its recipe hash: a new recipe is a new image
            key = hashlib.sha256(f"{key}\n{dockerfile}".encode()).hexdigest()[:16]
        tag = f"localhost/agentrl-task/{task.task_id.lower()}:{key}"
        lock = self._build_locks.setdefault(tag, asyncio.Lock())
        async with lock:
            rc, _, _ = await run_cli(self.cli, "image", "inspect", tag, timeout=60)
            if rc == 0:
                return tag
            await self._build(task, tag, dockerfile)
        return tag

    async def _dockerfile_offline(self, task: Task) -> str | None:
        """environment/Dockerfile with every `FROM` whose base is neither local nor pullable
        rewritten to the stand-in serving its repository; None when no line needs it. A stand-in
        an older agentrl tagged under the real name counts as local only while the stand-in under
        its own name is missing."""
        assert task.dockerfile is not None
        text = task.dockerfile.read_text(encoding="utf-8", errors="replace")
        recipe = images.load_recipe()
        replace: dict[int, str] = {}
        for line in images.from_lines(text):
            standin = images.standin_for(line.image, recipe)
            if await self._have_or_pull(line.image) and (
                standin is None
                or await self._recipe_label(line.image) is None
                or not await self._have(standin)
            ):
                continue
            if standin is None:
                raise ImageBuildError(
                    f"{task.task_id}: environment/Dockerfile line {line.line + 1}: FROM {line.written} "
                    "is not present locally, cannot be pulled, and no offline stand-in serves it "
                    f"(sandbox_images/bases.toml lists {', '.join(recipe.repositories)}): load the "
                    f"image on this machine (`{self.cli} load` / `{self.cli} pull` where a registry "
                    "answers), or start FROM a base the stand-ins serve"
                )
            if not await self._have(standin):
                raise ImageBuildError(
                    f"{task.task_id}: FROM {line.written} is not present locally and cannot be "
                    f"pulled; its offline stand-in {standin} is not built: run `agentrl sandbox "
                    "build-bases`"
                )
            if (task.task_id, line.written) not in self._standins_said:
                self._standins_said.add((task.task_id, line.written))
                log.warning(
                    "%s: FROM %s is not present locally and cannot be pulled: the stand-in %s answers "
                    "instead; %s",
                    task.task_id,
                    line.written,
                    standin,
                    recipe.content,
                )
            replace[line.line] = standin
        return images.rewrite_froms(text, replace) if replace else None

    async def _have(self, image: str) -> bool:
        return (await run_cli(self.cli, "image", "inspect", image, timeout=60))[0] == 0

    async def _recipe_label(self, image: str) -> str | None:
        rc, out, _ = await run_cli(
            self.cli,
            "image",
            "inspect",
            "--format",
            f'{{{{ index .Config.Labels "{images.RECIPE_LABEL}" }}}}',
            image,
            timeout=60,
        )
        value = out.strip()
        return value if rc == 0 and value and value != "<no value>" else None

    async def terminal_image(self, image: str, timeout: float = 600.0) -> str:
        """`image` plus a layer that installs tmux where it is missing (`INSTALL_TMUX`), built
        once and tagged by the image's id. An image whose layer cannot be built (no shell in it,
        say) is used as it is: the command path does not need tmux, and `open_terminal` says why
        there is none."""
        if not self.terminal_tools:
            return image
        if image in self._terminal_images:
            return self._terminal_images[image]
        lock = self._build_locks.setdefault(f"terminal:{image}", asyncio.Lock())
        async with lock:
            if image in self._terminal_images:
                return self._terminal_images[image]
            rc, out, err = await run_cli(
                self.cli, "image", "inspect", "--format", "{{.Id}}\t{{.Config.User}}", image, timeout=60
            )
            image_id, _, user = out.strip().partition("\t")
            if rc != 0 or not image_id:
                raise SandboxCreateError(f"inspecting image {image} failed", log_tail=err[-500:])
            recipe = hashlib.sha256(f"{image_id}\n{INSTALL_TMUX}".encode()).hexdigest()[:16]
            tag = f"localhost/agentrl-terminal/image:{recipe}"
            if (await run_cli(self.cli, "image", "inspect", tag, timeout=60))[0] != 0:
                dockerfile = f"FROM {image_id}\nUSER root\nRUN {INSTALL_TMUX}\n"
                if user and user not in ("root", "0", "0:0"):
                    dockerfile += f"USER {user}\n"
                with tempfile.TemporaryDirectory(prefix="agentrl-terminal-") as ctx:
                    (Path(ctx) / "Dockerfile").write_text(dockerfile)
                    args = ["build", "--network=host", "--pull=never" if self._podman else "--pull=false"]
                    try:
                        rc, out, err = await run_cli(self.cli, *args, "-t", tag, ctx, timeout=timeout)
                    except TimeoutError:
                        rc, out, err = 1, "", f"took longer than {timeout:.0f}s"
                if rc != 0:
                    note = (out + err).strip()[-300:]
                    log.warning(
                        "could not add tmux to %s (the terminal will be unavailable): %s", image, note
                    )
                    self._terminal_notes[image] = note
                    tag = image
                elif NO_TMUX in out + err:
                    self._terminal_notes[tag] = "no package manager of the image could install it"
                    log.warning("%s has no tmux and none could be installed: no terminal in it", image)
            self._terminal_images[image] = tag
            return tag

    async def _have_or_pull(self, image: str) -> bool:
        if image in self._unpullable:
            return await self._have(image)
        lock = self._build_locks.setdefault(image, asyncio.Lock())
        async with lock:
            if await self._have(image):
                return True
            try:
                pulled = (await run_cli(self.cli, "pull", "--quiet", image, timeout=600))[0] == 0
            except TimeoutError:
                pulled = False
            if not pulled:
                self._unpullable.add(image)  # one try per provider: offline, every try fails
            return pulled

    async def _build(self, task: Task, tag: str, dockerfile: str | None = None) -> None:
        """Build `tag` from environment/ with the Dockerfile as written, or `dockerfile` (the
        rewritten text) from a temporary file next to the unchanged context. Every base is local
        by now (present, pulled or a stand-in), so nothing is pulled during the build, unless a
        `FROM` names its image through a build argument no one could resolve beforehand."""
        assert task.dockerfile is not None
        with tempfile.TemporaryDirectory(prefix="agentrl-dockerfile-") as tmp:
            path = Path(task.dockerfile).resolve()
            if dockerfile is not None:
                path = Path(tmp) / "Dockerfile"
                path.write_text(dockerfile, encoding="utf-8")
                ignore = Path(task.environment_dir) / "Dockerfile.dockerignore"
                if ignore.is_file():
                    shutil.copyfile(ignore, Path(tmp) / "Dockerfile.dockerignore")
            args = ["build", "--network=host", "-t", tag, "-f", str(path)]
            if not _UNRESOLVED_FROM.search(dockerfile or path.read_text(errors="replace")):
                # docker never pulls a base it has unless told to; its --pull takes no value.
                args.append("--pull=never" if self._podman else "--pull=false")
            if self._ca_dir is not None:
                args += ["-v", f"{Path(self._ca_dir).resolve()}:{BUILD_PIP_DIR}:ro"]
            args.append(str(Path(task.environment_dir).resolve()))  # the CLI runs in cli_cwd()
            timeout = task.config.environment.build_timeout_sec
            try:
                rc, out, err = await run_cli(self.cli, *args, timeout=timeout)
            except TimeoutError:
                raise ImageBuildError(
                    f"building {task.task_id} took longer than {timeout:.0f}s (build_timeout_sec)"
                ) from None
        if rc != 0:
            raise ImageBuildError(
                f"building the image of {task.task_id} failed (exit {rc})", log_tail=(out + err)[-4000:]
            )

    # -- containers -----------------------------------------------------------------------------
    def _network(self, task: Task) -> str:
        allowed = (
            task.config.environment.internet_allowed if self.allow_network is None else self.allow_network
        )
        return "bridge" if allowed else "none"

    def _run_args(self, task: Task, run_id: str, name: str) -> tuple[list[str], int | None]:
        """`run` arguments without the storage cap, and the storage limit in MiB."""
        env = task.config.environment
        args = [
            "run",
            "-d",
            "--name",
            name,
            "--network",
            self._network(task),
            "--label",
            f"{LABEL_RUN}={run_id}",
            "--label",
            f"{LABEL_TASK}={task.task_id}",
            "--label",
            f"{LABEL_CREATED}={int(time.time())}",
            "--pids-limit",
            str(self.pids_limit),
        ]
        if self._podman:
            args.append("--http-proxy=false")  # podman copies the host's proxy variables by default
        if self.init:
            args += ["-v", f"{self.init}:{INIT_PATH}:ro", "--entrypoint", INIT_PATH]
        else:
            args += ["--init", "--entrypoint", "sleep"]
        cpus = env.cpus or self.default_cpus
        if cpus:
            args += ["--cpus", str(cpus)]
        memory = env.memory_mb or self.default_memory_mb
        if memory:
            args += ["--memory", f"{memory}m", "--memory-swap", f"{memory}m"]
        if env.workdir:
            args += ["-w", env.workdir]
        # `${VAR}` / `${VAR:-default}` values come from the host, as in Harbor (an unset one is a
        # task error that names the variable).
        for k, v in resolve_env_templates(env.env, str(task.path / "task.toml")).items():
            args += ["-e", f"{k}={v}"]
        return args, env.storage_mb or self.default_storage_mb

    async def _start(self, task: Task, run_id: str, image: str) -> PodmanSandbox:
        env = task.config.environment
        # Container names allow [a-zA-Z0-9][a-zA-Z0-9_.-]*; run ids and task ids may hold anything.
        safe = re.sub(r"[^a-z0-9_.-]+", "-", f"{run_id[:24]}-{task.task_id[:24]}".lower())
        name = f"agentrl-{safe}-{uuid.uuid4().hex[:8]}"
        args, storage = self._run_args(task, run_id, name)
        tail = [image, "-P"] if self.init else [image, "infinity"]
        _LIVE[name] = self.cli
        self._live.add(name)
        try:
            rc, err = 1, ""
            if storage and self._storage_opt is not False:
                rc, _, err = await run_cli(
                    self.cli, *args, "--storage-opt", f"size={storage}m", *tail, timeout=120
                )
                if rc == 0:
                    self._storage_opt = True
                elif "only supported for" in err or "storage-opt" in err.lower() or "quota" in err.lower():
                    log.info(
                        "the storage driver cannot cap container size (%s): measuring from the host",
                        err.strip()[-200:],
                    )
                    self._storage_opt = False
                    await run_cli(self.cli, *rm_args(self.cli), name, timeout=120)
            if rc != 0 and not (storage and self._storage_opt):
                rc, _, err = await run_cli(self.cli, *args, *tail, timeout=120)
            if rc != 0:
                raise SandboxCreateError(
                    f"starting a container for {task.task_id} failed", log_tail=err[-2000:]
                )
            # One inspect for both: the writable layer (storage measured from the host) and the
            # init's host pid (the verifier kills the agent's processes by its PID namespace).
            rc, out, err = await run_cli(
                self.cli,
                "inspect",
                "--format",
                "{{.State.Pid}}\t{{.GraphDriver.Data.UpperDir}}",
                name,
                timeout=60,
            )
            pid, _, upper_out = out.strip().partition("\t")
            upper = upper_out if rc == 0 and os.path.isdir(upper_out) else None
            if storage and not self._storage_opt and upper is None:
                raise SandboxCreateError(
                    f"{task.task_id} asks for storage_mb={storage}, which this host can enforce neither "
                    "with the storage driver (overlay on xfs with pquota) nor by measuring the "
                    "container's writable layer from the host; pass default_storage_mb=None and set no "
                    "storage_mb to run without a storage limit",
                    log_tail=err[-500:],
                )
            if not (storage and not self._storage_opt):
                upper = None
            sandbox = PodmanSandbox(
                self, name, env.workdir, storage_mb=storage if upper else None, upper_dir=upper, image=image
            )
            sandbox._init_pid = int(pid) if pid.isdigit() else None
            res = await sandbox._exec_clean(
                "mkdir -p /logs/verifier /logs/agent /logs/artifacts && chmod 777 /logs /logs/*", timeout=60
            )
            if res.exit_code != 0:
                raise SandboxCreateError(f"preparing /logs in {name} failed", log_tail=res.stderr)
            return sandbox
        except BaseException:
            await asyncio.shield(self._remove(name))
            raise

    async def create(self, task: Task, *, run_id: str) -> Sandbox:
        pooled = self._pool.get(task.task_id)
        while pooled:
            sandbox = pooled.pop()
            if await sandbox.alive():
                self._refill(task, run_id)
                return sandbox
            await sandbox.close()
        image = await self.terminal_image(
            await self.image_for(task), task.config.environment.build_timeout_sec
        )
        sandbox = await self._start(task, run_id, image)
        self._refill(task, run_id)
        return sandbox

    def _refill(self, task: Task, run_id: str) -> None:
        if self.warm_pool > 0:
            self.prefetch(task, run_id=run_id)

    def prefetch(self, task: Task, *, run_id: str, count: int | None = None) -> None:
        """Start containers for an upcoming task in the background (the warm pool)."""
        want = (
            (count or self.warm_pool)
            - len(self._pool.get(task.task_id, []))
            - sum(1 for t in self._pool_tasks if t.get_name() == task.task_id)
        )
        for _ in range(max(0, want)):
            t = asyncio.create_task(self._warm_one(task, run_id), name=task.task_id)
            self._pool_tasks.add(t)
            t.add_done_callback(self._pool_tasks.discard)

    async def wait_warm(self, task: Task) -> int:
        """Wait for the pre-starts of `task` in flight; return how many sandboxes are pooled."""
        pending = [t for t in self._pool_tasks if t.get_name() == task.task_id]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return len(self._pool.get(task.task_id, []))

    async def _warm_one(self, task: Task, run_id: str) -> None:
        try:
            image = await self.image_for(task)
            image = await self.terminal_image(image, task.config.environment.build_timeout_sec)
            sandbox = await self._start(task, run_id, image)
        except SandboxError as exc:
            log.warning("warm pool: could not pre-start %s: %s", task.task_id, exc)
            return
        self._pool.setdefault(task.task_id, []).append(sandbox)

    async def _remove(self, name: str) -> None:
        try:
            await run_cli(self.cli, *rm_args(self.cli), name, timeout=120)
        finally:
            self._live.discard(name)
            _LIVE.pop(name, None)

    def live_sandboxes(self) -> int:
        return len(self._live)

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for t in list(self._pool_tasks):
            t.cancel()
        if self._pool_tasks:
            await asyncio.gather(*self._pool_tasks, return_exceptions=True)
        for sandboxes in self._pool.values():
            for s in sandboxes:
                await s.close()
        self._pool.clear()
        for name in list(self._live):
            await self._remove(name)


async def reap(
    *, cli: str = "podman", run_id: str | None = None, older_than_s: float | None = None
) -> list[str]:
    """Remove agentrl containers by label: of one run, or older than a cutoff, or all."""
    args = [
        "ps",
        "-a",
        "--filter",
        f"label={LABEL_RUN}",
        "--format",
        f'{{{{.Names}}}}\t{{{{index .Labels "{LABEL_RUN}"}}}}\t{{{{index .Labels "{LABEL_CREATED}"}}}}',
    ]
    if run_id is not None:
        args[3] = f"label={LABEL_RUN}={run_id}"
    rc, out, err = await run_cli(cli, *args, timeout=120)
    if rc != 0:
        raise SandboxError(f"listing containers failed: {err.strip()[-500:]}")
    now = time.time()
    doomed = []
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) < 3:
            continue
        name, _, created = parts[:3]
        if older_than_s is not None and created.isdigit() and now - int(created) < older_than_s:
            continue
        doomed.append(name)
    for name in doomed:
        await run_cli(cli, *rm_args(cli), name, timeout=120)
    return doomed
