"""LocalEngine: exact log-probs, sampling controls, stops, pause/abort, weight loads."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from agentrl.engine.base import (  # noqa: E402
    DiskWeights,
    DistributedWeights,
    EngineBadRequest,
    SamplingParams,
    TensorWeights,
)
from agentrl.engine.local import LocalEngine  # noqa: E402
from agentrl.models.tiny import load_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture
async def engine(tiny):
    model, tok = tiny
    eng = LocalEngine(model, tok)
    yield eng
    await eng.aclose()


def _prompt(tok) -> list[int]:
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List /app."}]
    return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))


async def until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def recompute(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """What a trainer does: one plain forward over prompt + output, log_softmax of the logits."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[pos, torch.tensor(output)].tolist()


async def test_logprobs_equal_a_full_forward_recomputation(engine, tiny) -> None:
    model, tok = tiny
    prompt = _prompt(tok)
    gen = await engine.generate(prompt, SamplingParams(max_new_tokens=24, seed=1))
    assert len(gen.output_ids) == len(gen.logprobs) > 0
    ref = recompute(model, prompt, gen.output_ids)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True)) <= 1e-4


async def test_logprobs_are_of_the_tempered_distribution_before_truncation(engine, tiny) -> None:
    model, tok = tiny
    prompt = _prompt(tok)
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=12, seed=3)
    gen = await engine.generate(prompt, sp)
    ref = recompute(model, prompt, gen.output_ids, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True)) <= 1e-4
    engine.logprob_mode = "original"
    again = await engine.generate(prompt, sp)
    assert again.output_ids == gen.output_ids
    raw = recompute(model, prompt, gen.output_ids)
    assert max(abs(a - b) for a, b in zip(again.logprobs, raw, strict=True)) <= 1e-4


async def test_seed_makes_sampling_reproducible(engine, tiny) -> None:
    prompt = _prompt(tiny[1])
    a = await engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=7))
    b = await engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=7))
    c = await engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=8))
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    assert c.output_ids != a.output_ids


async def test_greedy_is_argmax_and_top_k_1_matches_it(engine, tiny) -> None:
    model, tok = tiny
    prompt = _prompt(tok)
    greedy = await engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=8))
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    assert greedy.output_ids[0] == first
    topk1 = await engine.generate(prompt, SamplingParams(top_k=1, max_new_tokens=8, seed=5))
    assert topk1.output_ids == greedy.output_ids


async def test_top_p_restricts_samples_to_the_nucleus(engine, tiny) -> None:
    model, tok = tiny
    prompt = _prompt(tok)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
    sorted_p, order = torch.sort(probs, descending=True)
    nucleus = set(order[: int((torch.cumsum(sorted_p, 0) < 0.05).sum()) + 1].tolist())
    firsts = set()
    for seed in range(12):
        gen = await engine.generate(prompt, SamplingParams(top_p=0.05, max_new_tokens=1, seed=seed))
        firsts.add(gen.output_ids[0])
    assert firsts <= nucleus


async def test_stops_on_stop_token_and_reports_length(engine, tiny) -> None:
    prompt = _prompt(tiny[1])
    free = await engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=2))
    assert free.finish_reason == "length" and len(free.output_ids) == 10
    assert free.meta["length"] == 10
    stop_at = free.output_ids[3]
    first = free.output_ids.index(stop_at)
    stopped = await engine.generate(
        prompt, SamplingParams(max_new_tokens=10, seed=2, stop_token_ids=(stop_at,))
    )
    assert stopped.finish_reason == "stop" and stopped.output_ids == free.output_ids[: first + 1]
    assert stopped.meta["matched"] == stop_at


async def test_stop_string_ends_generation(engine, tiny) -> None:
    tok = tiny[1]
    prompt = _prompt(tok)
    free = await engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=2))
    piece = tok.decode(free.output_ids[4:6])
    stopped = await engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=2, stop=(piece,)))
    assert stopped.finish_reason == "stop" and stopped.meta["matched"] == piece
    assert len(stopped.output_ids) <= 6


async def test_max_new_tokens_zero_and_bad_requests(engine, tiny) -> None:
    prompt = _prompt(tiny[1])
    zero = await engine.generate(prompt, SamplingParams(max_new_tokens=0))
    assert zero.output_ids == [] and zero.finish_reason == "length"
    for bad in (
        SamplingParams(top_p=0.0),
        SamplingParams(top_k=0),
        SamplingParams(temperature=-1.0),
    ):
        with pytest.raises(EngineBadRequest):
            await engine.generate(prompt, bad)
    with pytest.raises(EngineBadRequest, match="empty"):
        await engine.generate([], SamplingParams())
    with pytest.raises(EngineBadRequest, match="context length"):
        await engine.generate([5] * 5000, SamplingParams())


async def test_abort_matches_the_exact_rid_only_and_returns_partial_tokens_with_their_logprobs(
    engine, tiny
) -> None:
    # SGLang 0.5.16 tokenizer_manager.py abort_request: an rid that is not a live request's own is
    # dropped before the scheduler's prefix match, so only exact rids abort.
    model, tok = tiny
    prompt = _prompt(tok)
    task = asyncio.create_task(
        engine.generate(prompt, SamplingParams(max_new_tokens=2000, seed=1), rid="abc-1")
    )
    await until(lambda: engine.stats["tokens"] > 0)
    assert engine.abort_requests("abc") == 0
    await engine.abort("abc-1")
    gen = await asyncio.wait_for(task, 10)
    assert gen.finish_reason == "abort" and 0 < len(gen.output_ids) < 2000
    ref = recompute(model, prompt, gen.output_ids)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True)) <= 1e-4


async def test_pause_in_place_holds_requests_until_resume(engine, tiny) -> None:
    prompt = _prompt(tiny[1])
    await engine.pause(mode="in_place")
    task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=1)))
    await until(lambda: engine.num_requests == 1)
    assert not engine.busy and not task.done()  # held at the gate, never handed to the model
    await engine.resume()
    gen = await asyncio.wait_for(task, 10)
    assert gen.finish_reason == "length" and len(gen.output_ids) == 4


async def test_weights_load_while_a_running_batch_is_paused_in_place(engine, tiny) -> None:
    # The rollout manager pauses in place, loads weights, then resumes: the load must not queue
    # behind the batch that waits for that resume.
    model, tok = tiny
    task = asyncio.create_task(engine.generate(_prompt(tok), SamplingParams(max_new_tokens=400, seed=2)))
    await until(lambda: engine.stats["batches"] > 0)
    await engine.pause(mode="in_place")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    version = await asyncio.wait_for(engine.load_state_dict(state), 10)
    assert version == 1 and not task.done()
    await engine.resume()
    gen = await asyncio.wait_for(task, 120)
    assert gen.finish_reason in ("stop", "length") and gen.output_ids


async def test_a_request_paused_in_place_across_a_load_finishes_on_and_reports_the_new_weights(
    tiny,
) -> None:
    # SGLang: after an in_place pause and a load, the rest of the request runs on the new weights
    # (old KV cache) and its weight_version is read when the response is built.
    import copy

    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    try:
        prompt = _prompt(tok)
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=400, seed=2)))
        await until(lambda: engine.stats["batches"] > 0)
        await engine.pause("in_place")
        await until(lambda: engine._parked.is_set() or task.done())
        assert not task.done(), "the request finished before the pause: raise max_new_tokens"
        new_head = model.lm_head.weight * 4.0
        assert await engine.load_state_dict({"lm_head.weight": new_head}, weight_version=9) == 9
        await engine.resume()
        gen = await asyncio.wait_for(task, 60)
        assert gen.weight_version == 9
        old_lp = recompute(model, prompt, gen.output_ids)
        # The last token's log-prob came from the new head: it differs from the old model's.
        assert abs(gen.logprobs[-1] - old_lp[-1]) > 1e-3
    finally:
        await engine.aclose()


async def test_pause_abort_ends_in_flight_requests_and_blocks_new_ones(engine, tiny) -> None:
    prompt = _prompt(tiny[1])
    running = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=2000)))
    await until(lambda: any(r.submitted for r in engine._requests.values()))
    await asyncio.wait_for(engine.pause(mode="abort"), 10)
    assert running.done() and running.result().finish_reason == "abort"
    late = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=2)))
    await until(lambda: engine.num_requests == 1)
    assert not engine.busy and not late.done()  # held at the gate
    await engine.resume()
    assert (await asyncio.wait_for(late, 10)).finish_reason == "length"


async def test_cancelling_the_caller_stops_the_worker(engine, tiny) -> None:
    prompt = _prompt(tiny[1])
    task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=2000)))
    await until(lambda: engine.stats["batches"] > 0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    quick = await asyncio.wait_for(engine.generate(prompt, SamplingParams(max_new_tokens=2)), 5)
    assert len(quick.output_ids) == 2


async def test_concurrent_requests_queue_and_match_sequential_results(engine, tiny) -> None:
    prompt = _prompt(tiny[1])
    params = [SamplingParams(max_new_tokens=6, seed=s) for s in range(4)]
    together = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
    alone = [await engine.generate(prompt, p) for p in params]
    assert [g.output_ids for g in together] == [g.output_ids for g in alone]


async def test_load_state_dict_bumps_version_and_changes_logprobs(tiny) -> None:
    model, tok = tiny
    import copy

    eng = LocalEngine(copy.deepcopy(model), tok)
    try:
        prompt = _prompt(tok)
        before = await eng.generate(prompt, SamplingParams(max_new_tokens=6, seed=1))
        assert before.weight_version == 0
        new = {"lm_head.weight": model.lm_head.weight * 3.0}
        assert await eng.load_state_dict(new) == 1
        after = await eng.generate(prompt, SamplingParams(max_new_tokens=6, seed=1))
        assert after.weight_version == 1 and after.logprobs != before.logprobs
        await eng.load_state_dict(dict(model.state_dict()), weight_version=7)
        back = await eng.generate(prompt, SamplingParams(max_new_tokens=6, seed=1))
        assert back.weight_version == 7 and back.logprobs == before.logprobs
        with pytest.raises(EngineBadRequest, match="unknown parameter"):
            await eng.load_state_dict({"nope": torch.zeros(1)})
        with pytest.raises(EngineBadRequest, match="shape"):
            await eng.load_state_dict({"lm_head.weight": torch.zeros(2, 2)})
    finally:
        await eng.aclose()


async def test_load_from_a_save_pretrained_directory(tiny, tmp_path) -> None:
    model, tok = tiny
    import copy

    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.5)
    changed.save_pretrained(tmp_path)
    eng = LocalEngine(copy.deepcopy(model), tok)
    try:
        assert await eng.load_from_disk(tmp_path, weight_version=3) == 3
        for (name, a), (_, b) in zip(
            eng.model.state_dict().items(), changed.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), name
    finally:
        await eng.aclose()


async def test_worker_thread_uses_its_own_thread_count(engine) -> None:
    before = torch.get_num_threads()
    assert engine.cpu_threads == 1
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(engine._executor, torch.get_num_threads) == 1
    assert torch.get_num_threads() == before


async def test_update_weights_takes_each_sync_format(tiny, tmp_path) -> None:
    import copy

    from agentrl.engine.tensors import serialize_named_tensors

    model, tok = tiny
    eng = LocalEngine(copy.deepcopy(model), tok)
    try:
        head = model.lm_head.weight * 0.5
        entry = serialize_named_tensors([("lm_head.weight", head)])
        await eng.update_weights(TensorWeights([entry]), weight_version=2)
        assert eng.weight_version == 2 and torch.equal(eng.model.lm_head.weight, head)
        await eng.load_state_dict({"lm_head.weight": model.lm_head.weight}, weight_version=3)
        assert torch.equal(eng.model.lm_head.weight, model.lm_head.weight)
        model.save_pretrained(tmp_path)
        await eng.update_weights(DiskWeights(str(tmp_path)), weight_version=4)
        assert eng.weight_version == 4
        with pytest.raises(EngineBadRequest, match="pickled tensors are refused"):
            await eng.update_weights(TensorWeights(["not base64!"]), weight_version=5)
        with pytest.raises(EngineBadRequest, match="one TP rank"):
            await eng.update_weights(TensorWeights([entry, entry]), weight_version=5)
        with pytest.raises(EngineBadRequest, match="process group"):
            await eng.update_weights(DistributedWeights(["x"], ["float32"], [[1]]), weight_version=5)
        assert eng.weight_version == 4
    finally:
        await eng.aclose()


async def test_concurrent_prompts_of_different_lengths_batch_with_exact_logprobs(engine, tiny) -> None:
    model, tok = tiny
    base = _prompt(tok)
    prompts = [base, base[:7], base + tok.encode("ls -la /app\n"), base[:3]]
    gens = await asyncio.gather(
        *(engine.generate(p, SamplingParams(max_new_tokens=5 + 3 * i, seed=i)) for i, p in enumerate(prompts))
    )
    assert engine.stats["batched_requests"] > engine.stats["batches"]
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        assert g.finish_reason == "stop" or len(g.output_ids) == 5 + 3 * i
        assert (
            max(abs(a - b) for a, b in zip(g.logprobs, recompute(model, p, g.output_ids), strict=True))
            <= 1e-4
        )
