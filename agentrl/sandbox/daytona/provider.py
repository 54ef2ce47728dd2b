"""`DaytonaProvider`: create sandboxes from a task's image with its resources, network and labels,
retrying what Daytona says is transient; delete on close, at exit, and `reap_daytona`."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from daytona import (
    AsyncDaytona,
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    DaytonaError,
    DaytonaNotFoundError,
    ListSandboxesQuery,
    Resources,
)
from daytona.common.errors import DaytonaConnectionError, DaytonaTimeoutError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from agentrl.errors import AgentRLError, InputError
from agentrl.sandbox.base import (
    DEFAULT_OUTPUT_LIMIT,
    Sandbox,
    SandboxCreateError,
    SandboxError,
    SandboxProvider,
    SandboxTransportError,
)
from agentrl.sandbox.credentials import DaytonaCredentials
from agentrl.sandbox.daytona.common import (
    DEFAULT_LAUNCHER,
    LABEL_LAUNCHER,
    LABEL_OWNER,
    LABEL_RUN,
    LABEL_TASK,
    DaytonaClientFactory,
    _sanitize,
    _TransientCreateError,
    classify_create_error,
    image_for,
)
from agentrl.sandbox.daytona.sandbox import DaytonaSandbox, allow_settings
from agentrl.tasks.config import resolve_env_templates

if TYPE_CHECKING:
    from agentrl.tasks.task import Task
log = logging.getLogger(__name__)


class DaytonaProvider(SandboxProvider):
    """Creates `DaytonaSandbox`es. Every option is a keyword with a default, so
    `make_provider("daytona")` works from the environment's credentials alone.

    `client_factory` returns an `AsyncDaytona`-compatible client (tests pass a fake); by default an
    `AsyncDaytona` is built from `credentials` (default: `DaytonaCredentials.from_env()`).

    `trusted_checks` records each sandbox's starting state through the file API
    (`DaytonaSandbox.record_baseline`) so the verifier can check its kill and its tamper scan from
    outside; off (only for toolboxes that cannot answer, such as record-only test doubles), both
    trust the sandbox's own shell and `find`, which an agent can replace.

    `private_verification` runs each verification in a sandbox made from a snapshot of the agent's
    (`DaytonaSandbox.verification_copy`): nothing the agent started lives on into the tests, at the
    price of a snapshot and a create per episode (`snapshot_timeout_s` for each) and of services:
    a server the agent was asked to leave running is not running in the copy (docs/failures.md).
    """

    def __init__(
        self,
        *,
        credentials: DaytonaCredentials | None = None,
        client_factory: DaytonaClientFactory | None = None,
        launcher: str = DEFAULT_LAUNCHER,
        allow_network: bool | None = None,
        max_concurrent_creates: int = 8,
        create_attempts: int = 6,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        create_timeout_s: float | None = None,
        min_cpus: int = 1,
        min_memory_gb: int = 1,
        min_disk_gb: int = 3,
        auto_stop_minutes: int = 15,
        auto_delete_minutes: int = 0,
        ttl_minutes: int = 24 * 60,
        keepalive_s: float = 120.0,
        exec_limit_s: float = 600.0,
        exec_grace_s: float = 15.0,
        session_poll_s: float = 0.2,
        session_poll_max_s: float = 2.0,
        transfer_timeout_s: int = 600,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        os_user: str | None = "root",
        target: str | None = None,
        trusted_checks: bool = True,
        private_verification: bool = False,
        snapshot_timeout_s: float = 600.0,
    ) -> None:
        if client_factory is None:
            creds = credentials or DaytonaCredentials.from_env()
            client_factory = _sdk_client_factory(creds)
        if max_concurrent_creates < 1 or create_attempts < 1:
            raise AgentRLError("max_concurrent_creates and create_attempts must be at least 1")
        if keepalive_s and auto_stop_minutes and keepalive_s >= auto_stop_minutes * 60:
            raise AgentRLError(
                f"keepalive_s={keepalive_s} must be shorter than auto_stop_minutes={auto_stop_minutes} "
                "or a thinking model's sandbox stops under it"
            )
        self.client_factory = client_factory
        self.launcher = launcher
        self.allow_network = allow_network
        self.create_attempts = create_attempts
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.create_timeout_s = create_timeout_s
        self.min_cpus, self.min_memory_gb, self.min_disk_gb = min_cpus, min_memory_gb, min_disk_gb
        self.auto_stop_minutes = auto_stop_minutes
        self.auto_delete_minutes = auto_delete_minutes
        self.ttl_minutes = ttl_minutes
        self.keepalive_s = keepalive_s
        self.exec_limit_s = exec_limit_s
        self.exec_grace_s = exec_grace_s
        self.session_poll_s = session_poll_s
        self.session_poll_max_s = session_poll_max_s
        self.transfer_timeout_s = transfer_timeout_s
        self.output_limit = output_limit
        # Per task: the verifier's core files as its image ships them (`DaytonaSandbox.record_baseline`).
        self._core_records: dict[str, dict[str, str | None]] = {}
        self.trusted_checks = trusted_checks
        self.private_verification = private_verification
        self.snapshot_timeout_s = snapshot_timeout_s
        self.os_user = os_user
        self.target = target
        self._create_slots = asyncio.Semaphore(max_concurrent_creates)
        self._client: Any = None
        self._client_lock = asyncio.Lock()
        self._live: dict[str, DaytonaSandbox] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self.create_attempts_made = 0

    def __repr__(self) -> str:
        return f"DaytonaProvider(launcher={self.launcher!r}, live={len(self._live)})"

    # -- parameters ------------------------------------------------------------------------------
    def resources_for(self, task: Task) -> Resources:
        env = task.config.environment
        cpu = max(self.min_cpus, math.ceil(env.cpus or 0))
        memory = max(self.min_memory_gb, math.ceil((env.memory_mb or 0) / 1024))
        disk = max(self.min_disk_gb, math.ceil((env.storage_mb or 0) / 1024))
        return Resources(cpu=cpu, memory=memory, disk=disk, gpu=env.gpus or None)

    def network_for(self, task: Task) -> dict[str, Any]:
        """The agent phase's policy as Daytona's network limits (`allow_network` overrides it)."""
        if self.allow_network is not None:
            return {"network_block_all": not self.allow_network}
        first = (task.steps or [task])[0].config  # a multi-step task's first step's
        policy = first.phase_network("agent")
        if policy == "allowlist":
            return allow_settings(first.phase_hosts("agent"))
        return {"network_block_all": policy != "public"}

    def labels_for(self, task: Task, run_id: str) -> dict[str, str]:
        return {
            LABEL_RUN: run_id[:63],
            LABEL_TASK: task.task_id[:63],
            LABEL_LAUNCHER: self.launcher,
            LABEL_OWNER: f"{socket.gethostname()}:{os.getpid()}"[:63],
        }

    def params_for(self, task: Task, run_id: str) -> CreateSandboxFromImageParams:
        """The SDK's create parameters for a task (a fresh unique name on every call)."""
        env = task.config.environment
        name = f"agentrl-{_sanitize(run_id, 16)}-{_sanitize(task.task_id, 24)}-{uuid.uuid4().hex[:10]}"
        return CreateSandboxFromImageParams(
            name=name,
            image=image_for(task),
            resources=self.resources_for(task),
            labels=self.labels_for(task, run_id),
            env_vars=resolve_env_templates(env.env, str(task.path / "task.toml")),
            os_user=self.os_user,
            auto_stop_interval=self.auto_stop_minutes,
            auto_delete_interval=self.auto_delete_minutes,
            ttl_minutes=self.ttl_minutes,
            target=self.target,
            **self.network_for(task),
        )

    def create_timeout_for(self, task: Task) -> float:
        if self.create_timeout_s is not None:
            return self.create_timeout_s
        return task.config.environment.build_timeout_sec + 120.0

    # -- create ----------------------------------------------------------------------------------
    async def client(self) -> Any:
        async with self._client_lock:
            if self._client is None:
                self._client = self.client_factory()
            return self._client

    def _wait(self, retry_state: Any) -> float:
        jitter = wait_random_exponential(multiplier=self.backoff_initial_s, max=self.backoff_max_s)(
            retry_state
        )
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        after = getattr(exc, "retry_after_s", None)
        return max(jitter, min(after, self.backoff_max_s)) if after else jitter

    async def create(self, task: Task, *, run_id: str) -> Sandbox:
        if task.compose is not None:
            raise InputError(
                f"{task.task_id} is a multi-container task (environment/docker-compose.yaml): a Daytona "
                "sandbox is one container and the SDK starts no compose services; run it on podman"
            )
        timeout = self.create_timeout_for(task)
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.create_attempts),
            wait=self._wait,
            retry=retry_if_exception_type(_TransientCreateError),
            reraise=True,
            before_sleep=lambda state: log.info(
                "retrying a Daytona create (attempt %d): %s",
                state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            ),
        )
        attempt = 0
        try:
            async for attempt_state in retrying:
                with attempt_state:
                    attempt += 1
                    params = self.params_for(task, run_id)  # a fresh unique name each time
                    async with self._create_slots:
                        sdk_sandbox = await self._create_once(params, task.task_id, timeout)
        except _TransientCreateError as exc:
            raise SandboxCreateError(f"{exc} (gave up after {attempt} attempts)") from exc
        sandbox = self._adopt(sdk_sandbox, params, task.task_id, task.config.environment.workdir)
        log.debug("daytona sandbox %s started for %s (attempt %d)", sandbox.sandbox_id, task.task_id, attempt)
        try:
            if self.trusted_checks:
                self._core_records[task.task_id] = await sandbox.record_baseline(
                    self._core_records.get(task.task_id)
                )
        except BaseException as exc:
            await sandbox.close()
            if isinstance(exc, SandboxError):
                raise SandboxCreateError(
                    f"daytona sandbox for {task.task_id}: recording its starting state failed: {exc}"
                ) from exc
            raise
        sandbox.start_keepalive(self.keepalive_s)
        return sandbox

    def _adopt(self, sdk_sandbox: Any, params: Any, task_id: str, workdir: str | None) -> DaytonaSandbox:
        sandbox = DaytonaSandbox(self, sdk_sandbox, task_id, workdir)
        sandbox.params = params
        sandbox.network = {
            k: getattr(params, k)
            for k in ("network_block_all", "network_allow_list", "domain_allow_list")
            if getattr(params, k) is not None
        }
        self._live[sandbox.sandbox_id] = sandbox
        _LIVE[sandbox.sandbox_id] = self.client_factory
        return sandbox

    async def copy_of(self, sandbox: DaytonaSandbox) -> DaytonaSandbox:
        """A started sandbox made from a snapshot of `sandbox` as it is now (`private_verification`):
        its files, its user, environment, labels and current network, none of its processes. A
        failed snapshot or create is infrastructure (`SandboxError`); the snapshot is deleted with
        the copy (`_delete`) or at once when no copy came of it."""
        params = sandbox.params
        if params is None or not params.name:
            raise SandboxError(f"daytona sandbox {sandbox.sandbox_id} was not created by this provider")
        snapshot = f"{params.name}-final"
        client = await self.client()
        limit = self.snapshot_timeout_s
        try:
            await asyncio.wait_for(sandbox.sdk.create_snapshot(snapshot, timeout=limit), limit + 30)
            await self._snapshot_ready(client, snapshot, limit)
        except BaseException as exc:
            await asyncio.shield(self._delete_snapshot(snapshot))
            if isinstance(exc, DaytonaError | TimeoutError):
                raise SandboxTransportError(
                    f"daytona sandbox {sandbox.sandbox_id}: the snapshot for a private verification failed: {exc}"
                ) from exc
            raise
        copy_params = CreateSandboxFromSnapshotParams(
            snapshot=snapshot,
            name=f"{params.name}-v",
            labels=params.labels,
            env_vars=params.env_vars,
            os_user=params.os_user,
            auto_stop_interval=params.auto_stop_interval,
            auto_delete_interval=params.auto_delete_interval,
            ttl_minutes=params.ttl_minutes,
            target=params.target,
            **sandbox.network,
        )
        try:
            async with self._create_slots:
                sdk_copy = await self._create_once(copy_params, sandbox.task_id, limit)
        except BaseException:
            await asyncio.shield(self._delete_snapshot(snapshot))
            raise
        copy = self._adopt(sdk_copy, copy_params, sandbox.task_id, sandbox.workdir)
        copy.snapshot = snapshot
        copy.start_keepalive(self.keepalive_s)
        return copy

    async def _snapshot_ready(self, client: Any, name: str, limit: float) -> None:
        """Wait until the snapshot is `active`: the sandbox leaves `snapshotting` when the runner's
        job is done, and the snapshot's record may come a moment later."""
        deadline = time.monotonic() + limit
        while True:
            try:
                snap = await asyncio.wait_for(client.snapshot.get(name), 60)
            except DaytonaNotFoundError:
                state, reason = "missing", None
            else:
                state, reason = str(getattr(snap.state, "value", snap.state)), snap.error_reason
            if state == "active":
                return
            if state in ("error", "build_failed"):
                raise DaytonaError(f"snapshot {name} is {state}: {reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"snapshot {name} still {state} after {limit:.0f}s")
            await asyncio.sleep(1.0)

    async def _delete_snapshot(self, name: str) -> None:
        client = await self.client()
        try:
            await asyncio.wait_for(client.snapshot.delete(name), 90)
        except DaytonaNotFoundError:
            return
        except (DaytonaError, TimeoutError) as exc:
            log.warning("deleting Daytona snapshot %s failed (%s): delete it in the dashboard", name, exc)

    async def _create_once(self, params: Any, task_id: str, timeout: float) -> Any:
        client = await self.client()
        self.create_attempts_made += 1
        try:
            return await asyncio.wait_for(client.create(params, timeout=timeout), timeout + 30)
        except BaseException as exc:
            # The request may have created the sandbox before failing or being cancelled (the
            # server does not know the client gave up): find it by its unique name and delete it.
            await asyncio.shield(self._delete_orphan(params.name or "", exc))
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
            if isinstance(exc, AgentRLError):
                raise
            raise classify_create_error(exc, task_id) from exc

    async def _delete_orphan(self, name: str, exc: BaseException) -> None:
        status = getattr(exc, "status_code", None)
        if isinstance(exc, DaytonaError) and status is not None and 400 <= status < 500:
            return  # the API refused the request: nothing was created
        sandbox_id = getattr(exc, "sandbox_id", None) or name
        ambiguous = isinstance(
            exc, asyncio.CancelledError | TimeoutError | DaytonaConnectionError | DaytonaTimeoutError
        )
        client = await self.client()
        for i in range(3 if ambiguous else 1):
            try:
                found = await asyncio.wait_for(client.get(sandbox_id, request_timeout=20), 30)
            except DaytonaNotFoundError:
                if i < 2 and ambiguous:
                    await asyncio.sleep(0.5 * (i + 1))
                continue
            except (DaytonaError, TimeoutError) as lookup:
                log.warning("could not look up half-created Daytona sandbox %s: %s", sandbox_id, lookup)
                return
            await self._delete_sdk(found)
            return

    async def _delete_sdk(self, sdk_sandbox: Any) -> bool:
        try:
            await asyncio.wait_for(sdk_sandbox.delete(timeout=60), 90)
        except DaytonaNotFoundError:
            return True
        except (DaytonaError, TimeoutError) as exc:
            log.warning(
                "deleting Daytona sandbox %s failed (%s); auto-delete and `agentrl sandbox reap "
                "--backend daytona` remove it later",
                sdk_sandbox.id,
                exc,
            )
            return False
        return True

    async def _delete(self, sandbox: DaytonaSandbox) -> None:
        try:
            if await self._delete_sdk(sandbox.sdk):
                _LIVE.pop(sandbox.sandbox_id, None)
                log.debug("daytona sandbox %s deleted", sandbox.sandbox_id)
        finally:
            self._live.pop(sandbox.sandbox_id, None)
            if sandbox.snapshot is not None:
                await self._delete_snapshot(sandbox.snapshot)

    def _spawn(self, coro: Any, timeout: float) -> None:
        async def bounded() -> None:
            try:
                await asyncio.wait_for(coro, timeout)
            except (DaytonaError, TimeoutError) as exc:
                log.debug("daytona background call failed: %s", exc)

        t = asyncio.get_running_loop().create_task(bounded())
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    def live_sandboxes(self) -> int:
        return len(self._live)

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for sandbox in list(self._live.values()):
            await sandbox.close()
        if self._client is not None:
            client, self._client = self._client, None
            await asyncio.wait_for(client.close(), 30)


def _sdk_client_factory(credentials: DaytonaCredentials) -> DaytonaClientFactory:
    def factory() -> AsyncDaytona:
        return AsyncDaytona(credentials.sdk_config())

    return factory


# Sandboxes this process created and has not deleted, with a way to reach their API; deleted at
# interpreter exit (Daytona bills while they run; auto-delete and the TTL are the slower backstop).
_LIVE: dict[str, DaytonaClientFactory] = {}


async def _delete_ids(items: list[tuple[str, DaytonaClientFactory]]) -> None:
    by_factory: dict[int, tuple[DaytonaClientFactory, list[str]]] = {}
    for sandbox_id, factory in items:
        by_factory.setdefault(id(factory), (factory, []))[1].append(sandbox_id)
    for factory, ids in by_factory.values():
        client = factory()
        try:
            for sandbox_id in ids:
                try:
                    sdk_sandbox = await asyncio.wait_for(client.get(sandbox_id, request_timeout=20), 30)
                    await asyncio.wait_for(sdk_sandbox.delete(timeout=30), 45)
                except DaytonaNotFoundError:
                    pass
                except (DaytonaError, TimeoutError) as exc:
                    log.warning("could not delete Daytona sandbox %s at exit: %s", sandbox_id, exc)
                    continue
                _LIVE.pop(sandbox_id, None)
        finally:
            await asyncio.wait_for(client.close(), 30)


def _delete_live_at_exit() -> None:
    if not _LIVE:
        return
    # A fresh loop on a thread: the program's own loop is closed (or still running) by now.
    worker = threading.Thread(target=lambda: asyncio.run(_delete_ids(list(_LIVE.items()))), daemon=True)
    worker.start()
    worker.join(timeout=120)


atexit.register(_delete_live_at_exit)


async def reap_daytona(
    *,
    run_id: str | None = None,
    older_than_s: float | None = None,
    launcher: str = DEFAULT_LAUNCHER,
    client: Any = None,
) -> int:
    """Delete agentrl's Daytona sandboxes by label: of one run, older than a cutoff, or all of this
    launcher's, each with the snapshots made from it (a private verification cut short). Returns
    how many sandboxes were deleted. `client` defaults to one built from the environment."""
    labels = {LABEL_LAUNCHER: launcher}
    if run_id is not None:
        labels[LABEL_RUN] = run_id
    query = ListSandboxesQuery(labels=labels)
    if older_than_s is not None:
        query.created_at_before = datetime.now(UTC) - timedelta(seconds=older_than_s)
    own = client is None
    if own:
        client = _sdk_client_factory(DaytonaCredentials.from_env())()
    removed = 0
    try:
        doomed = [sb async for sb in client.list(query, request_timeout=60)]
        for sdk_sandbox in doomed:
            await _delete_snapshots_of(client, sdk_sandbox.id)
            try:
                await asyncio.wait_for(sdk_sandbox.delete(timeout=60), 90)
            except DaytonaNotFoundError:
                continue
            except (DaytonaError, TimeoutError) as exc:
                log.warning("reap: could not delete Daytona sandbox %s: %s", sdk_sandbox.id, exc)
                continue
            removed += 1
    finally:
        if own:
            await asyncio.wait_for(client.close(), 30)
    return removed


async def _delete_snapshots_of(client: Any, sandbox_id: str) -> None:
    """The snapshots made from `sandbox_id` (`copy_of`'s), deleted; failures are logged."""
    try:
        found = await asyncio.wait_for(client.snapshot.list(limit=100, source_sandbox_id=sandbox_id), 60)
        for snap in found.items:
            with contextlib.suppress(DaytonaNotFoundError):
                await asyncio.wait_for(client.snapshot.delete(snap), 90)
    except (DaytonaError, TimeoutError) as exc:
        log.warning("reap: could not delete the snapshots of Daytona sandbox %s: %s", sandbox_id, exc)
