"""In-memory sandboxes for unit tests: the Sandbox protocol without containers.

`FakeSandbox` keeps a dict file system and answers commands with handlers: `(pattern, handler)`
pairs tried in order, where a handler gets `(sandbox, cmd, match)` and returns an `ExecResult`, a
string (stdout, exit 0) or None (not handled). Built-in handlers understand the few commands the
verifier and the contract suite use (`cat`, `tail -c`, `echo ... > f`, `echo ... >&2`, `rm`,
`mkdir`, `chmod`, `sleep`, `true`, `exit N`, `pwd`, `printenv`, `id -un`, `test -d`,
`yes x | head -n N`, `cd DIR`, `export K=V`) and `a; b; c` sequences, split on the `;` outside quotes.
Running `/tests/test.sh` calls the provider's `grader(sandbox) -> float | None`, which writes
`/logs/verifier/reward.txt` (None writes nothing).

Shell state follows the real backends' rules (`agentrl.sandbox.shellstate`) for what the fake
tracks, the working directory and the environment: commands without `cwd`, `env` and `user` share
the agent's session (`cd` and `export` persist; a timed-out command leaves it as it was), others
start clean and leave it alone, `stop_processes` starts a new one. Handlers see the command's
state as `sandbox.cwd` and `sandbox.env`.

`open_terminal` gives a `FakeTerminal` (`fake_terminal.py`): an in-memory line discipline with its
own shell state and simulated `sleep`, `python3 -m http.server`, `python3` and `vi`; the fake's
`ps -eo ...` lists what runs in its terminals, and `urlopen(...)`/`curl` probes of a port reach a
server running in one. Built-ins also understand `seq`, `printf` (%s/%d), `CMD | wc -c` and `$(...)`
command substitution (the inner command through the same handlers).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.sandbox.base import (
    ExecResult,
    Sandbox,
    SandboxCreateError,
    SandboxError,
    SandboxProvider,
    SandboxTransportError,
    TerminalSession,
    bound_output,
    tampered,
    too_large,
)
from agentrl.sandbox.terminal import check_size
from agentrl.testing.terminal import FakeTerminal, ShellState, probe_port

if TYPE_CHECKING:
    from agentrl.tasks.task import Task

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


def _split_sequence(cmd: str) -> list[str]:
    """`a; b; c` split on the semicolons outside quotes."""
    parts, quote, start = [], "", 0
    for i, ch in enumerate(cmd):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ";":
            parts.append(cmd[start:i])
            start = i + 1
    return [*parts, cmd[start:]]


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

    def ps(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        fields = m.group(1).split(",")
        names = {"pid": "PID", "stat": "STAT", "args": "COMMAND", "command": "COMMAND"}
        if any(f not in names for f in fields):
            return _result("", f"fake ps: field list {m.group(1)!r} not modelled (pid, stat, args)\n", 1)
        rows = [(str(100 + i), stat, args) for i, (stat, args) in enumerate(sb.processes())]
        rows.append((str(100 + len(rows)), "R", cmd))
        pick = {"pid": 0, "stat": 1, "args": 2, "command": 2}
        lines = [" ".join(names[f] for f in fields)]
        lines += [" ".join(row[pick[f]] for f in fields) for row in rows]
        return _result("\n".join(lines) + "\n")

    def seq(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        first, last = (int(m.group(1)), int(m.group(2))) if m.group(2) else (1, int(m.group(1)))
        return _result("".join(f"{i}\n" for i in range(first, last + 1)))

    def printf(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult | None:
        words = shlex.split(m.group(1))
        fmt, args = words[0], words[1:]
        specs = re.findall(r"%[-0-9.]*([a-zA-Z%])", fmt)
        if any(c not in "sd%" for c in specs) or len([c for c in specs if c != "%"]) != len(args):
            return None  # one pass of %s/%d conversions only
        try:
            values = tuple(
                int(a) if c == "d" else a for c, a in zip([c for c in specs if c != "%"], args, strict=True)
            )
        except ValueError:
            return _result("", f"printf: {args[0]}: invalid number\n", 1)
        return _result(fmt.replace("\\n", "\n") % values)

    def probe(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        status = probe_port(sb, m.group(1))
        if status is None:
            return _result("", "urllib.error.URLError: <urlopen error [Errno 111] Connection refused>\n", 1)
        return _result(f"{status}\n")

    def curl(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> ExecResult:
        status = probe_port(sb, m.group(1))
        if status is None:
            return _result("", "curl: (7) Failed to connect: Connection refused\n", 7)
        return _result("")

    rules: list[tuple[str, Handler]] = [
        (r"^ps -eo ([a-z,]+)$", ps),
        (r"^seq (-?\d+)(?: (-?\d+))?$", seq),
        (r"^printf ('[^']*'(?: \S+)*)$", printf),
        (
            r"^python3 -c \"import urllib\.request; print\(urllib\.request\.urlopen\('([^']+)'(?:, timeout=\d+)?\)\.status\)\"$",
            probe,
        ),
        (r"^curl -s(?:f|S|sS|fsS)? (https?://\S+)$", curl),
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
        self.listeners: dict[int, Any] = {}  # port -> a server running in a terminal
        self.closed = False
        self.background: list[Callable[[FakeSandbox], None]] = []
        self.files.update(provider.image_files)

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
        if self.closed:
            raise SandboxError(f"fake sandbox {self.sandbox_id} is closed")
        faults = self.provider.faults
        rng = self.provider.rng
        self.commands.append(cmd)
        self.calls.append(FakeCall(cmd, timeout, cwd, env, user))
        self.last_cwd, self.last_env, self.last_user = cwd, env, user
        self.state = self.session.copy() if session else ShellState(cwd or "/", dict(env or {}))
        if faults.latency_s:
            await asyncio.sleep(faults.latency_s)
        if faults.transport_error and rng.random() < faults.transport_error:
            raise SandboxTransportError(f"injected transport error in {self.sandbox_id}")
        if faults.hang and rng.random() < faults.hang:
            await asyncio.sleep(timeout if timeout is not None else 3600)
            return ExecResult("", "", None, True, timeout or 0.0)
        # Scripted handlers see the whole command first; built-ins see the parts of a sequence.
        sequence = len(_split_sequence(cmd)) > 1
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
        """`a; b; c` (split on the `;` outside quotes): outputs concatenated, stops at the first `exit`."""
        out, err, code = [], [], 0
        for part in (p.strip() for p in _split_sequence(cmd)):
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
            sequence = len(_split_sequence(line)) > 1
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
        term = FakeTerminal(self, width, height, ShellState())
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
        found = self._handle(cmd, self.provider.handlers)
        if found is not None or not builtins:
            return found
        expanded = await self._substitute(cmd, timeout)
        if isinstance(expanded, ExecResult):
            return expanded
        pipe = re.match(r"^(.+?) \| wc -c$", expanded, re.DOTALL)
        if pipe:  # a pipeline into `wc -c`: the left side's stdout, counted
            left = await self._one(pipe.group(1), timeout)
            if left is None:
                return None
            return _result(f"{len(left.stdout.encode())}\n", left.stderr)
        return self._handle(expanded, _builtin_handlers())

    def _handle(self, cmd: str, handlers: list[tuple[re.Pattern[str], Handler]]) -> ExecResult | None:
        for pattern, handler in handlers:
            m = pattern.match(cmd)
            if m is None:
                continue
            out = handler(self, cmd, m)
            if out is not None:
                return _result(out) if isinstance(out, str) else out
        return None

    async def _substitute(self, cmd: str, timeout: float | None) -> str | ExecResult:
        """`$(inner)` command substitutions (innermost first) replaced by what the inner command
        printed, trailing newlines removed, as bash does; an inner command the fake cannot run
        is the whole command's failure."""
        while m := re.search(r"\$\(([^()]*)\)", cmd):
            inner = await self._one(m.group(1).strip(), timeout)
            if inner is None:
                return _result(
                    "", f"fake: no handler for {m.group(1)[:80]!r}\n", self.provider.unknown_exit_code
                )
            cmd = cmd[: m.start()] + inner.stdout.rstrip("\n") + cmd[m.end() :]
        return cmd

    def processes(self) -> list[tuple[str, str]]:
        """(stat, args) of the processes the fake models: its terminals and what runs in them."""
        procs = [("Ss", "/run/agentrl-init")]
        for term in self.terminals:
            procs += term.processes()
        return procs

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
            term.end()
        self.terminals.clear()

    async def tampered_paths(self) -> list[str] | None:
        image = self.provider.image_files
        changed = [p for p in image if p in self.files and self.files[p] != image[p]]
        deleted = [p for p in image if p not in self.files]
        added = [p for p in self.files if p not in image]
        return tampered(changed, deleted, added)

    async def download(self, src: str, dst: Path, *, limit_bytes: int | None = None) -> None:
        if self.closed:
            raise SandboxError(f"fake sandbox {self.sandbox_id} is closed")
        self._run_background()
        dst = Path(dst)
        if limit_bytes is not None:
            prefix = src.rstrip("/") + "/"
            size = sum(len(v) for k, v in self.files.items() if k == src or k.startswith(prefix))
            if not any(k == src or k.startswith(prefix) for k in self.files):
                raise FileNotFoundError(f"fake: {src} does not exist")
            if size > limit_bytes:
                raise too_large(src, limit_bytes)
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
                term.end()
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
