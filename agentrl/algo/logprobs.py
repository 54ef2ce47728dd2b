"""Token log-probs (and entropy) from hidden states and the output-embedding weight.

Full-vocabulary logits for a long sequence are the largest tensor of a training step (16k tokens x
150k vocab x 4 bytes = 10 GB in fp32, several copies during backward). `chunked_logprobs` computes
them `chunk_size` positions at a time under activation checkpointing, so forward and backward each
hold one chunk's logits at most: memory O(chunk_size * V) instead of O(T * V).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(y_t) = z_{t,y_t} - logsumexp_v z_{t,v};  H_t = logsumexp_v z_{t,v} - sum_v p_{t,v} z_{t,v},
    with z = (h W^T) / temperature computed in fp32.
    """
    logits = (hidden @ weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `targets` under softmax(hidden @ weight^T / temperature), `chunk_size` positions at a time.

    hidden: [..., T, H]; weight: [V, H]; targets: [..., T] (the token each position predicts).
    Returns (logp [..., T] fp32, entropy [..., T] fp32 or None). Each chunk runs under
    `torch.utils.checkpoint`, so backward recomputes that chunk's logits instead of keeping them.
    """
    if chunk_size <= 0:
        raise ValueError(
            f"logprob_chunk_size must be positive, got {chunk_size} (use full_logprobs for no chunking)"
        )
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for start in range(0, h.shape[0], chunk_size):
        hc, yc = h[start : start + chunk_size], y[start : start + chunk_size]
        if need_grad:
            lp, ent = checkpoint(_head, hc, weight, yc, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _head(hc, weight, yc, temperature, with_entropy)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        empty = h.new_zeros(lead, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    logp = torch.cat(logps).reshape(lead)
    return logp, (torch.cat(ents).reshape(lead) if with_entropy else None)


def full_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unchunked computation (all logits at once): the reference and the benchmark baseline."""
    logp, ent = _head(hidden, weight, targets, temperature, with_entropy)
    return logp, (ent if with_entropy else None)
