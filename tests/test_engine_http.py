"""Over real HTTP: the SGLang-compatible local server and the SGLang client, with the tiny model."""

from __future__ import annotations

import asyncio
import copy
import socket

import aiohttp
import pytest
from aiohttp import web

torch = pytest.importorskip("torch")

from agentrl.engine.base import (  # noqa: E402
    DiskWeights,
    DistributedWeights,
    EngineBadRequest,
    EngineError,
    SamplingParams,
    TensorWeights,
)
from agentrl.engine.local import LocalEngine  # noqa: E402
from agentrl.engine.server import EngineServer  # noqa: E402
from agentrl.engine.sglang import ROUTING_KEY_HEADER, SGLangEngine  # noqa: E402
from agentrl.engine.tensors import serialize_named_tensors  # noqa: E402
from agentrl.models.tiny import load_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture
async def served(tiny):
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, model_path="tiny", port=0) as server:
        client = SGLangEngine(server.url, retries=2)
        yield server, engine, client
        await client.aclose()
    await engine.aclose()


def _prompt(tok) -> list[int]:
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Count lines."}]
    return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))


def recompute(model, prompt: list[int], output: list[int]) -> list[float]:
    """The trainer's view: one plain forward over prompt + output, log_softmax of the raw logits."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[pos, torch.tensor(output)].tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def _until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def test_logprobs_over_http_equal_trainer_recomputation(served, tiny) -> None:
    _, engine, client = served
    prompt = _prompt(tiny[1])
    gen = await client.generate(prompt, SamplingParams(max_new_tokens=32, seed=11), session_id="ep-1")
    assert len(gen.output_ids) == len(gen.logprobs) > 0
    assert max_diff(gen.logprobs, recompute(engine.model, prompt, gen.output_ids)) <= 1e-4
    assert gen.weight_version == 0 and gen.finish_reason in ("stop", "length")


async def test_weight_update_from_disk_changes_version_and_logprobs(served, tiny, tmp_path) -> None:
    _, _, client = served
    model, tok = tiny
    prompt = _prompt(tok)
    before = await client.generate(prompt, SamplingParams(max_new_tokens=8, seed=4))
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.3)
    changed.save_pretrained(tmp_path)
    await client.update_weights(DiskWeights(str(tmp_path)), weight_version=5)
    after = await client.generate(prompt, SamplingParams(max_new_tokens=8, seed=4))
    assert after.weight_version == 5
    assert max_diff(after.logprobs, recompute(changed, prompt, after.output_ids)) <= 1e-4
    assert max_diff(before.logprobs, recompute(changed, prompt, before.output_ids)) > 1e-3
    assert list((await client.weight_versions()).values()) == [5] and client.weight_version == 5
    with pytest.raises(EngineError, match="not a directory"):
        await client.update_weights(DiskWeights(str(tmp_path / "missing")), weight_version=6)
    assert [i["weight_version"] for i in (await client.model_info()).values()] == ["5"]


async def test_weight_update_from_tensor_accepts_safetensors_and_refuses_pickles(served, tiny) -> None:
    _, engine, client = served
    model, tok = tiny
    prompt = _prompt(tok)
    new_head = model.lm_head.weight * 2.0
    blob = serialize_named_tensors([("lm_head.weight", new_head)])
    await client.update_weights(TensorWeights([blob]), weight_version=9)
    assert torch.equal(engine.model.lm_head.weight, new_head)
    gen = await client.generate(prompt, SamplingParams(max_new_tokens=4, seed=1))
    assert gen.weight_version == 9
    import base64
    import pickle

    evil = base64.b64encode(pickle.dumps({"lm_head.weight": [1.0]})).decode()
    with pytest.raises(EngineError, match="pickled tensors are refused"):
        await client.update_weights(TensorWeights([evil]), weight_version=10)
    assert engine.weight_version == 9


async def test_distributed_update_before_init_group_kills_the_server_as_sglangs_assertion(served) -> None:
    # SGLang model_runner_components/weight_updater.py asserts the group exists outside its try
    # block: the scheduler dies, and with it the server.
    server, _, client = served
    with pytest.raises(EngineError):
        await client.update_weights(
            DistributedWeights(["lm_head.weight"], ["float32"], [[3072, 256]]), weight_version=1
        )
    assert server.dead is not None and "init_weights_update_group" in server.dead
    assert not await client.health()


async def test_pause_in_place_holds_generation_until_continue(served, tiny) -> None:
    _, engine, client = served
    await client.pause(mode="in_place")
    task = asyncio.create_task(client.generate(_prompt(tiny[1]), SamplingParams(max_new_tokens=3)))
    await _until(lambda: engine.num_requests == 1)
    assert not engine.busy and not task.done()  # held before the model, as SGLang's tokenizer manager
    await client.resume()
    gen = await asyncio.wait_for(task, 10)
    assert gen.finish_reason == "length" and len(gen.output_ids) == 3


async def test_pause_abort_returns_partial_tokens_with_abort_reason(served, tiny) -> None:
    _, engine, client = served
    prompt = _prompt(tiny[1])
    task = asyncio.create_task(client.generate(prompt, SamplingParams(max_new_tokens=3000, seed=2)))
    await _until(lambda: engine.stats["tokens"] > 0)
    await asyncio.wait_for(client.pause(mode="abort"), 10)
    gen = await asyncio.wait_for(task, 10)
    await client.resume()
    assert gen.finish_reason == "abort" and 0 < len(gen.output_ids) < 3000
    assert max_diff(gen.logprobs, recompute(engine.model, prompt, gen.output_ids)) <= 1e-4


async def test_abort_request_by_rid_and_cancellation_abort_on_the_server(served, tiny) -> None:
    _, engine, client = served
    prompt = _prompt(tiny[1])
    task = asyncio.create_task(client.generate(prompt, SamplingParams(max_new_tokens=3000), rid="job-77"))
    await _until(lambda: "job-77" in engine._requests)
    await client.abort("job-7")  # SGLang 0.5.16 aborts exact rids only: a prefix does nothing
    assert engine.num_requests == 1 and not engine._requests["job-77"].abort.is_set()
    await client.abort("job-77")
    assert (await asyncio.wait_for(task, 10)).finish_reason == "abort"

    task = asyncio.create_task(client.generate(prompt, SamplingParams(max_new_tokens=3000), rid="job-78"))
    await _until(lambda: "job-78" in engine._requests)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: engine.num_requests == 0, timeout=5)


async def test_sticky_sessions_across_several_workers(tiny) -> None:
    model, tok = tiny
    engines = [LocalEngine(model, tok, weight_version=v) for v in (1, 2)]
    async with EngineServer(engines[0], port=0) as a, EngineServer(engines[1], port=0) as b:
        client = SGLangEngine([a.url, b.url])
        try:
            prompt = _prompt(tok)[:8]
            seen: dict[str, set[int]] = {}
            for turn in range(3):
                for s in range(8):
                    gen = await client.generate(prompt, SamplingParams(max_new_tokens=1), session_id=f"s{s}")
                    seen.setdefault(f"s{s}", set()).add(gen.weight_version)
                    assert client.worker_for(f"s{s}") == (a.url, b.url)[gen.weight_version - 1], turn
            assert all(len(v) == 1 for v in seen.values())
            assert set().union(*seen.values()) == {1, 2}
            assert await client.weight_versions() == {a.url: 1, b.url: 2}
            assert await client.health()
        finally:
            await client.aclose()
    for e in engines:
        await e.aclose()


async def test_router_mode_sends_routing_key_and_retries_503(served, tiny) -> None:
    server, _, _ = served
    seen_keys: list[str | None] = []
    failures = {"left": 2}

    async def generate(request: web.Request) -> web.Response:
        seen_keys.append(request.headers.get(ROUTING_KEY_HEADER))
        if failures["left"]:
            failures["left"] -= 1
            return web.json_response({"error": {"message": "no", "code": "no_available_workers"}}, status=503)
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{server.url}/generate", data=await request.read()) as r,
        ):
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    async def workers(request: web.Request) -> web.Response:
        return web.json_response({"workers": [{"url": server.url}], "total": 1})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/workers", workers)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    router = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = SGLangEngine(router_url=router, retries=4)
    try:
        gen = await client.generate(
            _prompt(tiny[1]), SamplingParams(max_new_tokens=2), session_id="episode-9"
        )
        assert len(gen.output_ids) == 2
        assert seen_keys == ["episode-9"] * 3
        assert await client.worker_urls() == [server.url]
        assert len(await client.model_info()) == 1
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_unreachable_worker_is_an_engine_error_after_retries() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = SGLangEngine(f"http://127.0.0.1:{port}", retries=2)
    try:
        with pytest.raises(EngineError) as info:
            await client.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        assert info.value.cause == "engine_unavailable"
        assert not await client.health()
    finally:
        await client.aclose()


async def test_bad_requests_map_to_engine_bad_request(served) -> None:
    _, _, client = served
    with pytest.raises(EngineBadRequest, match="input_ids cannot be empty"):
        await client.generate([], SamplingParams())
    with pytest.raises(EngineBadRequest, match="context length"):
        await client.generate([5] * 5000, SamplingParams(max_new_tokens=1))


# --- exact wire shapes (SGLang 0.5.16) ----------------------------------------------------------


async def _raw(method: str, url: str, **kw):
    async with aiohttp.ClientSession() as s, s.request(method, url, **kw) as r:
        return r.status, r.content_type, await r.read()


async def test_generate_response_shape(served, tiny) -> None:
    server, engine, _ = served
    tok = tiny[1]
    prompt = _prompt(tok)
    eos = tok.eos_token_id
    status, ctype, raw = await _raw(
        "POST",
        f"{server.url}/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "stop_token_ids": [eos], "sampling_seed": 3},
            "return_logprob": True,
            "logprob_start_len": 0,
            "rid": "shape-1",
        },
    )
    import json

    body = json.loads(raw)
    assert status == 200 and ctype == "application/json"
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert list(meta)[:5] == ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"]
    assert meta["id"] == "shape-1" and meta["weight_version"] == "0" and meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(body["output_ids"]) == meta["output_token_logprobs_length"]
    assert all(len(t) == 3 and t[2] is None for t in meta["output_token_logprobs"])
    assert [t[1] for t in meta["output_token_logprobs"]] == body["output_ids"]
    assert meta["finish_reason"] in ({"type": "length", "length": 6}, {"type": "stop", "matched": eos})
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == len(prompt) and inputs[0][0] is None and [t[1] for t in inputs] == prompt
    with torch.no_grad():
        logp = torch.log_softmax(engine.model(torch.tensor([prompt])).logits[0].float(), -1)
    assert abs(inputs[3][0] - float(logp[2, prompt[3]])) <= 1e-4
    assert meta["cached_tokens"] == 0 and meta["cached_tokens_details"] is None


async def test_batch_zero_tokens_and_text_in_logprobs(served, tiny) -> None:
    import json

    server, _, _ = served
    prompt = _prompt(tiny[1])
    status, _, raw = await _raw(
        "POST",
        f"{server.url}/generate",
        json={
            "input_ids": [prompt, prompt[:5]],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
        },
    )
    body = json.loads(raw)
    assert status == 200 and isinstance(body, list) and len(body) == 2
    assert body[0]["output_ids"] == [] and body[0]["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 0,
    }
    status, _, raw = await _raw(
        "POST",
        f"{server.url}/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 2, "n": 2},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        },
    )
    body = json.loads(raw)
    assert len(body) == 2 and body[0]["meta_info"]["id"] != body[1]["meta_info"]["id"]
    assert all(isinstance(t[2], str) for t in body[0]["meta_info"]["output_token_logprobs"])


async def test_error_shapes_match_sglang(served) -> None:
    import json

    server, _, _ = served
    u = server.url
    status, _, raw = await _raw("POST", f"{u}/generate", json={"input_ids": []})
    assert status == 400 and json.loads(raw) == {"error": {"message": "input_ids cannot be empty."}}
    status, _, raw = await _raw(
        "POST", f"{u}/generate", json={"input_ids": [1], "sampling_params": {"bogus": 1}}
    )
    assert status == 500 and raw == b"Internal Server Error"
    status, _, raw = await _raw(
        "POST", f"{u}/generate", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    body = json.loads(raw)
    assert (
        status == 400 and body["object"] == "error" and body["type"] == "Bad Request" and body["code"] == 400
    )
    status, _, raw = await _raw("POST", f"{u}/generate", json={"input_ids": [1] * 4096})
    assert status == 400 and "longer than the model's context length" in json.loads(raw)["error"]["message"]
    status, _, raw = await _raw("POST", f"{u}/generate", json={"input_ids": [1], "stream": True})
    assert status == 400 and "stream" in json.loads(raw)["error"]["message"]
    status, _, raw = await _raw("GET", f"{u}/get_weight_version")
    assert status == 404 and json.loads(raw)["code"] == 404
    status, ctype, raw = await _raw("GET", f"{u}/flush_cache")
    assert status == 200 and ctype == "text/plain" and raw.startswith(b"Cache flushed.")
    status, _, raw = await _raw("POST", f"{u}/abort_request", json={"rid": "nobody"})
    assert status == 200 and raw == b""
    status, _, raw = await _raw("POST", f"{u}/pause_generation", json={"mode": "in_place"})
    assert json.loads(raw) == {"message": "Generation paused successfully.", "status": "ok"}
    status, _, raw = await _raw("POST", f"{u}/continue_generation", json={})
    assert json.loads(raw) == {"message": "Generation continued successfully.", "status": "ok"}
    status, _, raw = await _raw("POST", f"{u}/update_weights_from_disk", json={"model_path": "/nope"})
    body = json.loads(raw)
    assert (
        status == 400
        and body["success"] is False
        and set(body) == {"success", "message", "num_paused_requests"}
    )
    for path in ("/health", "/health_generate"):
        status, _, raw = await _raw("GET", f"{u}{path}")
        assert status == 200 and raw == b""
    status, _, raw = await _raw("GET", f"{u}/model_info")
    info = json.loads(raw)
    assert info["model_type"] == "glm_moe_dsa" and info["is_generation"] is True
    status, _, raw = await _raw("GET", f"{u}/get_server_info")
    assert {"model_path", "served_model_name", "tp_size", "dp_size", "version", "weight_version"} <= set(
        json.loads(raw)
    )


async def test_flush_cache_refuses_while_busy(served, tiny) -> None:
    server, engine, client = served
    task = asyncio.create_task(client.generate(_prompt(tiny[1]), SamplingParams(max_new_tokens=3000)))
    await _until(lambda: engine.busy)
    status, _, raw = await _raw("GET", f"{server.url}/flush_cache")
    assert status == 400 and raw == b"Flush cache failed.\n"
    await client.abort(abort_all=True)
    await asyncio.wait_for(task, 10)
    await client.flush_cache(wait_s=5)


async def test_a_timed_out_generate_is_aborted_on_the_worker_not_resent(served, tiny) -> None:
    server, engine, _ = served
    client = SGLangEngine(server.url, request_timeout_s=0.5, retries=3)
    try:
        with pytest.raises(EngineError) as info:
            # A fixed seed: an unseeded sample can draw eos early and finish inside the timeout.
            await client.generate(_prompt(tiny[1]), SamplingParams(max_new_tokens=3000, seed=0), rid="slow-1")
        assert info.value.cause == "engine_timeout"
        await _until(lambda: engine.num_requests == 0, timeout=5)
        assert engine.stats["batched_requests"] == 1  # sent once: a request that may run is never re-sent
    finally:
        await client.aclose()
