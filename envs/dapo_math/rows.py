"""Rows in the DAPO-Math-17k format, kept exactly as published.

`BytedTsinghua-SIA/DAPO-Math-17k` (and its eval companion `BytedTsinghua-SIA/AIME-2024`) are verl
RL parquet files; one row is

    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": "<PROMPT_HEADER>\\n\\n<problem>\\n\\n<PROMPT_FOOTER>"}],
     "ability": "MATH",
     "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": "<uuid>"}}

The prompt already holds the instruction template, so the environment renders `prompt` with the
model's chat template as it is; the ground truth is `reward_model.ground_truth`. Rows made here (the
synthetic demo family, test sets) use the same template and fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentrl.rollout.environment import EnvironmentPluginError

PROMPT_HEADER = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
PROMPT_FOOTER = 'Remember to put your answer on its own line after "Answer:".'
DATA_SOURCE = "math_dapo"
REWARD_STYLE = "rule-lighteval/MATH_v2"


class MathRowError(EnvironmentPluginError):
    """A row does not follow the DAPO-Math-17k format."""


def prompt_text(problem: str) -> str:
    """The DAPO instruction template around a problem statement."""
    return f"{PROMPT_HEADER}\n\n{problem}\n\n{PROMPT_FOOTER}"


def dapo_row(
    problem: str, answer: str, *, index: str, data_source: str = DATA_SOURCE, **extra_info: Any
) -> dict[str, Any]:
    """A row in the published format (`extra_info` carries `index` and anything else given)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt_text(problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(answer), "style": REWARD_STYLE},
        "extra_info": {"index": str(index), **extra_info},
    }


def check_row(row: dict[str, Any], where: str = "row") -> None:
    """Raise MathRowError naming what is missing; the row is used as-is otherwise."""
    prompt = row.get("prompt")
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        raise MathRowError(f"{where}: `prompt` must be a non-empty list of {{role, content}} messages")
    gt = (row.get("reward_model") or {}).get("ground_truth")
    if not isinstance(gt, str) or not gt.strip():
        raise MathRowError(f"{where}: `reward_model.ground_truth` must be a non-empty string")


def ground_truth(row: dict[str, Any]) -> str:
    return str(row["reward_model"]["ground_truth"])


def row_id(row: dict[str, Any], position: int) -> str:
    """`extra_info.index` when the row has one, else its position."""
    index = (row.get("extra_info") or {}).get("index")
    return str(index) if index not in (None, "") else str(position)


def _plain(value: Any) -> Any:
    """numpy arrays and scalars from a parquet reader -> lists and Python scalars."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows from a `.jsonl` or `.parquet` file, checked; parquet needs pyarrow (`agentrl[math]`)."""
    p = Path(path)
    if not p.is_file():
        raise MathRowError(
            f"{p} does not exist: download the data (python recipes/local_dapo_math.py download) or "
            "point env.train_file / env.eval_file at a .jsonl or .parquet file of DAPO-format rows"
        )
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise MathRowError(f"{p}: reading parquet needs pyarrow (pip install 'agentrl[math]')") from None
        rows = [_plain(r) for r in pq.read_table(p).to_pylist()]
    else:
        with p.open(encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    if not rows:
        raise MathRowError(f"{p} holds no rows")
    for i, row in enumerate(rows):
        check_row(row, f"{p}:{i + 1}")
    return rows


def dedup_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """First row of each distinct prompt (the published DAPO-Math-17k file repeats each ~100 times)."""
    seen: set[str] = set()
    out = []
    for row in rows:
        key = json.dumps(row["prompt"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out
