"""`agentrl env serve tbench2 --backend podman` as a separate process on loopback, driven by the
`openenv` package's own client: a bundled task's reference solution scores 1, doing nothing scores 0,
and a client that disconnects mid-episode leaves no container behind. Then the consume plugin runs
the same task through that server with a scripted model and scores it like the direct path."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("openenv.core.env_server")

import httpx
from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import connect

from agentrl.agent.loop import AgentConfig
from agentrl.agent.solution import scripted_solution_texts
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import EpisodeConfig, run_episode
from agentrl.rollout.environment import EnvContext
from agentrl.sandbox.podman import PodmanProvider
from agentrl.tasks.task import load_task
from envs.openenv import OpenEnvConfig, OpenEnvEnvironment
from tests.chat_tokenizer import byte_tokenizer
from tests.conftest import BUNDLED_TASKS
from tests.test_openenv_server import eventually

pytestmark = [pytest.mark.container, pytest.mark.slow]

TASK = "hello-file"


def containers(run_id: str) -> list[str]:
    out = subprocess.run(
        ["podman", "ps", "-a", "--filter", f"label=agentrl.run-id={run_id}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(url, run id) of a podman-backed server in its own process, stopped (and checked) at the end."""
    tasks = tmp_path_factory.mktemp("tasks")
    shutil.copytree(BUNDLED_TASKS / TASK, tasks / TASK)
    port, run_id = free_port(), f"openenv-test-{uuid.uuid4().hex[:8]}"
    log = (tmp_path_factory.mktemp("log") / "server.log").open("w")
    cmd = [sys.executable, "-m", "agentrl.cli", "env", "serve", "tbench2", "--backend", "podman"]
    cmd += ["--tasks", str(tasks), "--port", str(port), "--max-sessions", "2", "--run-id", run_id]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", trust_env=False, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, Path(log.name).read_text()
            assert time.monotonic() < deadline, "the server did not come up in 90 s"
            time.sleep(0.3)
        yield url, run_id
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()
    assert containers(run_id) == [], "the server left containers behind"


async def test_the_reference_solution_scores_one_and_no_solution_scores_zero(served: tuple[str, str]) -> None:
    url, run_id = served
    solve = (BUNDLED_TASKS / TASK / "solution" / "solve.sh").read_text()
    async with GenericEnvClient(base_url=url, message_timeout_s=600) as env:
        first = await env.reset(task_id=TASK)
        assert "Hello, world!" in first.observation["instruction"], first.observation
        assert len(containers(run_id)) == 1
        ran = await env.step({"action_type": "exec", "command": f"bash <<'SOLVE'\n{solve}\nSOLVE"})
        assert ran.observation["success"], ran.observation
        look = await env.step({"action_type": "exec", "command": "cat /app/hello.txt"})
        assert look.observation["output"] == "Hello, world!\n"
        scored = await env.step({"action_type": "evaluate"})
        assert (scored.reward, scored.done) == (1.0, True), scored.observation
        assert scored.observation["info"]["outcome"] == "pass"

        await env.reset(task_id=TASK)
        scored = await env.step({"action_type": "evaluate"})
        assert (scored.reward, scored.done) == (0.0, True), scored.observation
        assert scored.observation["info"]["outcome"] == "fail"
    await _no_containers(run_id)


async def _no_containers(run_id: str, within_s: float = 30.0) -> None:
    assert await eventually(lambda: containers(run_id) == [], within_s), containers(run_id)


async def test_a_client_that_disconnects_mid_episode_leaves_no_container(served: tuple[str, str]) -> None:
    url, run_id = served
    ws_url = url.replace("http://", "ws://") + "/ws"
    for during_command in (True, False):
        ws = await connect(ws_url, proxy=None, open_timeout=30)
        await ws.send(json.dumps({"type": "reset", "data": {"task_id": TASK}}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 300))["type"] == "observation"
        assert len(containers(run_id)) == 1
        if during_command:
            step = {"action_type": "exec", "command": "sleep 120", "metadata": {"timeout_s": 300}}
            await ws.send(json.dumps({"type": "step", "data": step}))
            await asyncio.sleep(1.0)
        t0 = time.monotonic()
        ws.transport.abort()  # gone without a word, mid-command or between steps
        await _no_containers(run_id)
        assert time.monotonic() - t0 < 30


async def test_the_consume_plugin_scores_the_task_like_the_direct_path(served: tuple[str, str]) -> None:
    url, _ = served
    tok = byte_tokenizer()
    task = load_task(BUNDLED_TASKS / TASK)
    texts = scripted_solution_texts(task, "terminus-json", terminal=False)
    agent = AgentConfig(max_turns=4, max_new_tokens=8192, max_total_tokens=65536, terminal="commands")
    direct = await run_episode(
        task,
        provider=PodmanProvider(),
        engine=ScriptedEngine(texts, tok),
        renderer=ChatRenderer(tok),
        config=EpisodeConfig(
            action_format="terminus-json", agent=agent, sampling=SamplingParams(max_new_tokens=8192)
        ),
        run_id="openenv-direct",
    )
    env = OpenEnvEnvironment(
        OpenEnvConfig(url=url, task_ids=[TASK], agent=agent),
        EnvContext(tokenizer=tok, seed=0, out_dir=Path("."), temperature=1.0),
    )
    runner = env.runner(ScriptedEngine(texts, tok), run_id="openenv-remote")
    remote = await runner.run(env.rows("train")[0], group_id=TASK, sample_index=0)
    assert direct.episode.reward == remote.reward == 1.0
    assert remote.status == direct.episode.status and remote.end_reason == direct.episode.end_reason
    # The same model text, the same observations: the same tokens to train on.
    assert [s.tokens for s in remote.segments] == [s.tokens for s in direct.episode.segments]
    assert [s.loss_mask for s in remote.segments] == [s.loss_mask for s in direct.episode.segments]


async def test_the_daytona_backend_serves_the_same_episodes(tmp_path: Path) -> None:
    """The server is backend-blind: on Daytona (the in-process fake, its sandboxes real podman
    containers) the solution scores 1, nothing scores 0, and a vanished client leaves nothing."""
    pytest.importorskip("daytona")
    from agentrl.openenv.config import ServeConfig
    from agentrl.openenv.server import run_in_thread
    from agentrl.sandbox.daytona import DaytonaProvider
    from tests.fake_daytona import FAKE_LABEL, FakeDaytonaServer, PodmanRuntime

    shutil.copytree(BUNDLED_TASKS / TASK, tmp_path / TASK)
    runtime = PodmanRuntime("podman")
    provider = DaytonaProvider(
        client_factory=FakeDaytonaServer(runtime).client, backoff_initial_s=0.01, keepalive_s=0
    )

    def sandboxes() -> list[str]:
        out = subprocess.run(
            [
                "podman",
                "ps",
                "-a",
                "--filter",
                f"label={FAKE_LABEL}={runtime.server_tag}",
                "--format",
                "{{.Names}}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout.split()

    solve = (BUNDLED_TASKS / TASK / "solution" / "solve.sh").read_text()
    config = ServeConfig(
        env={"name": "tbench2", "backend": "daytona", "tasks": str(tmp_path)}, port=0, max_sessions=2
    )
    with run_in_thread(config, provider=provider) as (url, server):
        async with GenericEnvClient(base_url=url, message_timeout_s=600) as env:
            await env.reset(task_id=TASK)
            await env.step({"action_type": "exec", "command": f"bash <<'SOLVE'\n{solve}\nSOLVE"})
            assert (await env.step({"action_type": "evaluate"})).reward == 1.0
            await env.reset(task_id=TASK)
            assert (await env.step({"action_type": "evaluate"})).reward == 0.0
        ws = await connect(url.replace("http://", "ws://") + "/ws", proxy=None, open_timeout=30)
        await ws.send(json.dumps({"type": "reset", "data": {"task_id": TASK}}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 300))["type"] == "observation"
        await ws.send(json.dumps({"type": "step", "data": {"action_type": "exec", "command": "sleep 120"}}))
        await asyncio.sleep(1.0)
        ws.transport.abort()
        assert await eventually(lambda: server.hub.sandboxes == 0 and sandboxes() == [], 60), sandboxes()
