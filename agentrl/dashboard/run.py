"""`RunView`: what the dashboard knows about one run directory, read from its files alone.

    <run>/config.json     the resolved RunConfig (written at start)
    <run>/metrics.jsonl   one `StepMetrics` per trainer step (appended while the run goes)
    <run>/evals.json      eval summaries (rewritten after each in-between eval and at the end)
    <run>/records/*.jsonl one record per training episode (environments that record)

Curves are derived here, in Python, from each metrics row (`CHARTS` names them), so the page only
draws numbers it is given.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from agentrl.dashboard.records import RecordIndex
from agentrl.dashboard.tail import JsonlTail

# Longest a request spends indexing records; the rest is read by the next requests.
INDEX_BUDGET_S = 0.5

# (chart id, title, series keys; a key ending in ":" or "@" is a dict of per-cause / per-k values)
CHARTS: list[dict[str, Any]] = [
    {"id": "reward", "title": "Reward (trained episodes)", "series": ["reward_mean"]},
    {
        "id": "pass",
        "title": "Pass rate: trained groups / all finished episodes",
        "series": ["pass_rate", "rollout_pass_rate"],
    },
    {
        "id": "outcomes",
        "title": "Truncated / policy-failed (fraction of trained)",
        "series": ["truncation_ratio", "policy_failure_ratio"],
    },
    {
        "id": "staleness",
        "title": "Staleness (versions behind at training)",
        "series": ["staleness_mean", "staleness_max"],
    },
    {
        "id": "infra",
        "title": "Infra failures by cause (per step)",
        "series": ["infra:", "internal_errors", "version_mismatches", "stale_groups", "stale_cancelled"],
    },
    {"id": "policy", "title": "Policy failures by cause (scored 0, per step)", "series": ["policy:"]},
    {
        "id": "mismatch",
        "title": "Mismatch KL, engine vs trainer log-probs",
        "series": ["mismatch_kl", "mismatch_k1"],
    },
    {"id": "tokens", "title": "Tokens/s (trained response tokens)", "series": ["tokens_per_s"]},
    {
        "id": "time",
        "title": "Time split engine / sandbox / verifier (share of episode time)",
        "series": ["engine_share", "sandbox_share", "verifier_share"],
    },
    {"id": "loss", "title": "Trainer loss / grad norm", "series": ["loss", "grad_norm"]},
    {"id": "eval", "title": "Eval pass@k", "series": ["pass@"], "source": "evals"},
]


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def metric_point(row: dict[str, Any]) -> dict[str, Any] | None:
    """The plotted values of one metrics row (`StepMetrics.to_json`); keys missing from the row
    are left out, never filled in. None for a row without a step."""
    step = _num(row.get("step"))
    if step is None:
        return None
    p: dict[str, Any] = {"step": int(step) if step.is_integer() else step}
    for key in (
        "reward_mean",
        "pass_rate",
        "rollout_pass_rate",
        "truncation_ratio",
        "policy_failure_ratio",
        "tokens_per_s",
        "internal_errors",
        "version_mismatches",
        "stale_groups",
        "stale_cancelled",
        "wall_s",
        "samples",
        "weight_version",
    ):
        v = _num(row.get(key))
        if v is not None:
            p[key] = v
    hist = row.get("staleness_hist")
    if isinstance(hist, dict) and hist:
        pairs = [(int(k), int(n)) for k, n in hist.items() if str(k).lstrip("-").isdigit() and n]
        total = sum(n for _, n in pairs)
        if total:
            p["staleness_mean"] = sum(k * n for k, n in pairs) / total
            p["staleness_max"] = float(max(k for k, _ in pairs))
    for prefix, key in (("infra:", "failures_by_cause"), ("policy:", "policy_failures_by_cause")):
        causes = row.get(key)
        if isinstance(causes, dict):
            p[prefix] = {str(c): float(n) for c, n in causes.items() if _num(n) is not None}
    times = {k: _num(row.get(k)) for k in ("engine_s", "sandbox_s", "verifier_s")}
    if all(v is not None for v in times.values()):
        busy = sum(v for v in times.values() if v is not None)
        for k, v in times.items():
            p[k] = v
            if busy > 0 and v is not None:
                p[k.replace("_s", "_share")] = v / busy
    trainer = (row.get("extra") or {}).get("trainer") if isinstance(row.get("extra"), dict) else None
    if isinstance(trainer, dict):
        for key in ("mismatch_kl", "mismatch_k1", "loss", "grad_norm", "kl"):
            v = _num(trainer.get(key))
            if v is not None:
                p[key] = v
    return p


def eval_point(e: dict[str, Any]) -> dict[str, Any] | None:
    step = _num(e.get("step"))
    if step is None:
        return None
    p: dict[str, Any] = {"step": int(step) if step.is_integer() else step, "label": str(e.get("label", ""))}
    p["pass@"] = {
        k[len("pass@") :]: float(v) for k, v in e.items() if k.startswith("pass@") and _num(v) is not None
    }
    for key in ("mean_reward", "episodes", "unscored", "infra_failures"):
        v = _num(e.get(key))
        if v is not None:
            p[key] = v
    return p


class RunView:
    """One run directory, re-read incrementally: metrics by offset, evals and config by mtime,
    records by the index."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.metrics = JsonlTail(directory / "metrics.jsonl")
        self.points: list[dict[str, Any]] = []
        self.records = RecordIndex(directory / "records")
        self._records_at = 0.0
        self._json_cache: dict[str, tuple[float, Any, str | None]] = {}

    def _json_file(self, name: str) -> tuple[Any, str | None]:
        """(content, error) of a JSON file, re-read when its mtime changes; a file being
        rewritten that does not parse keeps the last good content and reports the error."""
        path = self.directory / name
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None, None
        cached = self._json_cache.get(name)
        if cached is not None and cached[0] == mtime:
            return cached[1], cached[2]
        try:
            value, error = json.loads(path.read_text(encoding="utf-8")), None
        except (ValueError, OSError) as exc:
            value, error = (cached[1] if cached else None), f"{name}: {exc}"
        self._json_cache[name] = (mtime, value, error)
        return value, error

    def poll_metrics(self) -> None:
        generation = self.metrics.generation
        self.metrics.poll()
        if self.metrics.generation != generation:
            self.points = []
        for row in self.metrics.rows[len(self.points) :]:
            self.points.append(metric_point(row) or {})

    def metrics_since(self, after: int, generation: int | None) -> dict[str, Any]:
        self.poll_metrics()
        reset = generation is not None and generation != self.metrics.generation
        start = 0 if reset else max(after, 0)
        return {
            "generation": self.metrics.generation,
            "reset": reset,
            "next": len(self.points),
            "points": [p for p in self.points[start:] if p],
            "malformed": self.metrics.malformed,
            "partial_bytes": self.metrics.partial,
            "exists": self.metrics.path.exists(),
        }

    def evals(self) -> dict[str, Any]:
        data, error = self._json_file("evals.json")
        points = [p for e in data or [] if isinstance(e, dict) for p in [eval_point(e)] if p]
        return {"points": points, "error": error}

    def config(self) -> dict[str, Any] | None:
        data, _ = self._json_file("config.json")
        return data if isinstance(data, dict) else None

    def refresh_records(self, max_age_s: float = 1.0, budget_s: float | None = INDEX_BUDGET_S) -> None:
        """Re-scan the records at most every `max_age_s` (at once while some are still pending),
        reading for at most `budget_s` per call."""
        now = time.monotonic()
        if self.records.pending or now - self._records_at >= max_age_s:
            self.records.refresh(budget_s)
            self._records_at = time.monotonic()

    def summary(self) -> dict[str, Any]:
        cfg = self.config() or {}
        env = cfg.get("env") if isinstance(cfg.get("env"), dict) else {}
        return {
            "name": self.name,
            "path": str(self.directory),
            "env": (env or {}).get("name"),
            "steps": cfg.get("steps"),
            "has_config": bool(cfg),
            "has_records": self.records.directory.is_dir(),
        }
