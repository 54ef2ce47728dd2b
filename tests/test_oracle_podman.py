"""The oracle sweep on real containers, including every kind of bad input: each ends in a failure
cause naming what went wrong, and nothing is left running."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.episode.oracle import run_oracle
from agentrl.sandbox.podman import LABEL_RUN, PodmanProvider
from agentrl.tasks.task import discover_tasks, load_task

FIXTURES = Path(__file__).parent / "fixtures" / "sandbox_tasks"
CLI = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(shutil.which(CLI) is None, reason=f"{CLI} is not installed"),
]


def left_behind(run_id: str) -> list[str]:
    out = subprocess.run(
        [CLI, "ps", "-a", "--filter", f"label={LABEL_RUN}={run_id}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


async def test_oracle_over_good_and_bad_tasks() -> None:
    run_id = f"oracle-{uuid.uuid4().hex[:8]}"
    tasks = discover_tasks(FIXTURES)
    results = {r.task_id: r for r in await run_oracle(PodmanProvider(cli=CLI), tasks, run_id=run_id)}
    assert results["write-hello"].ok and results["write-hello"].reward == 1.0
    expected_causes = {
        "build-fails": "image_build",
        "no-test-sh": "task_format",
        "solve-hangs": "solution_timeout",
        "no-reward": "verifier_error",
        "verifier-hangs": "verifier_timeout",
        "reward-json": "wrong_reward",
    }
    assert {k: results[k].cause for k in expected_causes} == expected_causes
    assert "building-step" in results["build-fails"].detail  # the build log tail
    assert "tests ran but wrote no reward" in results["no-reward"].detail  # test-stdout tail
    # Stored without its executable bit: made executable inside, as Harbor does.
    assert results["test-not-executable"].ok, results["test-not-executable"].detail
    assert results["reward-json"].reward == 0.5
    assert left_behind(run_id) == []


async def test_without_solution_rewards_are_zero() -> None:
    run_id = f"oracle-{uuid.uuid4().hex[:8]}"
    task = load_task(FIXTURES / "write-hello")
    [result] = await run_oracle(PodmanProvider(cli=CLI), [task], run_id=run_id, solution=False)
    assert result.ok and result.reward == 0.0 and result.expected == 0.0
    assert left_behind(run_id) == []


def test_cli_exit_codes() -> None:
    runner = CliRunner()
    run_id = f"oracle-{uuid.uuid4().hex[:8]}"
    good = runner.invoke(app, ["tasks", "oracle", str(FIXTURES / "write-hello"), "--run-id", run_id])
    assert good.exit_code == 0, good.output
    assert "1/1 tasks gave the expected reward" in good.output
    untouched = runner.invoke(
        app, ["tasks", "oracle", str(FIXTURES / "write-hello"), "--no-solution", "--run-id", run_id]
    )
    assert untouched.exit_code == 0, untouched.output  # untouched, the task gives 0: as expected
    failing = runner.invoke(app, ["tasks", "oracle", str(FIXTURES / "no-reward"), "--run-id", run_id])
    assert failing.exit_code == 1 and "verifier_error" in failing.output
    assert left_behind(run_id) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["two-step-notes", "kv-service-count", "sales-total-artifact"])
async def test_the_bundled_multi_step_compose_and_separate_verifier_tasks_score_one_and_zero(
    name: str,
) -> None:
    """`agentrl tasks oracle` on the bundled tasks that exercise Harbor's newer features (steps,
    compose services, a separate verifier image): the reference solution scores 1, no solution 0,
    and nothing is left running."""
    from tests.conftest import BUNDLED_TASKS

    run_id = f"oracle-{uuid.uuid4().hex[:8]}"
    task = load_task(BUNDLED_TASKS / name)
    provider = PodmanProvider(cli=CLI)
    [solved] = await run_oracle(provider, [task], run_id=run_id)
    [unsolved] = await run_oracle(provider, [task], run_id=run_id, solution=False)
    assert (solved.reward, solved.cause) == (1.0, None), solved.detail
    assert (unsolved.reward, unsolved.cause) == (0.0, None), unsolved.detail
    assert left_behind(run_id) == []
