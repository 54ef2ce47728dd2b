"""Prompt source: rows shuffled per epoch with a seed, resumable without repeats or losses.

A prompt is identified by `uid = "<epoch>:<row index>"`. The source remembers every uid it has
issued and not yet seen consumed (trained on, or filtered out by dynamic sampling); a checkpoint
stores those as `pending`, and a restored source issues them again first. So a resumed run redoes
exactly the prompts that were in flight or buffered at the checkpoint, and nothing else.

`skip_next(uid, n)` passes over the next n appearances of a prompt's row in the order: a prompt
every sample just solved is likely to be dropped by the dynamic filter again, its episodes spent
for nothing. The skips still owed are part of the state.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import AgentRLError
from agentrl.tasks.rows import read_jsonl, row_prompt_id


class PromptSourceError(AgentRLError):
    """The prompt rows or a saved state cannot be used."""


@dataclass(frozen=True)
class Prompt:
    uid: str
    prompt_id: str
    epoch: int
    index: int
    row: dict[str, Any]


class PromptSource:
    """Rows in a seeded per-epoch order; `max_epochs=None` cycles forever."""

    def __init__(self, rows: list[dict[str, Any]], *, seed: int = 0, max_epochs: int | None = None) -> None:
        if not rows:
            raise PromptSourceError("the prompt source has no rows: give a non-empty list or jsonl file")
        if max_epochs is not None and max_epochs < 1:
            raise PromptSourceError(f"max_epochs must be >= 1 or None, got {max_epochs}")
        self.rows = rows
        self.seed = seed
        self.max_epochs = max_epochs
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)
        self._requeued: deque[str] = deque()
        self._unfinished: OrderedDict[str, None] = OrderedDict()
        self._skips: dict[int, int] = {}  # row index -> appearances still to pass over
        self.skipped = 0  # appearances passed over so far

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs: Any) -> PromptSource:
        return cls(read_jsonl(path), **kwargs)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _prompt(self, uid: str) -> Prompt:
        epoch_s, index_s = uid.split(":", 1)
        index = int(index_s)
        if not 0 <= index < len(self.rows):
            raise PromptSourceError(
                f"prompt {uid} points past the {len(self.rows)} rows: resumed with other data?"
            )
        row = self.rows[index]
        return Prompt(uid, row_prompt_id(row, index), int(epoch_s), index, row)

    def exhausted(self) -> bool:
        return not self._requeued and self.max_epochs is not None and self.epoch >= self.max_epochs

    def next(self) -> Prompt | None:
        """The next prompt to roll out (re-queued ones first), or None when all epochs are issued."""
        if self._requeued:
            return self._prompt(self._requeued.popleft())
        while True:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                return None
            index = self._order[self.position]
            self.position += 1
            if self._skips.get(index, 0) > 0:  # each pass consumes a skip: this loop ends
                self._skips[index] -= 1
                self.skipped += 1
                continue
            uid = f"{self.epoch}:{index}"
            self._unfinished[uid] = None
            return self._prompt(uid)

    def skip_next(self, uid: str, n: int) -> None:
        """Pass over the next `n` appearances of the row prompt `uid` was made from (n <= 0: none)."""
        index = self._prompt(uid).index
        if n > 0:
            self._skips[index] = n
        else:
            self._skips.pop(index, None)

    def requeue(self, uid: str) -> None:
        """Issue `uid` again before any new prompt (its group could not be used)."""
        if uid not in self._unfinished:
            raise PromptSourceError(f"prompt {uid} was not issued or is already consumed")
        self._requeued.append(uid)

    def mark_consumed(self, uid: str) -> None:
        self._unfinished.pop(uid, None)

    @property
    def pending(self) -> list[str]:
        """Issued and not consumed: in flight, buffered or re-queued."""
        return list(self._unfinished)

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "n_rows": len(self.rows),
            "epoch": self.epoch,
            "position": self.position,
            "pending": self.pending,
            "skips": {str(i): n for i, n in self._skips.items() if n > 0},
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("n_rows") != len(self.rows) or state.get("seed") != self.seed:
            raise PromptSourceError(
                f"saved prompt state is for {state.get('n_rows')} rows with seed {state.get('seed')}, "
                f"this source has {len(self.rows)} rows with seed {self.seed}: resume with the same data and seed"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
        pending = [str(u) for u in state["pending"]]
        for uid in pending:
            self._prompt(uid)
        self._unfinished = OrderedDict.fromkeys(pending)
        self._requeued = deque(pending)
        self._skips = {}
        for index, n in dict(state.get("skips", {})).items():
            self.skip_next(f"0:{int(index)}", int(n))
        self.skipped = int(state.get("skipped", 0))
