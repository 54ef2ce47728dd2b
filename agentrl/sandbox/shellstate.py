"""Shell state that persists between the agent's commands, as in one terminal session.

Every command still runs in its own bash process (so a timeout or a cancellation kills it and
everything it started, and nothing it does can reach the backend's own shell or framing). The
session lives in a state directory inside the sandbox instead: a command first restores the state
the previous command left there, then runs, and on its way out (bash's EXIT trap: a normal end,
`exit`, `set -e`) writes its own state for the next one:

- the working directory, restored with `builtin cd`;
- every variable bash does not own (`declare -p`: exported or not, arrays, attributes), and the
  variables a command unset stay unset;
- functions (`declare -f`, `export -f` kept), aliases, shell options (`$SHELLOPTS`, `$BASHOPTS`)
  and the umask.

Options are restored last, so `set -x` or `set -e` from an earlier command never trips the
restore itself. `expand_aliases` starts on, as in an interactive shell. Job control (`set -m`) is
never restored, so a command's background jobs share its process group: they keep running after
the command ends, and a timeout of a later command does not touch them. Not kept: traps, the
directory stack (`pushd`), `jobs`/`fg` bookkeeping (each command is its own shell; the jobs
themselves live on), resource limits, positional parameters, variables declared without a value.

A command that is killed (its timeout, say) writes nothing, so the state stays what it was before
it; a backend whose own shell dies (podman's, on a cancellation) starts a new session. Whether a
command uses the session at all is the caller's choice: the backends restore it only for `exec`
calls without `cwd`, `env` and `user` (the agent's commands), and `stop_processes` (the verifier's
first step) starts a new, empty session, so the verifier's commands and `tests/test.sh` never see
an alias, function, variable or `BASH_ENV` the agent left. A command that sets its own EXIT trap
replaces the one that saves its state: its changes are lost.

Everything here is bash builtins (no process is forked on the command path): `compgen`, `mapfile`
and `declare` over small files in the state directory. `docs/terminal.md` has the rules in full.
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
# - `__ar_dump DIR`: the state into DIR/s, written in one go at exit: the directory, the options
#   (as `$SHELLOPTS` / `$BASHOPTS`), umask, the session's variables (`declare -p`; bash's own are
#   left out: assigning some of them aborts the shell that restores), functions (the backends'
#   own `__ar_*` helpers removed first) and last the aliases, which would otherwise be expanded
#   in the restore itself (an alias `cat` turns `cat () {` into a syntax error);
# - `__ar_post`: after a restore, set exactly the saved options (where they differ: `$__ar_so`,
#   `$__ar_bo`) but job control, and turn a saved `set -x` off until the command itself runs.
# No loop in bash over variables: `compgen -X` filters the names and `declare -p` prints them, in C.
FUNCTIONS = r"""
__ar_names() {
  shopt -s extglob
  compgen -v -X '@(__BASH_OWN__)' > "$1"; mapfile -t __ar_vs < "$1"
}
__ar_dump() {
  unset -f __ar_dump __ar_post __ar_names __ar_a __ar_z __ar_grab __ar_pre
  {
    printf 'builtin cd -- %q\n__ar_so=%q __ar_bo=%q\n' "$PWD" "$SHELLOPTS" "$BASHOPTS"
    set +o xtrace +o verbose +o errexit +o nounset +o noglob
    umask -p; shopt -s extglob
    compgen -v -X '@(__BASH_OWN__)' > "$1/n"; mapfile -t __ar_vs < "$1/n"
    if ((${#__ar_vs[@]})); then declare -p "${__ar_vs[@]}"; fi
    declare -f; declare -F -x; alias -p
  } > "$1/s"
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
