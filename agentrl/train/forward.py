"""Per-token log-probs of a transformers causal LM without its full-vocabulary logits.

The decoder body (`model.base_model`) yields hidden states; the output-embedding weight turns them
into log-probs chunk by chunk (`agentrl.algo.chunked_logprobs`). `model(...).logits` is never called.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.algo import chunked_logprobs, full_logprobs


def model_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    chunk_size: int | None = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(input_ids[b, t] | input_ids[b, :t]) as a [R, L] fp32 tensor aligned with `input_ids`.

    Column 0 (no context to predict it from) is 0. `chunk_size=None` computes all logits at once
    (the baseline the chunked path is measured against). Entropy, when asked, is aligned the same way.
    """
    out = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    hidden = out.last_hidden_state[:, :-1]
    weight = model.get_output_embeddings().weight
    targets = input_ids[:, 1:]
    if chunk_size:
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
