"""Shared test fixtures: episode and sample builders, the bundled tasks, and a tiny model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from agentrl.sample import Episode, Sample, Status

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_TASKS = ROOT / "envs" / "tbench2" / "tasks"


def make_sample(
    prompt_id: str = "p",
    *,
    response: Sequence[int] = (5, 6),
    prompt: Sequence[int] = (1, 2, 3),
    reward: float | None = 1.0,
    sample_index: int = 0,
    versions: Sequence[int] = (0,),
    logprob: float = -1.0,
) -> Sample:
    """A one-segment sample whose response tokens are all trained."""
    return Sample(
        prompt_id=prompt_id,
        tokens=[*prompt, *response],
        prompt_length=len(prompt),
        loss_mask=[1] * len(response),
        rollout_logprobs=[logprob] * len(response),
        reward=reward,
        sample_index=sample_index,
        weight_versions=list(versions),
    )


def make_episode(
    prompt_id: str = "p",
    *,
    reward: float | None = 1.0,
    sample_index: int = 0,
    segments: int = 1,
    version: int = 0,
    status: Status = Status.COMPLETED,
    response: Sequence[int] = (5, 6),
) -> Episode:
    """An episode of `segments` segments (as a history-rewriting template would split it)."""
    segs = [
        make_sample(
            prompt_id, response=response, reward=reward, sample_index=sample_index, versions=(version,)
        )
        for _ in range(segments)
    ]
    return Episode(
        segments=segs,
        reward=reward,
        status=status,
        start_version=version,
        turn_versions=[version] * segments,
        prompt_id=prompt_id,
        sample_index=sample_index,
    )


@pytest.fixture
def bundled_tasks() -> Path:
    return BUNDLED_TASKS
