"""Per-token log-probs of a transformers causal LM without its full-vocabulary logits.

The decoder body (`model.base_model`) yields hidden states; the output-embedding weight turns them
into log-probs without [T, V] logits: the fused kernel on CUDA (`agentrl.algo.fused_logprobs`), the
chunked torch passes elsewhere (`agentrl.algo.chunked_logprobs`). `model(...).logits` is never called.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from agentrl.algo.fused_logprobs import fused_kernel_applies, fused_logprobs
from agentrl.algo.fused_loss import TokenLoss, fused_token_loss
from agentrl.algo.logprobs import chunked_logprobs, full_logprobs
from agentrl.train.lora import causal_lm

LogprobImpl = Literal["auto", "fused", "chunked"]


def model_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    chunk_size: int | None = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: LogprobImpl = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(input_ids[b, t] | input_ids[b, :t]) as a [R, L] fp32 tensor aligned with `input_ids`.

    Column 0 (no context to predict it from) is 0. Entropy, when asked, is aligned the same way.
    `impl`: "fused" (`fused_logprobs`: Triton on CUDA, its torch passes elsewhere), "chunked"
    (`chunk_size` positions at a time; `chunk_size=None` computes all logits at once, the baseline),
    "auto" (fused where its Triton kernel runs: CUDA with bf16/fp16 products; chunked elsewhere).
    """
    hidden, weight, targets = _head_inputs(model, input_ids, attention_mask, position_ids)
    if resolve_impl(impl, hidden, weight) == "fused":
        logp, ent = fused_logprobs(
            hidden, weight, targets, temperature=temperature, with_entropy=with_entropy
        )
    else:
        logp, ent = _unfused_logprobs(hidden, weight, targets, chunk_size, temperature, with_entropy)
    return _aligned(logp), (_aligned(ent) if ent is not None else None)


def model_token_loss(
    model: Any,
    input_ids: torch.Tensor,
    token_loss: TokenLoss,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    chunk_size: int | None = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: LogprobImpl = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss, logp [R, L], entropy [R, L] or None): the sum of per-token losses of the positions
    that predict input_ids[:, 1:], with log-probs and entropy aligned as in `model_logprobs`
    (detached).

    `token_loss(logp, entropy, index)` returns one loss per position, the loss of position i
    depending on logp[i] and entropy[i] alone; positions are flattened row by row ([R * (L - 1)])
    and `index` is the slice of them passed. With impl "fused" (`fused_token_loss`) it is called
    a chunk at a time and the gradients are made in the forward pass (three products of the head's
    size instead of four); with "chunked" once, on all positions, through autograd.
    """
    hidden, weight, targets = _head_inputs(model, input_ids, attention_mask, position_ids)
    if resolve_impl(impl, hidden, weight) == "fused":
        loss, logp, ent = fused_token_loss(
            hidden, weight, targets, token_loss, temperature=temperature, with_entropy=with_entropy
        )
    else:
        logp, ent = _unfused_logprobs(hidden, weight, targets, chunk_size, temperature, with_entropy)
        flat_ent = ent.reshape(-1) if ent is not None else None
        loss = token_loss(logp.reshape(-1), flat_ent, slice(0, logp.numel())).sum()
        logp, ent = logp.detach(), (ent.detach() if ent is not None else None)
    return loss, _aligned(logp), (_aligned(ent) if ent is not None else None)


def resolve_impl(impl: LogprobImpl, hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """ "auto" -> "fused" where the Triton kernel runs (CUDA, bf16/fp16 products), else "chunked"."""
    if impl == "auto":
        return "fused" if fused_kernel_applies(hidden, weight) else "chunked"
    if impl not in ("fused", "chunked"):
        raise ValueError(f"impl={impl!r}: choose auto, fused or chunked")
    return impl


def _unfused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_size` positions at a time, or (None) all logits at once."""
    if chunk_size:
        return chunked_logprobs(
            hidden, weight, targets, chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy
        )
    return full_logprobs(hidden, weight, targets, temperature=temperature, with_entropy=with_entropy)


def _head_inputs(
    model: Any, input_ids: torch.Tensor, attention_mask: Any, position_ids: Any
) -> tuple[Any, Any, Any]:
    model = causal_lm(model)  # under a LoRA wrapper: the transformers model, its adapters in place
    out = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    return out.last_hidden_state[:, :-1], model.get_output_embeddings().weight, input_ids[:, 1:]


def _aligned(values: torch.Tensor) -> torch.Tensor:
    """Column 0 (no context to predict it from) is 0."""
    return torch.cat([values.new_zeros(values.shape[0], 1), values], dim=1)
