"""A history-rewriting (think-stripping) chat template through the whole path: agent loop ->
episode segments -> rollout group -> per-episode advantages -> the trainer's batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import EpisodeConfig, SandboxEpisodeRunner
from agentrl.rollout import RolloutConfig, RolloutManager
from agentrl.testing.sandbox import FakeSandboxProvider
from agentrl.train.batch import build_batch, training_samples
from tests.chat_tokenizer import THINK_STRIPPING_TEMPLATE, byte_tokenizer

TASK = Path(__file__).parent / "fixtures" / "sandbox_tasks" / "write-hello"


def reply(session_id: str | None, turn: int, _ids: list[int]) -> str:
    """Sample 0 of the group solves the task in three reasoning turns (each one rewritten out of the
    history by the template, so its episode splits into three segments); the others give up."""
    sample_index = int(str(session_id).split(":")[-2])
    if sample_index != 0:
        return "TASK_COMPLETE"
    return [
        "<think>look first</think>```bash\nls /app\n```",
        "<think>now write</think>```bash\necho hello > /app/out.txt\n```",
        "<think>done</think>TASK_COMPLETE",
    ][turn]


async def test_a_think_stripped_episode_gets_one_advantage_on_all_its_segments() -> None:
    tok = byte_tokenizer(THINK_STRIPPING_TEMPLATE)
    provider = FakeSandboxProvider()
    provider.grader = lambda sb: 1.0 if any("echo hello >" in c for c in sb.commands) else 0.0
    engine = ScriptedEngine(reply, tok)
    runner = SandboxEpisodeRunner(
        provider=provider,
        engine=engine,
        renderer=ChatRenderer.for_format(tok, "fenced-bash"),
        config=EpisodeConfig(
            action_format="fenced-bash",
            agent=AgentConfig(max_turns=4),
            sampling=SamplingParams(max_new_tokens=128),
        ),
        run_id="think",
    )
    rows = [{"prompt": "p", "metadata": {"task_id": "write-hello", "task_path": str(TASK)}}]
    config = RolloutConfig(batch_size=4, n_samples_per_prompt=4, max_in_flight=4, max_staleness=None)
    async with RolloutManager(runner, engine, rows, config) as mgr:
        (group,) = await mgr.get_batch(timeout=30)
    episodes = sorted((e for e in group.episodes if e is not None), key=lambda e: e.sample_index)
    assert [e.reward for e in episodes] == [1.0, 0.0, 0.0, 0.0]
    assert [len(e.segments) for e in episodes] == [3, 1, 1, 1]

    samples = training_samples([group.episodes])
    by_episode: dict[str | None, list[float]] = {}
    for s in samples:
        by_episode.setdefault(s.episode_id, []).append(float(s.advantage or 0.0))
    assert sorted(by_episode.values(), key=len, reverse=True) == [
        pytest.approx([1.5] * 3, abs=1e-5),
        pytest.approx([-0.5], abs=1e-5),
        pytest.approx([-0.5], abs=1e-5),
        pytest.approx([-0.5], abs=1e-5),
    ]

    batch = build_batch(samples, aggregation="seq_mean_token_mean", max_tokens_per_micro_batch=100_000)
    assert batch.num_loss_seqs == 4  # episodes, not segments
    per_episode_weight: dict[str | None, float] = {}
    for mb in batch.micro_batches:
        for r, i in enumerate(mb.sample_indices):
            s = samples[i]
            trained = mb.loss_mask[r] > 0
            assert mb.advantages[r][trained].tolist() == pytest.approx([s.advantage] * int(trained.sum()))
            per_episode_weight[s.episode_id] = per_episode_weight.get(s.episode_id, 0.0) + float(
                mb.loss_weights[r][trained].sum()
            )
    # Each episode weighs 1/4 of the loss however many segments it has.
    assert list(per_episode_weight.values()) == pytest.approx([0.25] * 4)
    assert provider.live_sandboxes() == 0
