"""The rollout manager over the real episode runner (agent loop, verifier, Sample building) on
FakeSandboxProvider, with injected sandbox, engine and verifier faults."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import DiskWeights, Engine, EngineError, Generation, SamplingParams
from agentrl.episode.run import EpisodeConfig, SandboxEpisodeRunner
from agentrl.episode.sample import Status
from agentrl.errors import InfraError
from agentrl.rollout import MetricsTracker, RolloutConfig, RolloutManager
from agentrl.testing.engine import FakeEngine
from agentrl.testing.engine import Faults as EngineFaults
from agentrl.testing.sandbox import FakeSandboxProvider, Faults
from tests.chat_tokenizer import byte_tokenizer

TASK = Path(__file__).parent / "fixtures" / "sandbox_tasks" / "write-hello"


class FlakyAgentEngine(Engine):
    """Plays an agent that solves the task in 70% of sessions; bursts of 503s; pause / resume
    with weight versions (in_place: in-flight generations finish first)."""

    def __init__(self, tok, *, burst_rate: float, burst_len: int, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
        self.tok = tok
        self.rng = random.Random(seed)
        self.burst_rate, self.burst_len = burst_rate, burst_len
        self.burst_left = 0
        self.weight_version = 0
        self.rejected = 0
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._plan: dict[str, list[str]] = {}

    async def generate(
        self, input_ids, sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:  # type: ignore[no-untyped-def]
        # Re-checked after waking: a pause may have closed the gate again between the wake-up and
        # this turn to run, and it must not see this generation as idle.
        while not self._open.is_set():
            await asyncio.wait_for(self._open.wait(), 30)
        if self.burst_left or self.rng.random() < self.burst_rate:
            self.burst_left = self.burst_left - 1 if self.burst_left else self.burst_len
            self.rejected += 1
            raise EngineError("503 Service Unavailable", cause="engine_unavailable")
        key = session_id or ""
        if key not in self._plan:
            cmd = "echo hello > /app/out.txt" if self.rng.random() < 0.7 else "echo bye > /app/out.txt"
            self._plan[key] = [f"```bash\n{cmd}\n```", "TASK_COMPLETE"]
        reply = self._plan[key].pop(0) if len(self._plan[key]) > 1 else self._plan[key][0]
        self._in_flight += 1
        self._idle.clear()
        try:
            await asyncio.sleep(0.002)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
        ids = self.tok.encode(reply, add_special_tokens=False) + [self.tok.eos_token_id]
        return Generation(ids, [-0.1] * len(ids), "stop", self.weight_version)

    async def pause(self, mode: str = "abort") -> None:
        self._open.clear()
        await self._idle.wait()

    async def resume(self) -> None:
        self._open.set()

    async def flush_cache(self) -> None:
        assert self._idle.is_set(), "flush while generating"


async def test_fault_injection_through_the_real_episode_runner() -> None:
    tok = byte_tokenizer()
    faults = Faults(create_failure=0.10, transport_error=0.02)
    provider = FakeSandboxProvider(faults=faults, seed=1)
    verifier_runs = [0]

    def grade(sb) -> float | None:  # type: ignore[no-untyped-def]
        # Every 25th verifier run writes no reward: the agent's work could have caused it, so it is
        # a policy failure with reward 0 and its cause (docs/failures.md), not a re-rolled infra error.
        verifier_runs[0] += 1
        if verifier_runs[0] % 25 == 1:
            return None
        return 1.0 if any("echo hello >" in c for c in sb.commands) else 0.0

    provider.grader = grade
    engine = FlakyAgentEngine(tok, burst_rate=0.01, burst_len=5, seed=3)
    # One outage for certain at the start: which concurrent episode draws the random ones depends on
    # scheduling, so on some runs none came.
    engine.burst_left = 3
    runner = SandboxEpisodeRunner(
        provider=provider,
        engine=engine,
        renderer=ChatRenderer(tok),
        config=EpisodeConfig(
            action_format="fenced-bash",
            agent=AgentConfig(max_turns=4),
            sampling=SamplingParams(max_new_tokens=128),
        ),
        run_id="rollout-test",
    )
    raised: dict[str, int] = {}
    inner = runner.run

    async def counting(row, **kw):  # type: ignore[no-untyped-def]
        try:
            return await inner(row, **kw)
        except InfraError as exc:
            raised[exc.cause] = raised.get(exc.cause, 0) + 1
            raise

    runner.run = counting  # type: ignore[method-assign]
    rows = [
        {"prompt": f"p{i}", "metadata": {"task_id": f"write-hello-{i}", "task_path": str(TASK)}}
        for i in range(30)
    ]
    config = RolloutConfig(
        batch_size=16,
        n_samples_per_prompt=4,
        max_in_flight=24,
        max_staleness=1,
        max_attempts=8,
        retry_backoff_s=0.001,
        episode_timeout_s=30,
    )
    mgr = RolloutManager(runner, engine, rows, config)
    tracker = MetricsTracker(mgr)
    trained = []
    async with mgr:
        for step in range(6):
            groups = await mgr.get_batch(timeout=60)
            tracker.step(step, groups)
            trained += [(s, engine.weight_version) for g in groups for s in g.episodes]

            async def sync() -> None:
                engine.weight_version += 1

            await mgr.update_weights(sync)
    assert len(trained) == 96
    assert dict(mgr.counters.failures) == raised
    assert set(raised) == {"sandbox_create", "sandbox_transport", "engine_unavailable"}
    # A verifier that wrote no reward after the agent worked is a policy outcome (docs/failures.md).
    assert any(s.failure_cause == "verifier_error" and s.reward == 0.0 for s, _ in trained)
    assert engine.rejected > 0
    assert all(s is not None and s.status is not Status.FAILED_INFRA for s, _ in trained)
    assert {s.reward for s, _ in trained} == {0.0, 1.0}
    assert all(v - min(s.turn_versions + [s.start_version]) <= 1 for s, v in trained)
    assert mgr.counters.samples_exhausted == 0 and mgr.counters.infra_scored == 0
    assert sum(sum(m.failures_by_cause.values()) for m in tracker.history) <= sum(raised.values())
    assert provider.live_sandboxes() == 0


async def test_fake_engine_faults_and_abort_updates_through_the_real_episode_runner() -> None:
    """FakeEngine (random tokens: the agent never acts, so episodes are policy failures with a
    verified reward of 0) with a 503 burst, random 503s, aborted generations and weight updates
    that abort in-flight turns; sandboxes with create failures and transport errors."""
    tok = byte_tokenizer()
    provider = FakeSandboxProvider(faults=Faults(create_failure=0.10, transport_error=0.05), seed=4)
    provider.grader = lambda sb: 0.0
    engine = FakeEngine(
        vocab_size=256,
        eos_id=tok.eos_token_id,
        eos_rate=0.1,
        faults=EngineFaults(error_burst=6, error_rate=0.03, abort_rate=0.05, latency_per_token_s=0.0002),
        seed=5,
    )
    runner = SandboxEpisodeRunner(
        provider=provider,
        engine=engine,
        renderer=ChatRenderer(tok),
        config=EpisodeConfig(
            action_format="fenced-bash",
            agent=AgentConfig(max_turns=3, max_consecutive_malformed=3),
            sampling=SamplingParams(max_new_tokens=32),
        ),
        run_id="rollout-fake-engine",
    )
    rows = [{"prompt": f"p{i}", "metadata": {"task_id": f"t{i}", "task_path": str(TASK)}} for i in range(20)]
    config = RolloutConfig(
        batch_size=8,
        n_samples_per_prompt=4,
        max_in_flight=16,
        max_staleness=1,
        max_attempts=8,
        retry_backoff_s=0.001,
        episode_timeout_s=30,
    )
    mgr = RolloutManager(runner, engine, rows, config)
    trained = []
    async with mgr:
        for _ in range(5):
            groups = await mgr.get_batch(timeout=60)
            trained += [(s, engine.weight_version) for g in groups for s in g.episodes]

            async def sync() -> None:
                await engine.update_weights(DiskWeights("/unused"), weight_version=engine.weight_version + 1)

            await mgr.update_weights(sync, mode="abort")
    assert len(trained) == 40 and engine.weight_version == 5
    failures = dict(mgr.counters.failures)
    assert failures.get("engine_unavailable", 0) == engine.failures >= 6
    assert failures.get("sandbox_create", 0) > 0 and failures.get("sandbox_transport", 0) > 0
    assert engine.aborts > 0
    assert all(s.status is Status.FAILED_POLICY and s.reward == 0.0 for s, _ in trained)
    assert all(v - min(s.turn_versions + [s.start_version]) <= 1 for s, v in trained)
    assert mgr.counters.samples_exhausted == 0 and mgr.counters.infra_scored == 0
    assert provider.live_sandboxes() == 0
