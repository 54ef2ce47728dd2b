"""`SGLangEngine` as a fleet over several SGLang-compatible servers: the control plane fans out
to every server, versions are confirmed after each update, a dead server does not stop the run,
and a turn answered under other weights is detected."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from agentrl.engine.base import (  # noqa: E402
    EngineBadRequest,
    EngineVersionMismatch,
    SamplingParams,
    TensorWeights,
)
from agentrl.engine.local import LocalEngine  # noqa: E402
from agentrl.engine.server import EngineServer  # noqa: E402
from agentrl.engine.sglang import SGLangEngine  # noqa: E402
from agentrl.engine.tensors import serialize_named_tensors  # noqa: E402
from agentrl.models.tiny import load_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


class _StuckVersionEngine(LocalEngine):
    """Loads weights but keeps counting versions its own way (a server whose version was not set)."""

    async def load_state_dict(self, state_dict: Any, weight_version: int | None = None) -> int:
        return await super().load_state_dict(state_dict, None)


def _head(model: Any, scale: float) -> TensorWeights:
    return TensorWeights([serialize_named_tensors([("lm_head.weight", model.lm_head.weight * scale)])])


async def test_update_confirms_every_servers_version_and_names_the_one_that_differs(tiny) -> None:
    model, tok = tiny
    good = LocalEngine(copy.deepcopy(model), tok)
    stuck = _StuckVersionEngine(copy.deepcopy(model), tok)
    async with EngineServer(good, port=0) as a, EngineServer(stuck, port=0) as b:
        fleet = SGLangEngine([a.url, b.url], retries=2)
        try:
            assert await fleet.refresh_weight_version() == 0
            with pytest.raises(EngineVersionMismatch) as info:
                await fleet.update_weights(_head(model, 2.0), weight_version=5)
            assert b.url in str(info.value) and a.url not in str(info.value)
            assert fleet.weight_version == 0  # not confirmed
            with pytest.raises(EngineVersionMismatch, match="disagree"):
                await fleet.refresh_weight_version()
        finally:
            await fleet.aclose()
    await good.aclose()
    await stuck.aclose()


async def test_control_plane_fans_out_and_goes_on_without_a_dead_server(tiny) -> None:
    model, tok = tiny
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(2)]
    async with EngineServer(engines[0], port=0) as a:
        b = EngineServer(engines[1], port=0)
        await b.__aenter__()
        fleet = SGLangEngine([a.url, b.url], retries=2)
        try:
            await fleet.pause("in_place")
            assert all(e.paused for e in engines)
            await fleet.update_weights(_head(model, 2.0), weight_version=1)
            await fleet.resume()
            assert [e.weight_version for e in engines] == [1, 1] and not any(e.paused for e in engines)
            await b.__aexit__(None, None, None)  # server b is gone: connections are refused
            await fleet.pause("abort")
            await fleet.flush_cache()
            await fleet.update_weights(_head(model, 3.0), weight_version=2)
            await fleet.resume()
            assert list(fleet.dead_workers) == [b.url]
            assert fleet.weight_version == 2 and await fleet.weight_versions() == {a.url: 2}
            # Direct mode: sessions that hashed to b now go to a.
            for s in range(6):
                gen = await fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1), session_id=f"s{s}")
                assert gen.weight_version == 2 and not gen.version_mismatch
        finally:
            await fleet.aclose()
    for e in engines:
        await e.aclose()


@pytest.mark.parametrize("on_mismatch", ["flag", "raise"])
async def test_a_turn_answered_under_other_weights_is_detected(tiny, on_mismatch: str) -> None:
    model, tok = tiny
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(2)]
    async with EngineServer(engines[0], port=0) as a, EngineServer(engines[1], port=0) as b:
        fleet = SGLangEngine([a.url, b.url], retries=2, on_version_mismatch=on_mismatch)  # type: ignore[arg-type]
        try:
            await fleet.update_weights(_head(model, 2.0), weight_version=3)
            engines[1].weight_version = 0  # b restarted with its launch weights
            sessions = [f"s{i}" for i in range(8)]
            on_b = [s for s in sessions if fleet.worker_for(s) == b.url]
            on_a = [s for s in sessions if fleet.worker_for(s) == a.url]
            assert on_a and on_b
            ok = await fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1), session_id=on_a[0])
            assert not ok.version_mismatch and ok.weight_version == 3
            if on_mismatch == "raise":
                with pytest.raises(EngineVersionMismatch, match="restarted"):
                    await fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1), session_id=on_b[0])
            else:
                gen = await fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1), session_id=on_b[0])
                assert gen.version_mismatch and gen.weight_version == 0
                assert gen.meta["expected_weight_version"] == 3
            assert fleet.version_mismatches == 1
        finally:
            await fleet.aclose()
    for e in engines:
        await e.aclose()


async def test_flush_cache_retries_while_a_server_is_busy_then_succeeds(tiny) -> None:
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, port=0) as server:
        fleet = SGLangEngine(server.url, retries=2)
        try:
            started = asyncio.Event()
            real_generate = engine.generate

            async def generate(*args: Any, **kw: Any) -> Any:
                started.set()
                return await real_generate(*args, **kw)

            engine.generate = generate  # type: ignore[method-assign]
            task = asyncio.create_task(
                fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=3000, seed=0), rid="long")
            )
            await asyncio.wait_for(started.wait(), 10)
            flush = asyncio.create_task(fleet.flush_cache(wait_s=30))
            await fleet.abort("long")
            assert (await asyncio.wait_for(task, 10)).finish_reason == "abort"
            await asyncio.wait_for(flush, 30)
        finally:
            await fleet.aclose()
    await engine.aclose()


async def test_servers_set_aside_keep_their_version_and_rejoin_whole_at_the_next_push(tiny) -> None:
    """An eval's servers (`set_aside`) serve the version they were taken at while the fleet pauses
    and updates without them, are never routed to, and come back at the next pause: never in the
    middle of a push (its remaining buckets alone would leave them half-updated under the new
    version), and routed again only once an update has put them on the fleet's version."""
    model, tok = tiny
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(3)]
    async with (
        EngineServer(engines[0], port=0) as a,
        EngineServer(engines[1], port=0) as b,
        EngineServer(engines[2], port=0) as c,
    ):
        fleet = SGLangEngine([a.url, b.url, c.url], retries=2)
        sessions = [f"s{i}" for i in range(48)]
        try:
            assert await fleet.refresh_weight_version() == 0
            assert fleet.can_set_aside(2) and not fleet.can_set_aside(3) and not fleet.can_set_aside(0)
            aside = await fleet.set_aside(1)
            assert aside.base_urls == [c.url] and aside.weight_version == 0
            assert not fleet.can_set_aside(2)  # one must stay
            assert {fleet.worker_for(s) for s in sessions} == {a.url, b.url}

            await fleet.pause("in_place")
            assert [e.paused for e in engines] == [True, True, False]
            await fleet.update_weights(_head(model, 2.0), weight_version=1)
            await fleet.resume()
            assert [e.weight_version for e in engines] == [1, 1, 0]
            assert await fleet.weight_versions() == {a.url: 1, b.url: 1}
            gen = await aside.generate(
                [1, 2, 3], SamplingParams(max_new_tokens=2, seed=0), session_id="eval-0"
            )
            assert gen.weight_version == 0 and not gen.version_mismatch

            # Given back in the middle of a two-bucket push: the push's last bucket skips it.
            await fleet.pause("in_place")
            await fleet.update_weights(_head(model, 3.0), weight_version=2)
            await fleet.rejoin(aside)
            await fleet.update_weights(_head(model, 3.0), weight_version=2)
            await fleet.resume()
            assert [e.weight_version for e in engines] == [2, 2, 0]
            assert c.url not in {fleet.worker_for(s) for s in sessions}

            # The next push reaches it whole; then it is routed to again.
            await fleet.pause("abort")
            assert [e.paused for e in engines] == [True, True, True]
            await fleet.flush_cache()
            await fleet.update_weights(_head(model, 4.0), weight_version=3)
            await fleet.resume()
            assert [e.weight_version for e in engines] == [3, 3, 3]
            assert torch.equal(engines[2].model.lm_head.weight, engines[0].model.lm_head.weight)
            assert {fleet.worker_for(s) for s in sessions} == {a.url, b.url, c.url}

            with pytest.raises(EngineBadRequest, match="not set aside"):
                await fleet.rejoin(SGLangEngine([a.url]))
        finally:
            await fleet.aclose()
    for e in engines:
        await e.aclose()
