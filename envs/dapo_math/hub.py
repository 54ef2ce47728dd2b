"""Download DAPO-Math-17k and its AIME-2024 eval set from the Hugging Face hub, rows kept as published.

The files are the ones the DAPO recipe uses (verl `recipe/dapo`): `data/dapo-math-17k.parquet` of
`BytedTsinghua-SIA/DAPO-Math-17k` and `data/aime-2024.parquet` of `BytedTsinghua-SIA/AIME-2024`.
The published training file repeats each of its ~17k problems about 100 times; `dedup` keeps the
first row of each distinct prompt (rows are never rewritten). Rows are written as JSONL, the
environment's default files. The endpoint is the hub's, `$HF_ENDPOINT`, or a mirror given here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.errors import AgentRLError
from agentrl.tasks.rows import write_jsonl
from envs.dapo_math.rows import dedup_rows, read_rows

# output name -> (dataset repository, file in it)
DATASETS: dict[str, tuple[str, str]] = {
    "dapo-math-17k": ("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet"),
    "aime-2024": ("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet"),
}


class HubError(AgentRLError):
    """A dataset file could not be downloaded or read."""


def fetch(repo_id: str, filename: str, *, cache_dir: Path, endpoint: str | None = None) -> Path:
    """One file of a dataset repository, through huggingface_hub's cache."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise HubError("downloading needs huggingface_hub (pip install 'agentrl[math]')") from None
    try:
        return Path(
            hf_hub_download(
                repo_id, filename, repo_type="dataset", cache_dir=str(cache_dir), endpoint=endpoint
            )
        )
    except Exception as exc:  # offline, DNS, HTTP 4xx/5xx: huggingface_hub raises many types
        where = endpoint or "the Hugging Face hub (or $HF_ENDPOINT)"
        raise HubError(
            f"cannot download {filename} of {repo_id} from {where}: {type(exc).__name__}: {exc}. "
            "Without access to the hub, copy the parquet files from a machine that has it and point "
            "env.train_file / env.eval_file at them, or give a mirror with --endpoint"
        ) from exc


def download_datasets(
    out: str | Path,
    *,
    endpoint: str | None = None,
    dedup: bool = True,
    datasets: dict[str, tuple[str, str]] | None = None,
    report: Callable[[str], Any] = print,
) -> dict[Path, int]:
    """Download every dataset into `out/<name>.jsonl`; returns path -> rows written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[Path, int] = {}
    for name, (repo_id, filename) in (datasets or DATASETS).items():
        report(f"downloading {filename} of {repo_id}")
        local = fetch(repo_id, filename, cache_dir=out / ".hub-cache", endpoint=endpoint)
        try:
            rows = read_rows(local)
        except AgentRLError as exc:
            raise HubError(f"{repo_id}/{filename} is not in the DAPO row format: {exc}") from exc
        if dedup:
            n = len(rows)
            rows = dedup_rows(rows)
            if len(rows) < n:
                report(f"{name}: {n} rows, {len(rows)} distinct prompts kept")
        path = out / f"{name}.jsonl"
        write_jsonl(path, rows)
        written[path] = len(rows)
    return written
