"""Buffer: completed GRPO groups (of episodes) in, whole-group batches out.

The trainer awaits `get_batch(batch_size, timeout=...)`; groups are never split. The buffer records
the uid of every group it hands out (`consumed`) and tells the prompt source, so a checkpoint
knows exactly which prompts were trained on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.episode.sample import Episode
from agentrl.errors import AgentRLError


class BufferError(AgentRLError):
    """The buffer cannot deliver: bad request, producer crashed, or no more data."""


class BufferTimeout(BufferError, TimeoutError):
    """No full batch within the timeout (rollout too slow, or stuck: look at the step metrics)."""


class RolloutFinished(BufferError):
    """Every prompt of every epoch was rolled out and consumed; no further batch will come."""


@dataclass
class Group:
    """The `n` episodes of one prompt. `complete` is False when an episode exhausted its infra retry
    budget: that slot then holds a FAILED_INFRA episode with no reward (never a reward of 0)."""

    uid: str
    prompt_id: str
    row: dict[str, Any]
    n: int
    episodes: list[Episode | None] = field(default_factory=list)
    discarded: bool = False  # cancelled as certain to exceed max_staleness; its prompt was re-queued

    def __post_init__(self) -> None:
        if not self.episodes:
            self.episodes = [None] * self.n

    @property
    def filled(self) -> int:
        return sum(e is not None for e in self.episodes)

    @property
    def done(self) -> bool:
        return self.filled == self.n

    @property
    def complete(self) -> bool:
        return self.done and all(e is not None and e.trainable for e in self.episodes)

    @property
    def trainable_episodes(self) -> list[Episode]:
        return [e for e in self.episodes if e is not None and e.trainable]

    def oldest_version(self) -> int | None:
        found = [v for e in self.episodes if e is not None and (v := e.oldest_version()) is not None]
        return min(found) if found else None


class Buffer:
    """Completed groups waiting for the trainer.

    `get_batch` takes the groups generated on the oldest weights first. With `current_version` and
    `max_staleness`, a group older than the bound is never returned: it goes to `on_stale` (the
    manager re-queues its prompt) and is counted in `stale_groups`.
    """

    def __init__(
        self,
        *,
        on_consumed: Callable[[str], None] | None = None,
        on_stale: Callable[[Group], None] | None = None,
    ) -> None:
        self._groups: list[Group] = []
        self._samples = 0
        self._versions: dict[str, int | None] = {}  # oldest version per buffered group, fixed once done
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._finished = False
        self._on_consumed = on_consumed
        self._on_stale = on_stale
        self.consumed: list[str] = []
        self.consumed_samples = 0
        self.stale_groups = 0

    def put(self, group: Group) -> None:
        if not group.done:
            raise BufferError(
                f"group {group.uid} has {group.filled}/{group.n} samples: only finished groups go in"
            )
        self._groups.append(group)
        self._samples += group.n
        self._versions[group.uid] = group.oldest_version()
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        """The producer died: waiting and future `get_batch` calls raise with this as the cause."""
        self._error = error
        self._changed.set()

    def finish(self) -> None:
        """No more groups will come."""
        self._finished = True
        self._changed.set()

    def reopen(self) -> None:
        """More groups will come after all (a prompt was re-queued)."""
        self._finished = False

    @property
    def n_groups(self) -> int:
        return len(self._groups)

    @property
    def n_samples(self) -> int:
        return self._samples

    def _remove(self, group: Group) -> None:
        self._groups.remove(group)
        self._samples -= group.n
        del self._versions[group.uid]

    def record_consumed(self, uid: str) -> None:
        self.consumed.append(uid)
        if self._on_consumed is not None:
            self._on_consumed(uid)

    def _evict_stale(self, current_version: int | None, max_staleness: int | None) -> None:
        if current_version is None or max_staleness is None:
            return
        for g in list(self._groups):
            oldest = self._versions[g.uid]
            if oldest is not None and current_version - oldest > max_staleness:
                self._remove(g)
                self.stale_groups += 1
                if self._on_stale is not None:
                    self._on_stale(g)

    async def get_batch(
        self,
        batch_size: int,
        *,
        timeout: float,
        current_version: int | None = None,
        max_staleness: int | None = None,
    ) -> list[Group]:
        """Wait up to `timeout` seconds for `batch_size` samples in whole groups."""
        if batch_size <= 0:
            raise BufferError(f"batch_size must be positive, got {batch_size}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._error is not None:
                raise BufferError(f"the rollout producer failed: {self._error!r}") from self._error
            self._evict_stale(current_version, max_staleness)
            picked = self._pick(batch_size)
            if picked is not None:
                for g in picked:
                    self._remove(g)
                    self.consumed_samples += g.n
                    self.record_consumed(g.uid)
                return picked
            if self._finished:
                raise RolloutFinished(
                    f"rollout finished with {self.n_samples} samples left, fewer than {batch_size}"
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise BufferTimeout(
                    f"no batch of {batch_size} samples within {timeout:.1f}s ({self.n_samples} buffered): "
                    "raise the timeout or max_in_flight, or check the failure counters"
                )
            self._changed.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
            except TimeoutError:
                continue

    def _pick(self, batch_size: int) -> list[Group] | None:
        if self._samples < batch_size:
            return None
        ordered = sorted(self._groups, key=lambda g: self._versions[g.uid] or 0)
        picked: list[Group] = []
        total = 0
        for g in ordered:
            if total + g.n <= batch_size:
                picked.append(g)
                total += g.n
            if total == batch_size:
                return picked
        return None
