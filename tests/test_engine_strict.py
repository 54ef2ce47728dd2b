"""The SGLang-compatible server is as strict as SGLang 0.5.16 where a client bug would crash a real
server or corrupt a run. Each test names the SGLang source it models."""

from __future__ import annotations

import asyncio
import copy
import json

import aiohttp
import pytest

torch = pytest.importorskip("torch")

from agentrl.engine.base import EngineError, SamplingParams, TensorWeights  # noqa: E402
from agentrl.engine.local import LocalEngine  # noqa: E402
from agentrl.engine.server import EngineServer  # noqa: E402
from agentrl.engine.sglang import SGLangEngine  # noqa: E402
from agentrl.engine.tensors import serialize_named_tensors  # noqa: E402
from agentrl.models.tiny import load_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


async def _until(predicate, timeout: float = 20.0) -> None:
    """Poll a condition that no event signals (engine internals), failing after `timeout`."""
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


async def _post(url: str, body: dict) -> tuple[int, object]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        raw = await r.read()
        return r.status, json.loads(raw) if r.content_type == "application/json" and raw else raw


def _prompt(tok) -> list[int]:
    return tok.encode("List the files in /app and count them.")


@pytest.fixture
async def held(tiny):
    """A server with one long request paused in place (running, as after the rollout manager's
    in_place pause), and that request's task."""
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, model_path="tiny", port=0) as server:
        client = SGLangEngine(server.url, retries=2)
        task = asyncio.create_task(
            client.generate(_prompt(tok), SamplingParams(max_new_tokens=400, seed=2), rid="held-1")
        )
        await _until(lambda: engine.stats["batches"] > 0)
        await client.pause("in_place")
        await _until(lambda: engine._parked.is_set() or task.done())
        assert not task.done(), "the request finished before the pause"
        yield server, engine, client, task
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
    await engine.aclose()


async def test_update_with_sglangs_default_flush_after_in_place_pause_kills_the_server(held, tiny) -> None:
    # scheduler_components/weight_updater.py flush_cache_after_weight_update asserts the flush
    # succeeded; Scheduler.flush_cache refuses while a request runs: the scheduler process dies.
    # This is the body the old client sent by default (flush_cache omitted means true).
    server, _, _, task = held
    entry = serialize_named_tensors([("lm_head.weight", tiny[0].lm_head.weight * 2)])
    with pytest.raises(aiohttp.ClientError):  # no answer: the connection drops, as a dead process's
        await _post(f"{server.url}/update_weights_from_tensor", {"serialized_named_tensors": [entry]})
    assert server.dead is not None and "Cache flush failed" in server.dead and server.died.is_set()
    with pytest.raises(EngineError):  # the in-flight request is lost with the server
        await asyncio.wait_for(task, 20)
    with pytest.raises(aiohttp.ClientConnectionError):  # and nothing listens any more
        await _post(f"{server.url}/generate", {"input_ids": [1, 2]})


async def test_client_update_after_in_place_pause_sends_no_flush_and_the_turn_reports_the_new_version(
    held, tiny
) -> None:
    # The client sends flush_cache false by default, so the same update succeeds; the held request
    # then finishes on the new weights and, as SGLang builds meta_info after the load
    # (tokenizer_manager.py reads weight_version when it answers), reports the new version.
    server, _, client, task = held
    entry = serialize_named_tensors([("lm_head.weight", tiny[0].lm_head.weight * 2)])
    await client.update_weights(TensorWeights([entry]), weight_version=7)
    assert server.dead is None and client.weight_version == 7
    await client.resume()
    gen = await asyncio.wait_for(task, 60)
    assert gen.weight_version == 7 and gen.meta["weight_version"] == "7" and not gen.version_mismatch


async def test_standalone_flush_while_paused_in_place_is_refused_not_fatal(held) -> None:
    # http_server.py /flush_cache answers 400 while the scheduler is busy; only the update's
    # assertion is fatal.
    server, _, client, task = held
    async with aiohttp.ClientSession() as s, s.get(f"{server.url}/flush_cache") as r:
        assert r.status == 400 and await r.read() == b"Flush cache failed.\n"
    assert server.dead is None
    await client.resume()
    await asyncio.wait_for(task, 60)


@pytest.mark.parametrize("tp_size", [1, 2])
async def test_per_rank_tensor_payload_round_trips(tiny, tp_size: int) -> None:
    # managers/tp_worker.py: serialized_named_tensors[tp_rank], each entry a list of
    # (name, tensor) pairs that model_runner iterates.
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, port=0, tp_size=tp_size) as server:
        client = SGLangEngine(server.url, retries=2)
        try:
            assert await client.server_tp_sizes() == {server.url: tp_size}
            head = model.lm_head.weight * 0.25
            pairs = [("lm_head.weight", head), ("model.norm.weight", model.model.norm.weight + 1)]
            await client.update_weights(
                TensorWeights([serialize_named_tensors(pairs)] * tp_size), weight_version=3
            )
            assert torch.equal(engine.model.lm_head.weight, head)
            assert torch.equal(engine.model.model.norm.weight, model.model.norm.weight + 1)
            assert client.weight_version == 3
        finally:
            await client.aclose()
    await engine.aclose()


async def test_tensor_payload_with_fewer_entries_than_tp_ranks_kills_the_server(tiny) -> None:
    # tp_worker.py indexes the list by tp_rank: rank 1 of a TP 2 server gets an IndexError in the
    # scheduler, which dies.
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, port=0, tp_size=2) as server:
        entry = serialize_named_tensors([("lm_head.weight", model.lm_head.weight)])
        with pytest.raises(aiohttp.ClientError):
            await _post(
                f"{server.url}/update_weights_from_tensor",
                {"serialized_named_tensors": [entry], "flush_cache": False},
            )
        assert server.dead is not None and "IndexError" in server.dead
    await engine.aclose()


async def test_tensor_payload_refusals_wrong_rank_count_dict_and_pickle(tiny) -> None:
    import base64
    import pickle

    from safetensors.torch import save

    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, port=0, tp_size=2) as server:
        url = f"{server.url}/update_weights_from_tensor"
        entry = serialize_named_tensors([("lm_head.weight", model.lm_head.weight)])
        status, body = await _post(url, {"serialized_named_tensors": [entry] * 3, "flush_cache": False})
        assert status == 400 and "one entry per TP rank" in body["message"]  # type: ignore[index]
        as_dict = base64.b64encode(save({"lm_head.weight": model.lm_head.weight.detach()})).decode()
        status, body = await _post(url, {"serialized_named_tensors": [as_dict] * 2, "flush_cache": False})
        assert status == 400 and "not a list of (name, tensor) pairs" in body["message"]  # type: ignore[index]
        evil = base64.b64encode(pickle.dumps([("lm_head.weight", [1.0])])).decode()
        status, body = await _post(url, {"serialized_named_tensors": [evil] * 2, "flush_cache": False})
        assert status == 400 and "pickled tensors are refused" in body["message"]  # type: ignore[index]
        other = serialize_named_tensors([("lm_head.weight", model.lm_head.weight * 3)])
        status, body = await _post(url, {"serialized_named_tensors": [entry, other], "flush_cache": False})
        assert status == 400 and "rank 1" in body["message"]  # type: ignore[index]
        assert server.dead is None and engine.weight_version == 0
    await engine.aclose()


async def test_abort_request_matches_only_the_exact_rid(tiny) -> None:
    # 0.5.16 tokenizer_manager.py abort_request returns early for an rid that is not a live
    # request's own, so the scheduler's prefix match never sees a partial rid.
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, port=0) as server:
        client = SGLangEngine(server.url, retries=2)
        try:
            task = asyncio.create_task(
                client.generate(
                    _prompt(tok), SamplingParams(max_new_tokens=2000, seed=2), rid="episode-3-turn-1"
                )
            )
            await _until(lambda: engine.busy)
            for partial in ("episode-3", "episode-3-turn-", "turn-1"):
                status, body = await _post(f"{server.url}/abort_request", {"rid": partial})
                assert status == 200 and body == b""
            status, _ = await _post(f"{server.url}/abort_request", {"rid": ""})  # ignored, as SGLang
            assert status == 200 and not engine._requests["episode-3-turn-1"].abort.is_set()
            await _post(f"{server.url}/abort_request", {"rid": "episode-3-turn-1"})
            gen = await asyncio.wait_for(task, 20)
            assert gen.finish_reason == "abort"
        finally:
            await client.aclose()
    await engine.aclose()


async def test_an_unpaused_update_waits_for_in_flight_requests_and_then_may_flush(tiny, tmp_path) -> None:
    # tokenizer_control_mixin.py: not paused, an update takes model_update_lock's writer side, so
    # it waits for in-flight requests; the flush that follows then succeeds (server stays up).
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, port=0) as server:
        client = SGLangEngine(server.url, retries=2)
        try:
            task = asyncio.create_task(
                client.generate(_prompt(tok), SamplingParams(max_new_tokens=40, seed=1))
            )
            await _until(lambda: engine.busy)
            entry = serialize_named_tensors([("lm_head.weight", model.lm_head.weight * 2)])
            status, body = await _post(
                f"{server.url}/update_weights_from_tensor",
                {"serialized_named_tensors": [entry], "weight_version": "4"},  # flush_cache defaults to true
            )
            assert status == 200 and body["success"] is True  # type: ignore[index]
            assert (await asyncio.wait_for(task, 20)).weight_version == 0  # answered before the load
            assert server.dead is None and engine.weight_version == 4
        finally:
            await client.aclose()
    await engine.aclose()
