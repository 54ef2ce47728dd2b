"""In-memory sandboxes for unit tests: the Sandbox protocol without containers.

`FakeSandbox` keeps a dict file system and answers commands with handlers: `(pattern, handler)`
pairs tried in order, where a handler gets `(sandbox, cmd, match)` and returns an `ExecResult`, a
string (stdout, exit 0) or None (not handled). Built-in handlers understand the few commands the
verifier and the contract suite use (`cat`, `tail -c`, `echo ... > f`, `echo ... >&2`, `rm`,
`mkdir`, `chmod`, `sleep`, `true`, `exit N`, `pwd`, `printenv`, `id -un`, `test -d`,
`yes x | head -n N`, `cd DIR`, `export K=V`) and `a; b; c` sequences, split naively on `;`.
Running `/tests/test.sh` calls the provider's `grader(sandbox) -> float | None`, which writes
`/logs/verifier/reward.txt` (None writes nothing).

Shell state follows the real backends' rules (`agentrl.sandbox.shellstate`) for what the fake
tracks, the working directory and the environment: commands without `cwd`, `env` and `user` share
the agent's session (`cd` and `export` persist; a timed-out command leaves it as it was), others
start clean and leave it alone, `stop_processes` starts a new one. Handlers see the command's
state as `sandbox.cwd` and `sandbox.env`.

`open_terminal` gives a `FakeTerminal`: an in-memory line discipline with its own shell state.

Processes the agent leaves running are `background` callables: each runs after every later exec
and before every download (a loop rewriting a file, say) until `stop_processes` ends them all.
`image_files` are the image's files: every sandbox starts with them, and `tampered_paths` compares
them (and suspicious additions) with the sandbox's files, as `podman diff` does.

Fault injection (seeded): create failures, transport errors mid-exec, latency and hangs.
"""

from __future__ import annotations

import asyncio
import posixpath
import random
import re
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.sandbox.base import (
    DEFAULT_OUTPUT_LIMIT,
    ExecResult,
    Sandbox,
    SandboxCreateError,
    SandboxError,
    SandboxProvider,
    SandboxTransportError,
    bound_output,
    tampered,
)
from agentrl.sandbox.terminal import ENTER_KEYS, TerminalClosedError, TerminalSession, check_size, wait_rest

if TYPE_CHECKING:
    from agentrl.tasks import Task

Handler = Callable[["FakeSandbox", str, "re.Match[str]"], "ExecResult | str | None"]


@dataclass(frozen=True)
class FakeCall:
    """One `exec` as the caller made it (for assertions on cwd, env, user and timeout)."""

    cmd: str
    timeout: float | None
    cwd: str | None
    env: dict[str, str] | None
    user: str | int | None


@dataclass
class Faults:
    create_failure: float = 0.0
    transport_error: float = 0.0  # per exec
    latency_s: float = 0.0  # per exec
    create_latency_s: float = 0.0
    hang: float = 0.0  # per exec: never returns (until the caller's timeout)


def _result(stdout: str = "", stderr: str = "", code: int = 0) -> ExecResult:
    return ExecResult(stdout, stderr, code)


def _builtin_handlers() -> list[tuple[re.Pattern[str], Handler]]:
    def cat(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        path = m.group(1)
        if path not in sb.files:
            return _result("", f"cat: {path}: No such file or directory\n", 1)
        return _result(sb.files[path].decode(errors="replace"))

    def tail(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        path = m.group(2)
        if path not in sb.files:
            return _result("", f"tail: cannot open '{path}'\n", 1)
        return _result(sb.files[path][-int(m.group(1)) :].decode(errors="replace"))

    def echo_to(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        (text,) = shlex.split(m.group(1))
        sb.files[m.group(3)] = (sb.files.get(m.group(3), b"") if m.group(2) == ">>" else b"") + (
            text + "\n"
        ).encode()
        return _result()

    def rm(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        for path in shlex.split(m.group(1)):
            for key in [k for k in sb.files if k == path or k.startswith(path.rstrip("/") + "/")]:
                del sb.files[key]
        return _result()

    def test_sh(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        if "/tests/test.sh" not in sb.files:
            return _result("", "bash: /tests/test.sh: No such file or directory\n", 127)
        reward = sb.provider.grader(sb) if sb.provider.grader else None
        sb.files["/logs/verifier/test-stdout.txt"] = b"fake verifier ran\n"
        if reward is not None:
            sb.files["/logs/verifier/reward.txt"] = f"{reward}\n".encode()
        return _result()

    def exit_code(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        return _result(code=int(m.group(1)))

    def echo(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        return _result(" ".join(shlex.split(m.group(1))) + "\n")

    def pwd(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        return _result(sb.cwd + "\n")

    def printenv(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        value = sb.env.get(m.group(1))
        return _result(value + "\n") if value is not None else _result(code=1)

    def cd(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        target = shlex.split(m.group(1))[0] if m.group(1) else "/root"
        sb.state.cwd = posixpath.normpath(posixpath.join(sb.cwd, target))
        return _result()

    def export(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        words = shlex.split(m.group(2))
        sb.state.env[m.group(1)] = words[0] if words else ""
        return _result()

    def to_stderr(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        return _result("", " ".join(shlex.split(m.group(1))) + "\n")

    def yes_head(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        return _result(f"{m.group(1)}\n" * int(m.group(2)))

    def whoami(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        return _result(f"{sb.last_user if sb.last_user is not None else 'root'}\n")

    def test_d(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        prefix = m.group(1).rstrip("/") + "/"
        return _result(code=0 if any(k.startswith(prefix) for k in sb.files) else 1)

    rules: list[tuple[str, Handler]] = [
        (r"^echo (.*?) >&2$", to_stderr),
        (r"^yes (\S+) \| head -n (\d+)$", yes_head),
        (r"^(?:id -un|whoami)$", whoami),
        (r"^test -d (\S+)$", test_d),
        (r"^cat (\S+)$", cat),
        (r"^tail -c (\d+) (\S+)$", tail),
        (r"^echo (.+?) (>>?) (\S+)$", echo_to),
        (r"^echo (.*)$", echo),
        (r"^rm -r?f (.+?)(?: && .*)?$", rm),
        (r"^/tests/test\.sh\b.*$", test_sh),
        (r"^exit (\d+)$", exit_code),
        (r"^pwd$", pwd),
        (r"^printenv (\w+)$", printenv),
        (r"^cd(?: (.+))?$", cd),
        (r"^export (\w+)=(.*)$", export),
        (r"^(?:true|mkdir .*|chmod .*)$", lambda sb, c, m: _result()),
    ]
    return [(re.compile(p, re.DOTALL), h) for p, h in rules]


@dataclass
class ShellState:
    """What the fake tracks of a shell: its working directory and its environment."""

    cwd: str = "/"
    env: dict[str, str] = field(default_factory=dict)

    def copy(self) -> ShellState:
        return ShellState(self.cwd, dict(self.env))


class FakeSandbox(Sandbox):
    def __init__(self, provider: FakeSandboxProvider, task_id: str, sandbox_id: str) -> None:
        self.provider = provider
        self.task_id = task_id
        self.sandbox_id = sandbox_id
        self.files: dict[str, bytes] = {}
        self.commands: list[str] = []
        self.calls: list[FakeCall] = []
        self.last_cwd: str | None = None
        self.last_env: dict[str, str] | None = None
        self.last_user: str | int | None = None
        self.session = ShellState()  # the agent's shell session
        self.state = ShellState()  # the running command's
        self.terminals: list[FakeTerminal] = []
        self.closed = False
        self.background: list[Callable[[FakeSandbox], None]] = []
        self.files.update(provider.image_files)

    async def exec(
        self,
        cmd: str,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        if self.closed:
            raise SandboxError(f"fake sandbox {self.sandbox_id} is closed")
        faults = self.provider.faults
        rng = self.provider.rng
        self.commands.append(cmd)
        self.calls.append(FakeCall(cmd, timeout, cwd, env, user))
        self.last_cwd, self.last_env, self.last_user = cwd, env, user
        session = cwd is None and env is None and user is None
        self.state = self.session.copy() if session else ShellState(cwd or "/", dict(env or {}))
        if faults.latency_s:
            await asyncio.sleep(faults.latency_s)
        if faults.transport_error and rng.random() < faults.transport_error:
            raise SandboxTransportError(f"injected transport error in {self.sandbox_id}")
        if faults.hang and rng.random() < faults.hang:
            await asyncio.sleep(timeout if timeout is not None else 3600)
            return ExecResult("", "", None, True, timeout or 0.0)
        # Scripted handlers see the whole command first; built-ins see the parts of a sequence.
        sequence = ";" in cmd
        res = await self._one(cmd.strip(), timeout, builtins=not sequence)
        if res is None and sequence:
            res = await self._sequence(cmd, timeout)
        if res is None:
            res = _result("", f"fake: no handler for {cmd[:80]!r}\n", self.provider.unknown_exit_code)
        if session and not res.timed_out:
            self.session = self.state
        self._run_background()
        limit = self.provider.output_limit
        return ExecResult(
            bound_output(res.stdout, limit),
            bound_output(res.stderr, limit),
            res.exit_code,
            res.timed_out,
            res.duration_s,
        )

    async def _sequence(self, cmd: str, timeout: float | None) -> ExecResult:
        """`a; b; c` (split naively on `;`): outputs concatenated, stops at the first `exit`."""
        out, err, code = [], [], 0
        for part in (p.strip() for p in cmd.split(";")):
            if not part:
                continue
            res = await self._one(part, timeout)
            if res is None:
                res = _result("", f"fake: no handler for {part[:80]!r}\n", self.provider.unknown_exit_code)
            out.append(res.stdout)
            err.append(res.stderr)
            code = res.exit_code if res.exit_code is not None else code
            if res.timed_out:
                return ExecResult("".join(out), "".join(err), None, True)
            if re.match(r"^exit \d+$", part):
                break
        return _result("".join(out), "".join(err), code)

    @property
    def cwd(self) -> str:
        """The running command's working directory."""
        return self.state.cwd

    @property
    def env(self) -> dict[str, str]:
        """The running command's environment (what the fake tracks of it)."""
        return self.state.env

    async def run_line(self, line: str, state: ShellState) -> ExecResult:
        """Run one command line with `state` (changed in place), as a terminal's shell does."""
        saved, self.state = self.state, state
        try:
            sequence = ";" in line
            res = await self._one(line.strip(), None, builtins=not sequence)
            if res is None and sequence:
                res = await self._sequence(line, None)
            if res is None:
                res = _result(
                    "", f"bash: {line.split()[0] if line.split() else line}: command not found\n", 127
                )
        finally:
            self.state = saved
        self._run_background()
        return res

    async def open_terminal(self, *, width: int = 160, height: int = 40) -> TerminalSession:
        if self.closed:
            raise SandboxError(f"fake sandbox {self.sandbox_id} is closed")
        check_size(width, height)
        term = FakeTerminal(self, width, height)
        self.terminals.append(term)
        return term

    async def _one(self, cmd: str, timeout: float | None, builtins: bool = True) -> ExecResult | None:
        sleep = re.match(r"^sleep (\d+(?:\.\d+)?)$", cmd)
        if sleep and builtins:
            wanted = float(sleep.group(1))
            if timeout is not None and wanted > timeout:
                await asyncio.sleep(timeout)
                return ExecResult("", "", None, True, timeout)
            await asyncio.sleep(wanted)
            return _result()
        for pattern, handler in [*self.provider.handlers, *(_builtin_handlers() if builtins else [])]:
            m = pattern.match(cmd)
            if m is None:
                continue
            out = handler(self, cmd, m)
            if out is not None:
                return _result(out) if isinstance(out, str) else out
        return None

    async def upload(self, src: Path, dst: str) -> None:
        if self.closed:
            raise SandboxError(f"fake sandbox {self.sandbox_id} is closed")
        src = Path(src)
        if src.is_dir():
            for p in sorted(src.rglob("*")):
                if p.is_file():
                    self.files[f"{dst.rstrip('/')}/{p.relative_to(src).as_posix()}"] = p.read_bytes()
        else:
            self.files[dst] = src.read_bytes()

    def _run_background(self) -> None:
        for action in list(self.background):
            action(self)

    async def stop_processes(self) -> None:
        if self.closed:
            raise SandboxError(f"fake sandbox {self.sandbox_id} is closed")
        self.background.clear()
        self.session = ShellState()
        for term in self.terminals:
            term.alive = False
        self.terminals.clear()

    async def tampered_paths(self) -> list[str] | None:
        image = self.provider.image_files
        changed = [p for p in image if p in self.files and self.files[p] != image[p]]
        deleted = [p for p in image if p not in self.files]
        added = [p for p in self.files if p not in image]
        return tampered(changed, deleted, added)

    async def download(self, src: str, dst: Path) -> None:
        if self.closed:
            raise SandboxError(f"fake sandbox {self.sandbox_id} is closed")
        self._run_background()
        dst = Path(dst)
        if src in self.files:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(self.files[src])
            return
        prefix = src.rstrip("/") + "/"
        children = {k: v for k, v in self.files.items() if k.startswith(prefix)}
        if not children:
            raise SandboxTransportError(f"fake: {src} does not exist")
        for k, v in children.items():
            out = dst / k[len(prefix) :]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(v)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            for term in self.terminals:
                term.alive = False
            self.provider._live.discard(self.sandbox_id)


@dataclass
class FakeSandboxProvider(SandboxProvider):
    """Creates `FakeSandbox`es; `live_sandboxes()` counts those not closed (leak checks)."""

    handlers: list[tuple[re.Pattern[str], Handler]] = field(default_factory=list)
    grader: Callable[[FakeSandbox], float | None] | None = None
    faults: Faults = field(default_factory=Faults)
    seed: int = 0
    output_limit: int = 64 * 1024
    unknown_exit_code: int = 127
    image_files: dict[str, bytes] = field(default_factory=dict)
    terminal_time_scale: float = 0.0  # real seconds slept per second of `send_keys(duration=)`
    created: int = 0
    _live: set[str] = field(default_factory=set)
    sandboxes: list[FakeSandbox] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def on(self, pattern: str, handler: Handler | str | ExecResult) -> FakeSandboxProvider:
        """Add a handler; a string or ExecResult is a fixed reply."""
        if isinstance(handler, str | ExecResult):
            fixed = handler
            self.handlers.append((re.compile(pattern, re.DOTALL), lambda sb, c, m: fixed))
        else:
            self.handlers.append((re.compile(pattern, re.DOTALL), handler))
        return self

    async def create(self, task: Task | Any, *, run_id: str) -> Sandbox:
        task_id = getattr(task, "task_id", str(task))
        if self.faults.create_latency_s:
            await asyncio.sleep(self.faults.create_latency_s)
        if self.faults.create_failure and self.rng.random() < self.faults.create_failure:
            raise SandboxCreateError(f"injected create failure for {task_id}")
        self.created += 1
        sandbox = FakeSandbox(self, task_id, f"fake-{run_id}-{self.created}")
        self._live.add(sandbox.sandbox_id)
        self.sandboxes.append(sandbox)
        return sandbox

    def live_sandboxes(self) -> int:
        return len(self._live)


# tmux key names the fake understands (others are ignored, as keys with no effect on a shell).
_CONTROL_KEYS = frozenset(
    {"C-c", "C-d", "C-u", "C-l", "BSpace", "Up", "Down", "Left", "Right", "Tab", "Escape"}
)
_SLEEP = re.compile(r"^sleep (\d+(?:\.\d+)?)$")


class FakeTerminal(TerminalSession):
    """An in-memory terminal for unit tests of keystroke agents: a line discipline over the fake's
    command handlers. Typed text is echoed after a prompt (`root@sandbox:CWD# `); Enter runs the
    line through the handlers with the terminal's own shell state (its `cd` and `export` persist)
    and prints its output; `sleep N` runs in the foreground for N seconds of the terminal's clock,
    which `send_keys(duration=)` advances (keys typed meanwhile wait, echoed, until it ends); C-c
    interrupts it (or discards the typed line); C-d on an empty line, or `exit`, ends the shell;
    Up recalls the previous line, BSpace and C-u edit. The screen is the last `height` rows, lines
    wrapped at `width`. Durations sleep `provider.terminal_time_scale` real seconds each (0 by
    default: tests run at full speed); `sent` records every call's keys and duration."""

    def __init__(self, sandbox: FakeSandbox, width: int, height: int) -> None:
        self.sandbox = sandbox
        self.width, self.height = width, height
        self.state = ShellState()
        self.lines: list[str] = []  # finished lines (scrollback and screen)
        self.current = self._prompt()  # the line being written (prompt, echo, output without \n)
        self.typed = ""  # the shell's line being edited
        self.queued: list[str] = []  # lines typed while a foreground program ran
        self.history: list[str] = []
        self.foreground_until: float | None = None  # clock time the foreground `sleep` ends
        self.clock = 0.0
        self.alive = True
        self.sent: list[tuple[list[str], float]] = []

    def _prompt(self) -> str:
        return f"root@sandbox:{self.state.cwd}# "

    def _write(self, text: str) -> None:
        parts = (self.current + text).split("\n")
        self.lines.extend(parts[:-1])
        self.current = parts[-1]

    async def _enter(self) -> None:
        line, self.typed = self.typed, ""
        self._write("\n")
        if line.strip():
            self.history.append(line)
        await self._run(line)

    async def _run(self, line: str) -> None:
        cmd = line.strip()
        if cmd == "exit" or cmd.startswith("exit "):
            self._write("exit\n")
            self.alive = False
            return
        sleep = _SLEEP.match(cmd)
        if sleep:
            self.foreground_until = self.clock + float(sleep.group(1))
            return
        if cmd:
            res = await self.sandbox.run_line(cmd, self.state)
            self._write(res.stdout + res.stderr)
            if self.current:
                self._write("\n")
        self._write(self._prompt())

    async def _finish_foreground(self) -> None:
        self.foreground_until = None
        self._write(self._prompt())
        while self.queued and self.alive and self.foreground_until is None:
            line = self.queued.pop(0)
            self._write(line + "\n")
            if line.strip():
                self.history.append(line)
            await self._run(line)

    async def _key(self, key: str) -> None:
        busy = self.foreground_until is not None
        if key in ENTER_KEYS:
            if busy:
                self.queued.append(self.typed)
                self.typed = ""
                self._write("\n")
            else:
                await self._enter()
        elif key == "C-c":
            self._write("^C\n")
            self.typed, self.queued = "", []
            if busy:
                self.foreground_until = None
            self._write(self._prompt())
        elif key == "C-d":
            if not busy and not self.typed:
                self._write("exit\n")
                self.alive = False
        elif key == "C-u" and not busy:
            self.current = self.current[: len(self.current) - len(self.typed)]
            self.typed = ""
        elif key == "BSpace" and self.typed:
            self.typed, self.current = self.typed[:-1], self.current[:-1]
        elif key == "Up" and not busy and self.history:
            self.current = self.current[: len(self.current) - len(self.typed)] + self.history[-1]
            self.typed = self.history[-1]
        elif key in _CONTROL_KEYS:
            pass
        else:
            for ch in "\n" if key == "Space" else key:
                if ch in "\r\n":
                    await self._key("Enter")
                elif self.alive:
                    self.typed += " " if key == "Space" else ch
                    self._write(" " if key == "Space" else ch)

    async def send_keys(self, keys: str | Sequence[str], *, duration: float = 0.0) -> None:
        start = time.monotonic()
        if not self.alive:
            raise TerminalClosedError(f"fake terminal of {self.sandbox.sandbox_id}: the session has ended")
        keys = [keys] if isinstance(keys, str) else list(keys)
        self.sent.append((keys, duration))
        for key in keys:
            if not self.alive:
                break
            await self._key(key)
        if duration > 0:
            self.clock += duration
            if self.foreground_until is not None and self.clock >= self.foreground_until:
                await self._finish_foreground()
            await wait_rest(start, duration * self.sandbox.provider.terminal_time_scale)

    def _rows(self) -> list[str]:
        rows: list[str] = []
        for line in [*self.lines, self.current]:
            rows.extend(line[i : i + self.width] for i in range(0, max(len(line), 1), self.width))
        return rows

    async def capture(self, *, history: bool = False) -> str:
        if not self.alive:
            raise TerminalClosedError(f"fake terminal of {self.sandbox.sandbox_id}: the session has ended")
        rows = self._rows()
        if history:
            text = "\n".join(rows) + "\n"
            return text[-DEFAULT_OUTPUT_LIMIT // 2 :]
        rows = rows[-self.height :]
        return "\n".join(rows + [""] * (self.height - len(rows))) + "\n"

    async def is_idle(self) -> bool:
        return self.alive and self.foreground_until is None

    async def is_alive(self) -> bool:
        return self.alive

    async def close(self) -> None:
        self.alive = False
