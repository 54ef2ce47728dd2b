"""`Episode` and `Sample`: what a rollout produces and what crosses from rollout to training.

An `Episode` is one attempt at one prompt: one reward, one status, and one or more segments. A
chat template that rewrites history (one that strips earlier turns' reasoning, as the GLM and Qwen3
families' do) breaks the token prefix, so the episode is cut into several segments; each segment is
a `Sample`. Groups (GRPO) hold episodes, advantages are computed once per episode and copied to its
segments, and loss denominators count each episode once (`agentrl.train.batch`).

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
    # Set by the runtime before training, identical on every segment of one episode.
    advantage: float | None = None
    episode_id: str | None = None
    # Rollout routing replay (R3): the experts the engine routed each token to, per decoder layer
    # ([len(tokens) - 1][num_layers][top_k], -1 on dense layers; SGLang's `routed_experts`), or None.
    routed_experts: list[list[list[int]]] | None = None

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


@dataclass
class Episode:
    """One attempt at one prompt row. `segments` hold the tokens (empty when nothing was generated);
    `reward` is None exactly when no reward exists (an infrastructure failure).

    `start_version` is the engine weight version when the episode started; `turn_versions` the
    version each model turn reported, in order (a turn that straddled a weight update reports the
    version its response was built with, as SGLang does)."""

    segments: list[Sample]
    reward: float | None
    status: Status
    start_version: int | None = None
    turn_versions: list[int] = field(default_factory=list)
    end_reason: str | None = None
    failure_cause: str | None = None
    task_id: str | None = None
    prompt_id: str = ""
    sample_index: int = 0
    attempt: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def trainable(self) -> bool:
        """Has a reward, is not an infra failure, and generated at least one token to train."""
        return (
            self.status is not Status.FAILED_INFRA
            and self.reward is not None
            and any(s.trainable for s in self.segments)
        )

    @property
    def trainable_segments(self) -> list[Sample]:
        return [s for s in self.segments if s.trainable] if self.trainable else []

    def oldest_version(self) -> int | None:
        """The oldest weight version anything of this episode was generated (or started) on."""
        versions = list(self.turn_versions)
        for seg in self.segments:
            versions += seg.weight_versions
        if self.start_version is not None:
            versions.append(self.start_version)
        return min(versions) if versions else None

    @property
    def response_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        d["segments"] = [s.to_dict() for s in self.segments]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Episode:
        d = dict(d)
        d["status"] = Status(d["status"])
        d["segments"] = [Sample.from_dict(s) for s in d.get("segments", [])]
        return cls(**d)

    @classmethod
    def infra_failure(
        cls, *, prompt_id: str, sample_index: int, cause: str, causes: list[str], task_id: str | None = None
    ) -> Episode:
        """The record of a sample that exhausted its infra retries: no reward, nothing to train."""
        return cls(
            segments=[],
            reward=None,
            status=Status.FAILED_INFRA,
            failure_cause=cause,
            prompt_id=prompt_id,
            sample_index=sample_index,
            attempt=len(causes),
            task_id=task_id,
            metadata={"causes": causes},
        )
