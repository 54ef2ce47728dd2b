"""Episode records: one JSONL file per episode, written while it runs and read by everything after.

A record is a `header` line (task, session, formats, `version`), optionally a `terminal` line (the
initial screen; a multi-step task has one per step), one `turn` line per turn (a `summary` line
before a turn whose prompt a context summary replaced; a multi-step task's turns and summaries
carry their `step`, each step opened by a `step` line and closed by a `step_result` line), then one `result` line with the reward, the outcome and
the training samples (`Sample.to_dict()`). `Recorder` writes it; `read_record` is the one reader
(replay, the dashboard, Harbor trajectories); `load_samples` turns records, or plain sample rows,
into training samples (SFT on good episodes, train-only replays).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.episode.sample import Sample
from agentrl.errors import AgentRLError

RECORD_VERSION = 1


class RecordError(AgentRLError):
    """An episode record (or a file of samples) that cannot be read."""


class Recorder:
    """Writes one episode record, a line at a time, flushed as it goes (a crash keeps the turns)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("w", encoding="utf-8")

    def write(self, kind: str, payload: dict[str, Any]) -> None:
        self._fh.write(json.dumps({"type": kind, **payload}, ensure_ascii=False, default=str) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


@dataclass
class EpisodeRecord:
    header: dict[str, Any]
    turns: list[dict[str, Any]] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)  # `agentrl.agent.summarize.Summary`
    # A multi-step task's steps in order: the `step` line (name, setup error) with its `step_result`
    # (rewards, outcome, cause, times) merged in.
    steps: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    other: dict[str, Any] = field(default_factory=dict)  # other line types by type ("terminal")
    malformed: int = 0  # lines skipped (tolerant reads only)


def read_record(path: Path, *, tolerant: bool = False) -> EpisodeRecord:
    """The record at `path`. Strict (the default) raises `RecordError` on a line that does not
    parse or a record without a header; `tolerant` (a record still being written) skips and counts
    such lines and stops at a half-written last line."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"{path}: no such episode record (records are the .jsonl files of --record)")
    record = EpisodeRecord(header={})
    seen_header = False
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            if tolerant and not raw.endswith(b"\n"):
                break  # still being written
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
                kind = row.pop("type")
            except (ValueError, AttributeError, KeyError, TypeError):
                if not tolerant:
                    raise RecordError(f"{path}:{number}: not an episode record line") from None
                record.malformed += 1
                continue
            if kind == "header":
                record.header, seen_header = row, True
            elif kind == "turn":
                record.turns.append(row)
            elif kind == "summary":
                record.summaries.append(row)
            elif kind == "step":
                record.steps.append(row)
            elif kind == "step_result" and record.steps and record.steps[-1].get("index") == row.get("index"):
                record.steps[-1].update({k: v for k, v in row.items() if k != "index"})
            elif kind == "result":
                record.result = row
            elif kind == "terminal":  # the first is the episode's; each step's is its step's too
                if record.steps:
                    record.steps[-1]["initial_state"] = row.get("initial_state")
                record.other.setdefault("terminal", row)
            else:
                record.other[str(kind)] = row
    if not seen_header and not tolerant:
        raise RecordError(f"{path}: not an episode record (no header line)")
    return record


def load_samples(paths: Iterable[Path], *, min_reward: float | None = None) -> list[Sample]:
    """Training samples from JSONL files, or directories of them: lines that are `Sample` rows,
    and the samples of episode records' `result` lines (with `min_reward`, only those of episodes
    that reached it)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise RecordError(f"{p} does not exist (give record files or directories of them)")
    out: list[Sample] = []
    for f in files:
        with f.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    if "tokens" in row:
                        out.append(Sample.from_dict(row))
                    elif "type" not in row:
                        raise KeyError("neither a sample (tokens) nor a record line (type)")
                    elif row["type"] == "result":
                        if min_reward is None or (row.get("reward") or 0.0) >= min_reward:
                            out += [Sample.from_dict(d) for d in row.get("samples") or []]
                except (ValueError, TypeError, KeyError, AttributeError) as exc:
                    raise RecordError(f"{f}:{n}: not a sample or episode result row ({exc})") from exc
    return out
