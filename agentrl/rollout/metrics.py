"""Per-step rollout metrics: one `StepMetrics` per trainer step, appended to a JSONL file and
rendered as a rich table."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from agentrl.episode.sample import Status
from agentrl.rollout.buffer import Group

if TYPE_CHECKING:
    from agentrl.rollout.manager import RolloutManager


@dataclass
class StepMetrics:
    step: int
    weight_version: int
    wall_s: float  # since the previous step (or the start)
    samples: int
    groups: int
    groups_incomplete: int
    reward_mean: float
    pass_rate: float
    truncation_ratio: float
    policy_failure_ratio: float
    failures_by_cause: dict[str, int]  # infra failures since the previous step
    policy_failures_by_cause: dict[str, int]  # scored-0 failures with a cause (tampered, shell_killed...)
    samples_exhausted: int
    groups_filtered: int
    stale_groups: int  # evicted from the buffer
    stale_cancelled: int  # cancelled in flight
    internal_errors: int  # untyped exceptions out of runners, caught per episode
    version_mismatches: int  # generations answered under an unexpected weight version
    staleness_hist: dict[int, int]  # versions behind at consumption -> samples
    in_flight: int
    buffered_groups: int
    unfinished_groups: int
    engine_s: float
    sandbox_s: float
    verifier_s: float
    response_tokens: int
    tokens_per_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    # Episodes' waits for a session on a full environment server (OpenEnv's CAPACITY_REACHED).
    capacity_wait_s: float = 0.0
    # Over every group finished since the previous step, kept by the dynamic filter or not.
    rollout_episodes: int = 0
    rollout_pass_rate: float = 0.0
    prompts_skipped: int = 0  # appearances passed over after an all-solved group (rollout.skip_solved)

    def to_json(self) -> str:
        d = asdict(self)
        d["staleness_hist"] = {str(k): v for k, v in sorted(self.staleness_hist.items())}
        return json.dumps(d, sort_keys=True)


def _delta(now: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(now[key]) - int(before.get(key, 0))


class MetricsTracker:
    """Builds a StepMetrics per consumed batch from the batch and the manager's counters."""

    def __init__(self, manager: RolloutManager, path: str | Path | None = None) -> None:
        self.manager = manager
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last_t: float | None = None
        self._last = manager.counters.snapshot()
        self.history: list[StepMetrics] = []

    def step(
        self,
        step: int,
        groups: list[Group],
        *,
        consumed_at_version: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> StepMetrics:
        """Metrics of one consumed batch; `extra` (e.g. the trainer's loss) is written alongside.

        Pass `consumed_at_version` (the weight version when the batch was taken) when the step is
        recorded after a weight update, or staleness reads one version too high.
        """
        mgr = self.manager
        # The event loop's clock, so a simulated-time loop reports simulated seconds.
        now_t = asyncio.get_running_loop().time()
        if self._last_t is None:
            self._last_t = mgr.started_at
        counters = mgr.counters.snapshot()
        version = mgr.control.weight_version if consumed_at_version is None else consumed_at_version
        samples = [e for g in groups for e in g.episodes if e is not None]
        scored = [e for e in samples if e.trainable]
        rewards = [float(e.reward) for e in scored if e.reward is not None]
        hist: Counter[int] = Counter()
        for s in scored:
            oldest = s.oldest_version()
            if oldest is not None:
                hist[version - oldest] += 1
        before_fail = self._last.get("failures", {})
        failures = {
            c: n - before_fail.get(c, 0) for c, n in counters["failures"].items() if n - before_fail.get(c, 0)
        }
        before_policy = self._last.get("policy_failures", {})
        policy = {
            c: n - before_policy.get(c, 0)
            for c, n in counters["policy_failures"].items()
            if n - before_policy.get(c, 0)
        }
        tokens = sum(e.response_tokens for e in scored)
        wall = max(now_t - self._last_t, 1e-9)
        m = StepMetrics(
            step=step,
            weight_version=version,
            wall_s=wall,
            samples=len(samples),
            groups=len(groups),
            groups_incomplete=sum(not g.complete for g in groups),
            reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
            pass_rate=(sum(r >= mgr.config.pass_threshold for r in rewards) / len(rewards))
            if rewards
            else 0.0,
            truncation_ratio=sum(s.status is Status.TRUNCATED for s in scored) / max(len(scored), 1),
            policy_failure_ratio=sum(s.status is Status.FAILED_POLICY for s in scored) / max(len(scored), 1),
            failures_by_cause=failures,
            policy_failures_by_cause=policy,
            samples_exhausted=_delta(counters, self._last, "samples_exhausted"),
            groups_filtered=_delta(counters, self._last, "groups_filtered"),
            prompts_skipped=_delta(counters, self._last, "prompts_skipped"),
            stale_groups=_delta(counters, self._last, "stale_groups"),
            stale_cancelled=_delta(counters, self._last, "stale_cancelled"),
            internal_errors=_delta(counters, self._last, "internal_errors"),
            version_mismatches=_delta(counters, self._last, "version_mismatches"),
            staleness_hist=dict(hist),
            in_flight=mgr.running,
            buffered_groups=mgr.buffer.n_groups,
            unfinished_groups=mgr.unfinished_groups,
            engine_s=sum(s.timings.get("engine_s", 0.0) for s in samples),
            sandbox_s=sum(s.timings.get("sandbox_s", 0.0) for s in samples),
            verifier_s=sum(s.timings.get("verifier_s", 0.0) for s in samples),
            capacity_wait_s=sum(s.timings.get("capacity_wait_s", 0.0) for s in samples),
            response_tokens=tokens,
            tokens_per_s=tokens / wall,
            extra=dict(extra or {}),
            rollout_episodes=_delta(counters, self._last, "samples_scored"),
            rollout_pass_rate=_delta(counters, self._last, "samples_passed")
            / max(_delta(counters, self._last, "samples_scored"), 1),
        )
        self._last_t, self._last = now_t, counters
        self.history.append(m)
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(m.to_json() + "\n")
        return m

    def print(self, m: StepMetrics, console: Console | None = None) -> None:
        (console or Console()).print(render(m))


def render(m: StepMetrics) -> Table:
    """A two-column table of one step's metrics."""
    table = Table(title=f"rollout step {m.step} (weights v{m.weight_version})", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    busy = m.engine_s + m.sandbox_s + m.verifier_s
    split = " / ".join(
        f"{100 * x / busy:.0f}%" if busy else "-" for x in (m.engine_s, m.sandbox_s, m.verifier_s)
    )
    rows = [
        ("samples / groups", f"{m.samples} / {m.groups} ({m.groups_incomplete} incomplete)"),
        ("reward mean", f"{m.reward_mean:.3f}"),
        ("pass rate (trained / all finished)", f"{m.pass_rate:.1%} / {m.rollout_pass_rate:.1%}"),
        ("truncated / policy-failed", f"{m.truncation_ratio:.1%} / {m.policy_failure_ratio:.1%}"),
        ("infra failures", ", ".join(f"{c}={n}" for c, n in sorted(m.failures_by_cause.items())) or "0"),
        (
            "policy failures (scored 0)",
            ", ".join(f"{c}={n}" for c, n in sorted(m.policy_failures_by_cause.items())) or "0",
        ),
        ("internal errors / version mismatches", f"{m.internal_errors} / {m.version_mismatches}"),
        (
            "exhausted / filtered (skipped) / stale (buffer, in flight)",
            f"{m.samples_exhausted} / {m.groups_filtered} ({m.prompts_skipped}) / {m.stale_groups}, "
            f"{m.stale_cancelled}",
        ),
        ("staleness", " ".join(f"{k}:{v}" for k, v in sorted(m.staleness_hist.items())) or "-"),
        (
            "in flight / buffered / open groups",
            f"{m.in_flight} / {m.buffered_groups} / {m.unfinished_groups}",
        ),
        ("time engine / sandbox / verifier", split),
        *(
            [("waiting for environment sessions", f"{m.capacity_wait_s:.1f}s (the server is full)")]
            if m.capacity_wait_s
            else []
        ),
        ("tokens/s", f"{m.tokens_per_s:,.0f} ({m.response_tokens} tokens in {m.wall_s:.2f}s)"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table
