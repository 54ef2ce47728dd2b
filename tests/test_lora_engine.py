"""LoRA adapters in the engines, as SGLang serves them: a PEFT adapter directory loaded by name
(`/load_lora_adapter`), requests naming it (`lora_path`, chat's "base:adapter"), SGLang's refusals,
the SGLang client's adapter sync, and a training run that syncs adapters alone."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import aiohttp
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from agentrl.engine.base import EngineBadRequest, EngineError, LoraAdapter, SamplingParams  # noqa: E402
from agentrl.engine.local import LocalEngine  # noqa: E402
from agentrl.engine.server import EngineServer  # noqa: E402
from agentrl.engine.sglang import SGLangEngine  # noqa: E402
from agentrl.models.tiny import load_tiny  # noqa: E402
from agentrl.train.lora import LoraConfig, apply_lora, write_adapter  # noqa: E402

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def adapter(tiny, directory: Path, seed: int, rank: int = 4):
    """A trained-looking adapter (random B) written as a PEFT directory; returns the adapted model."""
    model = apply_lora(copy.deepcopy(tiny[0]).float(), LoraConfig(rank=rank, alpha=8.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    write_adapter(model, directory)
    return model


def greedy(model, prompt: list[int], n: int = 6) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def test_the_engine_serves_an_adapter_by_name_and_the_base_without_one(tiny, tmp_path: Path) -> None:
    adapted = adapter(tiny, tmp_path / "a", seed=1)
    engine = LocalEngine(copy.deepcopy(tiny[0]).float(), tiny[1], enable_lora=True)
    prompt = [5, 9, 17, 3, 40, 11]
    try:
        await engine.load_lora_adapter("a", tmp_path / "a")
        with_a = await engine.generate(prompt, GREEDY, lora="a")
        base = await engine.generate(prompt, GREEDY, lora=None)
        assert with_a.output_ids == greedy(adapted, prompt)  # what the adapted policy computes
        assert base.output_ids == greedy(tiny[0], prompt)
        assert with_a.output_ids != base.output_ids
        # After the adapter ran, the base weights are intact (the update was folded out).
        assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(),
                                                     tiny[0].state_dict().values(), strict=True))  # fmt: skip
        with pytest.raises(EngineBadRequest, match="is not loaded"):
            await engine.generate(prompt, GREEDY, lora="nope")
        with pytest.raises(EngineBadRequest, match="because it is already loaded"):
            await engine.load_lora_adapter("a", tmp_path / "a")
        with pytest.raises(EngineBadRequest, match="not a LoRA adapter directory"):
            await engine.load_lora_adapter("b", tmp_path)
        await engine.unload_lora_adapter("a")
        with pytest.raises(EngineBadRequest, match="is not loaded"):
            await engine.generate(prompt, GREEDY, lora="a")
    finally:
        await engine.aclose()
    plain = LocalEngine(copy.deepcopy(tiny[0]).float(), tiny[1])
    try:
        with pytest.raises(EngineBadRequest, match=r"LoRA is not enabled\. Please set `--enable-lora`"):
            await plain.load_lora_adapter("a", tmp_path / "a")
    finally:
        await plain.aclose()


async def test_requests_with_different_adapters_batch_apart_and_each_gets_its_own(
    tiny, tmp_path: Path
) -> None:
    models = {name: adapter(tiny, tmp_path / name, seed=s) for name, s in (("a", 1), ("b", 2))}
    engine = LocalEngine(copy.deepcopy(tiny[0]).float(), tiny[1], enable_lora=True, max_batch=8)
    prompt = [7, 12, 30, 2, 19]
    try:
        for name in models:
            await engine.load_lora_adapter(name, tmp_path / name)
        import asyncio

        outs = await asyncio.gather(
            *(engine.generate(prompt, GREEDY, lora=n) for n in ["a", "b", None, "a", "b"])
        )
        want = {
            "a": greedy(models["a"], prompt),
            "b": greedy(models["b"], prompt),
            None: greedy(tiny[0], prompt),
        }
        assert [o.output_ids for o in outs] == [want[n] for n in ["a", "b", None, "a", "b"]]
    finally:
        await engine.aclose()


async def test_an_adapter_of_a_higher_rank_than_the_server_takes_is_refused(tiny, tmp_path: Path) -> None:
    adapter(tiny, tmp_path / "big", seed=3, rank=8)
    engine = LocalEngine(copy.deepcopy(tiny[0]).float(), tiny[1], enable_lora=True, max_lora_rank=4)
    try:
        with pytest.raises(EngineBadRequest, match="exceeds the server's --max-lora-rank 4"):
            await engine.load_lora_adapter("big", tmp_path / "big")
    finally:
        await engine.aclose()


async def test_over_http_the_server_takes_sglangs_lora_calls_and_the_client_syncs_adapters(
    tiny, tmp_path: Path
) -> None:
    models = {f"v{i}": adapter(tiny, tmp_path / f"v{i}", seed=i) for i in (1, 2, 3)}
    engine = LocalEngine(copy.deepcopy(tiny[0]).float(), tiny[1], enable_lora=True)
    prompt = [5, 9, 17, 3, 40, 11]
    async with EngineServer(engine, model_path="tiny", port=0) as server:
        async with aiohttp.ClientSession() as http:
            r = await http.post(
                f"{server.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "v1")}
            )
            assert r.status == 200 and (await r.json()) == {
                "success": True, "error_message": "", "loaded_adapters": {"x": str(tmp_path / "v1")}
            }  # fmt: skip
            r = await http.post(
                f"{server.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "v1")}
            )
            body = await r.json()
            assert r.status == 400 and body["success"] is False and "already loaded" in body["error_message"]
            r = await http.post(f"{server.url}/generate", json={
                "input_ids": prompt, "lora_path": "x", "sampling_params": {"temperature": 0, "max_new_tokens": 6}
            })  # fmt: skip
            assert (await r.json())["output_ids"] == greedy(models["v1"], prompt)
            # The prompt is scored with the request's adapter too (SGLang's input_token_logprobs).
            for lora, model in (("x", models["v1"]), (None, copy.deepcopy(tiny[0]).float())):
                r = await http.post(f"{server.url}/generate", json={
                    "input_ids": prompt, "lora_path": lora, "return_logprob": True, "logprob_start_len": 0,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 1},
                })  # fmt: skip
                served = [e[0] for e in (await r.json())["meta_info"]["input_token_logprobs"][1:]]
                with torch.no_grad():
                    ids = torch.tensor([prompt])
                    want = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                    want = want.gather(1, ids[0, 1:, None])[:, 0]
                got = torch.tensor(served, dtype=torch.float64)
                assert torch.allclose(got, want.double(), atol=1e-5), (lora, served, want.tolist())
            chat = {
                "model": "tiny:x",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "temperature": 0,
            }
            r = await http.post(f"{server.url}/v1/chat/completions", json=chat)
            assert r.status == 200, await r.text()
            r = await http.post(f"{server.url}/generate", json={"input_ids": prompt, "lora_path": "nope"})
            assert r.status == 400 and "is not loaded" in (await r.text())
            r = await http.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "x"})
            assert r.status == 200 and (await r.json())["loaded_adapters"] == {}
        client = SGLangEngine(server.url, retries=2)
        try:
            for version, name in enumerate(models, start=1):
                await client.update_weights(LoraAdapter(name, str(tmp_path / name)), weight_version=version)
                assert client.weight_version == version and client.lora == name
                gen = await client.generate(prompt, GREEDY)
                assert gen.output_ids == greedy(models[name], prompt) and gen.weight_version == version
            # The adapter before the previous one was unloaded; the previous one stays for in-flight turns.
            assert set(engine.lora_names()) == {"v2", "v3"}
        finally:
            await client.aclose()
    await engine.aclose()


async def test_a_server_without_lora_refuses_named_adapters_as_sglang_does(tiny, tmp_path: Path) -> None:
    adapter(tiny, tmp_path / "a", seed=1)
    engine = LocalEngine(copy.deepcopy(tiny[0]).float(), tiny[1])
    async with EngineServer(engine, model_path="tiny", port=0) as server:
        async with aiohttp.ClientSession() as http:
            r = await http.post(
                f"{server.url}/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "a")}
            )
            assert r.status == 400 and (await r.json())["error_message"] == NOT_ENABLED
            r = await http.post(f"{server.url}/generate", json={"input_ids": [5, 9], "lora_path": "a"})
            assert r.status == 400 and "was requested, but LoRA is not enabled" in (await r.text())
        client = SGLangEngine(server.url, retries=1)
        try:
            with pytest.raises(EngineError, match="LoRA is not enabled"):
                await client.update_weights(LoraAdapter("a", str(tmp_path / "a")), weight_version=1)
            assert client.lora is None and client.weight_version == 0
        finally:
            await client.aclose()
    await engine.aclose()


async def test_a_run_with_lora_syncs_adapters_alone_and_learns_on_them(tmp_path: Path) -> None:
    """trainer.lora + sync.transport=lora_adapter: the engine's base weights never change, each
    version is an adapter directory, and the engine samples with the newest adapter."""
    from agentrl.models.tiny import tiny_model_dir
    from agentrl.runtime import close_parts, train
    from agentrl.runtime.build import build_parts
    from tests.test_runtime import alternate_rewards, config

    cfg = config(tmp_path, Path(tiny_model_dir()), "trainer.lora.rank=4", "trainer.lora.alpha=8",
                 "sync.transport=lora_adapter", "eval.every=0")  # fmt: skip
    parts = build_parts(cfg)
    alternate_rewards(parts)
    base = {k: v.clone() for k, v in parts.engine.model.state_dict().items()}
    try:
        result = await train(cfg, parts)
    finally:
        await close_parts(parts)
    assert result.steps == 2
    assert parts.engine.active_lora == "agentrl-policy-v2" and parts.engine.weight_version == 2
    assert set(parts.engine.lora_names()) == {"agentrl-policy-v1", "agentrl-policy-v2"}
    parts.engine.lora.activate(None)
    assert all(torch.equal(v, base[k]) for k, v in parts.engine.model.state_dict().items())
    written = sorted(p.name for p in (cfg.out_dir / "adapters").iterdir())
    assert written == ["v00000001", "v00000002"]
    config_json = json.loads((cfg.out_dir / "adapters" / "v00000002" / "adapter_config.json").read_text())
    assert config_json["r"] == 4 and config_json["lora_alpha"] == 8
    ckpt = cfg.out_dir / "checkpoints" / (cfg.out_dir / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
