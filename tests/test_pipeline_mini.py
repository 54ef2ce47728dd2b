"""A two-step miniature of the demo pipeline: real podman sandboxes, the local engine, the rollout
manager, the torch trainer and an in-process weight sync. The trainer must consume exactly the
samples the episodes produced (tokens, masks, log-probs, rewards), and after each sync the engine
must score tokens exactly as the trainer does."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.container, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["hello-file", "make-executable"]


@pytest.fixture(scope="module")
def podman_ready() -> None:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: run `make setup` (CI runs it before the tests)")


async def test_two_step_pipeline_trains_on_exactly_the_episode_samples(
    tmp_path: Path, podman_ready: None
) -> None:
    import torch

    from agentrl.agent.loop import AgentConfig
    from agentrl.agent.tokens import ChatRenderer
    from agentrl.engine.base import SamplingParams
    from agentrl.engine.local import LocalEngine
    from agentrl.episode.run import EpisodeConfig, SandboxEpisodeRunner
    from agentrl.models.tiny import load_tiny
    from agentrl.rollout.manager import RolloutConfig, RolloutManager
    from agentrl.sandbox.podman import PodmanProvider
    from agentrl.tasks.dataset import task_row
    from agentrl.tasks.task import load_task
    from agentrl.train.batch import training_samples
    from agentrl.train.config import TrainConfig
    from agentrl.train.torch_backend import TorchTrainer
    from agentrl.train.weight_sync import InProcessTransport

    torch.manual_seed(0)
    policy, tokenizer = load_tiny(seed=0)
    engine = LocalEngine(copy.deepcopy(policy).eval(), tokenizer)
    trainer = TorchTrainer(
        policy, TrainConfig(lr=1e-3, weight_decay=0.0, logprob_chunk_size=None), device="cpu"
    )
    transport = InProcessTransport([engine])
    provider = PodmanProvider()
    records = tmp_path / "records"
    runner = SandboxEpisodeRunner(
        provider=provider,
        engine=engine,
        renderer=ChatRenderer(tokenizer),
        run_id="mini",
        config=EpisodeConfig(
            action_format="fenced-bash",
            agent=AgentConfig(max_turns=2, max_new_tokens=24, max_total_tokens=2048),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=24),
        ),
        record_dir=records,
    )
    rows = [task_row(load_task(ROOT / "envs" / "tbench2" / "tasks" / t)) for t in TASKS]
    consumed = []
    versions_after_sync = []
    try:
        cfg = RolloutConfig(
            batch_size=4, n_samples_per_prompt=2, max_in_flight=4, max_staleness=1, episode_timeout_s=300
        )
        async with RolloutManager(runner, engine, rows, cfg, seed=0) as mgr:
            for step in range(1, 3):
                groups = await mgr.get_batch(timeout=600)
                samples = training_samples([g.episodes for g in groups])
                consumed += [copy.deepcopy(s) for s in samples]
                await asyncio.to_thread(trainer.train_step, samples)

                async def push(version: int = step) -> None:
                    await transport.push(trainer.export_weights(), version=version)

                await mgr.update_weights(push)
                versions_after_sync.append(engine.weight_version)
                # The engine now scores a consumed sample exactly as the trainer does.
                s = samples[0]
                engine_lp = await engine.prompt_logprobs(s.tokens)
                with torch.no_grad():
                    logits = trainer.model(torch.tensor([s.tokens])).logits[0, :-1].float()
                    trainer_lp = torch.log_softmax(logits, -1).gather(
                        -1, torch.tensor(s.tokens[1:])[:, None]
                    )[:, 0]
                assert max(abs(a - b) for a, b in zip(engine_lp, trainer_lp.tolist(), strict=True)) < 1e-4
    finally:
        await provider.aclose()
        await engine.aclose()

    assert versions_after_sync == [1, 2]
    assert len({s.episode_id for s in consumed}) == 8
    produced = {}
    for path in records.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["type"] == "result" and row.get("samples"):
                for d in row["samples"]:
                    produced[(d["prompt_id"], d["sample_index"], tuple(d["tokens"]))] = d
    for s in consumed:
        d = produced[(s.prompt_id, s.sample_index, tuple(s.tokens))]
        assert s.loss_mask == d["loss_mask"]
        assert s.rollout_logprobs == d["rollout_logprobs"]
        assert s.reward == d["reward"] and s.prompt_length == d["prompt_length"]
        assert len(s.loss_mask) == len(s.tokens) - s.prompt_length and any(s.loss_mask)
    assert provider.live_sandboxes() == 0
