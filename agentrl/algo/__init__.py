"""The loss library shared by every trainer backend: pure torch functions of typed inputs.

Token tensors are `[B, T]` (rows, positions) with a 0/1 `mask` marking trained tokens; a trainer
aligns `logp[b, t]` with the token at `input_ids[b, t]` (predicted from position t-1).
"""

from agentrl.algo.advantages import broadcast_to_tokens, grpo_advantages
from agentrl.algo.fused_logprobs import fused_logprobs, vocab_parallel_logprobs
from agentrl.algo.logprobs import chunked_logprobs, full_logprobs
from agentrl.algo.losses import (
    LossConfig,
    aggregate,
    grpo_loss,
    kl_penalty,
    mismatch_kl,
    policy_loss,
    tis_weights,
)

__all__ = [
    "LossConfig",
    "aggregate",
    "broadcast_to_tokens",
    "chunked_logprobs",
    "full_logprobs",
    "fused_logprobs",
    "grpo_advantages",
    "grpo_loss",
    "kl_penalty",
    "mismatch_kl",
    "policy_loss",
    "tis_weights",
    "vocab_parallel_logprobs",
]
