"""terminal-bench-2 for the GLM-5.2 recipe: download the task set and split off held-out eval tasks.

The tasks are the Hugging Face mirror of the terminal-bench-2 repository
(`harborframework/terminal-bench-2.0`, a dataset repository holding one Harbor task directory per
task, as github.com/laude-institute/terminal-bench-2 does), fetched with huggingface_hub's
`snapshot_download` (`$HF_ENDPOINT` or a mirror given here), or any local directory of Harbor
tasks (a git checkout). `split_tasks` lints them, keeps the valid ones, and copies a fixed
held-out set (`eval_count`, chosen by a seeded hash of the task names, so a given seed picks the
same tasks from the same set) and the rest into two directories: the recipe trains on one
(`env.tasks`) and evaluates on the other (`env.eval_tasks`), as the reference run trains on 69
tasks and evaluates on 20 it never trains on.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.errors import AgentRLError

TASKS_REPO = "harborframework/terminal-bench-2.0"


class TasksHubError(AgentRLError):
    """The task set could not be downloaded or split."""


def download_tasks(
    local_dir: str | Path, *, repo: str = TASKS_REPO, revision: str | None = None, endpoint: str | None = None
) -> Path:
    """The task repository's files as plain files in `local_dir` (not the cache's links to blobs,
    which would leave every task file a link out of its task); returns `local_dir`."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise TasksHubError("downloading needs huggingface_hub (pip install huggingface_hub)") from None
    try:
        return Path(
            snapshot_download(
                repo, repo_type="dataset", revision=revision, local_dir=str(local_dir), endpoint=endpoint
            )
        )
    except Exception as exc:  # offline, DNS, HTTP 4xx/5xx: huggingface_hub raises many types
        where = endpoint or "the Hugging Face hub (or $HF_ENDPOINT)"
        raise TasksHubError(
            f"cannot download the dataset {repo} from {where}: {type(exc).__name__}: {exc}. Without the "
            "hub, clone github.com/laude-institute/terminal-bench-2 and give it with --tasks-source"
        ) from exc


def held_out(task_ids: list[str], count: int, seed: int) -> list[str]:
    """`count` task names by a seeded hash: the same seed picks the same tasks."""
    return sorted(task_ids, key=lambda t: hashlib.sha256(f"{seed}:{t}".encode()).hexdigest())[:count]


def split_tasks(
    source: str | Path,
    train_dir: str | Path,
    eval_dir: str | Path,
    *,
    eval_count: int = 20,
    seed: int = 0,
    report: Callable[[str], Any] = print,
) -> tuple[list[str], list[str]]:
    """Copy the valid tasks under `source` into `train_dir` and `eval_dir` (held out); returns the
    two lists of task names. Each directory is written whole or not at all (built beside it, then
    renamed), so a directory that exists is complete."""
    from envs.tbench2.environment import valid_tasks

    train_dir, eval_dir = Path(train_dir), Path(eval_dir)
    if train_dir.is_dir() and eval_dir.is_dir():  # split before: prepare runs again
        report(f"tasks already split: {train_dir}, {eval_dir} (remove both to split again)")
        return sorted(p.name for p in train_dir.iterdir()), sorted(p.name for p in eval_dir.iterdir())
    try:
        tasks = {t.task_id: t for t in valid_tasks(source)}
    except AgentRLError as exc:
        raise TasksHubError(f"no task set to split under {source}: {exc}") from exc
    if not 0 < eval_count < len(tasks):
        raise TasksHubError(
            f"cannot hold out {eval_count} of the {len(tasks)} valid tasks under {source}: "
            "choose a held-out count between 1 and one less than that"
        )
    for task in tasks.values():
        _no_link_out(task.path)
    evals = sorted(held_out(list(tasks), eval_count, seed))
    trains = sorted(set(tasks) - set(evals))
    for names, out in ((trains, train_dir), (evals, eval_dir)):
        if out.exists():
            raise TasksHubError(f"{out} exists without its other half: remove it to split the tasks again")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            for name in names:
                shutil.copytree(tasks[name].path, tmp / name, symlinks=True)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        report(f"{len(names)} tasks -> {out}")
    return trains, evals


def _no_link_out(root: Path) -> None:
    """A task's symbolic links stay inside its directory (a link out would copy or build a host
    file into a sandbox image)."""
    base = root.resolve()
    for path in root.rglob("*"):
        if path.is_symlink() and not path.resolve().is_relative_to(base):
            raise TasksHubError(
                f"{path} links outside its task ({path.resolve()}): refusing to copy the task set"
            )
