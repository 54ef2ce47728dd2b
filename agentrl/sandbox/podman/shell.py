"""The persistent shell inside a podman sandbox: a framed protocol over a pipe that the agent cannot
forge (`_BOOTSTRAP`), the agent's session shell, and which commands may skip the session snapshot."""

from __future__ import annotations

import asyncio
import logging
import re
import shlex

from agentrl.sandbox import shellstate
from agentrl.sandbox.base import (
    SandboxTransportError,
)

log = logging.getLogger(__name__)


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
