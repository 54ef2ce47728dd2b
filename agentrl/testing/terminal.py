"""The fake backend's terminal: an in-memory line discipline and the few interactive programs the
terminal contract drives (`tests/terminal_contract.py`), simulated, since the fake sandbox has no
processes or real file system to run them on.

A line typed at the prompt runs through the fake sandbox's command handlers with the terminal's
own shell state, except these, which take over the terminal in the foreground as the real ones do:

- `sleep N`: ends after N seconds of the terminal's clock (`send_keys(duration=)` advances it);
- `python3 -m http.server PORT [--bind ADDR]`: prints Python's banner, answers the fake's
  `urlopen(...)`/`curl` probes of its port from `exec` while it runs (logging each request on its
  screen, as `http.server` does) and refuses a port already served;
- `python3` (or `python`): a REPL of integer/float/string arithmetic, assignments and `print`,
  with Python's prompts and its traceback format for errors; other statements answer
  `NotImplementedError` rather than a made-up result;
- `vi FILE` / `vim FILE`: a full-screen editor (normal, insert and command-line modes; `i a o x
  h j k l`, arrows, `:w`, `:q`, `:wq`, `:x`, `:q!`) that writes the sandbox's dict file system.

Keys typed while `sleep` or the server run are echoed and run by the shell afterwards (type-ahead);
C-c interrupts the foreground program (`^C`, Python's `KeyboardInterrupt`), C-d on an empty line
ends the shell or the REPL. `CMD &` starts a background job (listed by the fake's `ps`, ended by
`stop_processes`). Line editing: BSpace, C-u, C-a, C-e, Left, Right, Up (history).
"""

from __future__ import annotations

import ast
import operator
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentrl.sandbox.base import DEFAULT_OUTPUT_LIMIT, ExecResult, TerminalClosedError, TerminalSession
from agentrl.sandbox.terminal import ENTER_KEYS, wait_rest

_SLEEP = re.compile(r"^sleep (\d+(?:\.\d+)?)$")
_HTTP = re.compile(r"^python3? -m http\.server(?: (\d+))?(?: --bind (\S+))?$")
_REPL = re.compile(r"^python3?$")
_VI = re.compile(r"^vim? (\S+)$")
_BACKGROUND = re.compile(r"^(.*[^&])&$")
# Keys with no effect on the simulated programs where they are not handled.
_IGNORED = frozenset({"C-l", "Tab", "Escape", "Up", "Down", "Left", "Right", "C-a", "C-e", "C-k", "BSpace"})
_KEY_NAMES = _IGNORED | ENTER_KEYS | {"C-c", "C-d", "C-u", "Space"}


@dataclass
class ShellState:
    """What the fake tracks of a shell: its working directory and its environment."""

    cwd: str = "/"
    env: dict[str, str] = field(default_factory=dict)

    def copy(self) -> ShellState:
        return ShellState(self.cwd, dict(self.env))


class FakeSandbox(Protocol):
    """What a fake terminal needs of its fake sandbox (`agentrl.testing.sandbox.FakeSandbox`)."""

    sandbox_id: str
    provider: Any
    files: dict[str, bytes]
    processes: Any
    listeners: dict[int, Any]

    async def run_line(self, line: str, state: ShellState) -> ExecResult: ...


class Program:
    """A program in a terminal's foreground."""

    args = ""
    fullscreen = False
    done = False
    takes_keys = False  # otherwise keys go to the shell's type-ahead

    def start(self, term: FakeTerminal) -> None:
        """Called once, when it takes over the terminal."""

    def tick(self, term: FakeTerminal) -> None:
        """The terminal's clock advanced."""

    async def key(self, term: FakeTerminal, key: str) -> None:
        """A key, for programs that read the terminal (`takes_keys`)."""

    def interrupt(self, term: FakeTerminal) -> None:
        term.write("^C\n")
        self.done = True

    def stop(self, term: FakeTerminal) -> None:
        """Killed (the terminal or the sandbox ended)."""
        self.done = True

    def rows(self, term: FakeTerminal) -> list[str]:
        return []


class Sleep(Program):
    def __init__(self, seconds: float, now: float) -> None:
        self.args = f"sleep {seconds:g}"
        self.until = now + seconds

    def tick(self, term: FakeTerminal) -> None:
        if term.clock >= self.until:
            self.done = True


class HttpServer(Program):
    """`python3 -m http.server`: serves the fake's probes of its port while it runs."""

    def __init__(self, port: int, bind: str) -> None:
        self.port, self.bind = port, bind
        self.args = f"python3 -m http.server {port} --bind {bind}"
        self.term: FakeTerminal | None = None

    def start(self, term: FakeTerminal) -> None:
        listeners = term.sandbox.listeners
        if self.port in listeners:
            term.write("OSError: [Errno 98] Address already in use\n")
            self.done = True
            return
        listeners[self.port] = self
        self.term = term
        shown = "0.0.0.0" if self.bind in ("", "0.0.0.0") else self.bind
        term.write(f"Serving HTTP on {shown} port {self.port} (http://{shown}:{self.port}/) ...\n")

    def request(self, path: str) -> int:
        assert self.term is not None
        stamp = time.strftime("%d/%b/%Y %H:%M:%S")
        self.term.write(f'127.0.0.1 - - [{stamp}] "GET {path or "/"} HTTP/1.1" 200 -\n')
        return 200

    def interrupt(self, term: FakeTerminal) -> None:
        term.write("^C\nKeyboard interrupt received, exiting.\n")
        self.stop(term)

    def stop(self, term: FakeTerminal) -> None:
        if term.sandbox.listeners.get(self.port) is self:
            del term.sandbox.listeners[self.port]
        self.done = True


_BINOPS: dict[type[ast.operator], Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Any] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class _PyError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        self.kind, self.message = kind, message


class PythonRepl(Program):
    """Python's interactive prompt over a small, strict subset of the language."""

    args = "python3"
    takes_keys = True
    BANNER = (
        "Python 3.11.2 (main, Mar 13 2023, 12:18:29) [GCC 12.2.0] on linux\n"
        'Type "help", "copyright", "credits" or "license" for more information.\n'
    )

    def __init__(self) -> None:
        self.names: dict[str, Any] = {}
        self.line = ""

    def start(self, term: FakeTerminal) -> None:
        term.write(self.BANNER + ">>> ")

    async def key(self, term: FakeTerminal, key: str) -> None:
        if key in ENTER_KEYS:
            line, self.line = self.line, ""
            term.write("\n")
            if self._run(term, line.strip()):
                term.write(">>> ")
        elif key == "C-c":
            term.write("\nKeyboardInterrupt\n>>> ")
            self.line = ""
        elif key == "C-d" and not self.line:
            term.write("\n")
            self.done = True
        elif key == "BSpace" and self.line:
            self.line = self.line[:-1]
            term.erase(1)
        elif key not in _IGNORED and key not in ("C-d", "C-u"):
            self.line += key
            term.write(key)

    def _run(self, term: FakeTerminal, source: str) -> bool:
        """Run one line; False when it exits the REPL."""
        if source in ("exit()", "quit()"):
            self.done = True
            return False
        if not source:
            return True
        try:
            tree = ast.parse(source, mode="exec")
        except SyntaxError:
            term.write(f'  File "<stdin>", line 1\n    {source}\nSyntaxError: invalid syntax\n')
            return True
        try:
            for stmt in tree.body:
                self._stmt(term, stmt)
        except _PyError as exc:
            term.write(
                f'Traceback (most recent call last):\n  File "<stdin>", line 1, in <module>\n{exc.kind}: {exc.message}\n'
            )
        return True

    def _stmt(self, term: FakeTerminal, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            value = self._eval(stmt.value)
            for target in stmt.targets:
                assert isinstance(target, ast.Name)
                self.names[target.id] = value
            return
        if isinstance(stmt, ast.Expr):
            call = stmt.value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print":
                if call.keywords:
                    raise _PyError("NotImplementedError", "the fake python3 models print() without keywords")
                term.write(" ".join(str(self._eval(a)) for a in call.args) + "\n")
                return
            value = self._eval(call)
            if value is not None:
                term.write(repr(value) + "\n")
            return
        raise _PyError(
            "NotImplementedError", f"the fake python3 does not model {type(stmt).__name__} statements"
        )

    def _eval(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float | str):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in self.names:
                raise _PyError("NameError", f"name {node.id!r} is not defined")
            return self.names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = self._eval(node.left), self._eval(node.right)
            try:
                return _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError as exc:
                raise _PyError("ZeroDivisionError", str(exc)) from None
            except TypeError as exc:
                raise _PyError("TypeError", str(exc)) from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        raise _PyError(
            "NotImplementedError", f"the fake python3 does not model {type(node).__name__} expressions"
        )


class Vi(Program):
    """A full-screen vi over the sandbox's dict file system."""

    fullscreen = True
    takes_keys = True

    def __init__(self, path: str) -> None:
        self.path = path
        self.args = f"vi {path}"
        self.mode = "normal"
        self.command = ""
        self.lines = [""]
        self.row = self.col = 0
        self.modified = False
        self.message = ""

    def start(self, term: FakeTerminal) -> None:
        data = term.sandbox.files.get(self.path)
        if data is None:
            self.message = f'"{self.path}" [New]'
        else:
            text = data.decode(errors="replace")
            self.lines = text[:-1].split("\n") if text.endswith("\n") else text.split("\n")
            self.message = f'"{self.path}" {len(self.lines)}L, {len(data)}B'

    def rows(self, term: FakeTerminal) -> list[str]:
        body = [line[: term.width] for line in self.lines[: term.height - 1]]
        body += ["~"] * (term.height - 1 - len(body))
        if self.mode == "insert":
            status = "-- INSERT --"
        elif self.mode == "command":
            status = ":" + self.command
        else:
            status = self.message
        return [*body, status[: term.width]]

    async def key(self, term: FakeTerminal, key: str) -> None:
        if self.mode == "command":
            self._command_key(term, key)
        elif self.mode == "insert":
            self._insert_key(key)
        else:
            self._normal_key(key)

    def _normal_key(self, key: str) -> None:
        line = self.lines[self.row]
        if key in ("i", "a", "o", "A", "I"):
            self.mode = "insert"
            if key == "a" and line:
                self.col = min(self.col + 1, len(line))
            elif key == "A":
                self.col = len(line)
            elif key == "I":
                self.col = 0
            elif key == "o":
                self.lines.insert(self.row + 1, "")
                self.row, self.col, self.modified = self.row + 1, 0, True
        elif key == ":":
            self.mode, self.command = "command", ""
        elif key == "x" and line:
            self.lines[self.row] = line[: self.col] + line[self.col + 1 :]
            self.col = max(0, min(self.col, len(self.lines[self.row]) - 1))
            self.modified = True
        elif key in ("h", "Left"):
            self.col = max(0, self.col - 1)
        elif key in ("l", "Right"):
            self.col = max(0, min(self.col + 1, len(line) - 1))
        elif key in ("j", "Down", "k", "Up"):
            step = 1 if key in ("j", "Down") else -1
            self.row = max(0, min(self.row + step, len(self.lines) - 1))
            self.col = max(0, min(self.col, len(self.lines[self.row]) - 1))
        elif len(key) > 1 and key not in _IGNORED and key not in ENTER_KEYS:
            for ch in key:  # a typed string is its characters, one command each
                self._normal_key(ch)

    def _insert_key(self, key: str) -> None:
        line = self.lines[self.row]
        if key == "Escape":
            self.mode = "normal"
            self.col = max(0, self.col - 1)
        elif key in ENTER_KEYS:
            self.lines[self.row : self.row + 1] = [line[: self.col], line[self.col :]]
            self.row, self.col, self.modified = self.row + 1, 0, True
        elif key == "BSpace":
            if self.col:
                self.lines[self.row] = line[: self.col - 1] + line[self.col :]
                self.col -= 1
                self.modified = True
        elif key in ("Left", "Right"):
            self.col = max(0, min(self.col + (1 if key == "Right" else -1), len(line)))
        elif key not in _IGNORED and not key.startswith("C-"):
            for ch in key:
                if ch in "\r\n":
                    self._insert_key("Enter")
                    continue
                line = self.lines[self.row]
                self.lines[self.row] = line[: self.col] + ch + line[self.col :]
                self.col += 1
                self.modified = True

    def _command_key(self, term: FakeTerminal, key: str) -> None:
        if key == "Escape" or key == "C-c":
            self.mode, self.command = "normal", ""
        elif key == "BSpace":
            if not self.command:
                self.mode = "normal"
            self.command = self.command[:-1]
        elif key in ENTER_KEYS:
            self.mode = "normal"
            self._ex(term, self.command.strip())
        elif key not in _IGNORED:
            for ch in key:
                if ch in "\r\n":
                    self._command_key(term, "Enter")
                    if self.mode != "command":
                        return
                else:
                    self.command += ch

    def _ex(self, term: FakeTerminal, cmd: str) -> None:
        if cmd in ("w", "wq", "x"):
            data = ("\n".join(self.lines) + "\n").encode()
            new = self.path not in term.sandbox.files
            term.sandbox.files[self.path] = data
            self.modified = False
            self.message = f'"{self.path}" {"[New] " if new else ""}{len(self.lines)}L, {len(data)}B written'
            if cmd != "w":
                self.done = True
        elif cmd == "q":
            if self.modified:
                self.message = "E37: No write since last change (add ! to override)"
            else:
                self.done = True
        elif cmd == "q!":
            self.done = True
        else:
            self.message = f"E492: Not an editor command: {cmd}"

    def interrupt(self, term: FakeTerminal) -> None:
        if self.mode == "normal":
            self.message = "Type  :qa!  and press <Enter> to abandon all changes and exit Vim"
        self.mode, self.command = "normal", ""


class FakeTerminal(TerminalSession):
    """An in-memory terminal for unit tests of keystroke agents (module docstring). The screen
    is the last `height` rows of the scrollback, lines wrapped at `width`, or a full-screen
    program's own rows; a capture with `history` is its last `capture_limit` characters, cut at
    a line start as tmux's is. Durations sleep `provider.terminal_time_scale` real seconds each
    (0 by default: tests run at full speed); `sent` records every call's keys and duration."""

    def __init__(self, sandbox: FakeSandbox, width: int, height: int, state: ShellState) -> None:
        self.sandbox = sandbox
        self.width, self.height = width, height
        self.state = state
        self.capture_limit = DEFAULT_OUTPUT_LIMIT // 2
        self.lines: list[str] = []  # finished lines (scrollback and screen)
        self.current = self._prompt()  # the line being written (prompt, echo, output without \n)
        self.typed = ""  # the shell's line being edited
        self.cursor = 0  # position in `typed`
        self.queued: list[str] = []  # lines typed while a foreground program ran
        self.history: list[str] = []
        self.program: Program | None = None
        self.jobs: list[Program] = []  # background jobs
        self.clock = 0.0
        self.alive = True
        self.sent: list[tuple[list[str], float]] = []

    def _prompt(self) -> str:
        return f"root@sandbox:{self.state.cwd}# "

    def write(self, text: str) -> None:
        parts = (self.current + text).split("\n")
        self.lines.extend(parts[:-1])
        self.current = parts[-1]

    def erase(self, count: int) -> None:
        self.current = self.current[: len(self.current) - count]

    def _show_typed(self, before: int) -> None:
        """Redraw the edited line: drop what was shown of it (`before` characters), show it anew."""
        self.erase(before)
        self.current += self.typed

    # -- the shell ---------------------------------------------------------------------------------
    async def _run(self, line: str) -> None:
        cmd = line.strip()
        if cmd == "exit" or cmd.startswith("exit "):
            self.write("exit\n")
            self.end()
            return
        background = _BACKGROUND.match(cmd)
        if background:
            self._background(background.group(1).strip())
        elif cmd and not self._foreground(cmd):
            res = await self.sandbox.run_line(cmd, self.state)
            self.write(res.stdout + res.stderr)
            if self.current:
                self.write("\n")
        if self.program is None and self.alive:
            self.write(self._prompt())

    def _foreground(self, cmd: str) -> bool:
        program: Program
        if m := _SLEEP.match(cmd):
            program = Sleep(float(m.group(1)), self.clock)
        elif m := _HTTP.match(cmd):
            program = HttpServer(int(m.group(1) or 8000), m.group(2) or "")
        elif _REPL.match(cmd):
            program = PythonRepl()
        elif m := _VI.match(cmd):
            program = Vi(self._path(m.group(1)))
        else:
            return False
        program.start(self)
        if not program.done:
            self.program = program
        return True

    def _background(self, cmd: str) -> None:
        number = len(self.jobs) + 1
        job: Program
        if m := _SLEEP.match(cmd):
            job = Sleep(float(m.group(1)), self.clock)
        else:
            job = Program()
            job.args, job.done = cmd, True  # anything else finishes at once in the fake
        self.write(f"[{number}] {4000 + len(self.sandbox.processes())}\n")
        if not job.done:
            self.jobs.append(job)

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.state.cwd.rstrip('/')}/{path}"

    async def _program_ended(self) -> None:
        self.program = None
        self.write(self._prompt())
        while self.queued and self.alive and self.program is None:
            line = self.queued.pop(0)
            self.write(line + "\n")
            if line.strip():
                self.history.append(line)
            await self._run(line)

    async def _settle(self) -> None:
        """Let the clock's effects land: finished programs and jobs."""
        for job in self.jobs:
            job.tick(self)
        self.jobs = [job for job in self.jobs if not job.done]
        if self.program is not None:
            self.program.tick(self)
            if self.program.done:
                await self._program_ended()

    async def _shell_key(self, key: str) -> None:
        before = len(self.typed)
        if key in ENTER_KEYS:
            line, self.typed, self.cursor = self.typed, "", 0
            self.write("\n")
            if line.strip():
                self.history.append(line)
            await self._run(line)
            return
        if key == "C-c":
            self.write("^C\n" + self._prompt())
            self.typed, self.cursor = "", 0
            return
        if key == "C-d":
            if not self.typed:
                self.write("exit\n")
                self.end()
            return
        if key == "C-u":
            self.typed, self.cursor = self.typed[self.cursor :], 0
        elif key == "BSpace":
            if self.cursor:
                self.typed = self.typed[: self.cursor - 1] + self.typed[self.cursor :]
                self.cursor -= 1
        elif key == "C-a":
            self.cursor = 0
        elif key == "C-e":
            self.cursor = len(self.typed)
        elif key == "Left":
            self.cursor = max(0, self.cursor - 1)
        elif key == "Right":
            self.cursor = min(len(self.typed), self.cursor + 1)
        elif key == "Up":
            if self.history:
                self.typed = self.history[-1]
                self.cursor = len(self.typed)
        elif key in _IGNORED or key.startswith("C-"):
            return
        else:
            for ch in " " if key == "Space" else key:
                if ch in "\r\n":
                    self._show_typed(before)
                    await self._shell_key("Enter")
                    if not self.alive or self.program is not None:
                        # the rest of the string is type-ahead for the program / shell afterwards
                        return
                    before = 0
                    continue
                self.typed = self.typed[: self.cursor] + ch + self.typed[self.cursor :]
                self.cursor += 1
        self._show_typed(before)

    async def _busy_key(self, key: str) -> None:
        """A key while `sleep` or the server runs: type-ahead, echoed, run afterwards."""
        if key in ENTER_KEYS:
            self.queued.append(self.typed)
            self.typed = ""
            self.write("\n")
        elif key == "C-c":
            assert self.program is not None
            self.program.interrupt(self)
            self.typed, self.queued = "", []
            if self.program.done:
                await self._program_ended()
        elif key not in _IGNORED and not key.startswith("C-"):
            for ch in " " if key == "Space" else key:
                if ch in "\r\n":
                    await self._busy_key("Enter")
                else:
                    self.typed += ch
                    self.write(ch)

    async def _key(self, key: str) -> None:
        program = self.program
        if program is None:
            await self._shell_key(key)
        elif program.takes_keys:
            key = " " if key == "Space" else key
            if key not in _KEY_NAMES and len(key) > 1:  # typed text: one key per character
                for i, ch in enumerate(key):
                    await self._key("Enter" if ch in "\r\n" else ch)
                    if self.program is not program:  # it ended: the rest is the shell's
                        if key[i + 1 :]:
                            await self._key(key[i + 1 :])
                        return
                return
            if key == "C-c":
                program.interrupt(self)
            else:
                await program.key(self, key)
            if program.done:
                await self._program_ended()
        else:
            await self._busy_key(key)

    def end(self) -> None:
        """The shell exited or was killed: its programs and jobs with it."""
        self.alive = False
        for program in [self.program, *self.jobs]:
            if program is not None:
                program.stop(self)
        self.program, self.jobs = None, []

    def processes(self) -> list[tuple[str, str]]:
        """(stat, args) of what runs in this terminal, for the fake's `ps`."""
        if not self.alive:
            return []
        procs = [("Ss" if self.program else "Ss+", "bash --login")]
        if self.program is not None:
            procs.append(("S+", self.program.args))
        procs += [("S", job.args) for job in self.jobs]
        return procs

    # -- TerminalSession ---------------------------------------------------------------------------
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
            await self._settle()
            await wait_rest(start, duration * self.sandbox.provider.terminal_time_scale)

    def _rows(self) -> list[str]:
        rows: list[str] = []
        for line in [*self.lines, self.current]:
            rows.extend(line[i : i + self.width] for i in range(0, max(len(line), 1), self.width))
        return rows

    async def capture(self, *, history: bool = False) -> str:
        if not self.alive:
            raise TerminalClosedError(f"fake terminal of {self.sandbox.sandbox_id}: the session has ended")
        if self.program is not None and self.program.fullscreen and not history:
            rows = self.program.rows(self)
            return "\n".join(rows) + "\n"
        rows = self._rows()
        if history:
            text = "\n".join(rows) + "\n"
            data = text.encode()
            if len(data) > self.capture_limit:
                cut = data[-(self.capture_limit + 1) :].decode(errors="replace")
                text = cut.split("\n", 1)[1] if "\n" in cut else ""
            return text
        rows = rows[-self.height :]
        return "\n".join(rows + [""] * (self.height - len(rows))) + "\n"

    async def is_idle(self) -> bool:
        return self.alive and self.program is None

    async def is_alive(self) -> bool:
        return self.alive

    async def close(self) -> None:
        if self.alive:
            self.end()


def probe_port(sandbox: FakeSandbox, url: str) -> int | None:
    """The status a GET of `url` gets from a server running in one of the sandbox's terminals, or
    None when nothing listens there (connection refused)."""
    m = re.match(r"^https?://(?:127\.0\.0\.1|localhost)(?::(\d+))?(/[^\s'\"]*)?$", url)
    if m is None:
        return None
    server = sandbox.listeners.get(int(m.group(1) or 80))
    return None if server is None else server.request(m.group(2) or "/")
