"""Weight sync: every strategy delivers the trainer's weights, bumps the version, and never leaves
an engine paused, whatever fails.

Engines are the project's real ones: `LocalEngine` in this process, and `agentrl engine serve`'s
SGLang-compatible `EngineServer` reached over loopback HTTP by the `SGLangEngine` client. Faults
come from `LocalEngine` subclasses that fail or hang at one step.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.algo import mismatch_kl
from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.server import EngineServer
from agentrl.engine.sglang import SGLangEngine
from agentrl.train.config import TrainConfig
from agentrl.train.forward import model_logprobs
from agentrl.train.torch_backend import TorchTrainer
from agentrl.train.weight_sync import DiskSync, InProcessSync, TensorSync, WeightSyncError
from tests.test_train_models import make_samples, policy, tiny_base  # noqa: F401


def _perturbed(model: Any, seed: int = 0) -> Any:
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return out.eval()


def _trained(policy: Any) -> TorchTrainer:  # noqa: F811
    trainer = TorchTrainer(policy, TrainConfig(lr=1e-2, weight_decay=0.0), device="cpu")
    trainer.train_step(make_samples(policy, seed=21, rewards=[1, 0, 0, 1, 1, 0]))
    return trainer


def _prompt(trainer: TorchTrainer) -> list[int]:
    return make_samples(trainer.model, seed=22)[0].tokens[:8]


def _trainer_logprobs(trainer: TorchTrainer, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model_logprobs(trainer.model, torch.tensor([tokens]), chunk_size=5)[0][0]


def _assert_close(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    kl = mismatch_kl(mine, theirs, torch.ones_like(mine))["mismatch_kl"].item()
    assert kl < 1e-9, kl
    assert (mine - theirs).abs().max().item() < 1e-4


async def _assert_engine_matches(trainer: TorchTrainer, engine: LocalEngine) -> None:
    tokens = _prompt(trainer) + [5, 6, 7, 8]
    theirs = torch.tensor(await engine.prompt_logprobs(tokens))
    _assert_close(_trainer_logprobs(trainer, tokens)[1:], theirs)


class BrokenEngine(LocalEngine):
    """A real local engine that fails (or hangs) at one step of the update."""

    def __init__(self, model: Any, fail_on: str) -> None:
        super().__init__(model, [0])
        self.fail_on = fail_on
        self.pauses = 0
        self.paused_once = asyncio.Event()

    async def pause(self, *, mode: str = "in_place", timeout: float = 60.0) -> None:
        await super().pause(mode=mode, timeout=timeout)
        self.pauses += 1
        self.paused_once.set()
        if self.fail_on == "pause":
            raise EngineError("engine unreachable")

    async def load_state_dict(self, state_dict: Any, weight_version: int | None = None) -> int:
        if self.fail_on == "update":
            raise EngineError("CUDA out of memory while loading weights")
        return await super().load_state_dict(state_dict, weight_version)

    async def update_weights(self, **kw: Any) -> None:
        if self.fail_on == "hang":
            await asyncio.sleep(3600)
        await super().update_weights(**kw)


async def test_after_in_process_sync_local_engine_samples_with_the_trainers_logprobs(policy):  # noqa: F811
    trainer = _trained(policy)
    engine = LocalEngine(_perturbed(policy), [0])
    try:
        prompt = _prompt(trainer)
        before = await engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))
        await InProcessSync([engine]).sync(trainer.model, version=3)
        assert not engine.paused
        gen = await engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))
        assert gen.weight_version == 3 and before.weight_version == 0
        mine = _trainer_logprobs(trainer, prompt + gen.output_ids)[len(prompt) :]
        _assert_close(mine, torch.tensor(gen.logprobs))
    finally:
        await engine.aclose()


async def test_disk_sync_writes_atomically_keeps_recent_versions_and_loads_them(policy, tmp_path: Path):  # noqa: F811
    trainer = _trained(policy)
    engines = [LocalEngine(_perturbed(policy, s), [0]) for s in range(2)]
    try:
        sync = DiskSync(engines, tmp_path / "weights", keep=2)
        for version in (1, 2, 3):
            await sync.sync(trainer.model, version=version)
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000002", "v00000003"]
        assert (tmp_path / "weights" / "v00000003" / "config.json").exists()
        for e in engines:
            assert e.weight_version == 3 and not e.paused
            await _assert_engine_matches(trainer, e)
        # `push` alone is what a caller that pauses engines itself uses.
        await sync.push(trainer.model, 4)
        assert [e.weight_version for e in engines] == [4, 4]
    finally:
        for e in engines:
            await e.aclose()


def test_tensor_buckets_are_bounded_and_cover_every_weight(tiny_base):  # noqa: F811
    sync = TensorSync([object()], bucket_bytes=256 * 1024)
    buckets = list(sync.buckets(tiny_base))
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    # A bucket stays under the bound unless one tensor alone exceeds it.
    assert len(buckets) > 3 and all(
        s <= 256 * 1024 or len(b) == 1 for s, b in zip(sizes, buckets, strict=True)
    )
    assert [n for b in buckets for n, _ in b] == list(tiny_base.state_dict())


@pytest.mark.parametrize("fail_on", ["update", "pause"])
async def test_a_failing_engine_never_stays_paused(policy, fail_on):  # noqa: F811
    good = LocalEngine(copy.deepcopy(policy), [0])
    bad = BrokenEngine(copy.deepcopy(policy), fail_on)
    try:
        sync = InProcessSync([good, bad])
        with pytest.raises(WeightSyncError) as info:
            await sync.sync(policy, version=1)
        assert info.value.cause == "weight_sync" and sync.version is None
        assert bad.pauses == 1
        assert not good.paused and not bad.paused
        assert bad.weight_version == 0
    finally:
        await good.aclose()
        await bad.aclose()


async def test_a_hanging_update_times_out_and_resumes(policy, tmp_path: Path):  # noqa: F811
    good = LocalEngine(copy.deepcopy(policy), [0])
    hang = BrokenEngine(copy.deepcopy(policy), "hang")
    try:
        sync = DiskSync([good, hang], tmp_path, timeout=0.5)
        with pytest.raises(WeightSyncError, match="timed out"):
            await sync.sync(policy, version=4)
        assert not good.paused and not hang.paused
        assert sync.version is None
    finally:
        await good.aclose()
        await hang.aclose()


async def test_a_cancelled_sync_still_resumes_the_engines(policy, tmp_path: Path):  # noqa: F811
    hang = BrokenEngine(copy.deepcopy(policy), "hang")
    try:
        task = asyncio.create_task(DiskSync([hang], tmp_path, timeout=60).sync(policy, version=1))
        await asyncio.wait_for(hang.paused_once.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not hang.paused
    finally:
        await hang.aclose()


# ---------- over HTTP: `agentrl engine serve`'s server, the SGLang client ----------


@pytest.fixture
async def served(policy) -> AsyncIterator[tuple[LocalEngine, SGLangEngine]]:  # noqa: F811
    engine = LocalEngine(_perturbed(policy), [0])
    try:
        async with EngineServer(engine, port=0) as server:
            client = SGLangEngine(server.url, control_timeout_s=60)
            try:
                yield engine, client
            finally:
                await client.aclose()
    finally:
        await engine.aclose()


@pytest.mark.parametrize("strategy", ["disk", "tensor"])
async def test_sync_over_http_to_an_sglang_compatible_server(policy, served, tmp_path: Path, strategy):  # noqa: F811
    engine, client = served
    trainer = _trained(policy)
    sync = DiskSync([client], tmp_path) if strategy == "disk" else TensorSync([client], bucket_bytes=2**20)
    await sync.sync(trainer.model, version=5)
    assert await client.weight_versions() == [5] and not engine.paused
    prompt = _prompt(trainer)
    gen = await client.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    assert gen.weight_version == 5
    _assert_close(
        _trainer_logprobs(trainer, prompt + gen.output_ids)[len(prompt) :], torch.tensor(gen.logprobs)
    )


async def test_a_rejected_http_update_resumes_the_server(served, tmp_path: Path):
    engine, client = served
    from transformers import Glm4Config, Glm4ForCausalLM

    wrong = Glm4ForCausalLM(
        Glm4Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8, pad_token_id=0, eos_token_id=1)
    )  # fmt: skip
    with pytest.raises(WeightSyncError, match="unknown parameter names"):
        await TensorSync([client]).sync(wrong, version=9)
    assert not engine.paused and await client.weight_versions() == [0]
