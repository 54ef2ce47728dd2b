"""Weight sync: every strategy delivers the trainer's weights, bumps the version, and never leaves
an engine paused, whatever fails.

Engines here are real implementations of the engine control plane over a real transformers model:
`ModelEngine` in-process, and an SGLang-compatible aiohttp server (`/pause_generation`,
`/continue_generation`, `/update_weights_from_disk`, `/update_weights_from_tensor`, `/model_info`)
reached over HTTP on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import copy
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from safetensors.torch import load, load_file, save

from agentrl.algo import mismatch_kl
from agentrl.train.config import TrainConfig
from agentrl.train.forward import model_logprobs
from agentrl.train.torch_backend import TorchTrainer
from agentrl.train.weight_sync import DiskSync, InProcessSync, TensorSync, WeightSyncError
from tests.train_models import make_samples, policy, tiny_base  # noqa: F401


class ModelEngine:
    """The engine control plane over a transformers model in this process."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.paused = False
        self.weight_version = 0
        self.calls: list[str] = []
        self.paused_once = asyncio.Event()

    async def pause(self, *, mode: str = "in_place") -> None:
        self.calls.append(f"pause:{mode}")
        self.paused = True
        self.paused_once.set()

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    def _load(self, state: dict[str, torch.Tensor], version: int, *, strict: bool) -> None:
        if not self.paused:
            raise AssertionError("weights loaded into an engine that was not paused")
        current = self.model.state_dict()
        unknown = set(state) - set(current)
        if unknown:
            raise KeyError(f"unknown weights {sorted(unknown)[:3]}")
        if strict and set(current) - set(state):
            raise KeyError("missing weights")
        with torch.no_grad():
            for k, v in state.items():
                current[k].copy_(v)
        self.weight_version = version

    def load_state_dict(self, state: dict[str, torch.Tensor], weight_version: int) -> None:
        self.calls.append("load_state_dict")
        self._load(state, weight_version, strict=True)

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: int, flush_cache: bool = True
    ) -> None:
        self.calls.append("update_weights_from_disk")
        self._load(load_file(str(Path(model_path) / "model.safetensors")), weight_version, strict=True)

    async def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, torch.Tensor]], *, weight_version: int
    ) -> None:
        self.calls.append("update_weights_from_tensor")
        self._load(dict(named_tensors), weight_version, strict=False)

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        return model_logprobs(self.model, ids, chunk_size=None)[0]


class FailingEngine(ModelEngine):
    def __init__(self, model: Any, fail_on: str) -> None:
        super().__init__(model)
        self.fail_on = fail_on

    async def pause(self, *, mode: str = "in_place") -> None:
        await super().pause(mode=mode)
        if self.fail_on == "pause":
            raise ConnectionError("engine unreachable")

    def load_state_dict(self, state: dict[str, torch.Tensor], weight_version: int) -> None:
        raise RuntimeError("CUDA out of memory")

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: int, flush_cache: bool = True
    ) -> None:
        if self.fail_on == "hang":
            await asyncio.sleep(3600)
        raise RuntimeError("load failed: bad shard")


def _perturbed(model: Any, seed: int = 0) -> Any:
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return out


def _trained(policy: Any) -> TorchTrainer:  # noqa: F811
    trainer = TorchTrainer(policy, TrainConfig(lr=1e-2, weight_decay=0.0), device="cpu")
    trainer.train_step(make_samples(policy, seed=21, rewards=[1, 0, 0, 1, 1, 0]))
    return trainer


def _assert_same_policy(trainer: TorchTrainer, engine_logprobs: Any) -> None:
    samples = make_samples(trainer.model, seed=22)
    ids = torch.tensor([samples[0].tokens])
    with torch.no_grad():
        mine = model_logprobs(trainer.model, ids, chunk_size=7)[0]
    theirs = engine_logprobs(ids)
    mask = torch.ones_like(mine)
    mask[:, 0] = 0
    assert mismatch_kl(mine, theirs, mask)["mismatch_kl"].item() < 1e-10
    assert (mine - theirs).abs().max().item() < 1e-5


async def test_in_process_sync_makes_engine_logprobs_equal_the_trainers(policy):  # noqa: F811
    trainer = _trained(policy)
    engine = ModelEngine(_perturbed(policy))
    await InProcessSync([engine]).sync(trainer.model, version=1)
    assert engine.weight_version == 1 and not engine.paused
    assert engine.calls == ["pause:abort", "load_state_dict", "resume"]
    _assert_same_policy(trainer, engine.logprobs)


async def test_disk_sync_writes_atomically_keeps_recent_versions_and_loads_them(policy, tmp_path: Path):  # noqa: F811
    trainer = _trained(policy)
    engines = [ModelEngine(_perturbed(policy, s)) for s in range(2)]
    sync = DiskSync(engines, tmp_path / "weights", keep=2)
    for version in (1, 2, 3):
        await sync.sync(trainer.model, version=version)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000002", "v00000003"]
    assert (tmp_path / "weights" / "v00000003" / "config.json").exists()
    for e in engines:
        assert e.weight_version == 3 and not e.paused
        _assert_same_policy(trainer, e.logprobs)


async def test_tensor_sync_sends_every_weight_in_bounded_buckets(policy):  # noqa: F811
    trainer = _trained(policy)
    engine = ModelEngine(_perturbed(policy))
    sync = TensorSync([engine], bucket_bytes=256 * 1024)
    buckets = list(sync.buckets(trainer.model))
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    # A bucket stays under the bound unless one tensor alone exceeds it.
    assert len(buckets) > 3 and all(
        s <= 256 * 1024 or len(b) == 1 for s, b in zip(sizes, buckets, strict=True)
    )
    assert sum(len(b) for b in buckets) == len(trainer.model.state_dict())
    await sync.sync(trainer.model, version=7)
    assert engine.calls.count("update_weights_from_tensor") == len(buckets)
    assert engine.weight_version == 7 and not engine.paused
    _assert_same_policy(trainer, engine.logprobs)


@pytest.mark.parametrize("fail_on", ["update", "pause"])
async def test_a_failing_engine_never_stays_paused(policy, fail_on):  # noqa: F811
    good = ModelEngine(copy.deepcopy(policy))
    bad = FailingEngine(copy.deepcopy(policy), fail_on)
    with pytest.raises(WeightSyncError) as info:
        await InProcessSync([good, bad]).sync(policy, version=1)
    assert info.value.cause == "weight_sync"
    assert not good.paused and not bad.paused
    assert good.calls[-1] == "resume" and bad.calls[-1] == "resume"


async def test_a_hanging_update_times_out_and_resumes(policy, tmp_path: Path):  # noqa: F811
    good = ModelEngine(copy.deepcopy(policy))
    hang = FailingEngine(copy.deepcopy(policy), "hang")
    sync = DiskSync([good, hang], tmp_path, timeout=0.5)
    with pytest.raises(WeightSyncError, match="timed out"):
        await sync.sync(policy, version=4)
    assert not good.paused and not hang.paused
    assert sync.version is None


async def test_a_cancelled_sync_still_resumes_the_engines(policy, tmp_path: Path):  # noqa: F811
    hang = FailingEngine(copy.deepcopy(policy), "hang")
    task = asyncio.create_task(DiskSync([hang], tmp_path, timeout=60).sync(policy, version=1))
    await asyncio.wait_for(hang.paused_once.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not hang.paused and hang.calls[-1] == "resume"


# ---------- over HTTP: an SGLang-compatible server around a real model ----------


def sglang_app(engine: ModelEngine) -> web.Application:
    """The SGLang control endpoints a weight sync uses, per the 0.5.16 reference (section 4)."""

    async def pause(request: web.Request) -> web.Response:
        body = await request.json()
        await engine.pause(mode=body.get("mode", "abort"))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(request: web.Request) -> web.Response:
        await engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def from_disk(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            await engine.update_weights_from_disk(
                body["model_path"], weight_version=int(body["weight_version"])
            )
        except Exception as exc:
            return web.json_response(
                {"success": False, "message": str(exc), "num_paused_requests": 0}, status=400
            )
        msg = f"Succeeded to update model weights. Weight version updated to {body['weight_version']}."
        return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})

    async def from_tensor(request: web.Request) -> web.Response:
        body = await request.json()
        named = list(load(base64.b64decode(body["serialized_named_tensors"][0])).items())
        await engine.update_weights_from_tensor(named, weight_version=int(body["weight_version"]))
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": "tiny", "is_generation": True, "weight_version": str(engine.weight_version)}
        )

    app = web.Application(client_max_size=256 * 2**20)
    app.router.add_post("/pause_generation", pause)
    app.router.add_post("/continue_generation", resume)
    app.router.add_post("/update_weights_from_disk", from_disk)
    app.router.add_post("/update_weights_from_tensor", from_tensor)
    app.router.add_get("/model_info", model_info)
    return app


class HttpControl:
    """The client side of those endpoints (the methods weight sync calls on an SGLang engine)."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(
            self.url + path, json=body, timeout=aiohttp.ClientTimeout(total=30)
        ) as r:
            data = await r.json()
            if r.status != 200 or data.get("success") is False:
                raise RuntimeError(f"{path}: HTTP {r.status}: {data.get('message')}")
            return data

    async def pause(self, *, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: int, flush_cache: bool = True
    ) -> None:
        await self._post(
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": str(weight_version), "flush_cache": flush_cache},
        )

    async def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, torch.Tensor]], *, weight_version: int
    ) -> None:
        blob = base64.b64encode(save(dict(named_tensors))).decode()
        await self._post(
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [blob], "weight_version": str(weight_version)},
        )

    async def weight_version(self) -> str:
        async with self.session.get(self.url + "/model_info", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return (await r.json())["weight_version"]


@pytest.fixture
async def http_engine(policy):  # noqa: F811
    engine = ModelEngine(_perturbed(policy))
    runner = web.AppRunner(sglang_app(engine))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as session:
        yield engine, HttpControl(session, f"http://127.0.0.1:{port}")
    await runner.cleanup()


@pytest.mark.parametrize("strategy", ["disk", "tensor"])
async def test_sync_over_http_to_an_sglang_compatible_server(policy, http_engine, tmp_path: Path, strategy):  # noqa: F811
    engine, client = http_engine
    trainer = _trained(policy)
    sync = DiskSync([client], tmp_path) if strategy == "disk" else TensorSync([client], bucket_bytes=2**20)
    await sync.sync(trainer.model, version=5)
    assert await client.weight_version() == "5" and not engine.paused
    _assert_same_policy(trainer, engine.logprobs)


async def test_a_rejected_http_update_resumes_the_server(policy, http_engine, tmp_path: Path):  # noqa: F811
    engine, client = http_engine
    from transformers import Glm4Config, Glm4ForCausalLM

    wrong = Glm4ForCausalLM(
        Glm4Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8, pad_token_id=0, eos_token_id=1)
    )  # fmt: skip
    with pytest.raises(WeightSyncError, match="HTTP 400"):
        await DiskSync([client], tmp_path).sync(wrong, version=9)
    assert not engine.paused and await client.weight_version() == "0"


# ---------- the real in-process engine ----------


async def test_after_in_process_sync_local_engine_samples_with_the_trainers_logprobs(policy):  # noqa: F811
    from agentrl.engine.base import SamplingParams
    from agentrl.engine.local import LocalEngine

    trainer = _trained(policy)
    engine = LocalEngine(_perturbed(policy), [0])
    try:
        prompt = make_samples(policy, seed=23)[0].tokens[:6]
        before = await engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))
        await InProcessSync([engine]).sync(trainer.model, version=3)
        assert not engine.paused
        gen = await engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))
        assert gen.weight_version == 3 and before.weight_version == 0
        ids = torch.tensor([prompt + gen.output_ids])
        with torch.no_grad():
            mine = model_logprobs(trainer.model, ids, chunk_size=5)[0][:, len(prompt) :]
        theirs = torch.tensor([gen.logprobs])
        mask = torch.ones_like(mine)
        kl = mismatch_kl(mine, theirs, mask)["mismatch_kl"].item()
        assert kl < 1e-9, kl
        assert (mine - theirs).abs().max().item() < 1e-4
    finally:
        await engine.aclose()
