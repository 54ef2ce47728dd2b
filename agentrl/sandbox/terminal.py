"""Terminal sessions: what an agent that types keystrokes and reads the screen (Harbor's
Terminus-2) works in. `Sandbox.open_terminal` gives a `TerminalSession`; the podman and Daytona
backends run a tmux server inside the sandbox (`TmuxTerminal`), the fake backend an in-memory line
discipline with simulated programs (`agentrl.testing.terminal.FakeTerminal`).

Fidelity with Harbor 0.25 (`harbor/agents/terminus_2/tmux_session.py`), as Terminus-2 uses it
(`send_keys(keystrokes, block=False, min_timeout_sec=duration)`, `capture_pane`):

- the session is `tmux new-session -d -s terminus-2 -x W -y H 'bash --login'` with
  `TERM=xterm-256color` and `SHELL=/bin/bash`, then `set-option -g history-limit 10000000` (set
  after the session exists, as Harbor does, so its first pane keeps tmux's default history);
- `send_keys` sends each key as one argument of `tmux send-keys -t terminus-2 --` (no `-l`: a
  whole key equal to a tmux key name such as `C-c`, `Enter`, `Escape` or `Up` is that key, any
  other text is typed literally, a newline in it presses Enter), batched into commands of at most
  16,000 bytes; a key too long for one command goes through a paste buffer (`load-buffer` /
  `paste-buffer -d`) in base64 chunks of 65,536 characters; "command too long" from an older tmux
  resends the batch key by key. Then it waits until `duration` seconds have passed since the call
  began (none when the keys took longer, or the duration is not positive);
- `capture` is `tmux capture-pane -p` (the visible screen; no `-J`, so wrapped lines stay split at
  the pane width) or with `-S -` the whole scrollback.

Differences, all on purpose: the server listens on a socket of its own in a fresh directory
(`tmux -S`) instead of tmux's default, so nothing else in the sandbox talks to it by accident; no
`pipe-pane` log of the raw pane stream is written into the sandbox (records are the loop's); the
scrollback handed to the host is its last `capture_limit` characters (the agent controls how much
there is).

Every tmux command runs through the backend's command path from a clean state (never the agent's
command session), so its output is bounded on the host like any command's, and a tmux that is gone
or refuses is a `TerminalClosedError`: the agent's own keystrokes can end the session (`exit`) or
break tmux, so it is a policy outcome, never infrastructure. `stop_processes` (the verifier's first
step) ends the tmux server with every other process the agent started; the verifier itself never
uses tmux. Screens are sandbox output: pass them through `printable` before showing them on a
terminal.
"""

from __future__ import annotations

import asyncio
import base64
import shlex
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from agentrl.sandbox.base import (
    DEFAULT_OUTPUT_LIMIT,
    ExecResult,
    SandboxError,
    SandboxPolicyError,
    TerminalClosedError,
    TerminalSession,
    TerminalUnavailableError,
    printable,
)

SESSION_NAME = "terminus-2"  # Harbor's name for Terminus-2's session (the agent's `name()`)
HISTORY_LIMIT = 10_000_000
MAX_COMMAND_BYTES = 16_000  # Harbor's `_TMUX_SEND_KEYS_MAX_COMMAND_LENGTH`
PASTE_CHUNK = 65_536  # Harbor's `_PASTE_BASE64_CHUNK_LEN`
TOO_LONG = "command too long"
MAX_SIZE = 1000  # columns or rows: a pane is bounded so a screen is bounded
TMUX_TIMEOUT_S = 30.0
# The keys that press Enter in Harbor's sense (`TmuxSession._ENTER_KEYS`).
ENTER_KEYS = frozenset({"Enter", "C-m", "KPEnter", "C-j", "^M", "^J"})
SHELLS = frozenset({"bash", "sh", "dash", "zsh", "ksh", "mksh", "fish", "ash", "busybox"})

# Installs tmux at image build time where it is missing (POSIX sh, root). A package manager that
# cannot reach its mirror leaves the image without tmux and says so; the build itself goes on
# (the command path does not need tmux), and `open_terminal` then raises `TerminalUnavailableError`.
NO_TMUX = "agentrl: tmux could not be installed in this image"
INSTALL_TMUX = (
    "if ! command -v tmux >/dev/null 2>&1; then "
    "if command -v apt-get >/dev/null 2>&1; then "
    "(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends tmux"
    " && rm -rf /var/lib/apt/lists/*); "
    "elif command -v apk >/dev/null 2>&1; then apk add --no-cache tmux; "
    "elif command -v dnf >/dev/null 2>&1; then dnf install -y tmux; "
    "elif command -v yum >/dev/null 2>&1; then yum install -y tmux; "
    "elif command -v microdnf >/dev/null 2>&1; then microdnf install -y tmux; fi; "
    f'command -v tmux >/dev/null 2>&1 || echo "{NO_TMUX}; the command path works, open_terminal() will not" >&2; '
    "fi; true"
)


def check_size(width: int, height: int) -> None:
    if not (isinstance(width, int) and isinstance(height, int)) or not (
        0 < width <= MAX_SIZE and 0 < height <= MAX_SIZE
    ):
        raise ValueError(
            f"terminal size {width!r}x{height!r}: width and height must be integers 1..{MAX_SIZE}"
        )


async def wait_rest(start: float, duration: float) -> None:
    """Terminus-2's wait after sending keys: until `duration` has passed since `start`."""
    elapsed = time.monotonic() - start
    if duration > elapsed:
        await asyncio.sleep(duration - elapsed)


Runner = Callable[[str, float], Awaitable[ExecResult]]
"""Runs a command of agentrl's own in the sandbox (clean state, output bounded): `(cmd, timeout)`."""


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


class TmuxTerminal(TerminalSession):
    """A tmux session inside the sandbox, every tmux command a clean command of the backend."""

    def __init__(
        self,
        run: Runner,
        *,
        socket_dir: str,
        width: int,
        height: int,
        where: str,
        capture_limit: int = DEFAULT_OUTPUT_LIMIT // 2,
    ) -> None:
        self._run = run
        self._dir = socket_dir
        self.width, self.height = width, height
        self.where = where
        self.capture_limit = capture_limit
        self._tmux = f"tmux -S {shlex.quote(socket_dir + '/tmux')}"
        self._target = shlex.quote(SESSION_NAME)
        self.closed = False

    @classmethod
    async def start(
        cls, run: Runner, *, width: int = 160, height: int = 40, where: str, hint: str = ""
    ) -> TmuxTerminal:
        """Start the session (Harbor's `TmuxSession.start` without the recording). `hint` is added
        to the error when the image has no tmux (how this backend gets tmux into images)."""
        check_size(width, height)
        term = cls(
            run, socket_dir=f"/tmp/.agentrl-term-{uuid.uuid4().hex}", width=width, height=height, where=where
        )
        res = await run("command -v tmux", TMUX_TIMEOUT_S)
        if res.exit_code != 0:
            raise TerminalUnavailableError(
                f"{where}: there is no tmux in this sandbox, so no terminal can be opened. Add it to the "
                "task's image (`RUN apt-get update && apt-get install -y tmux` in environment/Dockerfile)"
                + (f"; {hint}" if hint else "")
            )
        start = (
            f"mkdir -m 700 {shlex.quote(term._dir)} && export TERM=xterm-256color SHELL=/bin/bash && "
            f"{term._tmux} new-session -d -s {term._target} -x {width} -y {height} 'bash --login' && "
            f"{{ {term._tmux} set-option -g history-limit {HISTORY_LIMIT} >/dev/null 2>&1; true; }} && "
            # Wait (up to 5 s) for the shell's first prompt: the first observation then shows the
            # ready terminal, the same on every run, not whatever a cold shell had printed yet.
            f"i=0; while [ $i -lt 100 ]; do s=$({term._tmux} capture-pane -p -t {term._target} 2>/dev/null); "
            '[ -n "${s//[[:space:]]/}" ] && break; sleep 0.05; i=$((i+1)); done; true'
        )
        res = await run(start, TMUX_TIMEOUT_S)
        if res.exit_code != 0:  # before the agent's first keystroke: the image's doing
            raise TerminalUnavailableError(
                f"{where}: starting tmux failed (exit {res.exit_code}): {printable(res.stderr.strip()[-500:])}"
            )
        return term

    # -- keys -------------------------------------------------------------------------------------
    @property
    def _harbor_prefix(self) -> str:
        # Harbor sizes its commands with this prefix; the same arithmetic decides what is pasted.
        return "tmux send-keys -t " + shlex.quote(SESSION_NAME) + " --"

    def _requires_paste(self, key: str) -> bool:
        return _utf8_len(shlex.quote(key)) > MAX_COMMAND_BYTES - _utf8_len(self._harbor_prefix) - 1

    def _batches(self, keys: list[str]) -> list[list[str]]:
        prefix = _utf8_len(self._harbor_prefix)
        batches: list[list[str]] = []
        batch: list[str] = []
        size = prefix
        for key in keys:
            add = 1 + _utf8_len(shlex.quote(key))
            if batch and size + add > MAX_COMMAND_BYTES:
                batches.append(batch)
                batch, size = [], prefix
            batch.append(key)
            size += add
        if batch:
            batches.append(batch)
        return batches

    async def _tmux_cmd(self, args: str, what: str) -> ExecResult:
        if self.closed:
            raise TerminalClosedError(f"{self.where}: the terminal is closed")
        res = await self._run(f"exec {self._tmux} {args}", TMUX_TIMEOUT_S)
        if res.timed_out:
            raise await self._fail(res, what)
        return res

    async def _fail(self, res: ExecResult, what: str) -> TerminalClosedError:
        if res.timed_out:
            return TerminalClosedError(
                f"{self.where}: tmux did not answer {what} within {TMUX_TIMEOUT_S:.0f}s (stopped or hung)",
                cause="terminal_broken",
            )
        if not await self.is_alive():
            return TerminalClosedError(f"{self.where}: the terminal's session has ended ({what})")
        return TerminalClosedError(
            f"{self.where}: tmux refused {what} (exit {res.exit_code}): {printable(res.stderr.strip()[-300:])}",
            cause="terminal_broken",
        )

    async def _send_batch(self, batch: list[str]) -> None:
        args = f"send-keys -t {self._target} -- " + " ".join(shlex.quote(k) for k in batch)
        res = await self._tmux_cmd(args, "keys")
        if res.exit_code == 0:
            return
        if TOO_LONG in res.stderr:
            for key in batch:  # an older tmux with a smaller message limit: key by key
                single = await self._tmux_cmd(f"send-keys -t {self._target} -- {shlex.quote(key)}", "a key")
                if single.exit_code == 0:
                    continue
                if TOO_LONG in single.stderr:
                    await self._paste(key)
                    continue
                raise await self._fail(single, "a key")
            return
        raise await self._fail(res, "keys")

    async def _paste(self, key: str) -> None:
        if not key:
            return
        token = uuid.uuid4().hex
        path = shlex.quote(f"{self._dir}/paste-{token}")
        payload = base64.b64encode(key.encode("utf-8")).decode("ascii")
        try:
            for offset in range(0, len(payload), PASTE_CHUNK):
                redirect = ">>" if offset else ">"
                chunk = payload[offset : offset + PASTE_CHUNK]
                res = await self._run(f"printf %s {chunk} | base64 -d {redirect} {path}", TMUX_TIMEOUT_S)
                if res.exit_code != 0:
                    raise await self._fail(res, "a paste")
            buffer = f"agentrl-paste-{token}"
            res = await self._run(
                f"{self._tmux} load-buffer -b {buffer} {path} && "
                f"{self._tmux} paste-buffer -d -b {buffer} -t {self._target}",
                TMUX_TIMEOUT_S,
            )
            if res.exit_code != 0:
                raise await self._fail(res, "a paste")
        finally:
            if not self.closed:
                await self._run(f"rm -f {path}", TMUX_TIMEOUT_S)

    async def send_keys(self, keys: str | Sequence[str], *, duration: float = 0.0) -> None:
        start = time.monotonic()
        keys = [keys] if isinstance(keys, str) else list(keys)
        batch: list[str] = []
        for key in keys:
            if self._requires_paste(key):
                for b in self._batches(batch):
                    await self._send_batch(b)
                batch = []
                await self._paste(key)
            else:
                batch.append(key)
        for b in self._batches(batch):
            await self._send_batch(b)
        await wait_rest(start, duration)

    # -- screens ----------------------------------------------------------------------------------
    async def capture(self, *, history: bool = False) -> str:
        if not history:
            res = await self._tmux_cmd(f"capture-pane -p -t {self._target}", "a capture")
            if res.exit_code != 0:
                raise await self._fail(res, "a capture")
            return res.stdout
        if self.closed:
            raise TerminalClosedError(f"{self.where}: the terminal is closed")
        limit = self.capture_limit
        res = await self._run(
            f"set -o pipefail; {self._tmux} capture-pane -p -S - -t {self._target} | tail -c {limit + 1}",
            TMUX_TIMEOUT_S,
        )
        if res.exit_code != 0:
            raise await self._fail(res, "a capture")
        text = res.stdout
        if _utf8_len(text) > limit:  # cut: drop the partial first line
            text = text.split("\n", 1)[1] if "\n" in text else ""
        return text

    async def is_idle(self) -> bool:
        res = await self._run(
            f"p=$({self._tmux} display-message -p -t {self._target} '#{{pane_pid}}') && cat /proc/$p/stat",
            TMUX_TIMEOUT_S,
        )
        if res.exit_code != 0:
            raise await self._fail(res, "a status query")
        return shell_is_idle(res.stdout)

    async def is_alive(self) -> bool:
        if self.closed:
            return False
        res = await self._run(f"exec {self._tmux} has-session -t {self._target}", TMUX_TIMEOUT_S)
        return res.exit_code == 0

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self._run(
                f"{self._tmux} kill-server >/dev/null 2>&1; rm -rf {shlex.quote(self._dir)}", TMUX_TIMEOUT_S
            )
        except (SandboxError, SandboxPolicyError):
            pass  # the sandbox (and its tmux) is gone already

    def mark_closed(self) -> None:
        """The sandbox ended the session itself (its processes were killed, or it closed)."""
        self.closed = True


def shell_is_idle(stat: str) -> bool:
    """From the pane shell's `/proc/PID/stat`: a shell, asleep, owning the terminal's foreground."""
    head, _, rest = stat.strip().rpartition(")")
    comm = head.partition("(")[2]
    fields = rest.split()
    if len(fields) < 6:
        return False
    state, pgrp, tpgid = fields[0], fields[2], fields[5]
    return comm in SHELLS and state == "S" and pgrp == tpgid
