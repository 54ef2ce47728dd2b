"""`Sample`: the one record that crosses from rollout to training.

Token-in/token-out: `tokens` are exactly the prompt ids, the ids each turn generated and the
tokenized observations between them. `loss_mask` and `rollout_logprobs` cover the response part
(`tokens[prompt_length:]`), one entry per token: mask 1 and the engine's log-prob on generated
tokens, mask 0 and log-prob 0.0 on observation tokens.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Status(enum.StrEnum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED_INFRA = "failed-infra"
    FAILED_POLICY = "failed-policy"


@dataclass
class Sample:
    prompt_id: str
    tokens: list[int]
    prompt_length: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float | None = None
    status: Status = Status.COMPLETED
    end_reason: str | None = None
    failure_cause: str | None = None
    group_index: int = 0
    sample_index: int = 0
    weight_versions: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    task_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def trainable(self) -> bool:
        """Infra failures carry no reward and never reach the trainer; neither does an episode
        that generated no token (e.g. its wall clock ran out before the first turn)."""
        return self.status is not Status.FAILED_INFRA and self.reward is not None and any(self.loss_mask)

    def check(self) -> None:
        """Raise ValueError if the token arrays disagree (a corrupted sample must not train)."""
        n = self.response_length
        if n < 0 or len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"sample {self.prompt_id}/{self.sample_index}: response length {n}, "
                f"loss_mask {len(self.loss_mask)}, rollout_logprobs {len(self.rollout_logprobs)}"
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        d["status"] = Status(d["status"])
        return cls(**d)
