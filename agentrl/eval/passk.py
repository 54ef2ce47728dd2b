"""pass@1 and pass@k of any engine over any environment's rows, with fixed sampling seeds: the one
evaluator of the project (the runtime, the recipes and `eval` commands all call it).

Every (row, i) episode samples with seed `seed_base + i`, so two evaluations of different models
see the same seeds. An infrastructure failure (sandbox, engine, verifier) is retried with the same
seed; when retries run out the episode is reported as unscored, never as reward 0, and counted
against the run where the cause is ambiguous (`internal_error`: an untyped exception, which an
episode might have provoked). pass@k uses the unbiased estimator of Chen et al. (2021) over the n
samples of each row, so k may be below n.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from agentrl.episode.sample import Status
from agentrl.errors import AgentRLError, InfraError, InputError
from agentrl.rollout.manager import EpisodeRunner
from agentrl.tasks.rows import row_prompt_id

log = logging.getLogger("agentrl.eval.passk")

# Causes an episode's own actions might have produced: scored as a failure, not left unscored.
AMBIGUOUS_CAUSES = frozenset({"internal_error"})


class EvalError(AgentRLError):
    """An evaluation whose result would not mean anything (too many episodes unscored)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


@dataclass
class TaskEval:
    task_id: str
    rewards: list[float] = field(default_factory=list)  # scored episodes only
    unscored: int = 0  # infra failures after every retry
    counted_as_failed: int = 0  # ambiguous failures scored 0 against the run

    def passed(self, threshold: float) -> int:
        return sum(r >= threshold for r in self.rewards)


@dataclass
class EvalSummary:
    label: str
    samples_per_task: int
    ks: list[int]
    pass_threshold: float
    tasks: list[TaskEval]
    infra_failures: dict[str, int]  # every failed attempt, by cause (retried ones too)

    @property
    def episodes(self) -> int:
        return sum(len(t.rewards) for t in self.tasks)

    @property
    def unscored(self) -> int:
        return sum(t.unscored for t in self.tasks)

    def task_pass_at(self, t: TaskEval, k: int) -> float | None:
        n = len(t.rewards)
        return pass_at_k(n, t.passed(self.pass_threshold), k) if n >= k else None

    def pass_at(self, k: int) -> float:
        """Mean over tasks of the per-task estimate (tasks with fewer than k scored samples skipped)."""
        vals = [v for t in self.tasks if (v := self.task_pass_at(t, k)) is not None]
        return sum(vals) / len(vals) if vals else 0.0

    def mean_reward(self) -> float:
        rewards = [r for t in self.tasks for r in t.rewards]
        return sum(rewards) / len(rewards) if rewards else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label}
        for k in self.ks:
            out[f"pass@{k}"] = self.pass_at(k)
        out.update(
            {
                "mean_reward": self.mean_reward(),
                "samples_per_task": self.samples_per_task,
                "episodes": self.episodes,
                "unscored": self.unscored,
                "infra_failures": sum(self.infra_failures.values()),
                "infra_failures_by_cause": dict(self.infra_failures),
                "per_task": {
                    t.task_id: t.passed(self.pass_threshold) / len(t.rewards) if t.rewards else None
                    for t in self.tasks
                },
                "per_task_pass_at": {
                    t.task_id: {f"pass@{k}": self.task_pass_at(t, k) for k in self.ks} for t in self.tasks
                },
            }
        )
        return out

    def table(self) -> Table:
        table = Table(title=f"eval: {self.label}")
        table.add_column("task")
        table.add_column("scored")
        for k in self.ks:
            table.add_column(f"pass@{k}")
        for t in self.tasks:
            cells = [_fmt(self.task_pass_at(t, k)) for k in self.ks]
            scored = f"{len(t.rewards)}" + (f" ({t.unscored} unscored)" if t.unscored else "")
            if t.counted_as_failed:
                scored += f" ({t.counted_as_failed} ambiguous, scored 0)"
            table.add_row(t.task_id, scored, *cells)
        table.add_row("[b]mean[/b]", str(self.episodes), *(f"[b]{self.pass_at(k):.3f}[/b]" for k in self.ks))
        return table


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


async def evaluate(
    runner: EpisodeRunner,
    rows: Sequence[dict[str, Any]],
    *,
    samples_per_row: int,
    ks: Sequence[int] = (1,),
    seed_base: int = 0,
    concurrency: int = 4,
    max_attempts: int = 3,
    pass_threshold: float = 1.0,
    label: str = "eval",
    max_unscored_fraction: float = 0.5,
    on_done: Callable[[], None] | None = None,
) -> EvalSummary:
    """Run `samples_per_row` episodes of every row (seed `seed_base + i` for the i-th) through the
    environment's runner (its eval settings) and score them.

    `on_done` is called as each episode ends, scored or not (progress).

    Raises `EvalError` when more than `max_unscored_fraction` of the episodes stay unscored: a pass
    rate over the few that ran would say more about the infrastructure than the model.
    """
    if not rows:
        raise EvalError("the eval set is empty")
    if samples_per_row < 1:
        raise ValueError(f"samples_per_row must be >= 1 (got {samples_per_row})")
    bad = [k for k in ks if not 1 <= k <= samples_per_row]
    if bad:
        raise ValueError(f"every k must be in 1..samples_per_row={samples_per_row} (got {bad})")
    sem = asyncio.Semaphore(concurrency)
    ids = [row_prompt_id(r, i) for i, r in enumerate(rows)]
    if len(set(ids)) < len(ids):  # rows sharing an id are still separate problems
        ids = [f"{rid}#{i}" for i, rid in enumerate(ids)]
    results = {rid: TaskEval(rid) for rid in ids}
    failures: Counter[str] = Counter()

    async def one(rid: str, row: dict[str, Any], i: int) -> None:
        try:
            await scored(rid, row, i)
        finally:
            if on_done is not None:
                on_done()

    async def scored(rid: str, row: dict[str, Any], i: int) -> None:
        cause = "none"
        async with sem:
            for attempt in range(max_attempts):
                try:
                    episode = await runner.run(
                        row,
                        group_id=f"{label}:{rid}",
                        sample_index=i,
                        attempt=attempt,
                        eval=True,
                        seed=seed_base + i,
                    )
                except InfraError as exc:
                    cause = exc.cause
                except InputError as exc:  # the row itself is broken: no retry, unscored
                    log.error("eval row %s cannot be run, fix the data: %s", rid, exc)
                    cause = "bad_input"
                    failures[cause] += 1
                    break
                except Exception:
                    log.exception("eval episode %s/%d raised an untyped error", rid, i)
                    cause = "internal_error"
                else:
                    if episode.reward is not None and episode.status is not Status.FAILED_INFRA:
                        results[rid].rewards.append(float(episode.reward))
                        return
                    cause = episode.failure_cause or "infra"
                failures[cause] += 1
        if cause in AMBIGUOUS_CAUSES:
            results[rid].rewards.append(0.0)
            results[rid].counted_as_failed += 1
        else:
            results[rid].unscored += 1

    async with asyncio.TaskGroup() as tg:
        for rid, row in zip(ids, rows, strict=True):
            for i in range(samples_per_row):
                tg.create_task(one(rid, row, i))
    summary = EvalSummary(
        label=label,
        samples_per_task=samples_per_row,
        ks=sorted(set(ks)),
        pass_threshold=pass_threshold,
        tasks=[results[rid] for rid in dict.fromkeys(ids)],
        infra_failures=dict(failures),
    )
    total = len(rows) * samples_per_row
    if summary.unscored > max_unscored_fraction * total:
        raise EvalError(
            f"eval {label}: {summary.unscored} of {total} episodes stayed unscored after "
            f"{max_attempts} attempts (failures by cause: {dict(failures)}); fix the infrastructure "
            "before reading a pass rate"
        )
    return summary


def standard_error(p: float, n: int) -> float:
    """The standard error of a pass rate `p` measured over `n` independent episodes."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else float("nan")
