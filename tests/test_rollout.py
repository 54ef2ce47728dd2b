"""RolloutManager: staleness-bounded admission, per-sample retries, timeouts, cancellation,
weight updates, eval, resume and metrics, over the fault-injecting SimulatedRunner."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentrl.episode.sample import Episode, Status
from agentrl.errors import InfraError
from agentrl.eval.passk import evaluate
from agentrl.rollout import (
    BufferError,
    MetricsTracker,
    RolloutConfig,
    RolloutError,
    RolloutFinished,
    RolloutManager,
    render,
)
from agentrl.testing.rollout_sim import (
    SimEngine,
    SimFaults,
    SimSandboxProvider,
    SimulatedRunner,
    SimWorkload,
    clock,
    run_virtual_time,
)

FAST = SimWorkload(
    engine_per_token_s=0.00005,
    sandbox_create_s=0.001,
    sandbox_exec_s=0.001,
    verifier_s=0.001,
    median_turns=3,
    max_turns=12,
    engine_retry_backoff_s=0.002,
)


def rows(n: int, p_pass: float = 0.5) -> list[dict[str, Any]]:
    return [{"prompt": f"task {i}", "metadata": {"task_id": f"t{i}", "p_pass": p_pass}} for i in range(n)]


def build(
    faults: SimFaults | None = None,
    workload: SimWorkload = FAST,
    data: list | None = None,
    seed: int = 0,
    **cfg: Any,
) -> tuple[RolloutManager, SimEngine, SimSandboxProvider, SimulatedRunner]:
    faults = faults or SimFaults()
    engine = SimEngine(workload, faults, seed=seed)
    provider = SimSandboxProvider(workload, faults, seed=seed)
    runner = SimulatedRunner(engine, provider, workload, faults, seed=seed)
    config = RolloutConfig(
        **{
            "batch_size": 8,
            "n_samples_per_prompt": 4,
            "max_in_flight": 16,
            "retry_backoff_s": 0.001,
            "episode_timeout_s": 5.0,
            **cfg,
        }
    )
    return (
        RolloutManager(runner, engine, data if data is not None else rows(20), config, seed=seed),
        engine,
        provider,
        runner,
    )


def bump(engine: SimEngine):
    async def sync() -> None:
        await engine.set_weights(engine.weight_version + 1)

    return sync


async def train(
    mgr: RolloutManager,
    engine: SimEngine,
    steps: int,
    mode: str = "in_place",
    tracker: MetricsTracker | None = None,
    timeout: float = 20,
) -> list[list]:
    batches = []
    for step in range(steps):
        groups = await mgr.get_batch(timeout=timeout)
        for g in groups:
            for s in g.episodes:
                s.metadata["consumed_version"] = engine.weight_version
        if tracker is not None:
            tracker.step(step, groups)
        batches.append(groups)
        await mgr.update_weights(bump(engine), mode=mode)  # type: ignore[arg-type]
    return batches


def samples_of(batches: list[list]) -> list[Episode]:
    return [s for groups in batches for g in groups for s in g.episodes]


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
async def test_no_trained_sample_is_more_than_max_staleness_versions_behind(max_staleness: int) -> None:
    mgr, engine, provider, runner = build(max_staleness=max_staleness, max_in_flight=64)
    seen: list[tuple[int, int | None]] = []
    inner = runner.run

    async def checked(row: dict, **kw: Any) -> Episode:
        # The admission rule holds at every start: C + R + D <= (s + k + 1) * B.
        seen.append((mgr.outstanding, mgr.admission_limit()))
        return await inner(row, **kw)

    runner.run = checked  # type: ignore[method-assign]
    async with mgr:
        batches = await train(mgr, engine, steps=8)
    lags = Counter(s.metadata["consumed_version"] - s.start_version for s in samples_of(batches))
    assert max(lags) <= max_staleness and sum(lags.values()) == 64
    assert all(
        min(s.turn_versions) >= s.metadata["consumed_version"] - max_staleness for s in samples_of(batches)
    )
    assert all(limit is not None and out <= limit for out, limit in seen)
    if max_staleness:
        assert max(lags) >= 1, "an async run that never overlaps generation with training proves nothing"
    assert provider.live_sandboxes() == 0


async def test_a_finished_sample_frees_its_slot_at_once() -> None:
    mgr, _engine, _provider, runner = build(max_in_flight=4, max_staleness=None)
    release = asyncio.Event()
    inner = runner.run
    starts_while_blocked: list[int] = []

    async def slow_first(row: dict, *, group_id: str, sample_index: int, **kw: Any) -> Episode:
        if sample_index == 0 and group_id == mgr.source.pending[0]:
            await asyncio.wait_for(release.wait(), 10)
        else:
            starts_while_blocked.append(sample_index)
            if len(starts_while_blocked) >= 20:
                twenty.set()
        return await inner(row, group_id=group_id, sample_index=sample_index, **kw)

    twenty = asyncio.Event()
    runner.run = slow_first  # type: ignore[method-assign]
    async with mgr:
        await asyncio.wait_for(twenty.wait(), 10)
        release.set()
        groups = await mgr.get_batch(timeout=10)
    # One of 4 slots is held the whole time; a manager that refilled by whole groups would stall
    # behind the blocked group, this one keeps the other three slots busy sample by sample.
    assert len(starts_while_blocked) >= 20 and sum(g.n for g in groups) == 8


async def test_fault_injection_run_completes_with_every_failure_counted_and_nothing_leaked() -> None:
    faults = SimFaults(
        create_failure=0.10,
        transport_error=0.05,
        engine_burst_rate=0.01,
        engine_burst_s=0.02,
        verifier_timeout=0.02,
        policy_failure=0.05,
    )
    mgr, engine, provider, runner = build(
        faults, data=rows(40), max_in_flight=32, max_staleness=1, max_attempts=6, batch_size=16
    )
    tracker = MetricsTracker(mgr)
    steps = 12
    async with mgr:
        batches = await train(mgr, engine, steps=steps, tracker=tracker)
        issued = set(mgr.source.pending)
    assert len(batches) == steps and all(sum(g.n for g in b) == 16 for b in batches)
    # every failure the runner raised is counted, by cause; the run saw each kind of fault
    assert dict(mgr.counters.failures) == runner.raised
    assert {"sandbox_create", "sandbox_transport", "engine_unavailable", "verifier_timeout"} <= set(
        runner.raised
    )
    assert engine.rejected_503 > 0
    # no infrastructure failure became a reward; policy failures are outcomes with their reward
    trained = samples_of(batches)
    assert all(s.status is not Status.FAILED_INFRA for s in trained if s.reward is not None)
    assert mgr.counters.infra_scored == 0
    assert any(s.status is Status.FAILED_POLICY and s.reward == 0.0 for s in trained)
    # no group dropped: every consumed group is whole, and every issued prompt is consumed or still held
    assert all(g.done for b in batches for g in b)
    assert mgr.counters.groups_filtered == 0
    assert len(mgr.buffer.consumed) == len(set(mgr.buffer.consumed)) == steps * 4
    held = {g.uid for g in mgr.buffer._groups} | set(mgr._unfinished) | set(mgr.source._requeued)
    assert issued <= held, "a prompt was issued and then lost"
    assert sum(sum(m.failures_by_cause.values()) for m in tracker.history) <= sum(runner.raised.values())
    assert provider.live_sandboxes() == 0 and provider.created == provider.closed


async def test_exhausted_retry_budget_emits_the_group_flagged_incomplete_without_a_reward(caplog) -> None:
    mgr, _engine, _provider, runner = build(max_attempts=3, max_staleness=None)
    inner = runner.run
    doomed: list[str] = []

    async def broken_one(row: dict, *, group_id: str, sample_index: int, **kw: Any) -> Episode:
        if not doomed:
            doomed.append(group_id)
        if group_id == doomed[0] and sample_index == 2:
            raise InfraError("sandbox backend down", cause="sandbox_create")
        return await inner(row, group_id=group_id, sample_index=sample_index, **kw)

    runner.run = broken_one  # type: ignore[method-assign]
    async with mgr:
        groups = []
        while not doomed or doomed[0] not in {g.uid for g in groups}:
            groups += await mgr.get_batch(timeout=10)
    g = next(g for g in groups if g.uid == doomed[0])
    assert not g.complete and g.done
    bad = g.episodes[2]
    assert bad is not None and bad.status is Status.FAILED_INFRA and bad.reward is None and not bad.trainable
    assert bad.metadata["causes"] == ["sandbox_create"] * 3
    assert len(g.trainable_episodes) == 3
    assert mgr.counters.samples_exhausted == 1 and mgr.counters.failures["sandbox_create"] == 3
    assert mgr.counters.groups_incomplete == 1
    assert "failed 3 attempts" in caplog.text


async def test_dynamic_filter_drops_groups_whose_rewards_are_all_equal() -> None:
    data = rows(10, p_pass=1.0) + rows(10, p_pass=0.5)
    mgr, _engine, _provider, _runner = build(data=data, dynamic_filter=True, max_staleness=None)
    async with mgr:
        batches = [await mgr.get_batch(timeout=10) for _ in range(4)]
    assert mgr.counters.groups_filtered > 0
    assert all(len({s.reward for s in g.episodes}) > 1 for b in batches for g in b)
    # a filtered prompt counts as seen: it is not redone after a resume
    assert len(mgr.buffer.consumed) == 8 + mgr.counters.groups_filtered
    # the rollout pass rate counts every finished group, filtered ones too
    c = mgr.counters
    assert c.samples_scored == 4 * (c.groups_emitted + c.groups_filtered)
    kept_passes = sum(s.reward >= 1.0 for b in batches for g in b for s in g.episodes)
    assert c.samples_passed >= kept_passes


async def test_skip_solved_spends_fewer_episodes_on_prompts_every_sample_solves() -> None:
    # rows 0-3 always solved, 4-7 never (both always dropped), 8-11 mixed
    data = rows(4, p_pass=1.0) + rows(4, p_pass=0.0) + rows(4, p_pass=0.5)
    spent = {}
    for skip in (0, 2):
        mgr, _engine, _provider, _runner = build(
            data=data, dynamic_filter=True, skip_solved=skip, max_staleness=None, max_in_flight=4
        )
        skipped_rows: list[int] = []
        skip_next = mgr.source.skip_next
        mgr.source.skip_next = lambda uid, n, f=skip_next, out=skipped_rows: (  # type: ignore[method-assign]
            out.append(int(uid.split(":")[1])),
            f(uid, n),
        )
        async with mgr:
            batches = [await mgr.get_batch(timeout=10) for _ in range(6)]
        assert all(len({s.reward for s in g.episodes}) > 1 for b in batches for g in b)
        assert mgr.counters.prompts_skipped == mgr.source.skipped
        assert not set(skipped_rows) & {4, 5, 6, 7}  # never a task nobody solved: it is still to learn
        assert set(skipped_rows) >= ({0, 1, 2, 3} if skip else set())
        spent[skip] = (mgr.counters.groups_filtered, mgr.counters.prompts_skipped)
    assert spent[0][1] == 0 and spent[2][1] > 0
    assert spent[2][0] < spent[0][0]  # fewer groups rolled out only to be dropped
    with pytest.raises(RolloutError, match="skip_solved must be >= 0"):
        RolloutConfig(batch_size=8, n_samples_per_prompt=4, skip_solved=-1)


async def test_dynamic_filter_with_no_signal_anywhere_fails_the_trainer_instead_of_waiting() -> None:
    mgr, _engine, _provider, _runner = build(
        data=rows(40, p_pass=0.0), dynamic_filter=True, max_filtered_in_a_row=6, max_staleness=None
    )
    async with mgr:
        with pytest.raises(BufferError, match="dropped 6 groups in a row") as info:
            await mgr.get_batch(timeout=30)
    assert isinstance(info.value.__cause__, RolloutError)
    assert mgr.counters.groups_filtered >= 6


async def test_hung_episode_hits_the_wall_clock_cap_is_retried_and_closes_its_sandbox() -> None:
    mgr, _engine, provider, _runner = build(
        SimFaults(hang=0.2), episode_timeout_s=0.3, max_attempts=10, max_staleness=None
    )
    groups = []
    async with mgr:
        while mgr.counters.episode_timeouts < 3:
            groups += await mgr.get_batch(timeout=20)
        # the groups of the timed-out samples complete through retries
        while not any(s.attempt for g in groups for s in g.episodes):
            groups += await mgr.get_batch(timeout=20)
    assert mgr.counters.failures["episode_timeout"] == mgr.counters.episode_timeouts >= 3
    assert all(g.complete for g in groups)
    assert provider.live_sandboxes() == 0


async def test_leaving_the_manager_cancels_running_episodes_and_closes_every_sandbox() -> None:
    slow = SimWorkload(engine_per_token_s=0.01, sandbox_create_s=0.001, median_turns=50, max_turns=100)
    mgr, _engine, provider, _runner = build(workload=slow, max_in_flight=24, max_staleness=None)
    all_live = asyncio.Event()
    create = provider.create

    async def watched(run_id: str) -> Any:
        sandbox = await create(run_id)
        if provider.live_sandboxes() == 24:
            all_live.set()
        return sandbox

    provider.create = watched  # type: ignore[method-assign]
    async with mgr:
        await asyncio.wait_for(all_live.wait(), 10)
        assert mgr.running == 24 and provider.live_sandboxes() == 24
    assert provider.live_sandboxes() == 0 and mgr.running == 0 and provider.created == provider.closed


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


CTRL_C_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from agentrl.rollout import RolloutConfig, RolloutManager
    from agentrl.testing.rollout_sim import SimEngine, SimSandboxProvider, SimulatedRunner, SimWorkload
    w = SimWorkload(engine_per_token_s=0.01, median_turns=50, max_turns=100)
    engine, provider = SimEngine(w), SimSandboxProvider(w)
    async def main():
        mgr = RolloutManager(SimulatedRunner(engine, provider, w), engine, [{"p": 1}] * 4,
                             RolloutConfig(batch_size=4, n_samples_per_prompt=2, max_in_flight=8))
        async with mgr:
            while provider.live_sandboxes() < 8:
                await asyncio.sleep(0.01)
            print("ready", flush=True)
            await mgr.get_batch(timeout=60)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print(f"interrupted live={provider.live_sandboxes()} created={provider.created}", flush=True)
""")


def test_ctrl_c_closes_every_sandbox() -> None:
    # The child must get Ctrl-C's default disposition, whatever this worker process inherited.
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_SCRIPT], stdout=subprocess.PIPE, text=True, preexec_fn=_default_sigint
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "interrupted live=0 created=8" in out


@pytest.mark.parametrize("mode", ["in_place", "abort"])
async def test_weight_update_modes_keep_per_turn_versions(mode: str) -> None:
    slower = SimWorkload(
        engine_per_token_s=0.0005,
        sandbox_create_s=0.001,
        sandbox_exec_s=0.001,
        verifier_s=0.001,
        median_turns=4,
        max_turns=20,
    )
    mgr, engine, _provider, _runner = build(workload=slower, max_staleness=2, max_in_flight=24)
    async with mgr:
        batches = await train(mgr, engine, steps=6, mode=mode)
    assert engine.pauses == [mode] * 6
    trained = samples_of(batches)
    assert all(s.turn_versions == sorted(s.turn_versions) for s in trained)
    mixed = [s for s in trained if len(set(s.turn_versions)) > 1]
    assert mixed, "episodes spanning an update must show turns on old and new weights"
    if mode == "abort":
        assert engine.aborted > 0
    else:
        assert engine.aborted == 0


async def test_update_weights_resumes_engine_and_admission_even_when_sync_fails() -> None:
    mgr, engine, _provider, _runner = build(max_staleness=None)

    async def broken_sync() -> None:
        raise RuntimeError("NCCL broadcast failed")

    async with mgr:
        await mgr.get_batch(timeout=10)
        with pytest.raises(RuntimeError, match="NCCL"):
            await mgr.update_weights(broken_sync)
        assert engine._open.is_set() and mgr._admit_open.is_set()
        assert len(await mgr.get_batch(timeout=10)) == 2
        with pytest.raises(RolloutError, match="pause mode"):
            await mgr.update_weights(bump(engine), mode="bogus")  # type: ignore[arg-type]


async def test_eval_while_training_pauses_admission_uses_eval_settings_and_reports() -> None:
    mgr, _engine, provider, runner = build(SimFaults(create_failure=0.1), max_staleness=None, max_attempts=6)
    inner = runner.run
    train_starts_during_eval: list[str] = []
    in_eval = asyncio.Event()

    async def spy(row: dict, *, eval: bool = False, **kw: Any) -> Episode:
        if in_eval.is_set() and not eval:
            train_starts_during_eval.append(kw["group_id"])
        return await inner(row, eval=eval, **kw)

    runner.run = spy  # type: ignore[method-assign]
    async with mgr:
        await mgr.get_batch(timeout=10)
        async with mgr.paused():
            in_eval.set()
            report = await evaluate(
                runner, rows(20, p_pass=0.25) + rows(20, p_pass=1.0), samples_per_row=2, max_attempts=6
            )
            in_eval.clear()
        await mgr.get_batch(timeout=10)
    assert not train_starts_during_eval
    assert report.episodes == 80 and report.unscored == 0 and runner.eval_runs >= 80
    assert 0.45 < report.pass_at(1) < 0.80 and report.mean_reward() == report.pass_at(1)
    assert provider.live_sandboxes() == 0


async def test_resume_mid_epoch_neither_repeats_nor_skips_a_prompt() -> None:
    data = rows(12)
    mgr, engine, provider, _runner = build(data=data, max_staleness=1)
    mgr.source.max_epochs = 1
    async with mgr:
        first = await train(mgr, engine, steps=2)
        state = json.loads(json.dumps(mgr.state_dict()))
    assert state["source"]["pending"], "the checkpoint must catch prompts in flight"
    mgr2, engine2, provider2, _ = build(data=data, max_staleness=1)
    mgr2.source.max_epochs = 1
    mgr2.load_state_dict(state)
    assert mgr2.counters.groups_emitted == state["counters"]["groups_emitted"] > 0
    second = []
    async with mgr2:
        with pytest.raises(RolloutFinished):
            while True:
                second += await train(mgr2, engine2, steps=1)
    trained = [g.uid for b in first + second for g in b]
    assert len(trained) == len(set(trained)) == 12
    assert set(trained) == {f"0:{i}" for i in range(12)}
    assert provider.live_sandboxes() == provider2.live_sandboxes() == 0


async def test_an_untyped_error_in_one_episode_is_caught_counted_and_the_run_goes_on(caplog) -> None:
    mgr, engine, _provider, runner = build(max_staleness=None)
    inner = runner.run

    async def buggy(row: dict, *, sample_index: int, **kw: Any) -> Episode:
        if sample_index == 1:
            raise KeyError("metadata")
        return await inner(row, sample_index=sample_index, **kw)

    runner.run = buggy  # type: ignore[method-assign]
    async with mgr:
        batches = await train(mgr, engine, steps=3)
    groups = [g for b in batches for g in b]
    assert len(groups) == 6 and all(not g.complete for g in groups)
    assert all(
        g.episodes[1].failure_cause == "internal_error" and g.episodes[1].reward is None for g in groups
    )
    assert all(len(g.trainable_episodes) == 3 for g in groups)
    assert mgr.counters.internal_errors >= 18 and mgr.counters.failures["internal_error"] >= 18
    assert "KeyError" in caplog.text


def test_batch_size_must_hold_whole_groups() -> None:
    with pytest.raises(RolloutError, match="multiple of n_samples_per_prompt"):
        RolloutConfig(batch_size=10, n_samples_per_prompt=4)


async def test_step_metrics_go_to_jsonl_and_a_table(tmp_path) -> None:
    mgr, engine, _provider, _runner = build(SimFaults(create_failure=0.2), max_attempts=8)
    path = tmp_path / "metrics" / "rollout.jsonl"
    tracker = MetricsTracker(mgr, path)
    async with mgr:
        await train(mgr, engine, steps=3, tracker=tracker)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert sum(x["samples"] for x in lines) == 24
    assert (
        sum(sum(x["failures_by_cause"].values()) for x in lines)
        == mgr.counters.failures["sandbox_create"]
        > 0
    )
    assert all(
        x["engine_s"] > 0 and x["sandbox_s"] > 0 and x["verifier_s"] > 0 and x["tokens_per_s"] > 0
        for x in lines
    )
    assert sum(sum(x["staleness_hist"].values()) for x in lines) == 24
    console = Console(record=True, width=120)
    console.print(render(tracker.history[-1]))
    text = console.export_text()
    assert "reward mean" in text and "sandbox_create=" in text and "staleness" in text


def test_virtual_time_runs_simulated_hours_of_rollout_in_real_seconds() -> None:
    slow = SimWorkload(engine_per_token_s=0.1, sandbox_create_s=2.0, sandbox_exec_s=1.0, verifier_s=2.0)

    async def main() -> tuple[float, int]:
        mgr, engine, provider, _runner = build(workload=slow, max_staleness=1, episode_timeout_s=3600)
        t0 = clock()
        async with mgr:
            batches = await train(mgr, engine, steps=4, timeout=3600)
        assert provider.live_sandboxes() == 0
        return clock() - t0, len(samples_of(batches))

    # Minutes of simulated rollout (a real clock would need them too; the suite's timeout bounds it).
    simulated_s, n = run_virtual_time(main())
    assert n == 32 and simulated_s > 60


async def test_a_group_that_can_no_longer_be_trained_in_bound_is_cancelled_in_flight_and_redone() -> None:
    mgr, engine, provider, runner = build(max_staleness=1)
    inner = runner.run
    first: list[str] = []
    cancelled: list[str] = []

    async def stuck_once(row: dict, *, group_id: str, sample_index: int, **kw: Any) -> Episode:
        if not first:
            first.append(group_id)
            sandbox = await provider.create(f"{group_id}/stuck")
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(group_id)
                raise
            finally:
                await sandbox.close()
        return await inner(row, group_id=group_id, sample_index=sample_index, **kw)

    runner.run = stuck_once  # type: ignore[method-assign]
    async with mgr:
        batches = await train(mgr, engine, steps=5)
    trained = [g.uid for b in batches for g in b]
    assert cancelled == first and mgr.counters.stale_cancelled == 1
    assert trained.count(first[0]) == 1, "the re-queued prompt is redone and trained once"
    assert all(s.metadata["consumed_version"] - s.start_version <= 1 for s in samples_of(batches))
    assert provider.live_sandboxes() == 0


def test_the_old_rollout_sim_command_names_its_new_place() -> None:
    from typer.testing import CliRunner

    from agentrl.cli import app

    result = CliRunner().invoke(app, ["rollout", "sim", "--steps", "2"])
    assert result.exit_code == 2 and "benchmarks/rollout_faults.py sim" in result.output


def test_rollout_sim_command_prints_step_tables_and_leaks_nothing(tmp_path) -> None:
    import runpy

    from typer.testing import CliRunner

    app = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "rollout_faults.py"))["app"]
    path = tmp_path / "m.jsonl"
    result = CliRunner().invoke(
        app, ["sim", "--steps", "2", "--batch-size", "16", "--n-samples", "4", "--metrics", str(path)]
    )
    assert result.exit_code == 0, result.output
    assert "rollout step 1" in result.output and "live 0;" in result.output
    assert len(path.read_text().splitlines()) == 2


@pytest.mark.parametrize("advance", [0, 4])
async def test_a_weight_update_must_advance_the_version_by_exactly_one(advance: int) -> None:
    """The staleness bound counts versions: a sync that pushes the optimizer's step count (4 per
    rollout step with 4 minibatches) would cancel good in-flight work as stale, and one that leaves
    the version alone would never bound staleness. Both are refused, and the engines resume."""
    mgr, engine, _, _ = build()

    async def sync() -> None:
        await engine.set_weights(engine.weight_version + advance)

    async with mgr:
        await mgr.get_batch(timeout=20)
        with pytest.raises(RolloutError, match="must add exactly 1"):
            await mgr.update_weights(sync)
        assert engine._open.is_set() and mgr._admit_open.is_set()
        await mgr.update_weights(bump(engine))  # a correct update still works afterwards
        await mgr.get_batch(timeout=20)


async def test_a_row_that_cannot_be_run_is_not_retried_not_scored_and_the_run_goes_on(caplog) -> None:
    from agentrl.errors import TaskFormatError

    mgr, engine, _provider, runner = build(data=rows(4), max_staleness=None, max_attempts=5)
    inner = runner.run
    calls: Counter[tuple[str, int]] = Counter()

    async def broken_task(row: dict, *, group_id: str, sample_index: int, **kw: Any) -> Episode:
        if row["metadata"]["task_id"] == "t3":
            calls[group_id, sample_index] += 1
            raise TaskFormatError(
                "t3/instruction.md", None, "the instruction is 48 MB", "keep it under 256 KiB"
            )
        return await inner(row, group_id=group_id, sample_index=sample_index, **kw)

    runner.run = broken_task  # type: ignore[method-assign]
    async with mgr:
        batches = await train(mgr, engine, steps=5)
    bad = [g for b in batches for g in b if g.row["metadata"]["task_id"] == "t3"]
    assert bad and all(not g.complete and not g.trainable_episodes for g in bad)
    assert all(
        e is not None and e.failure_cause == "bad_input" and e.reward is None for g in bad for e in g.episodes
    )
    # Once per episode, never retried: every emitted t3 episode was run exactly once (a t3 group
    # still in flight when the run stopped may have started more episodes than were emitted).
    assert set(calls.values()) == {1}
    assert all((g.uid, i) in calls for g in bad for i in range(len(g.episodes)))
    assert mgr.counters.failures["bad_input"] == sum(calls.values())
    assert "fix the data" in caplog.text


async def test_policy_failures_are_counted_by_cause_and_reported_per_step(tmp_path) -> None:
    mgr, engine, _provider, runner = build(max_staleness=None)
    inner = runner.run

    async def tampering(row: dict, **kw: Any) -> Episode:
        episode = await inner(row, **kw)
        if kw["sample_index"] == 0:
            episode.status, episode.reward, episode.failure_cause = Status.FAILED_POLICY, 0.0, "tampered"
        return episode

    runner.run = tampering  # type: ignore[method-assign]
    tracker = MetricsTracker(mgr, tmp_path / "m.jsonl")
    async with mgr:
        await train(mgr, engine, steps=2, tracker=tracker)
    assert mgr.counters.policy_failures["tampered"] >= 4
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert sum(r["policy_failures_by_cause"].get("tampered", 0) for r in rows) >= 4
    assert "policy failures (scored 0)" in str(render(tracker.history[-1]).columns[0]._cells)
