"""Per-token log-probs of a transformers causal LM without its full-vocabulary logits.

The decoder body (`model.base_model`) yields hidden states; the output-embedding weight turns them
into log-probs without [T, V] logits: the fused kernel on CUDA (`agentrl.algo.fused_logprobs`), the
chunked torch passes elsewhere (`agentrl.algo.chunked_logprobs`). `model(...).logits` is never called.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from agentrl.algo import chunked_logprobs, full_logprobs, fused_logprobs
from agentrl.algo.fused_logprobs import fused_kernel_applies

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
    out = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    hidden = out.last_hidden_state[:, :-1]
    weight = model.get_output_embeddings().weight
    targets = input_ids[:, 1:]
    if impl == "auto":
        impl = "fused" if fused_kernel_applies(hidden, weight) else "chunked"
    if impl == "fused":
        logp, ent = fused_logprobs(
            hidden, weight, targets, temperature=temperature, with_entropy=with_entropy
        )
    elif impl != "chunked":
        raise ValueError(f"impl={impl!r}: choose auto, fused or chunked")
    elif chunk_size:
        logp, ent = chunked_logprobs(
            hidden, weight, targets, chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy
        )
    else:
        logp, ent = full_logprobs(hidden, weight, targets, temperature=temperature, with_entropy=with_entropy)
    pad = logp.new_zeros(logp.shape[0], 1)
    logp = torch.cat([pad, logp], dim=1)
    if ent is not None:
        ent = torch.cat([pad, ent], dim=1)
    return logp, ent
