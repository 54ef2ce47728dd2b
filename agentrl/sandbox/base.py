"""The Sandbox seam: one started container-like environment per episode.

Every backend (podman, daytona, fake) implements `Sandbox` and `SandboxProvider` and passes the
same contract suite in `tests/sandbox_contract.py`.
"""

from __future__ import annotations

import abc
import contextlib
import io
import re
import tarfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import TYPE_CHECKING

from agentrl.errors import AgentRLError, InfraError, InputError
from agentrl.sandbox.provenance import Opened

if TYPE_CHECKING:
    from agentrl.tasks.task import Task

DEFAULT_OUTPUT_LIMIT = 64 * 1024
REWARD_FILE_LIMIT = 64 * 1024  # bytes: a larger reward file is a verifier error, never read whole

# Limits applied when a task does not set its own (Harbor's documented task defaults for cpus and
# memory; a pids cap so a fork bomb stays inside its container; Harbor's storage default).
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_MB = 2048
DEFAULT_PIDS_LIMIT = 1024
DEFAULT_STORAGE_MB = 10240

# Where a verifier's interpreter, shell and libraries live: a change to a file the image shipped
# here (or one of these additions) lets an agent forge what the tests compute, so it is `tampered`.
SYSTEM_PREFIXES = ("/bin/", "/sbin/", "/lib/", "/lib32/", "/lib64/", "/libx32/", "/usr/")
SUSPICIOUS_ADDITIONS = re.compile(
    r"^/etc/ld\.so\.preload$"
    r"|^/usr/(?:local/)?lib/python3[^/]*/"  # new modules, .pth files, sitecustomize on sys.path
    r"|/(?:sitecustomize|usercustomize)\.py$"
    r"|/(?:pytest|_pytest|pluggy|py|iniconfig)(?:\.py|/__init__\.py)$"  # shadows the test harness
    r"|^/(?:conftest\.py|pytest\.ini|pyproject\.toml|tox\.ini|setup\.cfg|setup\.py)$"  # pytest's rootdir
    r"|^/(?:usr/(?:local/)?)?s?bin/(?:python[0-9.]*|pytest|py\.test|pip[0-9.]*|uvx?|bash|sh|dash|env|"
    r"cat|timeout|perl|node)$"  # a shadowing interpreter earlier on PATH
)
# Byte code is never read by the verifier (PYTHONPYCACHEPREFIX points elsewhere), so Python's own
# cache writes are not tampering.
HARMLESS = re.compile(r"/__pycache__(?:/|$)|\.pyc$")


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass
class TestRun:
    """A private verification's result (`Sandbox.run_tests`): the exit of test.sh (None after a
    timeout), the reward files and the output's tail by name, the files the verification opened
    that the agent made (`agentrl.sandbox.provenance`), which module names of the agent's files in
    the working directory a Python outside it provides, and that working directory."""

    exit_code: int | None
    timed_out: bool
    files: dict[str, str]
    opened: list[Opened]
    provided: frozenset[str]
    workdir: str


class SandboxError(InfraError):
    """The sandbox failed as infrastructure (create, transport, dead container)."""

    cause = "sandbox"


class SandboxCreateError(SandboxError):
    cause = "sandbox_create"


class ImageBuildError(SandboxCreateError):
    cause = "image_build"
    timed_out = False  # the build ran past build_timeout_sec (it may pass another time)


class SandboxTransportError(SandboxError):
    cause = "sandbox_transport"


class SandboxPolicyError(AgentRLError):
    """The sandbox broke in a way the agent's own commands could have caused: its shell killed or
    stopped during its command, a forged or garbled reply frame, its storage limit exceeded,
    verifier inputs it damaged beyond repair, system files it replaced (`docs/failures.md`).

    Never infrastructure (not an `InfraError`): the episode is a policy failure with reward 0,
    counted under `cause`. Retrying it would hand the policy a re-roll for sabotage.
    """

    cause = "policy"

    def __init__(self, message: str, *, cause: str | None = None) -> None:
        if cause is not None:
            self.cause = cause
        super().__init__(message)


_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Sandbox output made safe for an operator's terminal: control characters, escape sequences
    and bidirectional overrides shown as visible escapes (`\\x1b`), newlines and tabs kept."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def tail(text: str, limit: int) -> str:
    """The end of `text` in at most `limit` characters, cut where a line (else a word) starts and
    marked with "...", so an error's tail never begins mid-word."""
    if len(text) <= limit:
        return text
    cut = text[-(limit - 3) :]
    for sep in ("\n", " "):
        at = cut.find(sep)
        if 0 <= at < len(cut) // 2:
            return "..." + cut[at + 1 :]
    return "..." + cut


def bound_output(text: str, limit: int = DEFAULT_OUTPUT_LIMIT) -> str:
    """Keep the head and the tail of `text` within `limit` characters, with a marker in between
    saying how much was cut."""
    if len(text) <= limit:
        return text
    half = limit // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters omitted ...]\n{text[-half:]}"


class TerminalUnavailableError(InputError):
    """The sandbox cannot host a terminal (no tmux in its image, a tmux that does not start, a
    backend without terminals). A property of the task's image, not of the policy: the episode is
    unscored, never retried. Open terminals before the agent's first action."""


class TerminalClosedError(SandboxPolicyError):
    """The terminal's tmux session is gone or refuses commands. The agent's keystrokes can do that
    (`exit` ends the session, a command can kill or stop tmux), so it is a policy outcome (Harbor's
    Terminus-2 ends its loop when the session is gone: check `is_alive()` to do the same)."""

    def __init__(self, message: str, *, cause: str = "terminal_closed") -> None:
        super().__init__(message, cause=cause)


class TerminalSession(abc.ABC):
    """One interactive terminal in a sandbox: keystrokes in, screens out. Use as `async with`."""

    width: int
    height: int

    @abc.abstractmethod
    async def send_keys(self, keys: str | Sequence[str], *, duration: float = 0.0) -> None:
        """Type `keys` (one string, or several keys in order) as Terminus-2 does: a key that is a
        tmux key name (`C-c`, `C-d`, `Enter`, `Escape`, `Up`, `Tab`, ...) is that key, anything else
        is typed literally (a newline presses Enter). Returns once `duration` seconds have passed
        since the call began (at once when it is not positive); it never waits for a program."""

    @abc.abstractmethod
    async def capture(self, *, history: bool = False) -> str:
        """The visible screen (`height` lines), or with `history` the scrollback and screen (its
        last `capture_limit` characters at most). Sandbox output: escape it before printing."""

    @abc.abstractmethod
    async def is_idle(self) -> bool:
        """Whether the session's shell is waiting at its prompt: in the terminal's foreground,
        asleep (reading input), with no job of its own in the foreground."""

    @abc.abstractmethod
    async def is_alive(self) -> bool:
        """Whether the session still exists (Harbor's `is_session_alive`)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """End the session and everything running in it. Idempotent."""

    async def __aenter__(self) -> TerminalSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Sandbox(abc.ABC):
    """A started sandbox. Use as `async with`; `close()` is idempotent."""

    sandbox_id: str

    async def exec(
        self,
        cmd: str,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run `cmd` with bash. A timeout kills the command and returns `timed_out=True`; the
        sandbox stays usable. Transport failures raise `SandboxTransportError`.

        Without `cwd`, `env` and `user` the command runs in the agent's shell session: working
        directory, variables, functions, aliases and options persist from one such command to the
        next as in one terminal, and background jobs keep running (`shellstate.py`); a command
        killed by its timeout leaves the session as it was. With any of them (the verifier's
        commands, Harbor's exec) it runs from a clean state and leaves the session alone.
        `stop_processes` starts a new, empty session.

        Backends implement either this or `_exec`, which gets that routing decided."""
        session = cwd is None and env is None and user is None
        return await self._exec(cmd, timeout=timeout, cwd=cwd, env=env, user=user, session=session)

    async def _exec_clean(self, cmd: str, *, timeout: float | None = None) -> ExecResult:
        """A command of agentrl's own (files, checks, the terminal): never the agent's session."""
        return await self._exec(cmd, timeout=timeout, cwd=None, env=None, user=None, session=False)

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
        """Run `cmd` in the agent's shell session (`session`) or from a clean state with `cwd`,
        `env` and `user`. Every concrete backend overrides `exec` or this (`__init_subclass__`
        checks), so the base never runs a command itself."""
        raise TypeError(f"{type(self).__name__} implements neither exec nor _exec")

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        abstract = any(getattr(getattr(cls, n, None), "__isabstractmethod__", False) for n in dir(cls))
        if cls.exec is Sandbox.exec and cls._exec is Sandbox._exec and not abstract:
            raise TypeError(f"{cls.__name__} must implement Sandbox.exec or Sandbox._exec")

    @abc.abstractmethod
    async def upload(self, src: Path, dst: str) -> None:
        """Copy a host file or directory to `dst` inside the sandbox (directories: contents)."""

    @abc.abstractmethod
    async def download(self, src: str, dst: Path, *, limit_bytes: int | None = None) -> None:
        """Copy a sandbox file or directory to `dst` on the host. With `limit_bytes` (for what the
        agent made: artifacts), regular files and directories only (links, devices and paths
        outside `src` are left out), no tool of the sandbox's taking part where the backend
        allows, and more than `limit_bytes` of file content in all raises `SandboxPolicyError`
        (`artifact_too_large`) before it is copied; a missing `src` raises `FileNotFoundError`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop and remove the sandbox. Idempotent, safe under cancellation."""

    async def fetch_files(self, directory: str, names: list[str], dst: Path) -> list[str]:
        """Copy the files `names` of sandbox `directory` into host directory `dst` through the
        backend itself, never the sandbox's own tools (the agent may have replaced them); return
        the names that existed. A missing file is no error; a broken transport is."""
        dst.mkdir(parents=True, exist_ok=True)
        found = []
        for name in names:
            try:
                await self.download(f"{directory.rstrip('/')}/{name}", dst / name)
            except SandboxTransportError as exc:
                if _MISSING.search(str(exc)):
                    continue
                raise
            found.append(name)
        return found

    async def open_terminal(self, *, width: int = 160, height: int = 40) -> TerminalSession:
        """An interactive terminal in the sandbox (`agentrl.sandbox.terminal`): keystrokes in,
        screens out, Harbor's Terminus-2 semantics. Its shell is separate from the `exec` session.
        Raises `TerminalUnavailableError` where the sandbox cannot host one."""
        raise TerminalUnavailableError(f"{type(self).__name__} sandboxes have no terminal")

    async def stop_processes(self) -> None:
        """Kill every process started in the sandbox so far (the verifier's first step: nothing the
        agent left running may touch the tests or the reward), open terminals included, and start
        a new, empty shell session (the verifier's commands never see the agent's aliases,
        functions or variables). The next `exec` works as usual. Backends whose sandboxes hold
        their own service processes override this."""
        await self.exec(KILL_ALL, timeout=60)

    async def set_network(self, policy: str, allowed_hosts: tuple[str, ...] = ()) -> None:
        """Switch the sandbox's outbound network to `policy` ("public", "no-network" or
        "allowlist" with `allowed_hosts`) for the next phase: Harbor's phase switch, for a task
        whose agent and verifier phases differ. Enforced from outside the sandbox (nothing the
        agent's processes can undo). Backends that cannot refuse the task here."""
        raise InputError(
            f"{type(self).__name__} sandboxes cannot switch the network between phases ({policy!r} "
            "asked): run the task on podman or Daytona, or give both phases one network_mode"
        )

    def service(self, name: str) -> Sandbox:
        """The compose service `name` of a multi-container task, for the verifier's clean commands
        and downloads (collect hooks, artifacts); `main` is this sandbox. Backends without
        compose services refuse any other name."""
        if name == "main":
            return self
        raise InputError(f"{self.sandbox_id} has no service {name!r} (only `main`)")

    async def run_tests(
        self, tests_dir: Path, *, timeout: float, env: dict[str, str], user: str | int | None
    ) -> TestRun | None:
        """Run `tests_dir/test.sh` where no process of the agent's can see or touch it, with
        `tests_dir` at /tests and a fresh /logs/verifier, and report what the verification used that
        the agent made (`TestRun`). None where the backend cannot (the verifier then runs inside
        the sandbox, `agentrl.episode.verify`)."""
        return None

    @contextlib.asynccontextmanager
    async def verification_copy(self) -> AsyncIterator[Sandbox]:
        """Where a verification without `run_tests` runs its tests: this sandbox, after the kill.
        A backend that can start a copy of the agent's final filesystem with none of its
        processes gives that copy instead, and removes it at the end (Daytona with
        `private_verification`: a snapshot of the sandbox, a sandbox from the snapshot)."""
        yield self

    async def tampered_paths(self) -> list[str] | None:
        """System files of the image the agent changed or deleted, and additions that hijack an
        interpreter (`SYSTEM_PREFIXES`, `SUSPICIOUS_ADDITIONS`), seen from outside the sandbox.
        None when the backend cannot tell."""
        return None

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


_MISSING = re.compile(r"could not be found on container|does not exist(?! on)|no such file", re.IGNORECASE)

# `kill -STOP -1` freezes every process but PID 1 and the caller in one atomic sweep (a fork loop
# cannot outrun it), then they are killed. PID 1 is the sandbox's init, which ignores both.
KILL_ALL = "kill -STOP -1 2>/dev/null; kill -KILL -1 2>/dev/null; true"


def too_large(src: str, limit: int) -> SandboxPolicyError:
    return SandboxPolicyError(
        f"{src} holds more than {limit / 2**20:.0f} MiB: too large to copy out", cause="artifact_too_large"
    )


def untar_bounded(
    fileobj: io.RawIOBase | io.BufferedIOBase, dst: Path, limit: int, src: str, *, single: bool = False
) -> None:
    """Extract a tar stream of `src` under `dst` (with `single`, a file's one member to `dst`
    itself): regular files and directories only, no absolute or `..` names, at most `limit`
    bytes of content, counted from the headers before anything is read (a sparse file counts at
    its full size); over it, `too_large`."""
    total = 0
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for m in tar:
            parts = [p for p in PurePosixPath(m.name).parts if p != "."]
            if m.name.startswith("/") or ".." in parts or not (m.isreg() or m.isdir()):
                continue
            out = dst if single else dst.joinpath(*parts)
            if m.isdir():
                if not single:
                    out.mkdir(parents=True, exist_ok=True)
                continue
            total += m.size
            if total > limit:
                raise too_large(src, limit)
            out.parent.mkdir(parents=True, exist_ok=True)
            reader = tar.extractfile(m)
            assert reader is not None
            with out.open("wb") as fh:
                while chunk := reader.read(1 << 16):
                    fh.write(chunk)
            out.chmod(m.mode & 0o755 | 0o600)


def tampered(changed: list[str], deleted: list[str], added: list[str]) -> list[str]:
    """The suspicious entries of a file-system diff against the image (see `tampered_paths`).
    A changed directory only means its entries changed, so directories are left out."""
    parents = {p.rsplit("/", 1)[0] for p in [*changed, *deleted, *added]}
    found = [p for p in [*changed, *deleted] if p.startswith(SYSTEM_PREFIXES) and p not in parents]
    found += [p for p in added if SUSPICIOUS_ADDITIONS.search(p) and p not in parents]
    return sorted(p for p in set(found) if not HARMLESS.search(p))


class SandboxProvider(abc.ABC):
    """Turns a task into a started sandbox (building or reusing its image)."""

    @abc.abstractmethod
    async def create(self, task: Task, *, run_id: str) -> Sandbox:
        """Start a sandbox for `task` in the agent phase: no tests/, no solution/ inside."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release provider-wide resources (warm pools, clients)."""

    def live_sandboxes(self) -> int:
        """How many sandboxes this provider created and has not closed (leak checks)."""
        return 0
