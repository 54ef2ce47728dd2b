"""Episode records (`<run>/records/*.jsonl`, written by `agentrl.episode.run.Recorder`): an index for
the episode browser, and one episode read for the page.

A record is a header line, one line per turn, then a result line that ends with the episode's
token arrays (`samples`). The index reads only the header (the file's first line) and the result
without its token arrays, so 10,000 records index in well under a second: the result line is
found from the end of the file and parsed up to its `samples` key. Records are complete once
their result line is written; an incomplete one (a running episode) is read again when it grows.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.episode.record import read_record as read_episode_record

# Longest text sent inline to the page; the rest is fetched on demand ("show full").
TEXT_LIMIT = 2000
TOKEN_LIMIT = 4096

_RESULT = b'{"type": "result"'
_SAMPLES = b', "samples": ['
_VERSIONS = b'"weight_versions": ['
_BLOCK = 1 << 16
_HEAD = 1 << 14  # the header and, usually, the first turn's weight versions


@dataclass
class EpisodeEntry:
    """One record as the episode list shows it."""

    id: str
    task_id: str | None
    prompt_id: str | None
    sample_index: int | None
    created_at: float
    size: int
    done: bool = False
    status: str | None = None
    end_reason: str | None = None
    reward: float | None = None
    outcome: str | None = None
    failure_cause: str | None = None
    # The oldest weight version the index reads in the record: the first turn's when it lies in the
    # first block, else the last segment's (the index reads the first and last blocks only).
    version: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "size"}


def _head(fh: Any) -> tuple[bytes, bytes | None]:
    """(the file's first block, its first line or None while that line is half-written)."""
    head = fh.read(_HEAD)
    nl = head.find(b"\n")
    if nl >= 0:
        return head, head[:nl]
    line = head
    while more := fh.read(_BLOCK):  # a header longer than a block: rare, read on to its end
        nl = more.find(b"\n")
        if nl >= 0:
            return head, line + more[:nl]
        line += more
    return head, None


def _last_line_start(fh: Any, size: int) -> int:
    """Where the file's last line starts, found from the end one block at a time."""
    pos = size - 1  # the final newline ends the last line: it does not start one
    while pos > 0:
        step = min(_BLOCK, pos)
        fh.seek(pos - step)
        nl = fh.read(step).rfind(b"\n")
        if nl >= 0:
            return pos - step + nl + 1
        pos -= step
    return 0


def _prefix(line: bytes) -> bytes | None:
    """A line up to its token arrays, or whole; None when neither is in `line` yet."""
    for marker in (_SAMPLES, b"\n"):
        at = line.find(marker)
        if at >= 0:
            return line[: at + len(marker)]
    return None


def _result_prefix(fh: Any, start: int) -> bytes:
    """The last line from `start` up to its token arrays (or whole when it has none)."""
    fh.seek(start)
    line = b""
    while chunk := fh.read(_BLOCK):
        line += chunk
        if (found := _prefix(line)) is not None:
            return found
    return line


def _versions_at(block: bytes, at: int) -> list[int]:
    if at < 0:
        return []
    start = at + len(_VERSIONS)
    end = block.find(b"]", start)
    return [int(x) for x in block[start:end].split(b",") if x.strip().isdigit()] if end >= 0 else []


def _result_fields(prefix: bytes, fh: Any, start: int) -> dict[str, Any]:
    """The result line without its token arrays. Cutting at the first `, "samples": [` is right
    when that key is at the top level; a cut inside a nested object leaves unbalanced braces and
    fails, and then the whole line is read and parsed."""
    if prefix.endswith(_SAMPLES):
        try:
            row = json.loads(prefix[: -len(_SAMPLES)] + b"}")
            if isinstance(row, dict) and row.get("type") == "result":
                return row
        except ValueError:
            pass
        fh.seek(start)
        prefix = fh.read()
    row = json.loads(prefix)
    if not isinstance(row, dict):
        raise ValueError("result line is not an object")
    row.pop("samples", None)
    return row


class RecordIndex:
    """Every record of one directory, refreshed incrementally (new files, growing files).

    A refresh may stop at a time budget: the newest files (by mtime) are read first, so the
    first page of a large run is right after the first slice and `pending` says how many records
    the next refreshes still have to read."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.entries: dict[str, EpisodeEntry] = {}
        self.malformed: dict[str, str] = {}  # record id -> why it was skipped
        self.pending = 0
        self._seen_size: dict[str, int] = {}

    def refresh(self, budget_s: float | None = None) -> int:
        """Index new records and re-read the incomplete ones that grew, for at most `budget_s`
        seconds (None: all of them); returns how many were read."""
        t0 = time.monotonic()
        todo: list[tuple[float, str, str, int]] = []
        try:
            with os.scandir(self.directory) as it:
                for de in it:
                    if not de.name.endswith(".jsonl"):
                        continue
                    rid = de.name[: -len(".jsonl")]
                    entry = self.entries.get(rid)
                    if entry is not None and entry.done:
                        continue
                    try:
                        st = de.stat()
                    except FileNotFoundError:
                        continue
                    if self._seen_size.get(rid) != st.st_size:
                        todo.append((st.st_mtime, rid, de.path, st.st_size))
        except FileNotFoundError:
            return 0
        todo.sort(reverse=True)
        read = 0
        for _, rid, path, size in todo:
            if budget_s is not None and read and time.monotonic() - t0 > budget_s:
                break
            read += 1
            self._seen_size[rid] = size
            try:
                new = self._read(rid, path, size)
            except (ValueError, OSError) as exc:
                self.entries.pop(rid, None)
                self.malformed[rid] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            self.malformed.pop(rid, None)
            if new is not None:
                self.entries[rid] = new
        self.pending = len(todo) - read
        return read

    def _read(self, rid: str, path: str, size: int) -> EpisodeEntry | None:
        with open(path, "rb") as fh:
            head, first = _head(fh)
            if first is None:
                return None  # the header line is half-written: try again when it grows
            header = json.loads(first)
            if not isinstance(header, dict) or header.get("type") != "header":
                raise ValueError("first line is not a record header")
            entry = EpisodeEntry(
                id=rid,
                task_id=header.get("task_id"),
                prompt_id=header.get("prompt_id"),
                sample_index=header.get("sample_index"),
                created_at=float(header.get("created_at") or 0.0),
                size=size,
            )
            if size <= len(head):
                tail_at, tail = 0, head
            else:
                tail_at = max(size - _BLOCK, 0)
                fh.seek(tail_at)
                tail = fh.read()
            if not tail.endswith(b"\n"):
                return entry  # a line is being written: not done yet
            nl = tail.rfind(b"\n", 0, len(tail) - 1)
            if nl >= 0 or tail_at == 0:
                start = tail_at + nl + 1
                prefix = _prefix(tail[nl + 1 :]) or b""
            else:  # the last line is longer than a block
                start = _last_line_start(fh, size)
                prefix = _result_prefix(fh, start)
            if not prefix.startswith(_RESULT):
                return entry  # the last line is a turn: the episode is still running
            res = _result_fields(prefix, fh, start)
        entry.done = True
        entry.status = res.get("status")
        entry.end_reason = res.get("end_reason")
        entry.reward = res.get("reward")
        entry.outcome = res.get("outcome")
        entry.failure_cause = res.get("failure_cause")
        versions = _versions_at(head, head.find(_VERSIONS, len(first))) or _versions_at(
            tail, tail.rfind(_VERSIONS)
        )
        entry.version = min(versions) if versions else None
        return entry

    def facets(self) -> dict[str, Any]:
        """The values the page's filters offer."""
        tasks: set[str] = set()
        statuses: set[str] = set()
        ends: set[str] = set()
        versions: set[int] = set()
        for e in self.entries.values():
            if e.task_id:
                tasks.add(e.task_id)
            statuses.add(e.status or "running")
            if e.end_reason:
                ends.add(e.end_reason)
            if e.version is not None:
                versions.add(e.version)
        return {
            "tasks": sorted(tasks),
            "statuses": sorted(statuses),
            "end_reasons": sorted(ends),
            "versions": [min(versions), max(versions)] if versions else None,
        }

    def query(self, q: EpisodeQuery) -> tuple[int, list[EpisodeEntry]]:
        """(matches, one page of them)."""
        rows = [e for e in self.entries.values() if q.matches(e)]
        if q.sort == "reward":
            rows.sort(key=lambda e: (e.reward is None, -(e.reward or 0.0), -e.created_at))
        elif q.sort == "reward_asc":
            rows.sort(key=lambda e: (e.reward is None, e.reward or 0.0, -e.created_at))
        else:
            rows.sort(key=lambda e: (e.created_at, e.id), reverse=q.sort != "oldest")
        return len(rows), rows[q.offset : q.offset + q.limit]


@dataclass
class EpisodeQuery:
    """The episode browser's filters (every one optional) and page."""

    offset: int = 0
    limit: int = 50
    task: str | None = None
    status: str | None = None
    end_reason: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    min_version: int | None = None
    max_version: int | None = None
    sort: str = "newest"

    @classmethod
    def from_params(cls, params: Any) -> EpisodeQuery:
        def num(key: str, kind: type) -> Any:
            value = params.get(key)
            return kind(value) if value not in (None, "") else None

        return cls(
            offset=max(num("offset", int) or 0, 0),
            limit=min(max(num("limit", int) or 50, 1), 500),
            task=params.get("task") or None,
            status=params.get("status") or None,
            end_reason=params.get("end_reason") or None,
            min_reward=num("min_reward", float),
            max_reward=num("max_reward", float),
            min_version=num("min_version", int),
            max_version=num("max_version", int),
            sort=params.get("sort") or "newest",
        )

    def matches(self, e: EpisodeEntry) -> bool:
        if self.task is not None and e.task_id != self.task:
            return False
        if self.status is not None and (e.status or "running") != self.status:
            return False
        if self.end_reason is not None and e.end_reason != self.end_reason:
            return False
        if self.min_reward is not None and (e.reward is None or e.reward < self.min_reward):
            return False
        if self.max_reward is not None and (e.reward is None or e.reward > self.max_reward):
            return False
        if self.min_version is not None and (e.version is None or e.version < self.min_version):
            return False
        return not (self.max_version is not None and (e.version is None or e.version > self.max_version))


@dataclass
class _Clip:
    """Replaces every long string of a record with its head and where to fetch the rest."""

    limit: int = TEXT_LIMIT
    clipped: int = field(default=0)

    def __call__(self, value: Any, path: str) -> Any:
        if isinstance(value, str) and len(value) > self.limit:
            self.clipped += 1
            return {"clipped": True, "head": value[: self.limit], "chars": len(value), "path": path}
        if isinstance(value, dict):
            return {k: self(v, f"{path}.{k}" if path else k) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v, f"{path}.{i}") for i, v in enumerate(value)]
        return value


def read_record(path: Path) -> tuple[dict[str, Any], int]:
    """One record as {header, turns, result, other} and its count of skipped lines (a running
    episode's last line may be half-written)."""
    rec = read_episode_record(path, tolerant=True)
    return {"header": rec.header, "turns": rec.turns, "result": rec.result, "other": rec.other}, rec.malformed


def episode_view(path: Path) -> dict[str, Any]:
    """A record for the page: long texts clipped, token arrays summarised per segment."""
    record, malformed = read_record(path)
    result = record["result"]
    segments = []
    if result is not None:
        for k, s in enumerate(result.pop("samples", None) or []):
            mask = s.get("loss_mask") or []
            logps = s.get("rollout_logprobs") or []
            trained = [lp for lp, m in zip(logps, mask, strict=False) if m]
            segments.append(
                {
                    "index": k,
                    "tokens": len(s.get("tokens") or []),
                    "prompt_length": s.get("prompt_length"),
                    "response_tokens": len(mask),
                    "trained_tokens": len(trained),
                    "mean_logprob": sum(trained) / len(trained) if trained else None,
                    "weight_versions": s.get("weight_versions"),
                    "advantage": s.get("advantage"),
                }
            )
    clip = _Clip()
    view = clip({k: record[k] for k in ("header", "turns", "other")} | {"result": result}, "")
    return {**view, "segments": segments, "malformed_lines": malformed, "clipped": clip.clipped}


def full_text(path: Path, field_path: str) -> str:
    """The whole string at a dotted path of a record (`turns.3.outputs.0.stdout`)."""
    record, _ = read_record(path)
    value: Any = record
    for part in field_path.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise KeyError(f"no field {field_path!r} in this record")
    if not isinstance(value, str):
        raise KeyError(f"{field_path!r} is not a text field")
    return value


def segment_tokens(path: Path, segment: int, *, offset: int = 0, limit: int = TOKEN_LIMIT) -> dict[str, Any]:
    """One segment's response tokens with loss mask and rollout log-prob, and its prompt ids."""
    record, _ = read_record(path)
    samples = (record["result"] or {}).get("samples") or []
    if not 0 <= segment < len(samples):
        raise KeyError(f"segment {segment} not in this record ({len(samples)} segments)")
    s = samples[segment]
    n = int(s["prompt_length"])
    response = s["tokens"][n:]
    end = min(offset + limit, len(response))
    return {
        "segment": segment,
        "prompt_ids": s["tokens"][:n],
        "offset": offset,
        "total": len(response),
        "ids": response[offset:end],
        "mask": s["loss_mask"][offset:end],
        "logprobs": s["rollout_logprobs"][offset:end],
    }
