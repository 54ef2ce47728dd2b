"""Task sets as training rows: one JSONL row per task, in the row shape Miles / slime use.

    {"prompt": [{"role": "system", ...}, {"role": "user", ...}],
     "metadata": {"task_id": ..., "task_path": ..., "instruction": ...},
     "label": null}

The train/eval split is a pure function of (task id, seed): adding or removing tasks never moves
another task across the split.
"""

from __future__ import annotations

import hashlib
from typing import Any

from agentrl.tasks.rows import read_jsonl, write_jsonl
from agentrl.tasks.task import Task

__all__ = ["read_jsonl", "split_rows", "task_row", "write_jsonl"]

DEFAULT_SYSTEM_PROMPT = (
    "You are an AI assistant solving a task in a Linux terminal. "
    "You act by running shell commands; you see their output. "
    "When the task is done, say so."
)


def split_bucket(task_id: str, seed: int) -> float:
    """A deterministic number in [0, 1) from the task id and seed."""
    digest = hashlib.sha256(f"{seed}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def task_row(task: Task, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> dict[str, Any]:
    instruction = task.instruction
    return {
        "prompt": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": instruction},
        ],
        "label": None,
        "metadata": {
            "task_id": task.task_id,
            "task_name": task.name,
            "task_path": str(task.path.resolve()),
            "instruction": instruction,
            "difficulty": task.config.metadata.difficulty,
            "category": task.config.metadata.category,
        },
    }


def split_rows(
    tasks: list[Task], eval_fraction: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for task in sorted(tasks, key=lambda t: t.task_id):
        row = task_row(task)
        (evals if split_bucket(task.task_id, seed) < eval_fraction else train).append(row)
    return train, evals
