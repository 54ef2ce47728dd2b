"""The library runtime trains the terminal environment through the `openenv` plugin against
`agentrl env serve`, as it trains it directly: the tiny model, in-process weight sync, and the same
sandbox backend on both sides of the wire (in-memory, or podman with the real verifier). For the
same seeds the two paths give the same episodes token for token; two training steps through either
give the same shape of numbers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.env_server")
pytest.importorskip("torch")

from agentrl.openenv.config import ServeConfig
from agentrl.openenv.server import run_in_thread
from agentrl.runtime import RunConfig, close_parts, resolve, train
from agentrl.runtime.build import build_parts
from agentrl.testing.sandbox import FakeSandbox, FakeSandboxProvider
from tests.conftest import BUNDLED_TASKS
from tests.test_openenv_server import eventually

pytestmark = pytest.mark.slow

AGENT = {
    "max_turns": 1,
    "max_new_tokens": 12,
    "min_turn_tokens": 4,
    "max_total_tokens": 2048,
    "terminal": "commands",
}


def parity(sb: FakeSandbox) -> float:
    """A random-init model never solves a task: alternate rewards so groups carry signal (as
    tests/test_runtime.py does), on whichever side of the wire the sandbox lives."""
    return float(int(sb.sandbox_id.rsplit("-", 1)[-1]) % 2)


def config(tmp_path: Path, name: str, env: dict[str, Any]) -> RunConfig:
    from agentrl.models.tiny import tiny_model_dir

    defaults = {
        "out": str(tmp_path / name),
        "steps": 2,
        "env": env,
        "engine": {"model": str(tiny_model_dir())},
        "rollout": {"batch_size": 4, "n_samples_per_prompt": 2, "max_in_flight": 4, "max_staleness": 1},
        "trainer": {"lr": 1e-3, "num_minibatches": 2, "logprob_chunk_size": None},
        "eval": {"samples_per_row": 1},
    }
    return resolve(RunConfig, defaults=defaults)


def metrics(cfg: RunConfig) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (cfg.out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", ["fake", pytest.param("podman", marks=pytest.mark.container)])
async def test_two_training_steps_through_the_openenv_plugin_match_the_direct_path(
    tmp_path: Path, backend: str
) -> None:
    if backend == "fake":
        tasks = {"name": "tbench2", "tasks": str(BUNDLED_TASKS), "max_solution_chars": 64, "backend": "fake"}
    else:  # one small task: every episode is a real container and a real verifier run
        shutil.copytree(BUNDLED_TASKS / "hello-file", tmp_path / "tasks" / "hello-file")
        tasks = {"name": "tbench2", "tasks": str(tmp_path / "tasks"), "backend": "podman"}
    direct_cfg = config(tmp_path, "direct", {**tasks, "action_format": "fenced-bash", "agent": AGENT})
    direct = build_parts(direct_cfg)
    served = None
    if backend == "fake":
        direct.env.provider.grader = parity  # type: ignore[attr-defined]
        served = FakeSandboxProvider(grader=parity)
    rows = direct.env.rows("train")
    task_ids = [r["metadata"]["task_id"] for r in rows]
    with run_in_thread(ServeConfig(env=tasks, port=0, max_sessions=8), provider=served) as (url, server):
        remote_env = {
            "name": "openenv",
            "url": url,
            "task_ids": task_ids,
            "action_format": "fenced-bash",
            "agent": AGENT,
        }
        remote_cfg = config(tmp_path, "remote", remote_env)
        remote = build_parts(remote_cfg)
        try:
            # The same weights and seeds: the same episodes, token for token, log-prob for log-prob.
            here = direct.env.runner(direct.engine, run_id="seeded")
            there = remote.env.runner(remote.engine, run_id="seeded")
            for seed, row in enumerate(rows[:3]):
                a = await here.run(row, group_id=task_ids[seed], sample_index=0, eval=True, seed=seed)
                b = await there.run(row, group_id=task_ids[seed], sample_index=0, eval=True, seed=seed)
                assert [s.tokens for s in a.segments] == [s.tokens for s in b.segments]
                assert [s.rollout_logprobs for s in a.segments] == [s.rollout_logprobs for s in b.segments]
                assert (a.status, a.end_reason) == (b.status, b.end_reason)

            for cfg, parts in ((direct_cfg, direct), (remote_cfg, remote)):
                result = await train(cfg, parts)
                assert result.steps == 2 and [e["label"] for e in result.evals] == ["before", "after"]
        finally:
            await close_parts(direct)
            await close_parts(remote)
        assert await eventually(lambda: server.hub.sandboxes == 0)

    d, r = metrics(direct_cfg), metrics(remote_cfg)
    for name, rows_ in (("direct", d), ("remote", r)):
        assert [m["step"] for m in rows_] == [1, 2], name
        assert [m["extra"]["version"] for m in rows_] == [1, 2], name  # a weight sync per step
        assert [m["extra"]["trainer"]["step"] for m in rows_] == [2.0, 4.0], name
        assert all(
            m["samples"] == 4 and m["internal_errors"] == 0 and not m["failures_by_cause"] for m in rows_
        )
    # Fake: rewards alternate by sandbox, so each step's mean is near 0.5 on both paths. Podman: a
    # random model never solves the task, 0 on both. The sampled tokens differ (training sampling is
    # not seeded); the amount of them does not.
    for m_d, m_r in zip(d, r, strict=True):
        assert abs(m_d["reward_mean"] - m_r["reward_mean"]) <= (0.5 if backend == "fake" else 0.0)
        assert 0 < m_r["response_tokens"] <= 4 * AGENT["max_new_tokens"]
    before_d = json.loads((direct_cfg.out_dir / "evals.json").read_text())[0]
    before_r = json.loads((remote_cfg.out_dir / "evals.json").read_text())[0]
    assert before_d["episodes"] == before_r["episodes"] and before_r["unscored"] == 0
    assert before_d["pass@1"] == before_r["pass@1"]
