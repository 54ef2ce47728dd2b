"""The loss library shared by every trainer backend: pure torch functions of typed inputs.

Token tensors are `[B, T]` (rows, positions) with a 0/1 `mask` marking trained tokens; a trainer
aligns `logp[b, t]` with the token at `input_ids[b, t]` (predicted from position t-1).

Only `LossConfig` is imported eagerly: torch (the `local` extra) loads when a loss function is
first used, so a run's settings resolve and print without it. The fused kernel's entry point shares
its module's name: import it as `agentrl.algo.fused_logprobs.fused_logprobs`.
"""

from __future__ import annotations

import importlib
from typing import Any

from agentrl.algo.config import LossConfig

_LAZY = {
    "broadcast_to_tokens": "agentrl.algo.advantages",
    "grpo_advantages": "agentrl.algo.advantages",
    "vocab_parallel_logprobs": "agentrl.algo.fused_logprobs",
    "chunked_logprobs": "agentrl.algo.logprobs",
    "full_logprobs": "agentrl.algo.logprobs",
    "aggregate": "agentrl.algo.losses",
    "grpo_loss": "agentrl.algo.losses",
    "kl_penalty": "agentrl.algo.losses",
    "mismatch_kl": "agentrl.algo.losses",
    "policy_loss": "agentrl.algo.losses",
    "tis_weights": "agentrl.algo.losses",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentrl.algo' has no attribute {name!r}")


__all__ = ["LossConfig", *_LAZY]
