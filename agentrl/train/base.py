"""The `Trainer` seam: what the runtime needs of a trainer backend (torch today, Megatron next).

The backend is algorithm-blind about groups and episodes: `train_step` gets segments whose
advantages were computed once per episode outside it (`agentrl.train.batch.training_samples`), and
packs them with the per-token loss weights of `agentrl.train.batch.build_batch`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from agentrl.episode.sample import Sample
from agentrl.train.checkpoint import TrainState

WeightBucket = list[tuple[str, torch.Tensor]]


@runtime_checkable
class Trainer(Protocol):
    """One policy, its optimizer and its step counter."""

    step: int

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One rollout batch -> one or more optimizer steps; returns scalar metrics."""
        ...

    def save(self, root: str | Path, *, buffer_state: dict[str, Any] | None = None) -> Path:
        """Checkpoint weights, optimizer, step and the caller's state under `root`; returns the directory."""
        ...

    def load(self, path: str | Path) -> TrainState:
        """Restore from a checkpoint directory (or a root holding `latest`)."""
        ...

    def export_weights(
        self, dtype: torch.dtype | None = None, *, bucket_bytes: int = ...
    ) -> Iterator[WeightBucket]:
        """The weights under their Hugging Face names, in buckets of bounded size (the weight
        source of every sync transport)."""
        ...
