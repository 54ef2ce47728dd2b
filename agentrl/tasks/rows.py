"""Prompt rows: the JSONL records every environment's data comes in (the row shape Miles / slime
use: `prompt`, `label`, `metadata`), independent of what an environment does with them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def row_prompt_id(row: dict[str, Any], index: int) -> str:
    """A readable id: the row's task id, id, or published index (dapo-math-17k's
    `extra_info.index`) when it has one, else its position."""
    meta = row.get("metadata") or {}
    extra = row.get("extra_info") or {}
    found = meta.get("task_id") or row.get("id") or extra.get("index")
    return str(found if found not in (None, "") else index)


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write rows atomically (a temporary file renamed into place)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(p)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
