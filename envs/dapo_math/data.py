"""DAPO-Math's data hooks for the cluster recipes (`agentrl.cluster.recipe.env_data`: the plugin's
`data` attribute).

`prepare` downloads DAPO-Math-17k and AIME-2024 into `<data_dir>/dapo_math` (`hub.py`);
local mode (`smoke_settings`, `prepare_smoke`) trains on synthetic arithmetic in the DAPO row
format, written once under `<run_dir>/data`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.tasks.rows import write_jsonl
from envs.dapo_math.hub import download_datasets
from envs.dapo_math.synthetic import arithmetic_rows, statement


def describe(data_dir: str | Path, **_: Any) -> str:
    """What `prepare` does with the data (its `--dry-run` line)."""
    return f"download dapo-math-17k and aime-2024 -> {Path(data_dir) / 'dapo_math'}"


def prepare(data_dir: str | Path, *, report: Callable[[str], Any] = print, **_: Any) -> None:
    download_datasets(Path(data_dir) / "dapo_math", report=report)


def smoke_settings(run_dir: str | Path) -> list[str]:
    """Local mode: the rows `prepare_smoke` writes, short answers."""
    run_dir = Path(run_dir)
    return [
        f"env.train_file={run_dir / 'data' / 'train.jsonl'}",
        f"env.eval_file={run_dir / 'data' / 'eval.jsonl'}",
        "env.max_new_tokens=24",
        "env.verify_timeout_s=10",
    ]


def prepare_smoke(run_dir: str | Path, *, seed: int = 0) -> None:
    """Synthetic arithmetic in the DAPO row format (as the math demo's `prepare`), written once
    under <run_dir>/data."""
    data = Path(run_dir) / "data"
    if (data / "train.jsonl").is_file():
        return
    data.mkdir(parents=True, exist_ok=True)
    train = arithmetic_rows(64, seed=seed)
    write_jsonl(data / "train.jsonl", train)
    seen = {statement(r) for r in train}
    write_jsonl(data / "eval.jsonl", arithmetic_rows(16, seed=seed + 20_000, exclude=seen))
