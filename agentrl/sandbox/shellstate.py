"""Shell state that persists between the agent's commands, as in one terminal session.

The state is what one bash holds: the working directory; every variable bash does not own
(`declare -p`: exported or not, arrays, attributes; variables a command unset stay unset);
functions (`declare -f`, `export -f` kept), aliases, shell options (`$SHELLOPTS`, `$BASHOPTS`) and
the umask. This module has the bash to snapshot it into a directory (`__ar_dump`) and to restore a
snapshot into a new bash (`restore`); the backends decide when:

- podman keeps one long-lived session shell per sandbox that runs the agent's commands itself, so
  the state persists with nothing restored per command; it snapshots after each command whose
  text could change the state, and a new session shell (after a timeout killed the old one, an
  `exit`, a `set -e` failure) restores the last snapshot (`podman.py`, `_SESSION_SHELL`);
- Daytona runs every command in its own bash, which restores the snapshot first and saves its own
  on its way out (bash's EXIT trap: a normal end, `exit`, `set -e`): `save_on_exit`, `RUN`.

Options are restored last, so `set -x` or `set -e` from an earlier command never trips the
restore itself. `expand_aliases` starts on, as in an interactive shell. Job control (`set -m`) is
never restored. Not in a snapshot: traps, the directory stack (`pushd`), `jobs` bookkeeping,
resource limits, positional parameters, variables declared without a value.

A command killed by its timeout leaves the session as the last snapshot had it, that is as it was
before the command. Whether a command uses the session at all is the caller's choice: the backends
use it only for `exec` calls without `cwd`, `env` and `user` (the agent's commands), and
`stop_processes` (the verifier's first step) starts a new, empty session, so the verifier's
commands and `tests/test.sh` never see an alias, function, variable or `BASH_ENV` the agent left.
A command that sets its own EXIT trap replaces the one that saves its state on exit.

Everything here is bash builtins (no process is forked): `compgen`, `mapfile` and `declare` over
small files in the state directory. `docs/terminal.md` has the rules in full.
"""

from __future__ import annotations

# bash's own variables: read-only, dynamic (`RANDOM`, `SECONDS`, `LINENO`), per process (`BASHPID`,
# `PPID`, `SHLVL`) or per call (`FUNCNAME`, `PIPESTATUS`); `PWD` is restored with `cd`. Everything
# else a command leaves set is session state. `__ar_*` are the backends' own names.
BASH_OWN = (
    "__ar_*|BASH|BASHOPTS|BASHPID|BASH_ALIASES|BASH_ARGC|BASH_ARGV|BASH_ARGV0|BASH_CMDS|BASH_COMMAND|"
    "BASH_EXECUTION_STRING|BASH_LINENO|BASH_LOADABLES_PATH|BASH_MONOSECONDS|BASH_REMATCH|BASH_SOURCE|"
    "BASH_SUBSHELL|BASH_TRAPSIG|BASH_VERSINFO|BASH_VERSION|COMP_WORDBREAKS|DIRSTACK|EPOCHREALTIME|"
    "EPOCHSECONDS|EUID|FUNCNAME|GROUPS|HISTCMD|LINENO|PIPESTATUS|PPID|PWD|RANDOM|SECONDS|SHELLOPTS|"
    "SHLVL|SRANDOM|UID|_"
)

# Defines, for the command's own bash:
# - `__ar_names FILE`: the session's variables of this shell, into the array `__ar_vs` (FILE is
#   scratch space);
# - `__ar_dump DIR`: the state into DIR/s, written in one go: the directory, the options (as
#   `$SHELLOPTS` / `$BASHOPTS`), umask, the session's variables (`declare -p`; bash's own are
#   left out: assigning some of them aborts the shell that restores), functions (but the
#   backends' own `__ar_*` helpers) and last the aliases, which would otherwise be expanded in the
#   restore itself (an alias `cat` turns `cat () {` into a syntax error). It leaves xtrace,
#   verbose, errexit, nounset, noglob and noclobber off; `extglob` as it was;
# - `__ar_post`: after a restore, set exactly the saved options (where they differ: `$__ar_so`,
#   `$__ar_bo`) but job control, and turn a saved `set -x` off until the command itself runs.
# No loop in bash over variables: `compgen -X` filters the names and `declare -p` prints them, in C.
FUNCTIONS = r"""
__ar_names() {
  local __ar_eg=; shopt -q extglob || __ar_eg=1; shopt -s extglob
  compgen -v -X '@(__BASH_OWN__)' >| "$1"; mapfile -t __ar_vs < "$1"
  [ -z "$__ar_eg" ] || shopt -u extglob
}
__ar_dump() {
  {
    printf 'builtin cd -- %q\n__ar_so=%q __ar_bo=%q\n' "$PWD" "$SHELLOPTS" "$BASHOPTS"
    set +o xtrace +o verbose +o errexit +o nounset +o noglob +o noclobber
    umask -p; __ar_names "$1/n"
    if ((${#__ar_vs[@]})); then declare -p "${__ar_vs[@]}"; fi
    compgen -A function -X '__ar_*' >| "$1/n"; mapfile -t __ar_vs < "$1/n"
    if ((${#__ar_vs[@]})); then declare -f "${__ar_vs[@]}"; fi
    declare -F -x; alias -p
  } >| "$1/s"
}
__ar_post() {
  local __ar_i IFS=:
  if [ "$__ar_so:$__ar_bo" != "$SHELLOPTS:$BASHOPTS" ]; then
    for __ar_i in $BASHOPTS; do case :$__ar_bo: in *:$__ar_i:*) ;; *) shopt -u $__ar_i;; esac; done
    for __ar_i in $__ar_bo; do shopt -s $__ar_i; done
    for __ar_i in $SHELLOPTS; do case :$__ar_so:$__ar_i in *:$__ar_i:*|*monitor) ;; *) set +o $__ar_i;; esac; done
    for __ar_i in $__ar_so; do case $__ar_i in monitor) ;; *) set -o $__ar_i;; esac; done
  fi
  case $- in *x*) set +x; __ar_xt=1;; esac
}
""".replace("__BASH_OWN__", BASH_OWN)


def restore(directory: str) -> str:
    """Bash that restores the state saved in `directory` (a shell expression), if there is one.
    `$__ar_u` must hold `unset -v` and the variables the shell starts with, so that those the
    session unset stay unset; the shell's own functions must be named `__ar_*` (`__ar_dump` leaves
    them out). Errors (a read-only variable, say) are silent. A saved `set -x` is left for `RUN` to
    turn on, so the restore and the caller's own steps are never traced."""
    return f'if [ -s "{directory}/s" ]; then eval "$__ar_u"; . "{directory}/s"; __ar_post; fi 2>/dev/null'


def save_on_exit(directory: str) -> str:
    """Bash that makes the shell save its state into `directory` when it exits (trace-free)."""
    return f"trap '{{ __ar_dump \"{directory}\"; }} 2>/dev/null' EXIT"


# Runs the command in `$__ar_c` (after `restore`), with a restored `set -x` turned on only now.
RUN = 'eval -- "${__ar_xt:+set -x; }$__ar_c"'
