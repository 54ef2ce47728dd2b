"""Shared by the trainer tests (no tests here): the tiny GLM policy, fresh copies per test, and samples."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from agentrl.episode.sample import Sample
from agentrl.train.batch import with_advantages
from agentrl.train.forward import model_logprobs


@pytest.fixture(scope="session")
def tiny_base() -> Any:
    from agentrl.models.tiny import load_tiny

    model, _ = load_tiny(seed=0)
    return model


@pytest.fixture
def policy(tiny_base: Any) -> Any:
    """A fresh fp32 copy of the tiny model (tests mutate it)."""
    return copy.deepcopy(tiny_base).float()


def make_samples(
    model: Any,
    *,
    groups: int = 2,
    per_group: int = 3,
    prompt_len: int = 5,
    seed: int = 0,
    rewards: list[float] | None = None,
) -> list[Sample]:
    """Samples with varied lengths, an observation span (loss mask 0) mid-response and rollout
    log-probs equal to `model`'s own (as a perfectly matched engine would report)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    out = []
    for g in range(groups):
        prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        for k in range(per_group):
            n = rng.randrange(6, 14)
            resp = [rng.randrange(10, vocab) for _ in range(n)]
            mask = [1] * n
            for j in range(2, min(4, n)):
                mask[j] = 0
            idx = g * per_group + k
            reward = rewards[idx] if rewards is not None else float(rng.random() > 0.5)
            out.append(
                Sample(
                    prompt_id=f"p{g}",
                    tokens=prompt + resp,
                    prompt_length=prompt_len,
                    loss_mask=mask,
                    rollout_logprobs=[0.0] * n,
                    reward=reward,
                    sample_index=k,
                )
            )
    fill_rollout_logprobs(model, out)
    # Advantages are computed outside the trainer, once per episode (here: one segment each).
    return with_advantages(out)


@torch.no_grad()
def response_logprobs(model: Any, sample: Sample) -> torch.Tensor:
    ids = torch.tensor([sample.tokens])
    lp, _ = model_logprobs(model, ids, chunk_size=None)
    return lp[0, sample.prompt_length :]


def fill_rollout_logprobs(model: Any, samples: list[Sample]) -> None:
    for s in samples:
        lp = response_logprobs(model, s)
        s.rollout_logprobs = [float(x) * m for x, m in zip(lp.tolist(), s.loss_mask, strict=True)]
