"""The dapo_math environment through the unchanged library runtime: the same rollout manager,
trainer, weight sync and shared evaluator as the terminal environment, with the tiny math model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("math_verify")
pytest.importorskip("torch")

from agentrl.runtime import RunConfig, close_parts, resolve, train
from agentrl.runtime.build import build_parts
from agentrl.tasks.rows import write_jsonl
from envs.dapo_math.synthetic import arithmetic_rows

pytestmark = pytest.mark.slow


async def test_two_async_grpo_steps_on_math_rows_through_the_runtime(tmp_path: Path) -> None:
    from agentrl.models.tiny import tiny_math_model_dir

    rows = arithmetic_rows(8, seed=0, kinds=(("+", 1, 1),))
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "eval.jsonl", rows[:2])
    defaults = {
        "out": str(tmp_path / "run"),
        "steps": 2,
        "env": {
            "name": "dapo_math",
            "train_file": str(tmp_path / "train.jsonl"),
            "eval_file": str(tmp_path / "eval.jsonl"),
            "max_new_tokens": 8,
            "verify_workers": 1,
        },
        "engine": {"model": str(tiny_math_model_dir())},
        "rollout": {"batch_size": 4, "n_samples_per_prompt": 2, "max_in_flight": 4, "max_staleness": 1},
        "trainer": {"lr": 1e-4, "num_minibatches": 1, "logprob_chunk_size": None},
        "eval": {"samples_per_row": 2},
    }
    cfg = resolve(RunConfig, defaults=defaults)
    parts = build_parts(cfg)
    try:
        result = await train(cfg, parts)
    finally:
        await close_parts(parts)
    metrics = [json.loads(line) for line in (cfg.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and result.steps == 2
    assert [m["extra"]["version"] for m in metrics] == [1, 2]  # a weight sync every step
    assert all(m["samples"] == 4 and m["internal_errors"] == 0 for m in metrics)
    assert [e["label"] for e in result.evals] == ["before", "after"]
    assert all(e["unscored"] == 0 and e["episodes"] == 4 for e in result.evals)
    # A random-init model answers nonsense: every verdict is a policy outcome, none is infra.
    assert sum(parts.env.verifier.counts.values()) >= 8 + 8  # type: ignore[attr-defined]
