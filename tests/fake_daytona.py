"""An in-process Daytona for tests: the part of `AsyncDaytona` agentrl uses, method for method with
the installed SDK's signatures (`tests/test_daytona.py` compares them with `inspect.signature`, so
the fake cannot drift from the SDK), returning the SDK's own response types.

`FakeDaytonaServer` holds the state an account would: sandboxes by id and name, labels, the create
parameters it received, deletions and activity refreshes. Its sandboxes run on a `PodmanRuntime`
when one is given: the rendered Dockerfile and its context are built with podman, and every
`process.exec` / session command / file transfer happens in a real container, with Daytona's
semantics (a command string run by `sh -c`, combined output from `exec`, split streams from
session logs, uploads that need the parent directory to exist). Without a runtime the server only
keeps records, which is what create / delete / fault tests need.

Faults: `create_errors` are raised by the next create calls before anything exists (throttling,
quota); `start_errors` after the sandbox exists (a failed start); `start_delay_s` keeps a create
"starting" with the sandbox already present (cancellation mid-create), signalled by `starting`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from daytona import (
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    DaytonaConflictError,
    DaytonaError,
    DaytonaNotFoundError,
    ExecuteResponse,
    FileDownloadRequest,
    FileDownloadResponse,
    FileUpload,
    Image,
    ListSandboxesQuery,
    SessionExecuteRequest,
    SessionExecuteResponse,
)
from daytona.common.errors import (
    DaytonaProcessExecutionTimeoutError,
    DaytonaTimeoutError,
    DaytonaValidationError,
)
from daytona.common.process import ExecutionArtifacts, SessionCommandLogsResponse
from daytona.common.snapshot import PaginatedSnapshots, Snapshot
from daytona_api_client import SnapshotState
from daytona_toolbox_api_client_async import Command, FileInfo
from daytona_toolbox_api_client_async import ExecuteRequest as ToolboxExecuteRequest

from agentrl.sandbox.base import SandboxError
from agentrl.sandbox.images import serve_offline
from agentrl.sandbox.podman import netns, run_cli

FAKE_LABEL = "agentrl-fake-daytona"
DAEMON_START = 'cp "$(command -v sleep)" /tmp/.daytona-daemon && exec /tmp/.daytona-daemon infinity'


def firewall(block_all: bool | None, nets: str | None, domains: str | None) -> tuple[str, ...] | None:
    """What the runner lets out: None everything; else these addresses and ranges (an allow list
    implies not blocking all; no list and `block_all` blocks everything)."""
    if nets or domains:
        names = tuple(d for d in (domains or "").split(",") if d)
        return tuple(n for n in (nets or "").split(",") if n) + netns.allowed_addresses(names)
    return () if block_all else None


class PodmanRuntime:
    """Runs fake Daytona sandboxes as podman containers built from the rendered Dockerfile."""

    def __init__(self, cli: str = "podman", server_tag: str | None = None) -> None:
        self.cli = cli
        self.server_tag = server_tag or uuid.uuid4().hex[:12]

    async def _build(self, image: Image) -> str:
        dockerfile = image.dockerfile()
        h = hashlib.sha256(dockerfile.encode())
        for ctx in image._context_list:
            src = Path(ctx.source_path)
            files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
            for f in files:
                h.update(str(ctx.archive_path).encode() + f.name.encode() + f.read_bytes())
        tag = f"localhost/fake-daytona/image:{h.hexdigest()[:16]}"
        if (await run_cli(self.cli, "image", "exists", tag, timeout=60))[0] == 0:
            return tag
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            # Daytona pulls real bases; here the offline stand-in answers for them
            (root / "Dockerfile").write_text(serve_offline(dockerfile, self.cli))
            for ctx in image._context_list:
                src, dest = Path(ctx.source_path), root / (ctx.archive_path or Path(ctx.source_path).name)
                dest.parent.mkdir(parents=True, exist_ok=True)
                if src.is_dir():
                    shutil.copytree(src, dest, dirs_exist_ok=True)
                else:
                    shutil.copy2(src, dest)
            rc, out, err = await run_cli(
                self.cli, "build", "--pull=never", "--network=none", "-t", tag, str(root), timeout=600
            )
        if rc != 0:
            raise DaytonaError(f"Sandbox failed to start: build failed: {(out + err)[-1000:]}")
        return tag

    async def start(self, sandbox_id: str, params: CreateSandboxFromImageParams) -> str:
        image = params.image if isinstance(params.image, Image) else Image.base(params.image)
        tag = await self._build(image)
        memory = params.resources.memory if params.resources is not None else None
        return await self.run(sandbox_id, tag, params, memory)

    async def commit(self, container: str, name: str) -> str:
        """A snapshot of the container's filesystem as an image (the runner pauses the sandbox and
        commits it; the processes are not part of it)."""
        tag = f"localhost/fake-daytona/snapshot:{hashlib.sha256(name.encode()).hexdigest()[:16]}"
        rc, _, err = await run_cli(self.cli, "commit", "--pause=true", container, tag, timeout=300)
        if rc != 0:
            raise DaytonaError(f"Failed to create snapshot: {err[-500:]}")
        return tag

    async def run(
        self,
        sandbox_id: str,
        tag: str,
        params: CreateSandboxFromImageParams | CreateSandboxFromSnapshotParams,
        memory: int | None,
    ) -> str:
        name = f"fake-daytona-{sandbox_id}"
        # Daytona's runner blocks the network from outside the sandbox, and can open it again
        # (`update_network_settings`): a bridge with an nftables drop set from the host does both.
        args = [
            "run",
            "-d",
            "--name",
            name,
            "--label",
            f"{FAKE_LABEL}={self.server_tag}",
            "--network",
            "bridge",
        ]
        if memory:
            args += ["--memory", f"{memory}g"]
        if params.os_user:
            args += ["--user", params.os_user]
        for key, value in (params.env_vars or {}).items():
            args += ["-e", f"{key}={value}"]
        # PID 1 stands in for Daytona's toolbox daemon: a binary of its own (a copy of `sleep`), so
        # the verifier's kill, which spares the daemon's executable, spares nothing else.
        args += ["--entrypoint", "/bin/sh", tag, "-c", DAEMON_START]
        rc, _, err = await run_cli(self.cli, *args, timeout=120)
        if rc != 0:
            raise DaytonaError(f"Sandbox failed to start: {err[-500:]}")
        await self.block_network(
            name, firewall(params.network_block_all, params.network_allow_list, params.domain_allow_list)
        )
        return name

    async def block_network(self, container: str, allow: tuple[str, ...] | None) -> None:
        """The runner's firewall, from the host: `allow` None opens the network, else only the
        addresses and ranges in it (the real runner matches domains by name; the fake resolves
        them on the host, the podman backend's rules: `agentrl.sandbox.podman.netns`)."""
        rc, out, err = await run_cli(self.cli, "inspect", "-f", "{{.State.Pid}}", container, timeout=60)
        if rc != 0 or not out.strip().isdigit():
            raise DaytonaError(f"sandbox is not running: {err.strip()}")
        pid = int(out.strip())
        script = netns.egress_script("fake_daytona", allow, netns.resolvers(pid) if allow else ())
        try:
            await netns.apply(pid, script, what=container)
        except SandboxError as exc:
            raise DaytonaError(f"runner: network settings not applied: {exc}") from exc

    async def remove(self, container: str) -> None:
        await run_cli(self.cli, "rm", "-f", "-t", "0", container, timeout=120)

    def exec_args(
        self, container: str, command: str, cwd: str | None, env: dict[str, str] | None
    ) -> list[str]:
        args = [self.cli, "exec"]
        if cwd:
            args += ["-w", cwd]
        for key, value in (env or {}).items():
            args += ["-e", f"{key}={value}"]
        return [*args, container, "sh", "-c", command]


class FakeDaytonaServer:
    """The account-side state shared by every `FakeAsyncDaytona` client made from it."""

    def __init__(self, runtime: PodmanRuntime | None = None) -> None:
        self.runtime = runtime
        self.sandboxes: dict[str, FakeAsyncSandbox] = {}
        self.network_updates: list[tuple[str, bool | None, str | None]] = []
        self.create_params: list[CreateSandboxFromImageParams | CreateSandboxFromSnapshotParams] = []
        self.create_errors: list[BaseException] = []
        self.start_errors: list[BaseException] = []
        self.start_delay_s = 0.0
        self.starting = asyncio.Event()
        self.deleted: list[str] = []
        self.refreshes: dict[str, int] = {}
        self.clients_closed = 0
        # Snapshots made from sandboxes: name -> (image tag, memory GB, source sandbox id).
        self.snapshots: dict[str, tuple[str, int | None, str]] = {}
        self.snapshots_deleted: list[str] = []

    def client(self) -> FakeAsyncDaytona:
        return FakeAsyncDaytona(self)

    def find(self, id_or_name: str) -> FakeAsyncSandbox:
        for sb in self.sandboxes.values():
            if id_or_name in (sb.id, sb.name):
                return sb
        raise DaytonaNotFoundError(f"Sandbox with ID or name {id_or_name} not found", status_code=404)

    async def shutdown(self) -> None:
        for sb in list(self.sandboxes.values()):
            await sb.delete()


class FakeAsyncDaytona:
    """`AsyncDaytona`'s create / delete / get / list / close against a `FakeDaytonaServer`."""

    def __init__(self, server: FakeDaytonaServer) -> None:
        self.server = server
        self.snapshot = FakeAsyncSnapshotService(server)

    async def create(
        self,
        params: CreateSandboxFromSnapshotParams | CreateSandboxFromImageParams | None = None,
        *,
        timeout: float = 60,
        on_snapshot_create_logs: Callable[[str], None] | None = None,
    ) -> FakeAsyncSandbox:
        server = self.server
        if params is None:
            raise DaytonaError("the fake needs explicit create parameters")
        server.create_params.append(params)
        if server.create_errors:
            raise server.create_errors.pop(0)
        if params.name and any(sb.name == params.name for sb in server.sandboxes.values()):
            raise DaytonaConflictError(f"Sandbox with name {params.name} already exists", status_code=409)
        sandbox = FakeAsyncSandbox(server, params)
        server.sandboxes[sandbox.id] = sandbox
        if isinstance(params, CreateSandboxFromSnapshotParams):
            if params.snapshot not in server.snapshots:
                server.sandboxes.pop(sandbox.id)
                raise DaytonaNotFoundError(f"Snapshot {params.snapshot} not found", status_code=404)
            tag, memory, _ = server.snapshots[params.snapshot]
            if server.runtime is not None:
                sandbox.container = await server.runtime.run(sandbox.id, tag, params, memory)
        elif server.runtime is not None:
            sandbox.container = await server.runtime.start(sandbox.id, params)
            sandbox.memory = params.resources.memory if params.resources is not None else None
        server.starting.set()
        if server.start_delay_s:
            try:
                async with asyncio.timeout(timeout or None):
                    await asyncio.sleep(server.start_delay_s)
            except TimeoutError:
                # Like the SDK: the create gives up, the sandbox stays, the error names it.
                err = DaytonaTimeoutError(f"Function 'create' exceeded timeout of {timeout} seconds.")
                err._attach_sandbox_id(sandbox.id)
                raise err from None
        if server.start_errors:
            sandbox.state = "error"
            raise server.start_errors.pop(0)
        sandbox.state = "started"
        return sandbox

    async def delete(self, sandbox: FakeAsyncSandbox, timeout: float = 60, wait: bool = False) -> None:
        await sandbox.delete(timeout, wait=wait)

    async def get(self, sandbox_id_or_name: str, request_timeout: float | None = None) -> FakeAsyncSandbox:
        return self.server.find(sandbox_id_or_name)

    async def list(
        self, query: ListSandboxesQuery | None = None, request_timeout: float | None = None
    ) -> AsyncIterator[FakeAsyncSandbox]:
        q = query or ListSandboxesQuery()
        for sb in list(self.server.sandboxes.values()):
            if q.labels and any(sb.labels.get(k) != v for k, v in q.labels.items()):
                continue
            if q.created_at_before is not None and not sb.created < q.created_at_before:
                continue
            yield sb

    async def close(self):
        self.server.clients_closed += 1


class FakeAsyncSnapshotService:
    """`AsyncDaytona.snapshot`'s get / delete for snapshots made from sandboxes."""

    def __init__(self, server: FakeDaytonaServer) -> None:
        self.server = server

    async def get(self, name: str) -> Snapshot:
        if name not in self.server.snapshots:
            raise DaytonaNotFoundError(f"Snapshot with name {name} not found", status_code=404)
        tag, memory, source = self.server.snapshots[name]
        now = datetime.now(UTC)
        return Snapshot.model_validate(
            {
                "id": hashlib.sha256(name.encode()).hexdigest()[:32],
                "general": False,
                "name": name,
                "image_name": tag,
                "state": SnapshotState.ACTIVE,
                "size": None,
                "entrypoint": None,
                "cpu": 1,
                "gpu": 0,
                "mem": memory or 1,
                "disk": 3,
                "error_reason": None,
                "created_at": now,
                "updated_at": now,
                "last_used_at": None,
                "source_sandbox_id": source,
            }
        )

    async def list(
        self, page: int | None = None, limit: int | None = None, source_sandbox_id: str | None = None
    ) -> PaginatedSnapshots:
        names = [n for n, (_, _, src) in self.server.snapshots.items() if source_sandbox_id in (None, src)]
        size = limit or 100
        start = ((page or 1) - 1) * size
        items = [await self.get(n) for n in names[start : start + size]]
        pages = max(1, -(-len(names) // size))
        return PaginatedSnapshots(items=items, total=len(names), page=page or 1, total_pages=pages)

    async def delete(self, snapshot: Snapshot | str) -> None:
        name = snapshot if isinstance(snapshot, str) else snapshot.name
        found = self.server.snapshots.pop(name, None)
        if found is None:
            raise DaytonaNotFoundError(f"Snapshot with name {name} not found", status_code=404)
        self.server.snapshots_deleted.append(name)
        if self.server.runtime is not None:
            await run_cli(self.server.runtime.cli, "rmi", "-f", found[0], timeout=120)


class FakeAsyncSandbox:
    """A sandbox as `AsyncSandbox` presents it: attributes, `process`, `fs`, delete, activity."""

    def __init__(
        self,
        server: FakeDaytonaServer,
        params: CreateSandboxFromImageParams | CreateSandboxFromSnapshotParams,
    ) -> None:
        self.server = server
        self.id = uuid.uuid4().hex
        self.name = params.name or self.id
        self.labels = dict(params.labels or {})
        self.env = dict(params.env_vars or {})
        self.user = params.os_user or "daytona"
        self.network_block_all = bool(params.network_block_all)
        self.domain_allow_list = params.domain_allow_list
        self.auto_stop_interval = params.auto_stop_interval
        self.auto_delete_interval = params.auto_delete_interval
        self.created = datetime.now(UTC)
        self.created_at = self.created.isoformat()
        self.state = "creating"
        self.container: str | None = None
        self.memory: int | None = None
        self.process = FakeAsyncProcess(self)
        self.fs = FakeAsyncFileSystem(self)

    async def update_network_settings(
        self,
        *,
        network_block_all: bool | None = None,
        network_allow_list: str | None = None,
        domain_allow_list: str | None = None,
        request_timeout: float | None = None,
    ) -> None:
        """As the SDK's: one of the three must be set (`DaytonaValidationError`); an allow list
        implies not blocking all; the fake enforces the lists by address."""
        if network_block_all is None and network_allow_list is None and domain_allow_list is None:
            raise DaytonaValidationError(
                "At least one of network_block_all, network_allow_list or domain_allow_list must be set"
            )
        self.server.network_updates.append((self.id, network_block_all, domain_allow_list))
        block = bool(network_block_all) and network_allow_list is None and domain_allow_list is None
        runtime, container = self.runtime()
        await runtime.block_network(
            container, firewall(network_block_all, network_allow_list, domain_allow_list)
        )
        self.network_block_all, self.domain_allow_list = block, domain_allow_list

    async def create_snapshot(self, name: str, timeout: float | None = 60) -> None:
        """As the SDK's: the sandbox's filesystem as a new snapshot `name` (a name taken is a
        conflict); the snapshot is `active` when this returns."""
        if name in self.server.snapshots:
            raise DaytonaConflictError(f"Snapshot with name {name} already exists", status_code=409)
        runtime, container = self.runtime()
        self.server.snapshots[name] = (await runtime.commit(container, name), self.memory, self.id)

    def runtime(self) -> tuple[PodmanRuntime, str]:
        if self.id not in self.server.sandboxes:
            raise DaytonaNotFoundError(f"Sandbox {self.id} not found", status_code=404)
        if self.server.runtime is None or self.container is None:
            raise DaytonaError("this fake Daytona server keeps records only: give it a PodmanRuntime")
        return self.server.runtime, self.container

    async def delete(self, timeout: float | None = 60, wait: bool = False) -> None:
        if self.server.sandboxes.pop(self.id, None) is None:
            raise DaytonaNotFoundError(f"Sandbox {self.id} not found", status_code=404)
        await self.process.kill_all()
        if self.container is not None and self.server.runtime is not None:
            await self.server.runtime.remove(self.container)
        self.state = "destroyed"
        self.server.deleted.append(self.id)

    async def refresh_activity(self, request_timeout: float | None = None) -> None:
        if self.id not in self.server.sandboxes:
            raise DaytonaNotFoundError(f"Sandbox {self.id} not found", status_code=404)
        self.server.refreshes[self.id] = self.server.refreshes.get(self.id, 0) + 1


class _SessionCommand:
    def __init__(self, command: str, proc: asyncio.subprocess.Process) -> None:
        self.id = uuid.uuid4().hex
        self.command = command
        self.proc = proc
        self.stdout = ""
        self.stderr = ""
        self.exit_code: int | None = None
        self.reader: asyncio.Task[None] | None = None

    async def collect(self) -> None:
        out, err = await self.proc.communicate()
        self.stdout, self.stderr = out.decode(errors="replace"), err.decode(errors="replace")
        self.exit_code = self.proc.returncode


class _RawReply:
    """What the generated toolbox client's `*_without_preload_content` calls return: an aiohttp
    response, read as a stream (`content.read(n)`), then released or closed."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.content = asyncio.StreamReader()
        self.content.feed_data(body)
        self.content.feed_eof()
        self.released = False

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.released = True


class FakeToolboxProcessApi:
    """The toolbox's generated `ProcessApi` as agentrl calls it for bounded replies (the SDK's
    `process._api_client`), method for method with the installed client's signatures."""

    def __init__(self, process: FakeAsyncProcess) -> None:
        self.process = process

    async def execute_command_without_preload_content(
        self,
        request: ToolboxExecuteRequest,
        _request_timeout: float | tuple[float, float] | None = None,
        _request_auth: dict[str, Any] | None = None,
        _content_type: str | None = None,
        _headers: dict[str, Any] | None = None,
        _host_index: int = 0,
    ) -> _RawReply:
        try:
            resp = await self.process.exec(request.command, cwd=request.cwd, timeout=request.timeout)
        except DaytonaProcessExecutionTimeoutError:
            return _RawReply(408, json.dumps({"error": "command execution timeout"}).encode())
        return _RawReply(200, json.dumps({"exitCode": resp.exit_code, "result": resp.result}).encode())

    async def get_session_command_logs_without_preload_content(
        self,
        session_id: str,
        command_id: str,
        follow: bool | None = None,
        _request_timeout: float | tuple[float, float] | None = None,
        _request_auth: dict[str, Any] | None = None,
        _content_type: str | None = None,
        _headers: dict[str, Any] | None = None,
        _host_index: int = 0,
    ) -> _RawReply:
        try:
            cmd = self.process._command(session_id, command_id)
        except DaytonaNotFoundError as exc:
            return _RawReply(404, json.dumps({"error": str(exc)}).encode())
        body = {"output": cmd.stdout + cmd.stderr, "stdout": cmd.stdout, "stderr": cmd.stderr}
        return _RawReply(200, json.dumps(body).encode())


class FakeAsyncProcess:
    def __init__(self, sandbox: FakeAsyncSandbox) -> None:
        self.sandbox = sandbox
        self.sessions: dict[str, dict[str, _SessionCommand]] = {}
        self._api_client = FakeToolboxProcessApi(self)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: int | None = None,
    ) -> ExecuteResponse:
        runtime, container = self.sandbox.runtime()
        proc = await asyncio.create_subprocess_exec(
            *runtime.exec_args(container, command, cwd, env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout or None)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise DaytonaProcessExecutionTimeoutError("Command execution timeout") from None
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
            raise
        result = out.decode(errors="replace")
        return ExecuteResponse(
            exit_code=proc.returncode or 0, result=result, artifacts=ExecutionArtifacts(stdout=result)
        )

    async def create_session(self, session_id: str, request_timeout: float | None = None) -> None:
        self.sandbox.runtime()
        if session_id in self.sessions:
            raise DaytonaConflictError(f"session {session_id} already exists", status_code=409)
        self.sessions[session_id] = {}

    def _session(self, session_id: str) -> dict[str, _SessionCommand]:
        if session_id not in self.sessions:
            raise DaytonaNotFoundError(f"session {session_id} not found", status_code=404)
        return self.sessions[session_id]

    async def execute_session_command(
        self,
        session_id: str,
        req: SessionExecuteRequest,
        timeout: int | None = None,
    ) -> SessionExecuteResponse:
        runtime, container = self.sandbox.runtime()
        commands = self._session(session_id)
        proc = await asyncio.create_subprocess_exec(
            *runtime.exec_args(container, req.command, None, None),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        cmd = _SessionCommand(req.command, proc)
        commands[cmd.id] = cmd
        cmd.reader = asyncio.get_running_loop().create_task(cmd.collect())
        if not req.run_async:
            await cmd.reader
            return SessionExecuteResponse(
                cmd_id=cmd.id,
                output=cmd.stdout + cmd.stderr,
                stdout=cmd.stdout,
                stderr=cmd.stderr,
                exit_code=cmd.exit_code,
            )
        return SessionExecuteResponse(cmd_id=cmd.id)

    async def get_session_command(
        self, session_id: str, command_id: str, request_timeout: float | None = None
    ) -> Command:
        cmd = self._command(session_id, command_id)
        return Command(id=cmd.id, command=cmd.command, exit_code=cmd.exit_code)

    def _command(self, session_id: str, command_id: str) -> _SessionCommand:
        self.sandbox.runtime()
        commands = self._session(session_id)
        if command_id not in commands:
            raise DaytonaNotFoundError(f"command {command_id} not found", status_code=404)
        return commands[command_id]

    async def get_session_command_logs(
        self, session_id: str, command_id: str, request_timeout: float | None = None
    ) -> SessionCommandLogsResponse:
        cmd = self._command(session_id, command_id)
        return SessionCommandLogsResponse(
            output=cmd.stdout + cmd.stderr, stdout=cmd.stdout, stderr=cmd.stderr
        )

    async def delete_session(self, session_id: str, request_timeout: float | None = None) -> None:
        for cmd in self._session(session_id).values():
            await self._stop(cmd)
        del self.sessions[session_id]

    @staticmethod
    async def _stop(cmd: _SessionCommand) -> None:
        if cmd.proc.returncode is None:
            cmd.proc.kill()
        if cmd.reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await cmd.reader

    async def kill_all(self) -> None:
        for commands in self.sessions.values():
            for cmd in commands.values():
                await self._stop(cmd)
        self.sessions.clear()


class FakeAsyncFileSystem:
    def __init__(self, sandbox: FakeAsyncSandbox) -> None:
        self.sandbox = sandbox
        self.root: Path | None = None

    async def upload_files(self, files: list[FileUpload], timeout: int = 30 * 60) -> None:
        runtime, container = self.sandbox.runtime()
        with tempfile.TemporaryDirectory() as tmp:
            for i, f in enumerate(files):
                source = f.source
                if isinstance(source, bytes | bytearray):
                    path = Path(tmp) / f"upload-{i}"
                    path.write_bytes(source)
                    source = str(path)
                source = str(Path(source).resolve())  # the CLI runs in a private directory
                rc, _, err = await run_cli(
                    runtime.cli, "cp", source, f"{container}:{f.destination}", timeout=120
                )
                if rc != 0:
                    raise DaytonaError(f"400: cannot write {f.destination}: {err.strip()}", status_code=400)

    async def _root(self) -> Path:
        """The container's root as the host sees it (`/proc/PID/root`): what the toolbox daemon,
        a process inside the sandbox, reads with Go's `os.Open` / `os.ReadDir`, with no sandbox
        binary involved (the agent may have replaced them all)."""
        if self.root is None:
            runtime, container = self.sandbox.runtime()
            rc, out, err = await run_cli(
                runtime.cli, "inspect", "-f", "{{.State.Pid}}", container, timeout=60
            )
            if rc != 0 or not out.strip().isdigit() or out.strip() == "0":
                raise DaytonaError(f"sandbox is not running: {err.strip()}")
            self.root = Path(f"/proc/{out.strip()}/root")
        return self.root

    async def download_files(
        self, files: list[FileDownloadRequest], timeout: int = 30 * 60
    ) -> list[FileDownloadResponse]:
        self.sandbox.runtime()
        root = await self._root()
        responses = []
        for f in files:
            # The daemon's `os.Stat` + `os.Open` (fs/download_files.go): symlinks followed (inside the
            # sandbox), directories refused, /proc files read whole.
            path = _resolve_in_root(root, f.source)
            try:
                if path is None or not path.is_file():
                    raise FileNotFoundError(f.source)
                data = path.read_bytes()
            except OSError:
                responses.append(
                    FileDownloadResponse(source=f.source, error=f"file not found or invalid: {f.source}")
                )
                continue
            if f.destination:
                Path(f.destination).write_bytes(data)
                responses.append(FileDownloadResponse(source=f.source, result=f.destination))
            else:
                responses.append(FileDownloadResponse(source=f.source, result=data))
        return responses

    async def get_file_info(self, path: str, request_timeout: float | None = None) -> FileInfo:
        """The daemon's `os.Stat` (links followed inside the sandbox)."""
        self.sandbox.runtime()
        resolved = _resolve_in_root(await self._root(), path)
        try:
            if resolved is None:
                raise FileNotFoundError(path)
            st = resolved.stat()
        except OSError:
            raise DaytonaNotFoundError(
                f"Failed to get file info: {path} not found", status_code=404
            ) from None
        return FileInfo(
            name=resolved.name,
            path=path,
            is_dir=resolved.is_dir(),
            size=st.st_size,
            mode=stat.filemode(st.st_mode),
            permissions=oct(st.st_mode & 0o7777),
            mod_time=datetime.fromtimestamp(st.st_mtime, UTC).isoformat(),
            owner=str(st.st_uid),
            group=str(st.st_gid),
        )

    async def list_files(
        self, path: str, depth: int | None = None, request_timeout: float | None = None
    ) -> list[FileInfo]:
        self.sandbox.runtime()
        resolved = _resolve_in_root(await self._root(), path)
        if resolved is None or not resolved.is_dir():
            raise DaytonaNotFoundError(f"Failed to list files: {path} not found", status_code=404)
        infos = []
        for entry in os.scandir(resolved):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone between the listing and the stat (a /proc entry)
            infos.append(
                FileInfo(
                    name=entry.name,
                    path=f"{path.rstrip('/')}/{entry.name}",
                    is_dir=entry.is_dir(follow_symlinks=False),
                    size=st.st_size,
                    mode=stat.filemode(st.st_mode),
                    permissions=oct(st.st_mode & 0o7777),
                    mod_time=datetime.fromtimestamp(st.st_mtime, UTC).isoformat(),
                    owner=str(st.st_uid),
                    group=str(st.st_gid),
                )
            )
        return infos


def _resolve_in_root(root: Path, path: str, hops: int = 40) -> Path | None:
    """`path` resolved inside `root` as a process chrooted there would see it: absolute symlinks
    restart at `root`, `..` never climbs above it. None for a symlink loop."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved: list[str] = []
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        resolved.append(part)
    return root.joinpath(*resolved)
