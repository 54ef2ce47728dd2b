"""terminal-bench-2's data hooks for the cluster recipes (`agentrl.cluster.recipe.env_data`: the
plugin's `data` attribute).

`prepare` downloads the task set (or takes a local directory of Harbor tasks) and splits it into
the training tasks `<data_dir>/tbench2` (`env.tasks`) and the held-out eval tasks
`<data_dir>/tbench2-eval` (`env.eval_tasks`); `settings` points a run at them; `smoke_settings` is
local mode's small run on the bundled tasks in podman sandboxes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from envs.tbench2.environment import BUNDLED_TASKS
from envs.tbench2.hub import TASKS_REPO, download_tasks, split_tasks


def settings(data_dir: str | Path) -> dict[str, Any]:
    """The run settings that train on what `prepare` wrote under `data_dir`."""
    return {
        "env.tasks": f"{data_dir}/tbench2",
        "env.eval_tasks": f"{data_dir}/tbench2-eval",  # held-out tasks, disjoint from env.tasks
    }


def describe(data_dir: str | Path, *, source: str | None = None, eval_count: int = 20, seed: int = 0) -> str:
    """What `prepare` does with the data (its `--dry-run` line)."""
    data_dir = Path(data_dir)
    where = f"tasks from {source}" if source else f"download the dataset {TASKS_REPO}"
    return f"{where} -> {data_dir / 'tbench2'}, {eval_count} held out (seed {seed}) -> {data_dir / 'tbench2-eval'}"


def prepare(
    data_dir: str | Path,
    *,
    source: str | None = None,
    eval_count: int = 20,
    seed: int = 0,
    report: Callable[[str], Any] = print,
) -> None:
    """The task set (downloaded, or `source`), split into the training tasks (`<data_dir>/tbench2`,
    `env.tasks`) and the held-out eval tasks (`<data_dir>/tbench2-eval`)."""
    data_dir = Path(data_dir)
    tasks = Path(source) if source else download_tasks(data_dir / "terminal-bench-2")
    split_tasks(
        tasks,
        data_dir / "tbench2",
        data_dir / "tbench2-eval",
        eval_count=eval_count,
        seed=seed,
        report=report,
    )


def smoke_settings(run_dir: str | Path) -> list[str]:
    """Local mode (a tiny model on simulated nodes): the bundled tasks in podman sandboxes, short
    episodes."""
    return [
        "env.backend=podman",
        f"env.tasks={BUNDLED_TASKS}",
        f"env.eval_tasks={BUNDLED_TASKS}",
        "env.max_solution_chars=64",
        "env.action_format=fenced-bash",
        "env.max_agent_timeout_s=60",
        "env.agent.max_turns=2",
        "env.agent.max_new_tokens=32",
        "env.agent.max_total_tokens=1024",
        "env.agent.command_timeout_s=20",
    ]
