"""Token log-probs (and entropy) from hidden states and the output-embedding weight.

Full-vocabulary logits for a long sequence are the largest tensor of a training step (16k tokens x
150k vocab x 4 bytes = 10 GB in fp32, several copies during backward). `chunked_logprobs` computes
them `chunk_size` positions at a time and keeps only per-token scalars (log-sum-exp, expected logit)
for backward, which recomputes one chunk's logits at a time and applies the closed-form gradient:
memory O(chunk_size * V) instead of O(T * V) in both directions.
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


class _ChunkedLogprob(torch.autograd.Function):
    """With z = (h W^T) / T per position, p = softmax(z), y the target:

        forward:   logp = z_y - lse(z),   H = lse(z) - sum_v p_v z_v
        backward:  dlogp/dz = onehot(y) - p,   dH/dz = p * (E_p[z] - z)
                   dL/dh = (dL/dz / T) W,   dL/dW = sum_t (dL/dz_t / T)^T h_t
    Only lse and E_p[z] (one scalar per position each) are saved between the passes.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_size, temperature, with_entropy):
        n = h.shape[0]
        logp = torch.empty(n, device=h.device, dtype=_acc_dtype(h.dtype))
        lse = torch.empty_like(logp)
        ez = torch.empty_like(logp)
        for s in range(0, n, chunk_size):
            z = _logits(h[s : s + chunk_size], weight, temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk_size] = lse_c
            logp[s : s + chunk_size] = z.gather(-1, targets[s : s + chunk_size, None])[:, 0] - lse_c
            if with_entropy:
                z.sub_(lse_c[:, None])
                ez[s : s + chunk_size] = (z.exp() * z).sum(-1) + lse_c  # E_p[z] = sum p (z - lse) + lse
        entropy = lse - ez if with_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(h, weight, targets, lse, ez)
        ctx.chunk_size, ctx.temperature, ctx.with_entropy = chunk_size, temperature, with_entropy
        # Backward runs outside any autocast region: it redoes the matmuls in the dtype forward used.
        dev = h.device.type
        autocast = torch.is_autocast_enabled(dev)
        ctx.mm_dtype = (
            torch.get_autocast_dtype(dev) if autocast else torch.promote_types(h.dtype, weight.dtype)
        )
        ctx.mark_non_differentiable(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, targets, lse, ez = ctx.saved_tensors
        cs, temp = ctx.chunk_size, ctx.temperature
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = (
            torch.zeros(weight.shape, device=weight.device, dtype=_acc_dtype(weight.dtype))
            if need_w
            else None
        )
        w_mm = weight.to(ctx.mm_dtype)
        for s in range(0, h.shape[0], cs):
            hc = h[s : s + cs].to(ctx.mm_dtype)
            z = _logits(hc, w_mm, temp)
            p = torch.exp(z - lse[s : s + cs, None])
            gl = g_logp[s : s + cs, None].to(p.dtype)
            if ctx.with_entropy:
                # dL/dz = g_lp (onehot - p) + g_H p (E[z] - z)
                ge = g_ent[s : s + cs, None].to(p.dtype)
                dz = p * (ge * (ez[s : s + cs, None] - z) - gl)
            else:
                dz = p.mul_(-gl)
            dz.scatter_add_(-1, targets[s : s + cs, None], gl)
            if temp != 1.0:
                dz.div_(temp)
            dz = dz.to(ctx.mm_dtype)
            if need_h:
                grad_h[s : s + cs] = dz @ w_mm
            if need_w:
                # Product in the compute dtype (tensor cores), summed over chunks in fp32.
                grad_w += dz.t() @ hc
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


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
