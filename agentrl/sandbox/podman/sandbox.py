"""`PodmanSandbox`: one started container; exec through the persistent shell, upload and download,
terminals, limits, and the tamper scan of what the agent changed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shlex
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agentrl.errors import InputError
from agentrl.sandbox.base import (
    HARMLESS,
    KILL_ALL,
    SUSPICIOUS_ADDITIONS,
    SYSTEM_PREFIXES,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxPolicyError,
    SandboxTransportError,
    TerminalSession,
    TestRun,
    tail,
    untar_bounded,
)
from agentrl.sandbox.podman import netns, verifier
from agentrl.sandbox.podman.cli import (
    _bounded,
    _StreamFile,
    _tree_bytes,
    _untar_tails,
    cli_cwd,
    init_and_layer,
    run_cli,
    run_cli_bounded,
)
from agentrl.sandbox.podman.compose import ComposeNet
from agentrl.sandbox.podman.procs import _kill_namespace
from agentrl.sandbox.podman.shell import (
    _CLEAN_BODY,
    _KILL_SESSION,
    _STREAM_LIMIT,
    _NotSent,
    _Shell,
    _stateless_words,
)
from agentrl.sandbox.terminal import TmuxTerminal
from agentrl.tasks.compose import MAIN

log = logging.getLogger(__name__)


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


class PodmanHost(Protocol):
    """What a sandbox needs of the provider that started it (`PodmanProvider`)."""

    cli: str
    output_limit: int
    storage_check_s: float
    shell_grace_s: float
    terminal_tools: bool
    private_verification: bool
    _terminal_notes: dict[str, str]
    _background: set[asyncio.Task[Any]]

    async def _remove(self, name: str) -> None: ...


def _untar_or_empty(reader: _StreamFile, staging: Path, limit: int, src: str) -> None:
    """`untar_bounded`, where an empty stream (`cp` found nothing: its exit says why) is no tar."""
    try:
        untar_bounded(reader, staging, limit, src)
    except tarfile.ReadError:
        while reader.read(1 << 16):
            pass


@dataclass
class _CpResult:
    rc: int | None = None
    err: str = ""

    @property
    def missing(self) -> bool:
        return "could not be found on container" in self.err or "no such file" in self.err.lower()


class _Container:
    """What agentrl does to one container from the host, shared by the agent's sandbox and a
    compose task's other services: exec through the CLI, `cp` out as a bounded tar stream."""

    cli: str
    sandbox_id: str
    output_limit: int
    shell_grace_s: float

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
            raise SandboxTransportError(f"container {self.sandbox_id} is gone: {tail(err.strip(), 300)}")
        timed_out = timeout is not None and rc in (124, 137) and duration >= timeout * 0.98
        return ExecResult(out, err, None if timed_out else rc, timed_out, duration)

    async def _running(self) -> bool:
        rc, out, _ = await run_cli(
            self.cli, "inspect", "--format", "{{.State.Running}}", self.sandbox_id, timeout=30
        )
        return rc == 0 and out.strip() == "true"

    # -- terminal ---------------------------------------------------------------------------------

    async def _download_bounded(self, src: str, dst: Path, limit: int) -> None:
        """`cp` to a tar stream read on the host (no tool inside the container takes part), cut
        off once over `limit`."""
        # A tar of a file holds it under its own name; of a directory, its name and what is below.
        staging = Path(
            tempfile.mkdtemp(prefix="agentrl-download-", dir=dst.parent if dst.parent.is_dir() else None)
        )
        try:
            async with self._cp_stream(src) as (reader, stream):
                await asyncio.to_thread(_untar_or_empty, reader, staging, limit, src)
            if stream.rc != 0:
                if stream.missing:
                    raise FileNotFoundError(f"{src} does not exist in {self.sandbox_id}")
                raise SandboxTransportError(
                    f"copying {src} out of {self.sandbox_id} failed: {tail(stream.err, 300)}"
                )
            (top,) = list(staging.iterdir()) or [None]
            if top is None:
                raise FileNotFoundError(f"{src} is neither a regular file nor a directory")
            if dst.is_dir() and top.is_dir():
                for child in top.iterdir():
                    shutil.move(str(child), dst / child.name)
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(top), dst)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @contextlib.asynccontextmanager
    async def _cp_stream(self, src: str) -> AsyncIterator[tuple[_StreamFile, _CpResult]]:
        """`cp` of `src` out of the container as a tar stream, for the body to read (in a
        thread) within 300 s; the exit status and error text land in the result once the body is
        done. On any failure the process is killed and what it wrote is read away (a full, paused
        pipe never closes, and the process is not reaped until it does)."""
        proc = await asyncio.create_subprocess_exec(
            self.cli, "cp", f"{self.sandbox_id}:{src}", "-",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=cli_cwd(),
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        result = _CpResult()
        errors = asyncio.ensure_future(proc.stderr.read())
        try:
            async with asyncio.timeout(300):
                yield _StreamFile(proc.stdout, asyncio.get_running_loop()), result
                err = await errors
            await asyncio.wait_for(proc.wait(), 60)
            result.rc, result.err = proc.returncode, err.decode(errors="replace")
        finally:
            if proc.returncode is None:
                proc.kill()
                while await proc.stdout.read(1 << 16):
                    pass
                await asyncio.shield(proc.wait())
            errors.cancel()


class PodmanSandbox(_Container, Sandbox):
    def __init__(
        self,
        provider: PodmanHost,
        name: str,
        workdir: str | None,
        *,
        storage_mb: int | None = None,
        upper_dir: str | None = None,
        image: str = "",
        limit_args: tuple[str, ...] = (),
        storage_limit_mb: int | None = None,
    ) -> None:
        self.provider = provider
        self.cli = provider.cli
        self.sandbox_id = name
        self.workdir = workdir
        self.image = image
        self.limit_args = limit_args  # the container's cpus, memory and pids limits, as `run` options
        self.storage_limit_mb = storage_limit_mb  # the task's, however enforced (also the verifier's)
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
        self.network = "none"  # the container's podman network ("none" or "bridge")
        self._resolvers: tuple[str, ...] | None = None  # its nameservers, read before the agent ran
        self.compose: ComposeNet | None = None  # a compose task's network and other services
        self._service_pids: dict[str, int] = {}  # their inits' host pids (their network namespaces)
        self._service_uppers: dict[str, str] = {}  # their writable layers (measured with main's)
        self._egress: str | None = None  # the nft script of the network policy last set
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
            raise SandboxTransportError(f"container {self.sandbox_id} is gone: {tail(err.strip(), 300)}")

    async def fetch_files(self, directory: str, names: list[str], dst: Path) -> list[str]:
        """One `cp` of the directory as a tar stream to the host (no tool inside the container
        takes part), keeping only `names`, each at most its last `FETCH_LIMIT` bytes, regular
        files only: host memory and disk stay bounded whatever the sandbox wrote there."""
        dst.mkdir(parents=True, exist_ok=True)
        async with self._cp_stream(f"{directory.rstrip('/')}/.") as (reader, stream):
            found = await asyncio.to_thread(_untar_tails, reader, names, dst)
        if stream.rc != 0:
            if stream.missing:
                return []
            raise SandboxTransportError(
                f"copying {directory} out of {self.sandbox_id} failed: {tail(stream.err, 300)}"
            )
        return found

    async def set_network(self, policy: str, allowed_hosts: tuple[str, ...] = ()) -> None:
        """The container's outbound network for the next phase, switched from the host
        (`netns`): open for "public", closed for "no-network", for "allowlist" closed but for
        DNS to the resolvers the container started with and the allowed hosts' addresses."""
        if policy != "no-network" and self.network == "none":
            raise SandboxError(f"{self.sandbox_id} was started without a network: it cannot be opened")
        if self.network == "none":
            return  # already closed, for good
        if not self._init_pid:
            raise SandboxError(f"{self.sandbox_id}: its init's pid is unknown; cannot switch its network")
        if self._resolvers is None:
            self._resolvers = netns.resolvers(self._init_pid)
        allow = None if policy == "public" else ()
        if policy == "allowlist":
            allow = await asyncio.to_thread(netns.allowed_addresses, allowed_hosts)
        local = (self.compose.subnet, self.compose.gateway) if self.compose is not None else None
        dns = self._resolvers if policy == "allowlist" else ()
        # kept: a compose service started later gets the same rules, hostnames resolved once
        self._egress = script = netns.egress_script("agentrl_phase", allow, dns, local=local)
        await netns.apply(self._init_pid, script, what=self.sandbox_id)
        for service, pid in self._service_pids.items():  # a compose task's: every service's too
            await netns.apply(pid, script, what=f"{self.sandbox_id} service {service}")

    async def add_service(self, service: str, container: str) -> None:
        """A compose task's service, just started: the sandbox's network policy goes on its
        namespace too, before anything waits on it."""
        pid, upper, err = await init_and_layer(self.cli, container)
        if pid is None:
            raise SandboxError(
                f"service {service} of {self.sandbox_id} is not running: {tail(err.strip(), 300)}"
            )
        self._service_pids[service] = pid
        if upper is not None:
            self._service_uppers[service] = upper
        if self._egress is not None:
            await netns.apply(pid, self._egress, what=f"{self.sandbox_id} service {service}")

    async def run_tests(
        self, tests_dir: Path, *, timeout: float, env: dict[str, str], user: str | int | None
    ) -> TestRun | None:
        """In a verification container of its own over this container's files (`verifier.py`),
        on a rootful podman; None elsewhere."""
        if not (self.provider.private_verification and verifier.available()) or self._upper_dir is None:
            return None
        self._check_storage()
        return await verifier.run_private_tests(self, tests_dir, timeout=timeout, env=env, user=user)

    async def tampered_paths(self) -> list[str] | None:
        """Where verification cannot be private (rootless podman, docker): the container's changes against its image, as the storage driver sees them on the
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
                while await proc.stdout.read(1 << 16):  # a full, paused pipe never closes
                    pass
                await asyncio.shield(proc.wait())
            raise
        if proc.returncode != 0:
            raise SandboxTransportError(
                f"`{self.cli} diff {self.sandbox_id}` failed: {tail(err.decode(errors='replace').strip(), 300)}"
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
        used = 0  # main's writable layer and a compose task's services': one budget, the task's
        for upper in (self._upper_dir, *self._service_uppers.values()):
            used += await asyncio.to_thread(_tree_bytes, upper, limit - used)
            if used > limit:
                self._storage_used = used
                return

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
                    if self.compose is not None and self.compose.containers:
                        await run_cli(self.cli, "kill", *self.compose.containers.values(), timeout=60)
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
            raise SandboxTransportError(f"upload {src} -> {dst} failed: {tail(err.strip(), 500)}")

    async def download(self, src: str, dst: Path, *, limit_bytes: int | None = None) -> None:
        if limit_bytes is not None:
            return await self._download_bounded(src, Path(dst), limit_bytes)
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
            raise SandboxTransportError(f"download {src} -> {dst} failed: {tail(err.strip(), 500)}")

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

    def service(self, name: str) -> Sandbox:
        if name == MAIN:
            return self
        if self.compose is None or name not in self.compose.containers:
            return super().service(name)
        return PodmanService(self, self.compose.containers[name])

    async def alive(self) -> bool:
        if self._closed:
            return False
        try:
            res = await self._exec_clean("true", timeout=10)
        except (SandboxError, SandboxPolicyError):
            return False
        return res.exit_code == 0


class PodmanService(_Container, Sandbox):
    """Another service of a compose task (`PodmanSandbox.service`): clean commands and downloads
    only (collect hooks, artifacts); it goes with the agent's sandbox."""

    def __init__(self, owner: PodmanSandbox, container: str) -> None:
        self.cli = owner.cli
        self.sandbox_id = container
        self.output_limit = owner.output_limit
        self.shell_grace_s = owner.shell_grace_s

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
        return await self._exec_cli(cmd, timeout=timeout, cwd=cwd, env=env, user=user)

    async def upload(self, src: Path, dst: str) -> None:
        raise InputError(f"{self.sandbox_id}: agentrl copies nothing into a task's other services")

    async def download(self, src: str, dst: Path, *, limit_bytes: int | None = None) -> None:
        if limit_bytes is None:
            raise InputError(
                f"{self.sandbox_id}: a download from a task's service is bounded: give limit_bytes"
            )
        await self._download_bounded(src, Path(dst), limit_bytes)

    async def close(self) -> None:
        """Nothing: the service is removed with the agent's sandbox."""
