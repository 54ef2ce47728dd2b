"""Buffer and prompt source: whole groups, timeouts, staleness eviction, seeded epochs, resume."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.rollout.buffer import Buffer, BufferError, BufferTimeout, Group, RolloutFinished
from agentrl.rollout.source import PromptSource, PromptSourceError
from agentrl.tasks.rows import write_jsonl
from tests.conftest import make_episode


def _group(uid: str, n: int = 2, version: int = 0, reward: float = 1.0) -> Group:
    g = Group(uid, uid, {}, n)
    for i in range(n):
        g.episodes[i] = make_episode(uid, reward=reward, sample_index=i, version=version)
    return g


async def test_get_batch_returns_whole_groups_oldest_weights_first() -> None:
    buf = Buffer()
    for uid, v in [("a", 3), ("b", 1), ("c", 2)]:
        buf.put(_group(uid, version=v))
    batch = await buf.get_batch(4, timeout=1)
    assert [g.uid for g in batch] == ["b", "c"]
    assert buf.consumed == ["b", "c"] and buf.consumed_samples == 4 and buf.n_groups == 1


async def test_get_batch_waits_for_groups_and_times_out_when_none_come() -> None:
    buf = Buffer()

    async def later() -> None:
        await asyncio.sleep(0.05)
        buf.put(_group("x"))

    task = asyncio.create_task(later())
    assert [g.uid for g in await buf.get_batch(2, timeout=2)] == ["x"]
    await task
    with pytest.raises(BufferTimeout, match="no batch of 2 samples"):
        await buf.get_batch(2, timeout=0.05)


async def test_stale_groups_are_evicted_never_returned() -> None:
    stale: list[str] = []
    buf = Buffer(on_stale=lambda g: stale.append(g.uid))
    buf.put(_group("old", version=0))
    buf.put(_group("new", version=4))
    batch = await buf.get_batch(2, timeout=1, current_version=5, max_staleness=2)
    assert [g.uid for g in batch] == ["new"]
    assert stale == ["old"] and buf.stale_groups == 1 and buf.n_groups == 0


async def test_turn_versions_count_for_staleness() -> None:
    buf = Buffer(on_stale=lambda g: None)
    g = _group("mixed", version=5)
    assert g.episodes[0] is not None
    g.episodes[0].turn_versions = [2, 5]
    buf.put(g)
    with pytest.raises(BufferTimeout):
        await buf.get_batch(2, timeout=0.05, current_version=5, max_staleness=2)
    assert buf.stale_groups == 1


async def test_producer_failure_wakes_the_waiting_trainer() -> None:
    buf = Buffer()

    async def crash() -> None:
        await asyncio.sleep(0.02)
        buf.fail(RuntimeError("runner bug"))

    task = asyncio.create_task(crash())
    with pytest.raises(BufferError, match="runner bug"):
        await buf.get_batch(2, timeout=5)
    await task


async def test_finished_buffer_raises_rollout_finished() -> None:
    buf = Buffer()
    buf.put(_group("a"))
    buf.finish()
    assert len(await buf.get_batch(2, timeout=1)) == 1
    with pytest.raises(RolloutFinished):
        await buf.get_batch(2, timeout=1)


def test_only_finished_groups_and_positive_sizes_go_in() -> None:
    buf = Buffer()
    with pytest.raises(BufferError, match="1/2 samples"):
        g = _group("a")
        g.episodes[1] = None
        buf.put(g)


async def test_batch_size_must_be_positive() -> None:
    with pytest.raises(BufferError, match="positive"):
        await Buffer().get_batch(0, timeout=1)


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "metadata": {"task_id": f"t{i}"}} for i in range(n)]


def _drain(src: PromptSource) -> list[str]:
    out = []
    while (p := src.next()) is not None:
        out.append(p.uid)
    return out


def test_each_epoch_is_a_seeded_permutation_of_all_rows() -> None:
    a = _drain(PromptSource(_rows(10), seed=3, max_epochs=2))
    b = _drain(PromptSource(_rows(10), seed=3, max_epochs=2))
    c = _drain(PromptSource(_rows(10), seed=4, max_epochs=2))
    assert a == b and a != c
    e0 = [u.split(":")[1] for u in a[:10]]
    e1 = [u.split(":")[1] for u in a[10:]]
    assert sorted(e0, key=int) == [str(i) for i in range(10)] == sorted(e1, key=int)
    assert e0 != e1


def test_resume_redoes_exactly_the_unconsumed_issued_prompts(tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, _rows(8))
    src = PromptSource.from_jsonl(path, seed=1, max_epochs=1)
    issued = [src.next().uid for _ in range(5)]  # type: ignore[union-attr]
    for uid in issued[:3]:
        src.mark_consumed(uid)
    state = src.state_dict()
    assert state["pending"] == issued[3:]
    again = PromptSource.from_jsonl(path, seed=1, max_epochs=1)
    again.load_state_dict(state)
    rest = _drain(again)
    assert rest[:2] == issued[3:]
    assert sorted(issued[:3] + rest) == sorted(f"0:{i}" for i in range(8))


def test_requeued_prompt_is_issued_again_first() -> None:
    src = PromptSource(_rows(4), seed=0)
    first = src.next()
    assert first is not None
    src.requeue(first.uid)
    assert src.next().uid == first.uid  # type: ignore[union-attr]
    src.mark_consumed(first.uid)
    with pytest.raises(PromptSourceError, match="already consumed"):
        src.requeue(first.uid)


def test_skip_next_passes_over_a_rows_next_appearances_and_survives_a_resume() -> None:
    src = PromptSource(_rows(3), seed=0, max_epochs=4)
    first = src.next()
    assert first is not None
    src.mark_consumed(first.uid)
    src.skip_next(first.uid, 2)
    state = src.state_dict()
    assert state["skips"] == {str(first.index): 2}
    rest = _drain(src)
    again = PromptSource(_rows(3), seed=0, max_epochs=4)
    again.load_state_dict(state)
    assert _drain(again) == rest
    indices = [int(u.split(":")[1]) for u in rest]
    # 4 epochs of 3 rows: one issued before, two appearances of that row passed over, nine issued
    assert len(rest) == 9 and src.skipped == 2 == again.skipped
    assert indices.count(first.index) == 1 and rest[-1 - indices[::-1].index(first.index)].startswith("3:")
    src.skip_next(first.uid, 0)  # nothing owed: a no-op
    with pytest.raises(PromptSourceError, match="points past"):
        src.skip_next("0:7", 1)


def test_bad_rows_and_mismatched_state_are_rejected() -> None:
    with pytest.raises(PromptSourceError, match="no rows"):
        PromptSource([])
    state = PromptSource(_rows(4), seed=0).state_dict()
    with pytest.raises(PromptSourceError, match="same data and seed"):
        PromptSource(_rows(5), seed=0).load_state_dict(state)


@settings(max_examples=60, deadline=None)
@given(
    n_rows=st.integers(1, 7),
    epochs=st.integers(1, 3),
    seed=st.integers(0, 5),
    ops=st.lists(st.sampled_from(["issue", "consume", "requeue", "checkpoint"]), max_size=40),
)
def test_any_checkpoint_and_resume_trains_every_prompt_of_every_epoch_exactly_once(
    n_rows: int, epochs: int, seed: int, ops: list[str]
) -> None:
    rows = _rows(n_rows)
    src = PromptSource(rows, seed=seed, max_epochs=epochs)
    trained: list[str] = []
    held: list[str] = []  # issued, not yet consumed
    for op in ops:
        if op == "issue" and (p := src.next()) is not None:
            held.append(p.uid)
        elif op == "consume" and held:
            uid = held.pop(0)
            src.mark_consumed(uid)
            trained.append(uid)
        elif op == "requeue" and held:
            src.requeue(held.pop())
        elif op == "checkpoint":
            # a crash: whatever was held is lost with the process
            state = src.state_dict()
            src = PromptSource(rows, seed=seed, max_epochs=epochs)
            src.load_state_dict(state)
            held = []
    # the run stops here and resumes to the end
    state = src.state_dict()
    src = PromptSource(rows, seed=seed, max_epochs=epochs)
    src.load_state_dict(state)
    while (p := src.next()) is not None:
        src.mark_consumed(p.uid)
        trained.append(p.uid)
    assert sorted(trained) == sorted(f"{e}:{i}" for e in range(epochs) for i in range(n_rows))
