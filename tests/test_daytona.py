"""The Daytona backend without containers: the fake's fidelity to the SDK, the SDK parameter
objects agentrl builds, create under load (throttling, quota, timeouts, cancellation, the
concurrency limit), keepalive, reaping, credentials, and the real SDK against a loopback server."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import web
from daytona import (
    AsyncDaytona,
    AsyncSandbox,
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    DaytonaError,
    DaytonaRateLimitError,
    DaytonaServiceUnavailableError,
    Resources,
)
from daytona._async.filesystem import AsyncFileSystem
from daytona._async.process import AsyncProcess
from daytona._async.snapshot import AsyncSnapshotService
from daytona.common.errors import DaytonaConnectionError
from daytona_api_client_async.models import ListSandboxesResponse, SandboxListItem
from daytona_api_client_async.models import Sandbox as SandboxDto

from agentrl.errors import InputError
from agentrl.sandbox.base import (
    ImageBuildError,
    SandboxCreateError,
    SandboxError,
    SandboxPolicyError,
    SandboxTransportError,
)
from agentrl.sandbox.credentials import (
    DaytonaCredentials,
    DaytonaCredentialsError,
    ray_runtime_env_for_daytona,
)
from agentrl.sandbox.daytona import DaytonaProvider, reap_daytona
from agentrl.sandbox.daytona.common import (
    LABEL_LAUNCHER,
    LABEL_RUN,
    LABEL_TASK,
    PREPARE_LOGS,
    SandboxQuotaError,
    classify_create_error,
)
from agentrl.sandbox.registry import make_provider
from agentrl.sandbox.terminal import INSTALL_TMUX
from agentrl.tasks.task import load_task
from tests.fake_daytona import (
    FakeAsyncDaytona,
    FakeAsyncFileSystem,
    FakeAsyncProcess,
    FakeAsyncSandbox,
    FakeAsyncSnapshotService,
    FakeDaytonaServer,
)

WRITE_HELLO = "tests/fixtures/sandbox_tasks/write-hello"
DUMMY_KEY = "dtn_dummy_0123456789abcdef_never_log_me"


def make_task(
    root: Path, name: str, environment: str, dockerfile: str | None = "FROM debian:bookworm-slim\n"
):
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "task.toml").write_text(f'version = "1.0"\n\n[environment]\n{environment}\n')
    (d / "instruction.md").write_text("do it\n")
    (d / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (d / "tests" / "test.sh").chmod(0o755)
    if dockerfile is not None:
        (d / "environment" / "Dockerfile").write_text(dockerfile)
    return load_task(d)


def provider_on(server: FakeDaytonaServer, **options) -> DaytonaProvider:
    options.setdefault("keepalive_s", 0)
    options.setdefault("backoff_initial_s", 0.001)
    options.setdefault("backoff_max_s", 0.01)
    options.setdefault("trusted_checks", server.runtime is not None)  # a record-only toolbox cannot answer
    return DaytonaProvider(client_factory=server.client, **options)


# -- the fake cannot drift from the SDK -------------------------------------------------------------
SURFACE = [
    (FakeAsyncDaytona, AsyncDaytona, ["create", "delete", "get", "list", "close"]),
    (
        FakeAsyncSandbox,
        AsyncSandbox,
        ["delete", "refresh_activity", "update_network_settings", "create_snapshot"],
    ),
    (FakeAsyncSnapshotService, AsyncSnapshotService, ["get", "list", "delete"]),
    (
        FakeAsyncProcess,
        AsyncProcess,
        [
            "exec",
            "create_session",
            "execute_session_command",
            "get_session_command",
            "get_session_command_logs",
            "delete_session",
        ],
    ),
    (FakeAsyncFileSystem, AsyncFileSystem, ["upload_files", "download_files", "list_files", "get_file_info"]),
]


def _shape(fn) -> list[tuple[str, object, object, str]]:
    # The fake's own classes stand in for the SDK's: `FakeAsyncSandbox` where it says `AsyncSandbox`.
    return [
        (p.name, p.kind, p.default, str(p.annotation).replace("FakeAsync", "Async"))
        for p in inspect.signature(fn).parameters.values()
    ]


@pytest.mark.parametrize(
    ("fake", "real", "method"), [(f, r, m) for f, r, ms in SURFACE for m in ms], ids=lambda x: str(x)
)
def test_fake_methods_have_the_sdk_signatures(fake, real, method) -> None:
    assert _shape(getattr(fake, method)) == _shape(getattr(real, method))
    assert inspect.iscoroutinefunction(getattr(fake, method)) == inspect.iscoroutinefunction(
        getattr(real, method)
    )
    assert inspect.isasyncgenfunction(getattr(fake, method)) == inspect.isasyncgenfunction(
        inspect.unwrap(getattr(real, method))
    )


def test_every_sdk_call_agentrl_makes_is_in_the_checked_surface() -> None:
    source = "".join(p.read_text() for p in sorted(Path("agentrl/sandbox/daytona").glob("*.py")))
    checked = {m for _, _, ms in SURFACE for m in ms}
    called = set(re.findall(r"\.(?:process|fs)\.(\w+)\(", source))
    called |= set(re.findall(r"(?:client|sdk_sandbox|found|\.sdk)\.(\w+)\(", source))
    called |= set(re.findall(r"\.snapshot\.(\w+)\(", source))
    assert len(called) >= 12 and called <= checked, called - checked


# -- SDK parameter objects --------------------------------------------------------------------------
def test_params_from_the_task_dockerfile(tmp_path) -> None:
    provider = provider_on(FakeDaytonaServer())
    task = load_task(WRITE_HELLO)
    params = provider.params_for(task, "run-1")
    assert isinstance(params, CreateSandboxFromImageParams)
    assert params.image.dockerfile() == (
        "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY seed.txt /app/seed.txt\n"
        f"USER root\nRUN {PREPARE_LOGS}\nRUN {INSTALL_TMUX}\n"
    )
    ctx = params.image._context_list
    assert [c.archive_path for c in ctx] == ["seed.txt"] and Path(ctx[0].source_path).is_file()
    # task.toml: cpus 1, memory 256 MB -> the 1 GB floor; no storage -> the 3 GB floor
    assert params.resources == Resources(cpu=1, memory=1, disk=3)
    assert params.labels == {
        LABEL_RUN: "run-1",
        LABEL_TASK: "write-hello",
        LABEL_LAUNCHER: "agentrl",
        "agentrl.owner": params.labels["agentrl.owner"],
    }
    assert params.network_block_all is True and params.domain_allow_list is None
    assert (params.auto_stop_interval, params.auto_delete_interval, params.ttl_minutes) == (15, 0, 1440)
    assert params.os_user == "root"
    assert params.name.startswith("agentrl-run-1-write-hello-")
    assert params.name != provider.params_for(task, "run-1").name


def test_resources_round_up_and_network_follows_the_task(tmp_path) -> None:
    provider = provider_on(FakeDaytonaServer(), auto_stop_minutes=30, ttl_minutes=90)
    big = make_task(
        tmp_path, "big", 'cpus = 2.5\nmemory_mb = 3000\nstorage_mb = 10241\nnetwork_mode = "public"'
    )
    params = provider.params_for(big, "r")
    assert params.resources == Resources(cpu=3, memory=3, disk=11)
    assert params.network_block_all is False
    assert (params.auto_stop_interval, params.ttl_minutes) == (30, 90)
    allow = make_task(
        tmp_path,
        "allow",
        'network_mode = "allowlist"\nallowed_hosts = ["PyPI.org.", "*.pythonhosted.org", "10.1.2.3", "10.8.0.0/16"]',
    )
    p = provider.params_for(allow, "r")
    assert (p.network_block_all, p.domain_allow_list, p.network_allow_list) == (
        False,
        "pypi.org,*.pythonhosted.org",
        "10.1.2.3/32,10.8.0.0/16",
    )
    nothing = make_task(tmp_path, "nothing", 'network_mode = "allowlist"')
    assert provider.params_for(nothing, "r").network_block_all is True
    v6 = make_task(tmp_path, "v6", 'network_mode = "allowlist"\nallowed_hosts = ["2001:db8::1"]')
    with pytest.raises(InputError, match="IPv4 ranges only"):
        provider.params_for(v6, "r")
    forced = provider_on(FakeDaytonaServer(), allow_network=False).params_for(big, "r")
    assert forced.network_block_all is True


def test_docker_image_tasks_and_a_non_root_user_are_kept(tmp_path) -> None:
    provider = provider_on(FakeDaytonaServer())
    img = make_task(tmp_path, "img", 'docker_image = "python:3.12-slim"\nworkdir = "/srv"', dockerfile=None)
    assert provider.params_for(img, "r").image.dockerfile() == (
        f"FROM python:3.12-slim\nUSER root\nRUN {PREPARE_LOGS}\nRUN {INSTALL_TMUX}\n"
    )
    user = make_task(tmp_path, "user", "", dockerfile="FROM debian:bookworm-slim\nUSER app")
    assert provider.params_for(user, "r").image.dockerfile() == (
        f"FROM debian:bookworm-slim\nUSER app\nUSER root\nRUN {PREPARE_LOGS}\nRUN {INSTALL_TMUX}\nUSER app\n"
    )
    none = make_task(tmp_path, "none", "", dockerfile=None)
    with pytest.raises(SandboxCreateError, match="no environment/Dockerfile and no docker_image"):
        provider.params_for(none, "r")


def test_registry_builds_the_provider_from_keywords(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DAYTONA_API_KEY", DUMMY_KEY)
    provider = make_provider("daytona", max_concurrent_creates=3, launcher="team-a")
    assert isinstance(provider, DaytonaProvider) and provider.launcher == "team-a"
    assert DUMMY_KEY not in repr(provider)
    monkeypatch.delenv("DAYTONA_API_KEY")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DAYTONA_API_KEY_FILE", raising=False)
    with pytest.raises(DaytonaCredentialsError, match="no Daytona API key"):
        make_provider("daytona")


# -- create under load ------------------------------------------------------------------------------
async def test_throttling_then_success_retries_with_fresh_names() -> None:
    server = FakeDaytonaServer()
    server.create_errors = [
        DaytonaRateLimitError("Failed to create sandbox: Too Many Requests", status_code=429),
        DaytonaServiceUnavailableError("Failed to create sandbox: unavailable", status_code=503),
    ]
    provider = provider_on(server)
    sb = await provider.create(load_task(WRITE_HELLO), run_id="r")
    assert provider.create_attempts_made == 3
    names = [p.name for p in server.create_params]
    assert len(set(names)) == 3
    assert list(server.sandboxes) == [sb.sandbox_id]
    await sb.close()
    assert server.deleted == [sb.sandbox_id] and provider.live_sandboxes() == 0
    await provider.aclose()


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (403, "Failed to create sandbox: Total CPU limit exceeded. Maximum allowed: 10"),
        (402, "Failed to create sandbox: Payment required"),
        (400, "Failed to create sandbox: Memory request 64GiB exceeds the maximum per-sandbox limit"),
    ],
)
async def test_quota_errors_are_typed_carry_the_message_and_are_not_retried(status, message) -> None:
    server = FakeDaytonaServer()
    cause = DaytonaError(message, status_code=status)
    server.create_errors = [cause]
    provider = provider_on(server)
    with pytest.raises(SandboxQuotaError) as info:
        await provider.create(load_task(WRITE_HELLO), run_id="r")
    assert message in str(info.value) and info.value.__cause__ is cause
    assert info.value.cause == "sandbox_quota" and isinstance(info.value, SandboxCreateError)
    assert provider.create_attempts_made == 1 and server.sandboxes == {}


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (DaytonaRateLimitError("Too Many Requests", status_code=429), "retry"),
        (
            DaytonaError("Sandbox resource limit reached (16), please try again later.", status_code=400),
            "retry",
        ),
        (DaytonaServiceUnavailableError("unavailable", status_code=503), "retry"),
        (DaytonaConnectionError("connection reset"), "retry"),
        (ConnectionResetError("reset by peer"), "retry"),
        (DaytonaError("Total memory limit exceeded. Maximum allowed: 20GiB", status_code=403), "quota"),
        (DaytonaError("Organization is suspended: Depleted credits", status_code=403), "quota"),
        (DaytonaError("Payment required", status_code=402), "quota"),
        (DaytonaError("Invalid API key", status_code=401), "fatal"),
        (DaytonaError("Sandbox failed to start: build failed", status_code=None), "build"),
        (DaytonaError("Invalid image name", status_code=400), "fatal"),
    ],
)
def test_create_errors_are_classified(exc, kind) -> None:
    err = classify_create_error(exc, "t")
    got = (
        "quota"
        if isinstance(err, SandboxQuotaError)
        else "build"
        if isinstance(err, ImageBuildError)
        else "retry"
        if type(err).__name__ == "_TransientCreateError"
        else "fatal"
    )
    assert got == kind and str(getattr(exc, "message", exc)) in str(err)


def test_backoff_is_jittered_exponential_capped_and_honours_retry_after() -> None:
    from tenacity import AsyncRetrying, RetryCallState

    provider = provider_on(FakeDaytonaServer(), backoff_initial_s=1.0, backoff_max_s=8.0)

    def waits(attempt: int, exc: BaseException, n: int = 200) -> list[float]:
        state = RetryCallState(AsyncRetrying(), None, (), {})
        state.attempt_number = attempt
        state.set_exception((type(exc), exc, None))
        return [provider._wait(state) for _ in range(n)]

    plain = classify_create_error(DaytonaRateLimitError("slow", status_code=429), "t")
    first, fourth, tenth = waits(1, plain), waits(4, plain), waits(10, plain)
    assert len(set(first)) > 150  # jittered, not a fixed schedule
    assert max(first) <= 2.0 and max(fourth) <= 8.0 and max(tenth) <= 8.0
    assert sum(fourth) / len(fourth) > 2 * sum(first) / len(first)  # grows with the attempt number
    told = classify_create_error(
        DaytonaRateLimitError("slow", status_code=429, headers={"Retry-After": "5"}), "t"
    )
    assert min(waits(1, told)) >= 5.0 and max(waits(1, told)) <= 8.0


async def test_retries_give_up_after_the_configured_attempts() -> None:
    server = FakeDaytonaServer()
    server.create_errors = [DaytonaRateLimitError("slow down", status_code=429) for _ in range(10)]
    provider = provider_on(server, create_attempts=4)
    with pytest.raises(SandboxCreateError, match="gave up after 4 attempts") as info:
        await provider.create(load_task(WRITE_HELLO), run_id="r")
    assert not isinstance(info.value, SandboxQuotaError)
    assert provider.create_attempts_made == 4 and len(server.create_errors) == 6


async def test_auth_and_build_failures_are_not_retried_and_the_failed_sandbox_is_deleted() -> None:
    server = FakeDaytonaServer()
    server.create_errors = [DaytonaError("Unauthorized", status_code=401)]
    provider = provider_on(server)
    with pytest.raises(SandboxCreateError, match="DAYTONA_API_KEY"):
        await provider.create(load_task(WRITE_HELLO), run_id="r")
    server.start_errors = [DaytonaError("Sandbox failed to start: build failed: apt-get exited 100")]
    with pytest.raises(ImageBuildError, match="apt-get exited 100"):
        await provider.create(load_task(WRITE_HELLO), run_id="r")
    assert provider.create_attempts_made == 2
    assert server.sandboxes == {} and len(server.deleted) == 1  # it existed, then failed to start


async def test_cancellation_mid_create_deletes_the_sandbox() -> None:
    server = FakeDaytonaServer()
    server.start_delay_s = 60
    provider = provider_on(server)
    t = asyncio.create_task(provider.create(load_task(WRITE_HELLO), run_id="r"))
    await asyncio.wait_for(server.starting.wait(), 10)
    assert len(server.sandboxes) == 1
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert server.sandboxes == {} and len(server.deleted) == 1
    assert provider.live_sandboxes() == 0


async def test_a_create_that_times_out_is_deleted_and_retried() -> None:
    server = FakeDaytonaServer()
    server.start_delay_s = 5
    provider = provider_on(server, create_timeout_s=0.2, create_attempts=2)
    provider_wait = asyncio.get_running_loop().time()
    with pytest.raises(SandboxCreateError, match="gave up after 2 attempts"):
        await provider.create(load_task(WRITE_HELLO), run_id="r")
    assert asyncio.get_running_loop().time() - provider_wait < 4
    assert server.sandboxes == {} and len(server.deleted) == 2


async def test_the_create_concurrency_limit_holds() -> None:
    server = FakeDaytonaServer()
    server.start_delay_s = 0.1
    provider = provider_on(server, max_concurrent_creates=2)
    active = peak = 0
    original = server.client

    class Counting(FakeAsyncDaytona):
        async def create(self, params=None, *, timeout=60, on_snapshot_create_logs=None):
            nonlocal active, peak
            active += 1
            peak = max(peak, active)
            try:
                return await super().create(params, timeout=timeout)
            finally:
                active -= 1

    provider.client_factory = lambda: Counting(original().server)
    sandboxes = await asyncio.gather(*(provider.create(load_task(WRITE_HELLO), run_id="r") for _ in range(6)))
    assert peak == 2 and len(server.sandboxes) == 6
    for sb in sandboxes:
        await sb.close()
    await provider.aclose()
    assert server.sandboxes == {}


# -- lifetime ---------------------------------------------------------------------------------------
async def test_keepalive_refreshes_activity_while_idle_and_stops_on_close() -> None:
    server = FakeDaytonaServer()
    provider = provider_on(server, keepalive_s=0.1)
    sb = await provider.create(load_task(WRITE_HELLO), run_id="r")
    await asyncio.sleep(0.55)
    refreshed = server.refreshes.get(sb.sandbox_id, 0)
    assert refreshed >= 3
    await sb.close()
    await asyncio.sleep(0.3)
    assert server.refreshes.get(sb.sandbox_id, 0) == refreshed
    assert sb._keepalive is not None and sb._keepalive.done()
    with pytest.raises(SandboxError, match="closed"):
        await sb.exec("true")
    await provider.aclose()
    assert server.clients_closed == 1


def test_keepalive_must_beat_auto_stop() -> None:
    from agentrl.errors import AgentRLError

    with pytest.raises(AgentRLError, match="keepalive_s"):
        provider_on(FakeDaytonaServer(), keepalive_s=900, auto_stop_minutes=15)


async def test_a_failed_delete_is_logged_and_left_for_the_exit_handler(caplog) -> None:
    from agentrl.sandbox.daytona import provider as mod

    server = FakeDaytonaServer()
    provider = provider_on(server)
    sb = await provider.create(load_task(WRITE_HELLO), run_id="r")
    sdk = server.sandboxes[sb.sandbox_id]

    async def broken(timeout=60, wait=False):
        raise DaytonaServiceUnavailableError("unavailable", status_code=503)

    sdk.delete = broken
    with caplog.at_level(logging.WARNING):
        await sb.close()
    assert "remove it later" in caplog.text and provider.live_sandboxes() == 0
    assert sb.sandbox_id in mod._LIVE
    del sdk.delete
    await mod._delete_ids([(sb.sandbox_id, mod._LIVE[sb.sandbox_id])])
    assert sb.sandbox_id not in mod._LIVE and server.sandboxes == {}


async def test_reap_deletes_by_run_and_age_and_spares_other_launchers() -> None:
    server = FakeDaytonaServer()
    ours = provider_on(server)
    theirs = provider_on(server, launcher="someone-else")
    task = load_task(WRITE_HELLO)
    a1, a2, b1 = [await ours.create(task, run_id=r) for r in ("a", "a", "b")]
    other = await theirs.create(task, run_id="a")
    server.sandboxes[b1.sandbox_id].created = datetime.now(UTC) - timedelta(hours=3)
    # A private verification cut short leaves the snapshot it made of a1; theirs is not ours to take.
    server.snapshots |= {"a1-final": ("t", None, a1.sandbox_id), "x": ("t", None, other.sandbox_id)}
    assert await reap_daytona(run_id="a", client=server.client()) == 2
    assert set(server.sandboxes) == {b1.sandbox_id, other.sandbox_id}
    assert list(server.snapshots) == ["x"] and server.snapshots_deleted == ["a1-final"]
    assert await reap_daytona(older_than_s=7200, client=server.client()) == 1
    assert set(server.sandboxes) == {other.sandbox_id}
    for sb in (a1, a2, b1, other):
        await sb.close()  # already gone: closing is quiet
    assert server.sandboxes == {}


# -- credentials ------------------------------------------------------------------------------------
def test_credentials_from_env_then_key_file_then_default(tmp_path, monkeypatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(DUMMY_KEY + "\n")
    key_file.chmod(0o600)
    c = DaytonaCredentials.from_env({"DAYTONA_API_KEY": DUMMY_KEY, "DAYTONA_TARGET": "eu"})
    assert (c.api_key, c.target, c.key_file) == (DUMMY_KEY, "eu", None)
    c = DaytonaCredentials.from_env({"DAYTONA_API_KEY_FILE": str(key_file), "DAYTONA_API_URL": "http://x"})
    assert (c.api_key, c.api_url, c.key_file) == (DUMMY_KEY, "http://x", key_file)
    monkeypatch.setenv("HOME", str(tmp_path))
    default = tmp_path / ".config" / "daytona" / "api_key"
    default.parent.mkdir(parents=True)
    default.write_text(DUMMY_KEY)
    default.chmod(0o600)
    assert DaytonaCredentials.from_env({}).key_file == default
    with pytest.raises(DaytonaCredentialsError, match="cannot read"):
        DaytonaCredentials.from_env({"DAYTONA_API_KEY_FILE": str(tmp_path / "missing")})
    config = c.sdk_config()
    assert (config.api_key, config.api_url) == (DUMMY_KEY, "http://x")


def test_credentials_never_show_the_key_and_ray_gets_only_the_path(tmp_path, caplog) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(DUMMY_KEY)
    key_file.chmod(0o644)
    with caplog.at_level(logging.DEBUG):
        creds = DaytonaCredentials.from_env({"DAYTONA_API_KEY_FILE": str(key_file), "DAYTONA_TARGET": "us"})
    assert "readable by others" in caplog.text
    assert DUMMY_KEY not in repr(creds) and DUMMY_KEY not in str(creds) and DUMMY_KEY not in f"{creds}"
    env = ray_runtime_env_for_daytona(creds)
    assert env == {"env_vars": {"DAYTONA_API_KEY_FILE": str(key_file.resolve()), "DAYTONA_TARGET": "us"}}
    assert DUMMY_KEY not in json.dumps(env)
    with pytest.raises(DaytonaCredentialsError, match="must not receive it by value") as info:
        ray_runtime_env_for_daytona(environ={"DAYTONA_API_KEY": DUMMY_KEY})
    assert DUMMY_KEY not in str(info.value)
    assert DUMMY_KEY not in caplog.text
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o644  # reported, never changed behind the user's back


# -- the real SDK against a loopback Daytona API --------------------------------------------------------
class LoopbackDaytona:
    """Just enough of Daytona's REST API for the SDK's create, get, list, activity and delete."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, dict] = {}
        self.requests: list[tuple[str, str, str, str]] = []  # method, path, authorization, body
        self.create_replies: list[tuple[int, dict]] = []
        self.execute_replies: list[tuple[int, bytes]] = []  # raw toolbox replies sent before running
        self.base = ""

    def dto(self, sid: str) -> dict:
        body = self.sandboxes[sid]
        return json.loads(
            SandboxDto(
                id=sid,
                organization_id="org",
                name=body.get("name") or sid,
                user=body.get("user") or "root",
                env=body.get("env") or {},
                labels=body.get("labels") or {},
                public=False,
                network_block_all=bool(body.get("networkBlockAll")),
                kvm=False,
                target="us",
                cpu=body.get("cpu") or 1,
                gpu=0,
                memory=body.get("memory") or 1,
                disk=body.get("disk") or 3,
                state=body.get("_state", "started"),
                created_at=body["_created"],
                toolbox_proxy_url=f"{self.base}/toolbox",
            ).to_json()
        )

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.text()
        self.requests.append((request.method, request.path, request.headers.get("Authorization", ""), body))
        parts = request.path.strip("/").split("/")
        if request.method == "POST" and request.path.endswith("/process/execute"):
            # The toolbox's exec, run by the host's `sh` (the test only sends harmless commands).
            if self.execute_replies:
                status, raw = self.execute_replies.pop(0)
                return web.Response(status=status, body=raw, content_type="application/json")
            req = json.loads(body)
            proc = await asyncio.create_subprocess_exec(
                "sh", "-c", req["command"], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            out, _ = await asyncio.wait_for(proc.communicate(), req.get("timeout") or 10)
            return web.json_response({"exitCode": proc.returncode, "result": out.decode()})
        if request.method == "POST" and request.path == "/sandbox":
            if self.create_replies:
                status, payload = self.create_replies.pop(0)
                return web.json_response(payload, status=status)
            sid = f"sb-{len(self.sandboxes) + 1}"
            self.sandboxes[sid] = {**json.loads(body), "_created": datetime.now(UTC).isoformat()}
            return web.json_response(self.dto(sid))
        if request.method == "GET" and request.path == "/sandbox":
            wanted = json.loads(request.query.get("labels", "{}"))
            items = [
                SandboxListItem.from_dict(self.dto(sid))
                for sid, sb in self.sandboxes.items()
                if all((sb.get("labels") or {}).get(k) == v for k, v in wanted.items())
            ]
            return web.json_response(
                json.loads(ListSandboxesResponse(items=items, next_cursor=None).to_json())
            )
        if len(parts) >= 2 and parts[0] == "sandbox":
            sid = next((k for k, v in self.sandboxes.items() if parts[1] in (k, v.get("name"))), None)
            if sid is None:
                return web.json_response({"message": "Sandbox not found", "statusCode": 404}, status=404)
            if request.method == "GET" and len(parts) == 2:
                return web.json_response(self.dto(sid))
            if request.method == "POST" and parts[2:] == ["last-activity"]:
                return web.Response(status=200)
            if request.method == "DELETE" and len(parts) == 2:
                self.sandboxes[sid]["_state"] = "destroying"
                dto = self.dto(sid)
                del self.sandboxes[sid]
                return web.json_response(dto)
        return web.json_response({"message": f"not implemented: {request.path}"}, status=404)


@pytest.fixture
async def loopback(monkeypatch):
    api = LoopbackDaytona()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", api.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    api.base = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("DAYTONA_API_KEY", DUMMY_KEY)
    monkeypatch.setenv("DAYTONA_API_URL", api.base)
    yield api
    await runner.cleanup()


async def test_real_sdk_creates_lists_and_deletes_against_a_loopback_api(loopback, tmp_path, caplog) -> None:
    task = make_task(
        tmp_path, "wire", 'docker_image = "python:3.12-slim"\ncpus = 2\n[environment.env]\nMODE = "x"', None
    )
    caplog.set_level(logging.DEBUG)
    provider = DaytonaProvider(
        keepalive_s=0.05, backoff_initial_s=0.001, backoff_max_s=0.01, trusted_checks=False
    )
    loopback.create_replies = [(429, {"message": "Too many requests", "statusCode": 429})]
    sb = await provider.create(task, run_id="wire-run")
    await asyncio.sleep(0.2)  # the keepalive reaches the API while "the model thinks"
    res = await sb.exec("echo out; echo err >&2; exit 3", timeout=10, env={"A": "b c"})
    assert (res.stdout, res.stderr, res.exit_code, res.timed_out) == ("out\n", "err\n", 3, False)
    (execute,) = [json.loads(b) for m, p, _, b in loopback.requests if p.endswith("/process/execute")]
    assert execute["timeout"] == 25 and execute["command"].startswith("sh -c ")  # 10 s + 15 s grace
    assert f"/toolbox/{sb.sandbox_id}/process/execute" in {p for _, p, _, _ in loopback.requests}
    assert await reap_daytona(run_id="other-run") == 0
    creates = [json.loads(b) for m, p, _, b in loopback.requests if (m, p) == ("POST", "/sandbox")]
    assert len(creates) == 2  # throttled once, then created
    sent = creates[-1]
    assert sent["labels"][LABEL_RUN] == "wire-run" and sent["labels"][LABEL_TASK] == "wire"
    assert (sent["cpu"], sent["memory"], sent["disk"], sent["networkBlockAll"]) == (2, 1, 3, True)
    assert (sent["autoStopInterval"], sent["autoDeleteInterval"], sent["ttlMinutes"]) == (15, 0, 1440)
    assert sent["env"] == {"MODE": "x"}
    assert sent["buildInfo"]["dockerfileContent"].startswith("FROM python:3.12-slim\nUSER root\n")
    assert any(p.endswith("/last-activity") for _, p, _, _ in loopback.requests)
    await sb.close()
    assert loopback.sandboxes == {}
    assert ("DELETE", f"/sandbox/{sb.sandbox_id}") in {(m, p) for m, p, _, _ in loopback.requests}
    # a sandbox left behind by a "dead" process is found by its labels
    orphan = await provider.create(task, run_id="wire-run")
    provider._live.clear()
    assert await reap_daytona(run_id="wire-run") == 1 and loopback.sandboxes == {}
    await orphan.close()
    await provider.aclose()
    # the key went where it belongs, and nowhere else
    # (the SDK's event stream also knocks at /socket.io/, which this server does not speak)
    rest = [r for r in loopback.requests if r[1].startswith("/sandbox")]
    assert rest and all(auth == f"Bearer {DUMMY_KEY}" for _, _, auth, _ in rest)
    assert all(DUMMY_KEY not in body for _, _, _, body in loopback.requests)
    assert caplog.records and DUMMY_KEY not in caplog.text
    assert DUMMY_KEY not in repr(provider) and DUMMY_KEY not in repr(sb)


async def test_real_sdk_quota_reply_becomes_a_quota_error_without_the_key(loopback, tmp_path, caplog) -> None:
    task = make_task(tmp_path, "quota", 'docker_image = "python:3.12-slim"', None)
    caplog.set_level(logging.DEBUG)
    provider = DaytonaProvider(keepalive_s=0, backoff_initial_s=0.001, trusted_checks=False)
    reply = {
        "message": "Total CPU limit exceeded. Maximum allowed: 4",
        "statusCode": 403,
        "error": "Forbidden",
    }
    loopback.create_replies = [(403, reply)]
    with pytest.raises(
        SandboxQuotaError, match=re.escape("Total CPU limit exceeded. Maximum allowed: 4")
    ) as info:
        await provider.create(task, run_id="q")
    assert len([1 for m, p, _, _ in loopback.requests if (m, p) == ("POST", "/sandbox")]) == 1
    assert isinstance(info.value.__cause__, DaytonaError) and info.value.__cause__.status_code == 403
    await provider.aclose()
    assert DUMMY_KEY not in str(info.value) and DUMMY_KEY not in repr(info.value.__cause__)
    assert DUMMY_KEY not in caplog.text


async def test_real_sdk_exec_replies_are_read_bounded(loopback, tmp_path) -> None:
    """The toolbox's replies are streamed with a cap (`reply_limit`): a command that writes into
    its wrapper's reply is a policy outcome, never gigabytes in the trainer's memory; an HTTP error
    is a transport error; a 408 is the toolbox's timeout."""
    task = make_task(tmp_path, "bounded", 'docker_image = "python:3.12-slim"', None)
    provider = DaytonaProvider(
        keepalive_s=0, backoff_initial_s=0.001, output_limit=1024, trusted_checks=False
    )
    sb = await provider.create(task, run_id="bounded")
    try:
        limit = sb.reply_limit()
        assert limit == 12 * 1024 + 64 * 1024
        loopback.execute_replies = [(200, json.dumps({"exitCode": 0, "result": "x" * (limit + 1)}).encode())]
        with pytest.raises(SandboxPolicyError, match="over") as info:
            await sb.exec("true", timeout=5)
        assert info.value.cause == "shell_protocol"
        loopback.execute_replies = [(500, b'{"message": "toolbox down"}')]
        with pytest.raises(SandboxTransportError, match=r"HTTP 500: .*toolbox down"):
            await sb.exec("true", timeout=5)
        loopback.execute_replies = [(408, b'{"message": "timed out"}')]
        with pytest.raises(SandboxTransportError, match="no reply to a command within its timeout"):
            await sb.exec("true", timeout=5)
        res = await sb.exec("echo fine", timeout=5)  # and the sandbox goes on
        assert (res.stdout, res.exit_code) == ("fine\n", 0)
    finally:
        await sb.close()
        await provider.aclose()


def test_fake_toolbox_api_has_the_generated_clients_parameters() -> None:
    from daytona_toolbox_api_client_async import ProcessApi

    from tests.fake_daytona import FakeToolboxProcessApi

    for name in (
        "execute_command_without_preload_content",
        "get_session_command_logs_without_preload_content",
    ):
        real = [
            (p.name, p.kind, p.default)
            for p in inspect.signature(getattr(ProcessApi, name)).parameters.values()
        ]
        fake = [
            (p.name, p.kind, p.default)
            for p in inspect.signature(getattr(FakeToolboxProcessApi, name)).parameters.values()
        ]
        assert fake == real, name


def test_the_terminal_environment_asks_daytona_for_a_private_verification(monkeypatch, tmp_path) -> None:
    """`env.private_verification` reaches the Daytona provider; on any other backend it is an error
    that says so, not a setting silently dropped."""
    from agentrl.rollout.environment import EnvContext, EnvironmentPluginError
    from envs.tbench2.environment import TerminalConfig, TerminalEnvironment

    monkeypatch.setenv("DAYTONA_API_KEY", "dtn_not_a_real_key")  # the client is never used here
    ctx = EnvContext(tokenizer=None, seed=0, out_dir=tmp_path, temperature=1.0)
    env = TerminalEnvironment(TerminalConfig(backend="daytona", private_verification=True), ctx)
    assert env.provider.private_verification is True
    assert TerminalEnvironment(TerminalConfig(backend="daytona"), ctx).provider.private_verification is False
    fake = TerminalEnvironment(TerminalConfig(backend="fake", private_verification=True), ctx)
    with pytest.raises(EnvironmentPluginError, match="a Daytona option"):
        _ = fake.provider


async def test_a_private_verification_that_cannot_start_is_infra_and_leaves_no_snapshot(monkeypatch) -> None:
    """No snapshot (the account's toolbox here keeps records only) or no sandbox from it: a typed
    infrastructure error, and the snapshot made for it is deleted either way."""
    from agentrl.sandbox.base import SandboxTransportError

    server = FakeDaytonaServer()
    provider = provider_on(server, private_verification=True)
    sb = await provider.create(load_task(WRITE_HELLO), run_id="r")
    try:
        with pytest.raises(SandboxTransportError, match="snapshot for a private verification failed"):
            async with sb.verification_copy():
                pass

        async def snapshot(self, name: str, timeout: float | None = 60) -> None:
            server.snapshots[name] = ("tag", None, self.id)

        monkeypatch.setattr(FakeAsyncSandbox, "create_snapshot", snapshot)
        server.create_errors = [DaytonaError("Payment required", status_code=402)]
        with pytest.raises(SandboxQuotaError):
            async with sb.verification_copy():
                pass
        assert server.snapshots == {} and len(server.snapshots_deleted) == 1
        made = server.create_params[-1]
        assert (
            isinstance(made, CreateSandboxFromSnapshotParams) and made.snapshot == server.snapshots_deleted[0]
        )
        assert made.labels == sb.params.labels and made.network_block_all is True  # as the agent's
    finally:
        await sb.close()
        await provider.aclose()
    assert provider.live_sandboxes() == 0
