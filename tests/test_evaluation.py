"""Evaluation over a task set: the pass@k estimator, fixed seeds, retried and unscored infra failures."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import Generation, SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import EpisodeConfig, SandboxEpisodeRunner
from agentrl.eval.passk import EvalError, evaluate, pass_at_k
from agentrl.sandbox.base import SandboxCreateError
from agentrl.tasks.dataset import task_row
from agentrl.tasks.task import load_task
from agentrl.testing.sandbox import FakeSandboxProvider
from tests.chat_tokenizer import byte_tokenizer

TASK = Path(__file__).parent / "fixtures" / "sandbox_tasks" / "write-hello"


def test_pass_at_k_matches_the_combinatorial_definition() -> None:
    assert pass_at_k(8, 0, 1) == 0.0
    assert pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # 1 - C(n-c, k) / C(n, k)
    for n, c, k in [(5, 2, 3), (10, 3, 4), (16, 1, 8), (7, 0, 7)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


class SeededEngine(ScriptedEngine):
    """Solves the task iff the request's sampling seed is even; records every seed it saw."""

    def __init__(self) -> None:
        self.seed_of: dict[str | None, int | None] = {}
        self.seeds: list[int | None] = []
        super().__init__(self._reply, byte_tokenizer())

    def _reply(self, session_id: str | None, turn: int, _ids: list[int]) -> str:
        if turn > 0:
            return "TASK_COMPLETE"
        seed = self.seed_of[session_id]
        cmd = "echo hello > /app/hello.txt" if seed is not None and seed % 2 == 0 else "ls /app"
        return f"```bash\n{cmd}\n```"

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        self.seed_of[session_id] = sampling.seed
        self.seeds.append(sampling.seed)
        return await super().generate(input_ids, sampling, session_id=session_id)


class FlakyProvider(FakeSandboxProvider):
    """Fails the first `fail_first` sandbox creations."""

    fail_first = 0

    async def create(self, task: Any, *, run_id: str) -> Any:
        if self.fail_first > 0:
            self.fail_first -= 1
            raise SandboxCreateError("injected: the sandbox service is down")
        return await super().create(task, run_id=run_id)


def provider(fail_first: int = 0) -> FlakyProvider:
    p = FlakyProvider()
    p.fail_first = fail_first
    p.grader = lambda sb: 1.0 if any("hello" in c and ">" in c for c in sb.commands) else 0.0
    return p


CONFIG = EpisodeConfig(
    action_format="fenced-bash",
    agent=AgentConfig(max_turns=2),
    sampling=SamplingParams(max_new_tokens=128, seed=999),
)


def runner_for(prov: FlakyProvider, engine: Any, renderer: Any) -> SandboxEpisodeRunner:
    return SandboxEpisodeRunner(
        provider=prov, engine=engine, renderer=renderer, config=CONFIG, run_id="eval-test"
    )


async def run_eval(prov: FlakyProvider, engine: SeededEngine, **kw: Any) -> Any:
    runner = runner_for(prov, engine, ChatRenderer(engine.tokenizer))
    return await evaluate(runner, [task_row(load_task(TASK))], **kw)


async def test_every_episode_gets_its_fixed_seed_and_pass_at_k_is_estimated_per_task() -> None:
    engine = SeededEngine()
    prov = provider()
    summary = await run_eval(prov, engine, samples_per_row=4, ks=[1, 2, 4], seed_base=100)
    # seeds 100..103, one per episode (two turns each); even seeds solve the task.
    assert sorted(set(engine.seeds)) == [100, 101, 102, 103]
    assert summary.episodes == 4 and summary.unscored == 0
    assert summary.pass_at(1) == pytest.approx(0.5)
    assert summary.pass_at(2) == pytest.approx(1 - 1 / 6)
    assert summary.pass_at(4) == 1.0
    d = summary.to_dict()
    assert d["pass@1"] == pytest.approx(0.5) and d["per_task"] == {"write-hello": 0.5}
    assert d["infra_failures"] == 0
    assert prov.live_sandboxes() == 0


async def test_an_infra_failure_is_retried_with_the_same_seed_and_counted() -> None:
    engine = SeededEngine()
    summary = await run_eval(provider(fail_first=2), engine, samples_per_row=2, concurrency=1, seed_base=0)
    assert summary.episodes == 2 and summary.unscored == 0
    assert summary.infra_failures == {"sandbox_create": 2}
    assert summary.pass_at(1) == pytest.approx(0.5)  # seed 0 passes, seed 1 fails: retries kept the seeds


async def test_an_episode_that_never_runs_is_unscored_not_zero() -> None:
    engine = SeededEngine()
    # concurrency 1: the first episode (seed 0, a pass) burns all 3 attempts and stays unscored.
    summary = await run_eval(provider(fail_first=3), engine, samples_per_row=3, concurrency=1, max_attempts=3)
    assert summary.unscored == 1 and summary.episodes == 2
    assert summary.pass_at(1) == pytest.approx(0.5)  # seeds 1 and 2 only; not 1/3
    assert summary.to_dict()["unscored"] == 1


async def test_an_evaluation_mostly_lost_to_infrastructure_raises() -> None:
    with pytest.raises(EvalError, match=r"unscored.*sandbox_create"):
        await run_eval(provider(fail_first=100), SeededEngine(), samples_per_row=2, max_attempts=2)


async def test_bad_arguments_are_rejected_before_any_episode() -> None:
    engine = SeededEngine()
    with pytest.raises(ValueError, match="every k"):
        await run_eval(provider(), engine, samples_per_row=2, ks=[3])
    with pytest.raises(EvalError, match="empty"):
        await evaluate(runner_for(provider(), engine, None), [], samples_per_row=1)
    assert engine.seeds == []


async def test_an_openai_compatible_api_is_evaluated_through_chat_messages(monkeypatch) -> None:
    """No tokenizer, no token ids: the agent talks messages to the API, seeds travel in the body."""
    from aiohttp import web

    from agentrl.engine.openai import OpenAIChatEngine

    seeds: list[int] = []

    async def chat(request: web.Request) -> web.Response:
        assert request.headers.get("Authorization") == "Bearer sk-eval-key"
        body = await request.json()
        seeds.append(body["seed"])
        first = sum(m["role"] == "assistant" for m in body["messages"]) == 0
        cmd = "echo hello > /app/hello.txt" if body["seed"] % 2 == 0 else "ls /app"
        content = f"```bash\n{cmd}\n```" if first else "TASK_COMPLETE"
        return web.json_response(
            {
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ]
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    monkeypatch.setenv("EVAL_TEST_KEY", "sk-eval-key")
    engine = OpenAIChatEngine(
        base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1", model="m", api_key_env="EVAL_TEST_KEY"
    )
    try:
        summary = await evaluate(
            runner_for(provider(), engine, None),
            [task_row(load_task(TASK))],
            samples_per_row=4,
            ks=[1, 4],
            seed_base=10,
        )
    finally:
        await engine.aclose()
        await runner.cleanup()
    assert sorted(set(seeds)) == [10, 11, 12, 13]
    assert summary.pass_at(1) == pytest.approx(0.5) and summary.pass_at(4) == 1.0
    assert summary.unscored == 0


async def test_an_ambiguous_failure_counts_against_the_run_not_as_unscored() -> None:
    """An untyped exception might have been provoked by the episode itself: after the retries it is
    scored as a failure (reward 0), never left out of the pass rate."""

    class Exploding:
        async def run(self, row: dict, **kw: Any) -> Any:
            raise RuntimeError("something the episode made happen")

    summary = await evaluate(Exploding(), [task_row(load_task(TASK))], samples_per_row=2, max_attempts=2)  # type: ignore[arg-type]
    assert summary.unscored == 0 and summary.episodes == 2 and summary.pass_at(1) == 0.0
    assert summary.infra_failures == {"internal_error": 4}
    assert summary.tasks[0].counted_as_failed == 2


async def test_a_row_that_cannot_be_run_is_unscored_once_never_retried_nor_zero() -> None:
    from agentrl.errors import TaskFormatError

    class Broken:
        calls = 0

        async def run(self, row: dict, **kw: Any) -> Any:
            Broken.calls += 1
            raise TaskFormatError("t/instruction.md", None, "too large")

    summary = await evaluate(
        Broken(), [task_row(load_task(TASK))], samples_per_row=2, max_attempts=3, max_unscored_fraction=1.0
    )  # type: ignore[arg-type]
    assert Broken.calls == 2 and summary.unscored == 2 and summary.episodes == 0
    assert summary.infra_failures == {"bad_input": 2}
