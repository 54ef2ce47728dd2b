"""The `openenv` environment plugin: episodes on a remote OpenEnv server, as the rollout manager sees
them. Terminal episodes through `agentrl env serve` equal the direct path's token for token; a
dropped connection, a server that is down or full is an infrastructure failure, retried and never
scored; generic text environments (any OpenEnv server whose actions carry text) train the same way."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.env_server")

import uvicorn
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.generic_client import GenericEnvClient
from pydantic import Field

from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import EpisodeConfig, SandboxEpisodeRunner
from agentrl.episode.sample import Episode, Status
from agentrl.errors import InfraError
from agentrl.openenv.client import OpenEnvInfraError
from agentrl.rollout import RolloutConfig, RolloutManager
from agentrl.rollout.environment import EnvContext, EnvironmentPluginError
from agentrl.tasks.dataset import task_row
from agentrl.tasks.task import load_task
from envs.openenv import OpenEnvConfig, OpenEnvEnvironment
from tests.chat_tokenizer import byte_tokenizer
from tests.conftest import BUNDLED_TASKS
from tests.test_openenv_server import HELLO, eventually, fake_provider, fake_server

AGENT = AgentConfig(max_turns=4, max_new_tokens=256, max_total_tokens=8192, terminal="commands")
PLAYS = {
    0: [f"```bash\n{HELLO}\n```", "TASK_COMPLETE"],  # solves it: 1
    1: ["```bash\nls /nowhere\n```", "TASK_COMPLETE"],  # a command the sandbox does not know: 0
    2: ["```bash\nkill -9 $$\n```"],  # breaks its own sandbox: 0, failed-policy
    3: ["no idea", "still none", "nothing"],  # never a usable reply: 0
}


def play(session_id: str | None, turn: int, _: list[int]) -> str:
    """The same play for the same sample index, whichever runner's session this is."""
    plays = PLAYS[int(str(session_id).split(":")[2])]
    return plays[min(turn, len(plays) - 1)]


def context(tok: Any) -> EnvContext:
    return EnvContext(tokenizer=tok, seed=0, out_dir=Path("."), temperature=1.0)


def remote_env(url: str, tok: Any, **settings: Any) -> OpenEnvEnvironment:
    config = OpenEnvConfig(
        url=url, task_ids=["hello-file"], action_format="fenced-bash", agent=AGENT, **settings
    )
    return OpenEnvEnvironment(config, context(tok))


def same_episode(a: Episode, b: Episode) -> None:
    assert (a.reward, a.status, a.failure_cause, a.end_reason) == (
        b.reward,
        b.status,
        b.failure_cause,
        b.end_reason,
    )
    assert [s.tokens for s in a.segments] == [s.tokens for s in b.segments]
    assert [s.loss_mask for s in a.segments] == [s.loss_mask for s in b.segments]
    assert [s.rollout_logprobs for s in a.segments] == [s.rollout_logprobs for s in b.segments]
    assert a.metadata == b.metadata


async def test_remote_terminal_episodes_equal_the_direct_path_token_for_token() -> None:
    tok = byte_tokenizer()
    row = task_row(load_task(BUNDLED_TASKS / "hello-file"))
    direct = SandboxEpisodeRunner(
        provider=fake_provider(),
        engine=ScriptedEngine(play, tok),
        renderer=ChatRenderer.for_format(tok, "fenced-bash"),
        config=EpisodeConfig(
            action_format="fenced-bash", agent=AGENT, sampling=SamplingParams(max_new_tokens=256)
        ),
        run_id="direct",
    )
    with fake_server() as (url, server, provider):
        remote = remote_env(url, tok).runner(ScriptedEngine(play, tok), run_id="remote")
        episodes = []
        for i in PLAYS:
            here = await direct.run(row, group_id="hello-file", sample_index=i)
            there = await remote.run(row, group_id="hello-file", sample_index=i)
            same_episode(here, there)
            episodes.append(there)
        assert [(e.reward, e.status, e.failure_cause) for e in episodes] == [
            (1.0, Status.COMPLETED, None),
            (0.0, Status.COMPLETED, None),
            (0.0, Status.FAILED_POLICY, "shell_killed"),  # scored 0 and trained on, never retried
            (0.0, Status.FAILED_POLICY, None),  # no usable reply
        ]
        assert all(e.segments for e in episodes)
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)


class SlowFirstAttempt(ScriptedEngine):
    """Stalls every sample's first attempt after its first command for longer than the server's
    idle limit: the server closes that session, and the episode's next command finds it gone."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Any:
        if str(session_id).endswith(":0") and self._turns.get(session_id, 0) == 1:
            await asyncio.sleep(1.5)
        return await super().generate(input_ids, sampling, session_id=session_id)


async def test_a_dropped_connection_is_an_infra_failure_retried_in_a_new_session_never_a_zero() -> None:
    tok = byte_tokenizer()
    solve = [f"```bash\n{HELLO}\n```", "```bash\ncat /app/hello.txt\n```", "TASK_COMPLETE"]
    with fake_server(idle_timeout_s=0.5) as (url, server, provider):
        env = remote_env(url, tok)
        engine = SlowFirstAttempt(lambda sid, turn, ids: solve[min(turn, 2)], tok)
        runner = env.runner(engine, run_id="drop")
        with pytest.raises(OpenEnvInfraError) as dropped:
            await runner.run(env.rows("train")[0], group_id="g", sample_index=0, attempt=0)
        assert dropped.value.cause == "openenv_connection" and "4408" in str(dropped.value)

        config = RolloutConfig(
            batch_size=4,
            n_samples_per_prompt=4,
            max_in_flight=4,
            max_staleness=0,
            max_attempts=3,
            retry_backoff_s=0.01,
        )
        async with RolloutManager(runner, engine, env.rows("train"), config) as manager:
            (group,) = await manager.get_batch(timeout=120)
        assert manager.counters.failures["openenv_connection"] == 4  # every first attempt, counted
        assert [e.reward for e in group.episodes] == [1.0] * 4 and group.complete
        assert all(e.attempt == 1 for e in group.episodes)
        assert manager.counters.infra_scored == 0
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)


async def test_a_server_that_is_full_or_down_is_infrastructure() -> None:
    tok = byte_tokenizer()
    engine = ScriptedEngine(["TASK_COMPLETE"] * 8, tok)
    with fake_server(max_sessions=1) as (url, _, _):
        env = remote_env(url, tok, connect_timeout_s=5, capacity_wait_s=1.0)
        runner = env.runner(engine, run_id="full")
        async with GenericEnvClient(base_url=url) as holder:  # another client holds the only session
            await holder.reset(task_id="hello-file")
            with pytest.raises(OpenEnvInfraError) as full:
                await runner.run(env.rows("train")[0], group_id="g", sample_index=0)
            assert full.value.cause == "openenv_capacity" and "at capacity" in str(full.value)
            assert "waited 1s for a session: the server is the bottleneck" in str(full.value)
            assert env.gate.refusals >= 2 and env.gate.limit == 1
    with pytest.raises(OpenEnvInfraError) as down:
        await runner.run(env.rows("train")[0], group_id="g", sample_index=1)
    assert down.value.cause == "openenv_connect"
    assert isinstance(down.value, InfraError)
    with pytest.raises(EnvironmentPluginError, match="cannot reach the OpenEnv server"):
        remote_env(url, tok)


async def test_a_rollout_against_a_one_session_server_waits_for_room_and_scores_every_episode() -> None:
    """Four episodes in flight against a server that takes one session: the client learns the cap
    from CAPACITY_REACHED, holds the others back, and every episode is scored; none is lost or
    counted as an infrastructure attempt; the waits show in the step's metrics."""
    from agentrl.rollout import MetricsTracker

    tok = byte_tokenizer()
    solve = [f"```bash\n{HELLO}\n```", "TASK_COMPLETE"]
    with fake_server(max_sessions=1) as (url, server, provider):
        env = remote_env(url, tok)
        engine = ScriptedEngine(lambda sid, turn, ids: solve[min(turn, 1)], tok)
        runner = env.runner(engine, run_id="cap1")
        config = RolloutConfig(batch_size=4, n_samples_per_prompt=4, max_in_flight=4, max_staleness=0)
        async with RolloutManager(runner, engine, env.rows("train"), config) as manager:
            tracker = MetricsTracker(manager)
            (group,) = await manager.get_batch(timeout=120)
            metrics = tracker.step(1, [group])
        assert group.complete and [e.reward for e in group.episodes] == [1.0] * 4
        assert all(e.attempt == 0 for e in group.episodes)  # no episode spent an attempt on capacity
        assert dict(manager.counters.failures) == {} and manager.counters.infra_scored == 0
        assert env.gate.limit == 1 and env.gate.refusals >= 1
        assert (
            metrics.capacity_wait_s > 0 and sum(e.timings["capacity_wait_s"] > 0 for e in group.episodes) >= 1
        )
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)


# -- a generic OpenEnv environment whose actions are text -------------------------------------


class SayAction(Action):
    message: str = Field(..., max_length=200)


class SayObservation(Observation):
    text: str = ""


class SayIt(Environment[SayAction, SayObservation, State]):
    """Say the word: reward 1 when the reply is the target, the episode ends after it or 3 tries."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    WORDS = ("apple", "pear", "plum")

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SayObservation:
        self.target = self.WORDS[int(kwargs.get("index", 0))]
        self._state = State(episode_id=episode_id)
        return SayObservation(text=f"say {self.target}")

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> SayObservation:
        self._state.step_count += 1
        hit = action.message.strip() == self.target
        done = hit or self._state.step_count >= 3
        return SayObservation(text=f"no: say {self.target}", reward=1.0 if hit else 0.0, done=done)

    @property
    def state(self) -> State:
        return self._state

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return [{"id": w} for w in self.WORDS] if split == "train" else []


@contextlib.contextmanager
def say_it_server() -> Iterator[str]:
    with serve_app(
        upstream_app(SayIt, SayAction, SayObservation, max_concurrent_envs=4, env_name="say_it")
    ) as url:
        yield url


def upstream_app(*args: Any, env_name: str, **kwargs: Any) -> Any:
    """Upstream's app factory, on either package line: openenv 0.10 names the app (`env_name`, for
    its Task API); openenv-core 0.3 (which upstream environment packages install) has no such
    argument (`test_the_consumer_works_on_the_openenv_core_line` runs these tests on it)."""
    if "env_name" in inspect.signature(create_fastapi_app).parameters:
        kwargs["env_name"] = env_name
    return create_fastapi_app(*args, **kwargs)


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """An app built on upstream's server framework, on loopback in a thread of its own."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def text_env(url: str, tok: Any, **settings: Any) -> OpenEnvEnvironment:
    config = OpenEnvConfig(
        url=url, protocol="text", agent=AgentConfig(max_turns=3, max_new_tokens=300), **settings
    )
    return OpenEnvEnvironment(config, context(tok))


async def test_a_text_environment_trains_like_a_local_one() -> None:
    tok = byte_tokenizer()
    replies = {"apple": ["banana", "apple"], "pear": ["x" * 250], "plum": ["no", "no", "no"]}

    def speaker(session_id: str | None, turn: int, ids: list[int]) -> str:
        word = str(session_id).split(":")[1]
        return replies[word][turn]

    with say_it_server() as url:
        env = text_env(url, tok)
        rows = env.rows("train")  # from the server's Task API: reset(split=..., index=...)
        assert [r["metadata"]["task_id"] for r in rows] == ["apple", "pear", "plum"]
        assert rows[1]["metadata"]["reset"] == {"split": "train", "index": 1}
        runner = env.runner(ScriptedEngine(speaker, tok), run_id="say")
        apple, pear, plum = [
            await runner.run(r, group_id=r["metadata"]["task_id"], sample_index=0) for r in rows
        ]

    assert (apple.reward, apple.status, apple.end_reason) == (1.0, Status.COMPLETED, "done")
    assert apple.metadata["step_rewards"] == [0.0, 1.0] and apple.metadata["turns"] == 2
    (seg,) = apple.segments
    text = tok.decode(seg.tokens[seg.prompt_length :])
    assert "say apple" in tok.decode(seg.tokens[: seg.prompt_length])
    assert "banana" in text and "no: say apple" in text  # the observation, between the turns
    observed = [m for m, t in zip(seg.loss_mask, seg.tokens[seg.prompt_length :], strict=True) if m == 0]
    assert observed and len(seg.loss_mask) == len(seg.rollout_logprobs)
    # A reply the server rejects (over its 200-character limit) is the policy's doing.
    assert (pear.reward, pear.status, pear.failure_cause) == (0.0, Status.FAILED_POLICY, "action_rejected")
    assert pear.segments and pear.segments[0].reward == 0.0
    # Three misses: the server ends the episode, every step scored 0.
    assert (plum.reward, plum.end_reason, plum.metadata["step_rewards"]) == (0.0, "done", [0.0, 0.0, 0.0])


def test_a_text_environment_that_does_not_match_the_settings_fails_at_build() -> None:
    tok = byte_tokenizer()
    with say_it_server() as url:
        with pytest.raises(
            EnvironmentPluginError, match=r"no field 'prompt' \(they have message, metadata\)"
        ):
            text_env(url, tok, action_field="prompt")
        with pytest.raises(EnvironmentPluginError, match="observations have no field 'question'"):
            text_env(url, tok, observation_field="question")
        with pytest.raises(EnvironmentPluginError, match="does not speak the tbench2_env schema"):
            OpenEnvEnvironment(OpenEnvConfig(url=url), context(tok))


# -- an upstream-framework server that has no such task ----------------------------------------


class MissingTasks(Environment):
    """reset as upstream's tbench2_env does for a task it does not have (`_resolve_task_path`
    raises FileNotFoundError("Task path not found: ...")), or an infrastructure failure."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Any:
        task_id = kwargs.get("task_id")
        if task_id == "broken-docker":
            raise RuntimeError("docker daemon unavailable")
        raise FileNotFoundError(f"Task path not found: /srv/tb2/tasks/{task_id}")

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        raise AssertionError("never reached")

    @property
    def state(self) -> State:
        return State()


async def test_an_unknown_task_on_an_upstream_server_is_an_input_error_never_retried_as_infra() -> None:
    from agentrl.errors import InputError
    from agentrl.openenv.schema import TerminalAction, TerminalObservation

    tok = byte_tokenizer()
    app = upstream_app(
        MissingTasks, TerminalAction, TerminalObservation, max_concurrent_envs=2, env_name="tb2"
    )
    with serve_app(app) as url:
        config = OpenEnvConfig(
            url=url, task_ids=["no-such-task", "broken-docker"], action_format="fenced-bash", agent=AGENT
        )
        env = OpenEnvEnvironment(config, context(tok))
        runner = env.runner(ScriptedEngine(["TASK_COMPLETE"], tok), run_id="missing")
        rows = env.rows("train")
        with pytest.raises(InputError, match=r"cannot run task 'no-such-task': Task path not found"):
            await runner.run(rows[0], group_id="g", sample_index=0)
        with pytest.raises(OpenEnvInfraError) as infra:  # a failure to start the task stays infrastructure
            await runner.run(rows[1], group_id="g", sample_index=0)
        assert infra.value.code == "EXECUTION_ERROR" and "docker daemon unavailable" in str(infra.value)


@pytest.mark.slow
def test_the_consumer_works_on_the_openenv_core_line(tmp_path: Path) -> None:
    """Every upstream environment package installs openenv-core 0.3 over the shared `openenv`
    module. The `openenv` plugin (the consuming side) keeps working on it: the MCP tests and the
    upstream-server tests of this file run again with openenv-core 0.3.0's module first on the path
    (the wheel from the package registry, as a user's install would get it). Serving on that line is
    refused instead (`tests/test_openenv_server.py`)."""
    import os
    import subprocess
    import sys
    import zipfile

    repo = Path(__file__).resolve().parents[1]
    cache = Path.home() / ".cache" / "agentrl" / "wheels"
    wheels = sorted(cache.glob("openenv_core-0.3.0-*.whl"))
    if not wheels:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "openenv-core==0.3.0", "-d", str(cache)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        wheels = sorted(cache.glob("openenv_core-0.3.0-*.whl"))
        if not wheels:
            pytest.skip(f"openenv-core 0.3.0 could not be downloaded here: {got.stderr[-500:]}")
    with zipfile.ZipFile(wheels[-1]) as whl:
        whl.extractall(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(repo)])}
    line = subprocess.run(
        [sys.executable, "-c", "import inspect, openenv.core.env_server.http_server as h; "
         "print('env_name' in inspect.signature(h.create_fastapi_app).parameters)"],
        env=env, capture_output=True, text=True, timeout=120, cwd=repo,
    )  # fmt: skip
    assert line.stdout.strip() == "False", line.stderr  # the 0.3 line's app factory is the one loaded
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-m", "",
         "tests/test_openenv_mcp.py", "tests/test_openenv_consume.py",
         "-k", "mcp or unknown_task or a_text_environment_that_does_not_match"],
        env=env, capture_output=True, text=True, timeout=600, cwd=repo,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\b([4-9]|\d\d+) passed", run.stdout), run.stdout[-2000:]
