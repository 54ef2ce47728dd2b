"""Multi-container tasks: `environment/docker-compose.yaml` as agentrl reads it
(`agentrl.tasks.compose`), and on real podman (a pod per sandbox; `agentrl.sandbox.podman.compose`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from agentrl.agent.actions import get_format
from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import EpisodeConfig, run_episode
from agentrl.errors import InputError, TaskFormatError
from agentrl.sandbox.podman import PodmanProvider
from agentrl.tasks.compose import MAIN, load_compose
from agentrl.tasks.task import load_task
from tests.chat_tokenizer import byte_tokenizer
from tests.host_listener import host_listener

TASK = Path(__file__).resolve().parents[1] / "envs" / "tbench2" / "tasks" / "kv-service-count"
FMT = get_format("terminus-json")


def _env(tmp_path: Path, compose: str) -> Path:
    env = tmp_path / "environment"
    (env / "svc").mkdir(parents=True)
    (env / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    (env / "svc" / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    (env / "docker-compose.yaml").write_text(compose)
    return env


def _load(env: Path, **values: str):  # type: ignore[no-untyped-def]
    return load_compose(env, env=values, main_image=None, main_has_dockerfile=True)


def test_the_bundled_task_has_main_then_its_service() -> None:
    spec = load_task(TASK).compose
    assert spec is not None and list(spec.services) == ["main", "db"]
    main, db = spec.services["main"], spec.services["db"]
    assert main.build_context == TASK / "environment"  # Harbor's base: main is built from environment/
    assert main.depends_on == {"db": "service_healthy"}
    assert db.build_context == TASK / "environment" / "service" and db.healthcheck is not None
    assert db.healthcheck.command[0] == "python3" and db.healthcheck.interval_s == 1.0
    assert load_task(TASK).validate() == []


def test_services_start_after_what_they_depend_on_and_cycles_are_refused(tmp_path: Path) -> None:
    spec = _load(
        _env(
            tmp_path,
            "services:\n  web:\n    image: x\n    depends_on: [db, cache]\n  cache:\n    image: x\n"
            "  db:\n    image: x\n    depends_on: {cache: {condition: service_started}}\n",
        )
    )
    assert list(spec.services) == [MAIN, "cache", "db", "web"]
    cyclic = _env(
        tmp_path / "c",
        "services:\n  a:\n    image: x\n    depends_on: [b]\n  b:\n    image: x\n    depends_on: [a]\n",
    )
    with pytest.raises(TaskFormatError, match="cycle"):
        _load(cyclic)


def test_interpolation_takes_the_tasks_values_never_the_hosts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    env = _env(
        tmp_path,
        "services:\n  db:\n    image: 'x:${TAG:-1}'\n    environment:\n      A: $$literal\n      B: ${MINE}\n",
    )
    spec = _load(env, MINE="ok")
    assert spec.services["db"].image == "x:1" and spec.services["db"].environment == {
        "A": "$literal",
        "B": "ok",
    }
    leak = _env(tmp_path / "l", "services:\n  db:\n    image: x\n    environment: [T=${SECRET_TOKEN}]\n")
    with pytest.raises(TaskFormatError, match="SECRET_TOKEN"):
        _load(leak)


@pytest.mark.parametrize(
    ("service", "match"),
    [
        ("image: x\n    privileged: true", "more than a container"),
        ("image: x\n    cap_add: [NET_ADMIN]", "more than a container"),
        ("image: x\n    network_mode: host", "more than a container"),
        ("image: x\n    volumes: ['/etc:/host-etc']", "outside environment/"),
        ("image: x\n    volumes: ['../..:/up']", "outside environment/"),
        ("image: x\n    volumes: ['data:/data']", "not declared"),
        ("build: ./nowhere", "no Dockerfile"),
        ("command: run", "needs an `image` or a `build`"),
        ("image: x\n    depends_on: [ghost]", "not a service"),
        ("image: x\n    healthcheck: {test: 3}", "use a string"),
        ("image: x\n    sysctls: {a: 1}", "not supported"),
    ],
)
def test_what_a_compose_file_may_not_do(tmp_path: Path, service: str, match: str) -> None:
    with pytest.raises(TaskFormatError, match=match):
        _load(_env(tmp_path, f"services:\n  db:\n    {service}\n"))


def test_service_limits_in_either_form(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        "services:\n  main: {}\n  a:\n    image: x\n    mem_limit: 1.5g\n    cpus: 2\n    pids_limit: 50\n"
        "  b:\n    image: x\n    deploy:\n      resources:\n        limits:\n          memory: 100M\n",
    )
    spec = _load(env)
    a, b = spec.services["a"], spec.services["b"]
    assert (a.memory_mb, a.cpus, a.pids) == (1536, 2.0, 50)
    assert (b.memory_mb, b.cpus, b.pids) == (100, None, None)
    with pytest.raises(TaskFormatError, match="not a size"):
        _load(_env(tmp_path / "bad", "services:\n  main: {}\n  a:\n    image: x\n    mem_limit: lots\n"))


def test_named_volumes_bind_mounts_env_files_and_healthcheck_forms(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        "services:\n  db:\n    build: {context: svc}\n    env_file: vars.env\n"
        "    volumes: ['data:/data', './svc:/seed:ro']\n"
        "    healthcheck: {test: [CMD-SHELL, 'pg_isready -q'], interval: 1m30s, start_period: 500ms}\n"
        "volumes:\n  data: {}\n",
    )
    (env / "vars.env").write_text("# a comment\nUSER_NAME=app\n")
    db = _load(env).services["db"]
    assert db.environment == {"USER_NAME": "app"}
    assert db.volumes == (("data", "/data", False), (str(env / "svc"), "/seed", True))
    assert db.healthcheck is not None and db.healthcheck.command == ["sh", "-c", "pg_isready -q"]
    assert db.healthcheck.interval_s == 90.0 and db.healthcheck.start_period_s == 0.5


def _script(*cmds: str) -> list[str]:
    return [
        FMT.render([c + "\n" for c in cmds], task_complete=False, analysis="a", plan="p"),
        FMT.render([], task_complete=True, analysis="done", plan="finish"),
    ]


def _run_id(name: str) -> str:
    """A run id of this test's own: the other worker's compose tests run at the same time."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _leftovers(run_id: str) -> list[str]:
    """The networks and containers of run `run_id` still on the host."""
    prefix = f"agentrl-{run_id}"
    nets = subprocess.run(
        ["podman", "network", "ls", "--format", "{{.Name}}"], capture_output=True, text=True
    )
    ctrs = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
    return [n for n in (nets.stdout + ctrs.stdout).split() if n.startswith(prefix)]


def _inspect(container: str, fmt: str) -> list[str]:
    return subprocess.run(
        ["podman", "inspect", "--format", fmt, container], capture_output=True, text=True
    ).stdout.split()


def _volumes(prefix: str) -> list[str]:
    out = subprocess.run(["podman", "volume", "ls", "-q"], capture_output=True, text=True)
    return [v for v in out.stdout.split() if v.startswith(prefix)]


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
async def test_the_agent_reaches_its_service_by_name_and_nothing_else(tmp_path: Path) -> None:
    """Each service in a network namespace of its own, as Docker compose runs them: `db` answers
    by name, not on main's localhost; the task has no network, so the network's gateway (the
    host) and the host's bridge never hear from main."""
    solve = (TASK / "solution" / "solve.sh").read_text().split("\n", 1)[1]
    listening = contextlib.ExitStack()
    port, seen = listening.enter_context(host_listener())
    probe = " ; ".join(
        f"(timeout 3 bash -c 'echo x > /dev/tcp/{where}' && echo open || echo closed)"
        for where in ("db/7000", "127.0.0.1/7000", "$gw/" + str(port), f"10.88.0.1/{port}")
    )
    tok = byte_tokenizer()
    provider = PodmanProvider()
    script = _script(
        "bash /dev/stdin <<'EOS'\n" + solve + "EOS",
        'gw=$(getent hosts db | awk \'{split($1, a, "."); print a[1]"."a[2]"."a[3]".1"}\'); ' + probe,
    )
    try:
        result = await run_episode(
            load_task(TASK),
            provider=provider,
            engine=ScriptedEngine(script, tok),
            renderer=ChatRenderer(tok),
            config=EpisodeConfig(
                agent=AgentConfig(
                    max_turns=3, max_new_tokens=4096, max_total_tokens=32768, terminal="commands"
                ),
                sampling=SamplingParams(max_new_tokens=4096),
            ),
            run_id=(run_id := _run_id("compose")),
        )
    finally:
        await provider.aclose()
        listening.close()
    assert result.verify.reward == 1.0, result.verify.log_tail  # the tests asked the service too
    assert result.run.turns[0].outputs[1].stdout.split() == ["open", "closed", "closed", "closed"]
    assert seen == []
    assert provider.live_sandboxes() == 0 and _leftovers(run_id) == []


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
async def test_collect_hooks_and_artifacts_of_another_service(tmp_path: Path) -> None:
    """Harbor's sidecar pass: a hook runs in `db` (not in main), and `db`'s file lands in the
    artifacts beside main's, each entry naming its service; a service's file too large is marked
    failed, never copied."""
    task_dir = tmp_path / "kv"
    shutil.copytree(TASK, task_dir)
    toml = (task_dir / "task.toml").read_text()
    (task_dir / "task.toml").write_text(
        'artifacts = [{source = "/srv/state.txt", service = "db"}, {source = "/srv/big", service = "db"},'
        ' "/app/note.txt"]\n'
        + toml
        + '\n[[verifier.collect]]\ncommand = "hostname > /srv/state.txt; test -e /app || echo no-app >> /srv/state.txt;'
        ' truncate -s 300G /srv/big"\nservice = "db"\n'
    )
    solve = (TASK / "solution" / "solve.sh").read_text().split("\n", 1)[1]
    tok = byte_tokenizer()
    provider = PodmanProvider()
    out = tmp_path / "trial" / "artifacts"
    try:
        result = await run_episode(
            load_task(task_dir),
            provider=provider,
            engine=ScriptedEngine(
                _script("bash /dev/stdin <<'EOS'\n" + solve + "EOS", "echo mine > /app/note.txt"), tok
            ),
            renderer=ChatRenderer(tok),
            config=EpisodeConfig(
                agent=AgentConfig(
                    max_turns=3, max_new_tokens=4096, max_total_tokens=32768, terminal="commands"
                ),
                sampling=SamplingParams(max_new_tokens=4096),
            ),
            run_id=(run_id := _run_id("artifacts")),
            artifacts_dir=out,
        )
    finally:
        await provider.aclose()
    assert result.verify.reward == 1.0, result.verify.log_tail
    assert "no-app" in (out / "srv" / "state.txt").read_text()  # the hook ran in db, which has no /app
    assert (out / "app" / "note.txt").read_text() == "mine\n"
    manifest = {e["source"]: e for e in json.loads((out / "manifest.json").read_text())}
    assert manifest["/srv/state.txt"]["service"] == "db" and manifest["/srv/state.txt"]["status"] == "ok"
    assert manifest["/srv/big"]["status"] == "failed" and not (out / "srv" / "big").exists()
    assert manifest["/app/note.txt"]["service"] is None
    assert provider.live_sandboxes() == 0 and _leftovers(run_id) == []


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
async def test_reap_removes_a_compose_sandboxs_services_network_and_volumes(tmp_path: Path) -> None:
    """What a crashed run leaves (nothing closed): `reap` by run id removes it all."""
    from agentrl.sandbox.podman import reap

    task_dir = tmp_path / "kv"
    shutil.copytree(TASK, task_dir)
    yaml = (task_dir / "environment" / "docker-compose.yaml").read_text()
    (task_dir / "environment" / "docker-compose.yaml").write_text(
        yaml.replace(
            "    build: ./service\n",
            "    build: ./service\n    volumes:\n      - data:/data\n    mem_limit: 256m\n"
            "    deploy:\n      resources:\n        limits:\n          cpus: '0.5'\n          pids: 64\n",
        )
        + "volumes:\n  data: {}\n"
    )
    provider = PodmanProvider()
    run_id = _run_id("reap")
    sandbox = await provider.create(load_task(task_dir), run_id=run_id)
    assert len(_leftovers(run_id)) == 3  # main, db, the network
    # the service's own limits hold on its container
    limits = _inspect(
        f"{sandbox.sandbox_id}-db",
        "{{.HostConfig.Memory}} {{.HostConfig.NanoCpus}} {{.HostConfig.PidsLimit}}",
    )
    assert limits == [str(256 * 2**20), str(5 * 10**8), "64"]
    # the task has no network, and that holds for the service too: it reaches main, not the host
    with host_listener() as (port, seen):
        db = sandbox.service("db")
        probe = "(timeout 3 bash -c 'echo x > /dev/tcp/{}' && echo open || echo closed)"
        gateway = sandbox.compose.gateway  # type: ignore[attr-defined]
        for where, want in ((f"{gateway}/{port}", "closed"), (f"10.88.0.1/{port}", "closed")):
            assert (await db.exec(probe.format(where), timeout=30)).stdout.strip() == want
        await sandbox.exec("python3 -m http.server 8000 >/dev/null 2>&1 &", timeout=10)
        await asyncio.sleep(1)
        assert (await db.exec(probe.format("main/8000"), timeout=30)).stdout.strip() == "open"
    assert seen == []
    assert _volumes(sandbox.sandbox_id) == [f"{sandbox.sandbox_id}-data"]
    removed = await reap(run_id=run_id)
    assert sorted(removed) == sorted([sandbox.sandbox_id, f"{sandbox.sandbox_id}-db"])
    assert _leftovers(run_id) == []
    assert _volumes(sandbox.sandbox_id) == []
    await provider.aclose()


async def test_daytona_refuses_a_compose_task_plainly() -> None:
    from agentrl.sandbox.daytona import DaytonaProvider
    from tests.fake_daytona import FakeDaytonaServer

    provider = DaytonaProvider(client_factory=FakeDaytonaServer().client, keepalive_s=0)
    with pytest.raises(InputError, match="multi-container task"):
        await provider.create(load_task(TASK), run_id="x")


def test_lint_checks_every_image_a_task_builds(tmp_path: Path) -> None:
    from agentrl.sandbox.lint import lint_task

    d = tmp_path / "t"
    shutil.copytree(TASK, d)
    (d / "environment" / "service" / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nCOPY missing.txt /srv/\n"
    )
    compose = (d / "environment" / "docker-compose.yaml").read_text()
    (d / "environment" / "docker-compose.yaml").write_text(
        compose + "  cache:\n    image: nowhere.example/cache:9\n"
    )
    result = lint_task(load_task(d))
    assert result.errors == ["Dockerfile (service db): COPY source 'missing.txt' is not in environment/"]
    assert any(
        w.startswith("unservable base (service cache): FROM nowhere.example/cache:9") for w in result.warnings
    )


@pytest.mark.container
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
async def test_a_network_half_made_is_removed() -> None:
    """A volume podman refuses, after the network exists: the network goes too."""
    from agentrl.sandbox.base import SandboxCreateError
    from agentrl.sandbox.podman import compose as podman_compose
    from agentrl.tasks.compose import ComposeSpec, Service

    spec = ComposeSpec({MAIN: Service(MAIN, image="x")}, volumes=("not/a volume",))
    with pytest.raises(SandboxCreateError, match="volume"):
        await podman_compose.create_network(
            PodmanProvider(), spec, f"agentrl-{(run_id := _run_id('half'))}", []
        )
    assert _leftovers(run_id) == []


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
async def test_a_services_files_count_against_the_tasks_storage_and_its_cpus_are_the_tasks(
    tmp_path: Path,
) -> None:
    """Limits hold for every container of the task: a service that names no cpus gets the task's,
    and what a service writes counts against the task's storage limit with main's (a service the
    agent drives to fill the disk stops the episode as main filling it would: storage_exceeded,
    a policy outcome), where the storage driver cannot cap the service's layer itself."""
    from agentrl.sandbox.base import SandboxPolicyError

    task_dir = tmp_path / "kv"
    shutil.copytree(TASK, task_dir)
    toml = (task_dir / "task.toml").read_text()
    assert "storage_mb = 4096" in toml and "cpus = 1\n" in toml
    (task_dir / "task.toml").write_text(toml.replace("storage_mb = 4096", "storage_mb = 64"))
    provider = PodmanProvider(storage_check_s=0.5)
    sandbox = await provider.create(load_task(task_dir), run_id=(run_id := _run_id("storage")))
    try:
        assert sandbox.compose is not None
        db = sandbox.compose.containers["db"]
        nano = (await asyncio.to_thread(subprocess.run, ["podman", "inspect", "--format", "{{.HostConfig.NanoCpus}}", db],
                                        capture_output=True, text=True, check=True)).stdout.strip()  # fmt: skip
        assert nano == str(10**9)  # the task's one CPU
        fill = await asyncio.to_thread(subprocess.run, ["podman", "exec", db, "dd", "if=/dev/zero", "of=/srv/fill",
                                       "bs=1M", "count=100"], capture_output=True, text=True)  # fmt: skip
        if provider._storage_opt:  # the driver caps the service's layer: the write itself fails
            assert fill.returncode != 0
        else:
            with pytest.raises(SandboxPolicyError) as stopped:
                for _ in range(60):
                    await sandbox.exec("true", timeout=10)
                    await asyncio.sleep(0.5)
            assert stopped.value.cause == "storage_exceeded"
    finally:
        await sandbox.close()
        await provider.aclose()
    assert _leftovers(run_id) == []
