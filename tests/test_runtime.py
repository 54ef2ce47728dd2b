"""The library runtime on fakes: rollout -> advantages -> trainer -> weight sync -> eval ->
checkpoint -> resume, with the tiny model, in-process sync and in-memory sandboxes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.runtime import RunConfig, close_parts, resolve, train
from agentrl.runtime.build import build_parts
from tests.conftest import BUNDLED_TASKS

pytestmark = pytest.mark.slow


def config(tmp_path: Path, model: Path, *overrides: str) -> RunConfig:
    defaults = {
        "out": str(tmp_path / "run"),
        "steps": 2,
        "env": {
            "name": "tbench2",
            "tasks": str(BUNDLED_TASKS),
            "max_solution_chars": 64,
            "backend": "fake",
            "action_format": "fenced-bash",
            "agent": {"max_turns": 1, "max_new_tokens": 12, "min_turn_tokens": 4, "max_total_tokens": 2048},
        },
        "engine": {"model": str(model)},
        "rollout": {"batch_size": 4, "n_samples_per_prompt": 2, "max_in_flight": 4, "max_staleness": 1},
        "trainer": {"lr": 1e-3, "num_minibatches": 2, "logprob_chunk_size": None},
        "eval": {"samples_per_row": 1},
    }
    return resolve(RunConfig, defaults=defaults, overrides=list(overrides))


def alternate_rewards(parts) -> None:  # type: ignore[no-untyped-def]
    """A random-init model never solves a task: alternate rewards so groups carry signal."""
    parts.env.provider.grader = lambda sb: float(int(sb.sandbox_id.rsplit("-", 1)[-1]) % 2)


async def test_train_checkpoints_and_resumes_where_it_stopped(tmp_path: Path, monkeypatch, capsys) -> None:
    from agentrl.models.tiny import tiny_model_dir
    from tests.test_progress import _has_bar, _plain

    monkeypatch.setenv("AGENTRL_PROGRESS", "1")  # the bars, forced: on stderr, never in the run's files

    model = Path(tiny_model_dir())
    cfg = config(tmp_path, model)
    parts = build_parts(cfg)
    alternate_rewards(parts)
    try:
        result = await train(cfg, parts)
    finally:
        await close_parts(parts)
    out = cfg.out_dir
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and result.steps == 2
    assert [r["extra"]["version"] for r in rows] == [1, 2]  # one weight version per rollout step
    assert [r["extra"]["trainer"]["step"] for r in rows] == [2.0, 4.0]  # two minibatches each
    assert all(r["samples"] == 4 and r["internal_errors"] == 0 for r in rows)
    assert [e["label"] for e in result.evals] == ["before", "after"]
    assert result.evals[-1]["weight_version"] == 2
    assert json.loads((out / "config.json").read_text())["rollout"]["batch_size"] == 4
    assert (out / "checkpoints" / "latest").exists() and (out / "reward.png").is_file()
    assert parts.env.provider.live_sandboxes() == 0
    shown, err = capsys.readouterr()
    assert "train" in _plain(err) and "2/2" in _plain(err) and "eval before" in _plain(err)
    assert not _has_bar(shown)
    for name in ("run.log", "metrics.jsonl", "evals.json", "config.json"):
        assert not _has_bar((out / name).read_text()), name

    cfg2 = config(tmp_path, model, "steps=3", "checkpoint.resume=true")
    parts2 = build_parts(cfg2)
    alternate_rewards(parts2)
    try:
        result2 = await train(cfg2, parts2)
    finally:
        await close_parts(parts2)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["extra"]["trainer"]["step"] == 6.0  # the optimizer state and step came back
    assert [e["label"] for e in result2.evals] == ["before", "after", "after"]


async def test_a_resumed_run_that_is_already_done_does_nothing(tmp_path: Path) -> None:
    from agentrl.models.tiny import tiny_model_dir

    model = Path(tiny_model_dir())
    cfg = config(tmp_path, model, "steps=1", "eval.before=false", "eval.after=false")
    parts = build_parts(cfg)
    alternate_rewards(parts)
    try:
        await train(cfg, parts)
    finally:
        await close_parts(parts)
    again = config(tmp_path, model, "steps=1", "checkpoint.resume=true")
    parts = build_parts(again)
    try:
        result = await train(again, parts)
    finally:
        await close_parts(parts)
    assert result.steps == 1 and result.metrics == []


async def test_an_eval_on_servers_set_aside_runs_while_training_goes_on(tmp_path: Path) -> None:
    """eval.mode=auto with a fleet of three servers: the eval of step 2 takes one server out at
    version 2 and cannot finish before step 4 has trained (its turns wait for that), so training
    and its weight pushes went on beside it; every turn of the eval ran on version 2; the server
    is given back after it, and the evals are recorded in order."""
    import asyncio
    import copy

    from agentrl.engine.local import LocalEngine
    from agentrl.engine.server import EngineServer
    from agentrl.models.tiny import load_tiny, tiny_model_dir

    model_dir = Path(tiny_model_dir())
    model, tok = load_tiny()
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(3)]
    step4 = asyncio.Event()
    seen: list[int] = []  # the version the aside server had at each eval turn
    real = engines[2].generate

    active = 0  # turns running on the third server before the eval's
    idle = asyncio.Event()
    idle.set()
    gate = False

    async def turn(*args, **kw):  # type: ignore[no-untyped-def]
        nonlocal active
        if gate:  # an eval turn: it cannot end before step 4 has trained
            seen.append(engines[2].weight_version)
            await asyncio.wait_for(step4.wait(), 120)
            return await real(*args, **kw)
        active += 1
        idle.clear()
        try:
            return await real(*args, **kw)
        finally:
            active -= 1
            if not active:
                idle.set()

    engines[2].generate = turn  # type: ignore[method-assign]
    lines: list[str] = []

    def reporter(text: str) -> None:
        lines.append(text)
        if text.startswith("step 4/"):
            step4.set()

    async with (
        EngineServer(engines[0], port=0) as a,
        EngineServer(engines[1], port=0) as b,
        EngineServer(engines[2], port=0) as c,
    ):
        cfg = config(
            tmp_path,
            model_dir,
            "steps=4",
            "engine.kind=sglang",
            f'engine.urls=["{a.url}","{b.url}","{c.url}"]',
            "sync.transport=tensor",
            "eval.before=false",
            "eval.every=2",
        )
        parts = build_parts(cfg)
        alternate_rewards(parts)
        set_aside = parts.engine.set_aside

        async def set_aside_then_gate(n: int):  # type: ignore[no-untyped-def]
            nonlocal gate
            client = await set_aside(n)
            assert client.base_urls == [c.url]
            await idle.wait()  # training turns sent before it left finish there, on version 2
            gate = True
            return client

        parts.engine.set_aside = set_aside_then_gate  # type: ignore[method-assign]
        try:
            result = await train(cfg, parts, reporter=reporter)
        finally:
            await close_parts(parts)
    for e in engines:
        await e.aclose()
    assert [e["label"] for e in result.evals] == ["step-2", "after"]
    aside, after = result.evals
    assert aside["mode"] == "aside" and aside["weight_version"] == 2 and after["weight_version"] == 4
    assert seen and set(seen) == {2}
    order = [line.split(":")[0].split("/")[0] for line in lines if line.startswith(("step ", "eval step-2"))]
    assert order.index("step 4") < order.index("eval step-2 (step 2)")
    assert [e.weight_version for e in engines] == [4, 4, 2]  # given back after the last push
    assert json.loads((cfg.out_dir / "evals.json").read_text()) == result.evals


async def test_an_eval_that_cannot_run_fails_the_run_before_its_first_step(tmp_path: Path) -> None:
    from agentrl.errors import AgentRLError
    from agentrl.models.tiny import tiny_model_dir
    from agentrl.overrides import ConfigError

    model = Path(tiny_model_dir())
    cases = [
        (("eval.every=1", "eval.mode=aside"), ConfigError, "eval.mode=pause"),  # one local engine
        (("eval.every=1", f"env.eval_tasks={tmp_path / 'missing'}"), AgentRLError, "does not exist"),
    ]
    for overrides, error, message in cases:
        cfg = config(tmp_path, model, "eval.before=false", *overrides)
        parts = build_parts(cfg)
        try:
            with pytest.raises(error, match=message):
                await train(cfg, parts)
        finally:
            await close_parts(parts)
        assert not (cfg.out_dir / "metrics.jsonl").exists()


async def test_a_run_starts_servers_a_crashed_run_left_paused(tmp_path: Path) -> None:
    """A trainer killed between a sync's pause and its resume leaves the servers paused; the next
    run (a resume, or a new run on the same fleet) starts them again instead of waiting there."""
    import copy

    from agentrl.engine.local import LocalEngine
    from agentrl.engine.server import EngineServer
    from agentrl.engine.sglang import SGLangEngine
    from agentrl.models.tiny import load_tiny, tiny_model_dir

    model, tok = load_tiny()
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, port=0) as server:
        crashed = SGLangEngine([server.url])
        await crashed.pause("in_place")
        await crashed.aclose()
        assert engine.paused
        cfg = config(
            tmp_path,
            Path(tiny_model_dir()),
            "steps=1",
            "engine.kind=sglang",
            f'engine.urls=["{server.url}"]',
            "sync.transport=tensor",
            "eval.before=false",
            "eval.after=false",
            "rollout.episode_timeout_s=20",
            "batch_timeout_s=60",
        )
        parts = build_parts(cfg)
        alternate_rewards(parts)
        try:
            result = await train(cfg, parts)
        finally:
            await close_parts(parts)
    await engine.aclose()
    assert result.steps == 1 and not engine.paused and engine.weight_version == 1


def test_torchrun_with_the_one_process_trainer_is_refused_with_the_fix(tmp_path: Path, monkeypatch) -> None:
    from agentrl.models.tiny import tiny_model_dir
    from agentrl.runtime.ranks import RankError, run_ranks

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RankError, match=r"trainer\.backend=torch trains in one process"):
        run_ranks(config(tmp_path, Path(tiny_model_dir())))
