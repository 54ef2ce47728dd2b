"""ScriptedEngine and FakeEngine: the same protocol as real engines, with scripts and faults."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.engine.base import DiskWeights, EngineBadRequest, EngineError, SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.testing.engine import FakeEngine, Faults
from tests.chat_tokenizer import byte_tokenizer


async def test_scripted_turns_are_tokenized_and_closed_with_eos() -> None:
    tok = byte_tokenizer()
    engine = ScriptedEngine(["ls -la", "done"], tok, logprob=-0.25, weight_version=3)
    first = await engine.generate([1, 2], SamplingParams(), session_id="a")
    assert first.output_ids == tok.encode("ls -la", add_special_tokens=False) + [tok.eos_token_id]
    assert first.logprobs == [-0.25] * len(first.output_ids)
    assert first.finish_reason == "stop" and first.weight_version == 3 and first.text == "ls -la"
    other = await engine.generate([1], SamplingParams(), session_id="b")
    assert other.text == "ls -la"  # each session walks the script from its start
    second = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2), session_id="a")
    assert second.finish_reason == "length" and len(second.output_ids) == 2
    assert engine.calls[2] == ("a", [1, 2, 3])
    with pytest.raises(EngineError, match="script has 2 turns"):
        await engine.generate([1], SamplingParams(), session_id="a")


async def test_scripted_callable_sees_session_turn_and_prompt() -> None:
    tok = byte_tokenizer()
    engine = ScriptedEngine(lambda sid, turn, ids: f"{sid}:{turn}:{len(ids)}", tok)
    gen = await engine.generate([5, 6, 7], SamplingParams(), session_id="s")
    assert gen.text == "s:0:3"
    await engine.update_weights(DiskWeights("/weights/v8"), weight_version=8)
    assert engine.updates == [DiskWeights("/weights/v8")]
    assert (await engine.generate([5], SamplingParams(), session_id="s")).weight_version == 8


async def test_fake_is_deterministic_with_a_seed_and_honours_limits() -> None:
    a = FakeEngine(seed=1, eos_rate=0.0)
    b = FakeEngine(seed=1, eos_rate=0.0)
    ga = await a.generate([1], SamplingParams(max_new_tokens=20, seed=4))
    gb = await b.generate([1], SamplingParams(max_new_tokens=20, seed=4))
    assert ga.output_ids == gb.output_ids and len(ga.output_ids) == 20 and ga.finish_reason == "length"
    assert all(-5.0 < lp <= 0.0 for lp in ga.logprobs)
    stop = ga.output_ids[5]
    gs = await a.generate([1], SamplingParams(max_new_tokens=20, seed=4, stop_token_ids=(stop,)))
    assert gs.finish_reason == "stop" and gs.output_ids[-1] == stop
    with pytest.raises(EngineBadRequest):
        await a.generate([], SamplingParams())


async def test_fault_injection_bursts_then_recovers_and_aborts() -> None:
    engine = FakeEngine(faults=Faults(error_burst=2), eos_rate=0.0)
    for _ in range(2):
        with pytest.raises(EngineError) as info:
            await engine.generate([1], SamplingParams(max_new_tokens=4))
        assert info.value.cause == "engine_unavailable"
    assert len((await engine.generate([1], SamplingParams(max_new_tokens=4))).output_ids) == 4
    assert engine.failures == 2 and engine.requests == 3
    aborting = FakeEngine(faults=Faults(abort_rate=1.0), eos_rate=0.0)
    gen = await aborting.generate([1], SamplingParams(max_new_tokens=10))
    assert gen.finish_reason == "abort" and len(gen.output_ids) == 5 and aborting.aborts == 1
    flaky = FakeEngine(faults=Faults(error_rate=0.5), seed=3)
    outcomes = []
    for _ in range(40):
        try:
            await flaky.generate([1], SamplingParams(max_new_tokens=1))
            outcomes.append(True)
        except EngineError:
            outcomes.append(False)
    assert 5 < outcomes.count(False) < 35


async def test_pause_abort_cuts_slow_generations_and_blocks_new_ones() -> None:
    engine = FakeEngine(faults=Faults(latency_per_token_s=0.01), eos_rate=0.0)
    running = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=1000)))
    for _ in range(5000):  # poll until it has produced a token (nothing signals it)
        if engine.tokens:
            break
        await asyncio.sleep(0.001)
    await asyncio.wait_for(engine.pause(mode="abort"), 5)
    gen = running.result()
    assert gen.finish_reason == "abort" and 0 < len(gen.output_ids) < 1000
    late = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=2)))
    for _ in range(10):  # let it run up to the pause gate (no wall-clock wait)
        await asyncio.sleep(0)
    assert not late.done() and not engine._gate.busy
    await engine.resume()
    assert (await asyncio.wait_for(late, 5)).finish_reason == "length"
    with pytest.raises(EngineBadRequest):
        await engine.pause(mode="sideways")


async def test_fake_flush_and_flushing_update_refuse_while_a_request_is_in_flight() -> None:
    # As SGLang 0.5.16's Scheduler.flush_cache: nothing may be running or queued.
    engine = FakeEngine(faults=Faults(latency_per_token_s=0.01), eos_rate=0.0)
    running = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=1000)))
    for _ in range(1000):
        if engine._gate.busy:
            break
        await asyncio.sleep(0)
    await engine.pause("in_place")
    with pytest.raises(EngineError, match="flush_cache refused"):
        await engine.flush_cache()
    with pytest.raises(EngineError, match="flush_cache refused"):
        await engine.update_weights(DiskWeights("/w"), weight_version=1, flush_cache=True)
    await engine.update_weights(DiskWeights("/w"), weight_version=1)  # the default never flushes
    assert engine.weight_version == 1
    await engine.resume()
    await engine.abort(abort_all=True)
    assert (await asyncio.wait_for(running, 5)).finish_reason == "abort"
    await engine.flush_cache()
