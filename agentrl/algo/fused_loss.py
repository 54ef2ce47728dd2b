"""A per-token loss straight from the LM head in three products: gradients made in forward.

`fused_logprobs` returns log-probs that any later loss may use, so its backward must rebuild the
logits (the upstream gradient is unknown until then): four products of the head's size. An RL
loss is, per token, a function of that token's log-prob and entropy alone (PPO clip, TIS weights,
KL to a reference, entropy bonus; `agentrl.algo.losses`), times a weight fixed before the pass
(the aggregation's). Given that function, each chunk of positions is finished while its logits
are still in memory:

    z = h_c W^T / temperature     (product 1: the forward kernel, which also stores z - m in fp16)
    logp, entropy from the kernel's statistics; g = d(loss)/d(logp, entropy), autograd on [chunk]
    dL/dz = g_logp (onehot(y) - p) + g_ent p (E_p[z] - z), written over the stored logits (bf16)
    dL/dh_c = dL/dz W             (product 2)
    dL/dW  += dL/dz^T h_c         (product 3)

Forward keeps dL/dh and dL/dW; backward scales them by the loss's upstream gradient. Memory: the
two gradients and one [chunk, V] 2-byte buffer. A bf16 weight's dL/dW is summed over chunks in
bf16 (one rounding per chunk). An fp32 weight (fp32 master weights under autocast) gets an fp32
dL/dW from dL/dz carried as a bf16 pair hi + lo: a second [chunk, V] buffer and a fourth product.

The contract on `token_loss(logp, entropy, index)`: it returns one loss per position of the chunk
`index` (a slice of the flattened positions), the loss of position i depending on logp[i] and
entropy[i] only. A loss that mixes positions (a sequence-level ratio) must use `fused_logprobs`.

Off the GPU, or with `kernel="torch"`, the same function runs the chunked torch passes (the
reference semantics the CPU tests check). `vocab_parallel_token_loss` is the tensor-parallel form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from agentrl.algo.fused_logprobs import (
    _TORCH_CHUNK,
    Kernel,
    TileConfig,
    _add_product_fp32,
    _addmm_accumulates_fp32,
    _engine,
    _mm,
    _reduce_over_shards,
    _triton_dz_from_z,
    _triton_stats,
    default_tiles,
)
from agentrl.algo.logprobs import chunk_grads, chunk_stats, matmul_dtype

TokenLoss = Callable[[torch.Tensor, torch.Tensor | None, slice], torch.Tensor]

# The [chunk, V] fp16 logit buffer of the Triton path is kept near this size (GLM-5.2's
# vocabulary: 1,536 positions; larger chunks sum dL/dW in fewer roundings, in fewer passes).
CHUNK_BYTES = 480 * 2**20


class TokenLossResult(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable in hidden and weight
    logp: torch.Tensor  # [..., T] fp32, detached
    entropy: torch.Tensor | None  # [..., T] fp32, detached (None unless with_entropy)


def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_loss: TokenLoss,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    kernel: Kernel = "auto",
    tiles: TileConfig | None = None,
    chunk: int | None = None,
) -> TokenLossResult:
    """sum_i token_loss(logp, entropy, chunk)[i] over all positions, with logp (and entropy) of
    `targets` under softmax(hidden @ weight^T / temperature).

    hidden: [..., T, H]; weight: [V, H]; targets: [..., T]. `token_loss` sees the flattened
    positions one chunk at a time (the module docstring states its contract). `chunk`: positions
    per chunk (default: a ~480 MiB logit buffer on the Triton path, 1024 on the torch path).
    """
    return _run(hidden, weight, targets, token_loss, temperature, with_entropy, kernel, tiles, chunk, None, 0)


def vocab_parallel_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_loss: TokenLoss,
    *,
    group: Any = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    kernel: Kernel = "auto",
    tiles: TileConfig | None = None,
    chunk: int | None = None,
) -> TokenLossResult:
    """`fused_token_loss` with `weight` one rank's shard [V / P, H] of the vocabulary.

    As `vocab_parallel_logprobs`: hidden states and targets are the same on every rank of `group`
    (default: the world), and so are the log-probs, the entropy and the loss (every rank computes
    it; do not sum it over the group). dL/dh is all-reduced; dL/dW is this rank's shard.
    """
    if group is None:
        group = dist.group.WORLD
    if vocab_start is None:
        vocab_start = dist.get_rank(group) * weight.shape[0]
    return _run(
        hidden,
        weight,
        targets,
        token_loss,
        temperature,
        with_entropy,
        kernel,
        tiles,
        chunk,
        group,
        vocab_start,
    )


def _run(
    hidden, weight, targets, token_loss, temperature, with_entropy, kernel, tiles, chunk, group, vocab_start
):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    if chunk is not None and chunk <= 0:
        raise ValueError(f"chunk must be a positive number of positions, got {chunk}")
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    engine = _engine(kernel, h, weight)
    if engine == "triton":
        tiles = tiles or default_tiles(h.device)
        chunk = chunk or max(
            tiles.block_t, CHUNK_BYTES // (2 * weight.shape[0]) // tiles.block_t * tiles.block_t
        )
    else:
        chunk = chunk or _TORCH_CHUNK
    opts = (token_loss, float(temperature), with_entropy, engine, tiles, chunk, group, vocab_start)
    loss, logp, ent = _FusedTokenLoss.apply(h, weight, y, opts)
    return TokenLossResult(loss, logp.reshape(lead), ent.reshape(lead) if with_entropy else None)


def _token_grads(token_loss: TokenLoss, logp: torch.Tensor, ent: torch.Tensor | None, index: slice):
    """(loss sum, d/dlogp, d/dentropy or None) of one chunk's per-token losses."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        ep = ent.detach().requires_grad_() if ent is not None else None
        per_token = token_loss(lp, ep, index)
        if per_token.shape != lp.shape:
            raise ValueError(
                f"token_loss must return one loss per position: got shape {tuple(per_token.shape)} "
                f"for a chunk of {lp.shape[0]} positions"
            )
        total = per_token.sum()
        wrt = [lp] if ep is None else [lp, ep]
        grads = (
            torch.autograd.grad(total, wrt, allow_unused=True) if total.requires_grad else [None] * len(wrt)
        )
    g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp)
    g_ent = grads[1] if ep is not None else None
    acc = torch.promote_types(logp.dtype, torch.float32)
    return (
        total.detach().to(acc),
        g_lp.to(acc).contiguous(),
        g_ent.to(acc).contiguous() if g_ent is not None else None,
    )


def _add_weight_grad(
    acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool, fp32_acc: bool
) -> None:
    """acc (+)= a @ b: the first chunk's product is written (acc is uninitialised), later ones
    added in cuBLAS's epilogue (bf16 acc: one rounding per chunk; fp32 acc: fp32 sums)."""
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
    elif first:
        torch.mm(a, b, out_dtype=torch.float32, out=acc)
    else:
        _add_product_fp32(acc, a, b, fp32_acc)


class _FusedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, opts):
        token_loss, temperature, with_entropy, engine, tiles, chunk, group, vocab_start = opts
        n, v = h.shape[0], weight.shape[0]
        mm = matmul_dtype(h, weight)
        y = targets - vocab_start if vocab_start else targets
        need_h, need_w = h.requires_grad, weight.requires_grad
        dev = h.device
        grad_h = torch.empty(h.shape, device=dev, dtype=h.dtype) if need_h else None
        w_dtype = weight.dtype if weight.dtype in (mm, torch.float32) else torch.float32
        # Zeros on the torch path (it adds every chunk) and for an empty input; the Triton path's
        # first chunk writes its product into it.
        fill = torch.empty if engine == "triton" and n else torch.zeros
        grad_w = fill(weight.shape, device=dev, dtype=w_dtype) if need_w else None
        acc = torch.promote_types(mm, torch.float32)
        logp = torch.empty(n, device=dev, dtype=acc)
        ent = torch.empty(n if with_entropy else 0, device=dev, dtype=acc)
        total = torch.zeros((), device=dev, dtype=acc)
        h_mm, w_mm = _mm(h, mm), _mm(weight, mm)
        inv_temp = 1.0 / temperature
        zbuf = lobuf = None
        # An fp32 weight gradient (fp32 master weights) gets dL/dz as a bf16 pair hi + lo, one
        # more product: bf16 dL/dz alone would leave ~1e-3 relative error (as in fused_logprobs).
        split = grad_w is not None and grad_w.dtype == torch.float32 and mm != torch.float32
        if engine == "triton" and n:
            zbuf = torch.empty(min(chunk, n) * v, device=dev, dtype=torch.float16)
            lobuf = torch.empty(min(chunk, n) * v, device=dev, dtype=mm) if split else None
        fp32_acc = engine == "triton" and _addmm_accumulates_fp32(dev)
        for c0 in range(0, n, chunk):
            c1 = min(c0 + chunk, n)
            hc, yc = h_mm[c0:c1], y[c0:c1]
            in_range = (yc >= 0) & (yc < v) if group is not None else None
            y_safe = yc.clamp(0, v - 1) if in_range is not None else yc
            if engine == "triton":
                z = zbuf[: (c1 - c0) * v].view(c1 - c0, v)
                zy, lse, ez, pm = _triton_stats(hc, w_mm, yc, inv_temp, with_entropy, tiles, z_out=z)
            else:
                zy, lse, ez = chunk_stats(
                    hc, w_mm, y_safe, chunk_size=chunk, temperature=temperature,
                    with_entropy=with_entropy, in_range=in_range,
                )  # fmt: skip
            if group is not None:
                zy, lse, ez = _reduce_over_shards(zy, lse, ez, group)
            lp_c = zy - lse
            ent_c = lse - ez if ez is not None else None
            logp[c0:c1] = lp_c
            if ent_c is not None:
                ent[c0:c1] = ent_c
            part, g_lp, g_ent = _token_grads(token_loss, lp_c, ent_c, slice(c0, c1))
            total += part
            if not (need_h or need_w):
                continue
            if engine == "triton":
                lo = lobuf[: (c1 - c0) * v].view(c1 - c0, v) if lobuf is not None else None
                dz = _triton_dz_from_z(z, pm, yc, lse, ez, g_lp, g_ent, inv_temp, mm, tiles, lo=lo)
                if grad_h is not None:
                    if grad_h.dtype == mm:
                        torch.mm(dz, w_mm, out=grad_h[c0:c1])
                    else:
                        torch.mm(dz, w_mm, out_dtype=torch.float32, out=grad_h[c0:c1])
                if grad_w is not None:
                    _add_weight_grad(grad_w, dz.t(), hc, first=c0 == 0, fp32_acc=fp32_acc)
                    if lo is not None:
                        _add_weight_grad(grad_w, lo.t(), hc, first=False, fp32_acc=fp32_acc)
            else:
                gh, gw = chunk_grads(
                    hc, w_mm, y_safe, lse, ez, g_lp, g_ent, chunk_size=chunk, temperature=temperature,
                    mm_dtype=mm, need_h=need_h, need_w=need_w, in_range=in_range,
                )  # fmt: skip
                if grad_h is not None:
                    grad_h[c0:c1] = gh
                if grad_w is not None:
                    grad_w += gw
        if grad_h is not None and group is not None:
            dist.all_reduce(grad_h, group=group)
        ctx.grads = (grad_h, grad_w)
        ctx.mark_non_differentiable(logp, ent)
        return total, logp, ent

    @staticmethod
    def backward(ctx, g_total, _g_logp, _g_ent):
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        if grad_h is not None:
            grad_h.mul_(g_total.to(grad_h.dtype))
        if grad_w is not None:
            grad_w.mul_(g_total.to(grad_w.dtype))
        return grad_h, grad_w, None, None
