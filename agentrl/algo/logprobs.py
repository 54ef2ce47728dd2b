"""Token log-probs (and entropy) from hidden states and the output-embedding weight.

Full-vocabulary logits for a long sequence are the largest tensor of a training step (16k tokens x
150k vocab x 4 bytes = 10 GB in fp32, several copies during backward). `chunked_logprobs` computes
them `chunk_size` positions at a time and keeps only per-token scalars (log-sum-exp, expected logit)
for backward, which recomputes one chunk's logits at a time and applies the closed-form gradient:
memory O(chunk_size * V) instead of O(T * V) in both directions.

`chunk_stats` and `chunk_grads` are those two passes as plain functions: the fused kernel
(`agentrl.algo.fused_logprobs`) falls back to them off the GPU and for vocabulary shards.
"""

from __future__ import annotations

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (bf16 logits lose the log-prob), fp64 kept for exact checks."""
    return torch.promote_types(dtype, torch.float32)


def _logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    z = h @ weight.t()
    z = z.to(_acc_dtype(z.dtype))
    return z / temperature if temperature != 1.0 else z


def matmul_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's products run in: autocast's when it is on, else the inputs' promoted
    dtype. Backward runs outside any autocast region, so forward records this for it."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, weight.dtype)


def chunk_stats(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    temperature: float,
    with_entropy: bool,
    in_range: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per position of h [N, H]: (target logit z_y, lse(z), E_p[z] or None), z = h W^T / temperature.

    `in_range` (bool [N]) marks the targets that are rows of `weight` when it is one shard of the
    vocabulary (the others must be clamped into range by the caller; their z_y is 0); None when all are.
    """
    n = h.shape[0]
    acc = _acc_dtype(torch.promote_types(h.dtype, weight.dtype))
    zy = torch.empty(n, device=h.device, dtype=acc)
    lse = torch.empty_like(zy)
    ez = torch.empty_like(zy) if with_entropy else None
    for s in range(0, n, chunk_size):
        z = _logits(h[s : s + chunk_size], weight, temperature)
        lse_c = torch.logsumexp(z, dim=-1)
        lse[s : s + chunk_size] = lse_c
        zy[s : s + chunk_size] = z.gather(-1, targets[s : s + chunk_size, None])[:, 0]
        if ez is not None:
            z.sub_(lse_c[:, None])
            ez[s : s + chunk_size] = (z.exp() * z).sum(-1) + lse_c  # E_p[z] = sum p (z - lse) + lse
    if in_range is not None:
        zy = zy.masked_fill(~in_range, 0.0)
    return zy, lse, ez


def chunk_grads(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ez: torch.Tensor | None,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
    *,
    chunk_size: int,
    temperature: float,
    mm_dtype: torch.dtype,
    need_h: bool,
    need_w: bool,
    in_range: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dL/dh in h's dtype, dL/dW in fp32 or wider) from the upstream gradients of logp = z_y - lse
    and of the entropy lse - E_p[z] (`g_ent` None: entropy unused), recomputing the logits
    `chunk_size` positions at a time with products in `mm_dtype`. Arguments as for `chunk_stats`;
    lse and ez are the full-vocabulary ones (reduced across shards)."""
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = (
        torch.zeros(weight.shape, device=weight.device, dtype=_acc_dtype(weight.dtype)) if need_w else None
    )
    w_mm = weight.to(mm_dtype)
    for s in range(0, h.shape[0], chunk_size):
        hc = h[s : s + chunk_size].to(mm_dtype)
        z = _logits(hc, w_mm, temperature)
        p = torch.exp(z - lse[s : s + chunk_size, None])
        gl = g_logp[s : s + chunk_size, None].to(p.dtype)
        if g_ent is not None and ez is not None:
            # dL/dz = g_lp (onehot - p) + g_H p (E[z] - z)
            ge = g_ent[s : s + chunk_size, None].to(p.dtype)
            dz = p * (ge * (ez[s : s + chunk_size, None] - z) - gl)
        else:
            dz = p.mul_(-gl)
        if in_range is not None:
            gl = gl * in_range[s : s + chunk_size, None]
        dz.scatter_add_(-1, targets[s : s + chunk_size, None], gl)
        if temperature != 1.0:
            dz.div_(temperature)
        dz = dz.to(mm_dtype)
        if grad_h is not None:
            grad_h[s : s + chunk_size] = dz @ w_mm
        if grad_w is not None:
            # Product in the compute dtype (tensor cores), summed over chunks in fp32.
            grad_w += dz.t() @ hc
    return grad_h, grad_w


class _ChunkedLogprob(torch.autograd.Function):
    """With z = (h W^T) / T per position, p = softmax(z), y the target:

        forward:   logp = z_y - lse(z),   H = lse(z) - sum_v p_v z_v
        backward:  dlogp/dz = onehot(y) - p,   dH/dz = p * (E_p[z] - z)
                   dL/dh = (dL/dz / T) W,   dL/dW = sum_t (dL/dz_t / T)^T h_t
    Only lse and E_p[z] (one scalar per position each) are saved between the passes.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_size, temperature, with_entropy):
        zy, lse, ez = chunk_stats(
            h, weight, targets, chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy
        )
        logp = zy - lse
        entropy = lse - ez if ez is not None else torch.zeros_like(logp)
        ctx.save_for_backward(h, weight, targets, lse, ez if ez is not None else lse)
        ctx.chunk_size, ctx.temperature, ctx.with_entropy = chunk_size, temperature, with_entropy
        ctx.mm_dtype = matmul_dtype(h, weight)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, targets, lse, ez = ctx.saved_tensors
        grad_h, grad_w = chunk_grads(
            h,
            weight,
            targets,
            lse,
            ez if ctx.with_entropy else None,
            g_logp,
            g_ent if ctx.with_entropy else None,
            chunk_size=ctx.chunk_size,
            temperature=ctx.temperature,
            mm_dtype=ctx.mm_dtype,
            need_h=ctx.needs_input_grad[0],
            need_w=ctx.needs_input_grad[1],
        )
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None


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
    Returns (logp [..., T], entropy [..., T] or None) in fp32 (fp64 for fp64 inputs), differentiable in hidden and weight.
    """
    if chunk_size <= 0:
        raise ValueError(
            f"logprob_chunk_size must be positive, got {chunk_size} (use full_logprobs for no chunking)"
        )
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    logp, ent = _ChunkedLogprob.apply(h, weight, y, chunk_size, float(temperature), with_entropy)
    return logp.reshape(lead), (ent.reshape(lead) if with_entropy else None)


def full_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unchunked computation (all logits at once, autograd through them): the reference and
    the benchmark baseline."""
    z = _logits(hidden, weight, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    return logp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)
