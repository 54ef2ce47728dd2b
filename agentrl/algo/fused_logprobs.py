"""Log-probs (and entropy) of target tokens straight from the LM head, never holding [T, V] logits.

With z = h W^T / temperature per position, p = softmax(z) and y the target:

    forward:   logp = z_y - lse(z),   entropy = lse(z) - E_p[z]
    backward:  dL/dz = g_logp (onehot(y) - p) + g_ent p (E_p[z] - z)
               dL/dh = (dL/dz / temperature) W,   dL/dW = (dL/dz / temperature)^T h

On CUDA (Triton) forward is one matrix product whose epilogue reduces each [tokens x vocab] tile
to per-row partials (max, sum exp, sum exp * z, the target's logit); a small combine gives lse and
E_p[z], the only per-token state kept for backward. On Hopper the kernels are persistent (one
program per multiprocessor walking the tiles, so the next tile's bulk tensor copies overlap this
tile's epilogue). Backward walks the vocabulary in slices of `TileConfig.vocab_chunk` rows of W: a
second Triton product recomputes the slice's logits and writes dL/dz in bf16 (fp32 in registers;
bulk tensor stores), then two cuBLAS products give that slice's dL/dW (the whole token sum in one
product: fp32 accumulation, one rounding) and add its share of dL/dh into an fp32 accumulator.
Work: four products of the head's size (the plain forward + backward is three; the fourth is the
logit recompute that buys the memory). Memory: the gradients themselves, an fp32 [T, H]
accumulator and one [T, vocab_chunk] slice. An fp32 weight (fp32 master weights under bf16
autocast) gets an fp32 dL/dW from dL/dz carried as a bf16 pair (hi + lo: a fifth product).

Precision: the tensor cores' fp32 accumulation truncates (the measured errors fit every logit
shrunk by a relative ~1e-5 over a 6,144-wide hidden state), and log-probs are ~6e-5 from exact at
GLM-5.2's head (bf16-logit paths: ~2e-2). Forward therefore adds the tensor cores' partial sums
into an fp32 register accumulator every `TileConfig.promote` k-blocks (default 16: six times over
6,144; ~1e-5 from exact, closer than an fp32 cuBLAS reference; ~7% of forward time; 0 turns it
off). Replacing only the target's logit by an exact fp32 dot product was tried and loses: the
target's and the log-sum-exp's shrinkage cancel where the target is likely (benchmarks/RESULTS.md).
Backward's recompute needs no such care: its dL/dz is rounded to bf16 anyway.

Off the GPU, or with `kernel="torch"`, the same function runs the chunked torch passes of
`agentrl.algo.logprobs` (the reference semantics the CPU tests check).

`vocab_parallel_logprobs` is the tensor-parallel form (Megatron's vocab-parallel LM head): each rank
holds a contiguous shard of W's rows, the hidden states are replicated, per-token log-sum-exp,
E_p[z] and target logit are reduced across the group with all-reduce, and dL/dh is summed across it
in backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from agentrl.algo.logprobs import chunk_grads, chunk_stats, matmul_dtype

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU installs: the torch passes serve
    triton = None

Kernel = Literal["auto", "triton", "torch"]

# Positions per chunk of the torch passes (the CPU path): [chunk, V] fp32 logits at a time.
_TORCH_CHUNK = 1024


@dataclass(frozen=True)
class TileConfig:
    """How the Triton path tiles the head's products.

    `load`: "tma" (Hopper's bulk tensor copies) or "ptr" (plain pointer loads, any CUDA GPU).
    `vocab_chunk` (a multiple of block_v) is backward's slice of the vocabulary; its bf16
    [T, vocab_chunk] buffer (two for an fp32 weight gradient) is most of the kernel's memory
    beyond the gradients.
    `promote` > 0: forward adds the tensor cores' partial logits into an fp32 register accumulator
    every `promote` k-blocks (the module docstring says why and what it costs); 0 leaves the whole
    sum to the tensor cores.
    `persistent`: one program per multiprocessor walking the tiles (the default on Hopper) instead
    of one program per tile.
    `group_v`: vocabulary tiles that sweep the token tiles together (4: measured best of 2-64 on an
    H100 with stored logits, `benchmarks/fused_loss_parts.py`).
    """

    block_t: int = 128
    block_v: int = 256
    block_k: int = 64
    group_v: int = 4
    num_warps: int = 8
    num_stages: int = 3
    load: Literal["tma", "ptr"] = "tma"
    vocab_chunk: int = 8192
    promote: int = 16
    persistent: bool = True

    def __post_init__(self) -> None:
        if self.vocab_chunk % self.block_v:
            raise ValueError(
                f"TileConfig: vocab_chunk ({self.vocab_chunk}) must be a multiple of block_v ({self.block_v})"
            )


def default_tiles(device: torch.device) -> TileConfig:
    """Bulk tensor copies on Hopper and newer, pointer loads before."""
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 9:
        return TileConfig()
    return TileConfig(load="ptr", num_stages=3, block_v=128, num_warps=4, persistent=False)


def fused_kernel_available(device: torch.device | str) -> bool:
    """Whether Triton kernels can run on `device`: CUDA, Triton installed, and a torch whose matrix
    products write fp32 from bf16 operands (`out_dtype`)."""
    return (
        triton is not None and torch.device(device).type == "cuda" and hasattr(torch.ops.aten.mm, "dtype_out")
    )


def fused_kernel_applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `fused_logprobs(hidden, weight, ...)` with kernel="auto" runs the Triton kernels
    here: a CUDA device they run on and bf16/fp16 products (the inputs' dtype, or autocast's)."""
    return fused_kernel_available(hidden.device) and matmul_dtype(hidden, weight) in (
        torch.bfloat16,
        torch.float16,
    )


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    kernel: Kernel = "auto",
    tiles: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `targets` under softmax(hidden @ weight^T / temperature), and its entropy if asked.

    hidden: [..., T, H]; weight: [V, H]; targets: [..., T] in [0, V). Returns (logp, entropy or
    None) in fp32, differentiable in hidden and weight for any upstream gradient of either.
    `kernel`: "triton" (CUDA, bf16/fp16 products: the inputs' dtype or autocast's), "torch" (the
    chunked passes), "auto" (Triton where it applies).
    """
    return _run(hidden, weight, targets, temperature, with_entropy, kernel, tiles, None, 0)


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: Any = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    kernel: Kernel = "auto",
    tiles: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fused_logprobs` with `weight` one rank's shard [V / P, H] of the vocabulary.

    `hidden` and `targets` (global token ids) are the same on every rank of `group` (default: the
    world); so are the returned log-probs and entropy, and so must be their upstream gradients (a
    loss computed on every rank). `vocab_start` defaults to rank * shard rows (Megatron's equal
    shards). dL/dh is all-reduced in backward; dL/dW is this rank's shard.
    """
    if group is None:
        group = dist.group.WORLD
    if vocab_start is None:
        vocab_start = dist.get_rank(group) * weight.shape[0]
    return _run(hidden, weight, targets, temperature, with_entropy, kernel, tiles, group, vocab_start)


def _run(hidden, weight, targets, temperature, with_entropy, kernel, tiles, group, vocab_start):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    engine = _engine(kernel, h, weight)
    if engine == "triton" and tiles is None:
        tiles = default_tiles(h.device)
    logp, ent = _FusedLogprob.apply(
        h, weight, y, float(temperature), with_entropy, engine, tiles, group, vocab_start
    )
    return logp.reshape(lead), (ent.reshape(lead) if with_entropy else None)


def _engine(kernel: Kernel, h: torch.Tensor, weight: torch.Tensor) -> str:
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel={kernel!r}: choose auto, triton or torch")
    if kernel == "torch":
        return "torch"
    ok = fused_kernel_applies(h, weight)
    if kernel == "triton" and not ok:
        raise ValueError(
            f"kernel='triton' needs CUDA tensors, Triton, torch with out_dtype products and bf16/fp16 "
            f"products (got device {h.device}, products in {matmul_dtype(h, weight)}, "
            f"triton {'absent' if triton is None else 'present'}): use kernel='auto' to fall back to the torch passes"
        )
    return "triton" if ok else "torch"


class _FusedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, temperature, with_entropy, engine, tiles, group, vocab_start):
        v = weight.shape[0]
        mm = matmul_dtype(h, weight)
        y = targets - vocab_start if vocab_start else targets
        in_range = (y >= 0) & (y < v) if group is not None else None
        if engine == "triton":
            zy, lse, ez = _triton_stats(
                _mm(h, mm), _mm(weight, mm), y, 1.0 / temperature, with_entropy, tiles
            )
        else:
            zy, lse, ez = chunk_stats(
                h,
                weight,
                y.clamp(0, v - 1) if in_range is not None else y,
                chunk_size=_TORCH_CHUNK,
                temperature=temperature,
                with_entropy=with_entropy,
                in_range=in_range,
            )
        if group is not None:
            zy, lse, ez = _reduce_over_shards(zy, lse, ez, group)
        logp = zy - lse
        entropy = lse - ez if ez is not None else torch.zeros_like(logp)
        if ez is None:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(h, weight, y, lse, ez if ez is not None else lse)
        ctx.cfg = (temperature, with_entropy, engine, tiles, group, mm)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, y, lse, ez = ctx.saved_tensors
        temperature, with_entropy, engine, tiles, group, mm = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not with_entropy:
            ez, g_ent = None, None
        if engine == "triton":
            grad_h, grad_w = _triton_grads(
                _mm(h, mm),
                _mm(weight, mm),
                y,
                lse,
                ez,
                g_logp.float().contiguous(),
                g_ent.float().contiguous() if g_ent is not None else None,
                1.0 / temperature,
                need_h,
                need_w,
                weight.dtype,
                tiles,
            )
        else:
            v = weight.shape[0]
            in_range = (y >= 0) & (y < v) if group is not None else None
            grad_h, grad_w = chunk_grads(
                h,
                weight,
                y.clamp(0, v - 1) if in_range is not None else y,
                lse,
                ez,
                g_logp,
                g_ent,
                chunk_size=_TORCH_CHUNK,
                temperature=temperature,
                mm_dtype=mm,
                need_h=need_h,
                need_w=need_w,
                in_range=in_range,
            )
        if grad_h is not None and group is not None:
            dist.all_reduce(grad_h, group=group)
        return (
            grad_h.to(h.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            *([None] * 7),
        )


def _mm(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).contiguous()


def _reduce_over_shards(zy, lse, ez, group):
    """Full-vocabulary (z_y, lse, E_p[z]) from each shard's: lse = log sum_r exp(lse_r),
    E_p[z] = sum_r exp(lse_r - lse) E_r[z], z_y from the one shard holding y (0 elsewhere)."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(lse - top)
    parts = [scale, zy] + ([scale * ez] if ez is not None else [])
    sums = torch.stack(parts)
    dist.all_reduce(sums, group=group)
    total = sums[0]
    lse_all = top + torch.log(total)
    return sums[1], lse_all, (sums[2] / total if ez is not None else None)


# ---------------------------------------------------------------------------------------------
# Triton path


def _operands(h: torch.Tensor, w: torch.Tensor, cfg: TileConfig) -> tuple[Any, Any, int]:
    """Kernel arguments for h [T, H] and a slice of W [v, H], and the LOAD mode they imply."""
    if cfg.load == "tma" and _tma_ok(h) and _tma_ok(w):
        return (
            TensorDescriptor.from_tensor(h, [cfg.block_t, cfg.block_k]),
            TensorDescriptor.from_tensor(w, [cfg.block_v, cfg.block_k]),
            1,
        )
    return h, w, 0


def _tma_ok(t: torch.Tensor) -> bool:
    """Bulk tensor copies need 16-byte aligned base and row pitch."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


@functools.cache
def _addmm_accumulates_fp32(device: torch.device) -> bool:
    """Whether cuBLAS addmm adds bf16 products into an fp32 matrix in place (newer torch);
    otherwise each slice's product is made in fp32 and added."""
    a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
    c = torch.ones(16, 16, device=device, dtype=torch.float32)
    try:
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError):
        return False
    return bool((c == 17).all())


def _triton_stats(h, w, y, inv_temp, with_entropy, cfg: TileConfig, z_out: torch.Tensor | None = None):
    """(z_y, lse, E_p[z] or None) per token, fp32, without [T, V] logits. With `z_out` (fp16
    [T, V]) the logits are written there too, each tile shifted by its row maxima, and those
    maxima ([n_vocab_tiles, T] fp32) are returned as a fourth value."""
    n, hid = h.shape
    v = w.shape[0]
    dev = h.device
    zy = torch.zeros(n, device=dev, dtype=torch.float32)
    if n == 0:
        return zy, zy.clone(), (zy.clone() if with_entropy else None)
    n_vt = triton.cdiv(v, cfg.block_v)
    pm = torch.empty(n_vt, n, device=dev, dtype=torch.float32)
    ps = torch.empty_like(pm)
    pa = torch.empty_like(pm) if with_entropy else ps
    meta = dict(
        WITH_ENT=with_entropy,
        EVEN_K=hid % cfg.block_k == 0,
        EVEN_V=v % cfg.block_v == 0,
        PROMOTE=cfg.promote,
        BLOCK_T=cfg.block_t,
        BLOCK_V=cfg.block_v,
        BLOCK_K=cfg.block_k,
        GROUP_V=cfg.group_v,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    ha, wa, load = _operands(h, w, cfg)
    n_tiles = triton.cdiv(n, cfg.block_t) * n_vt
    # STORE_Z: 0 no logits, 1 pointer stores, 2 bulk tensor stores (Hopper; the copy engine
    # clips the tile at T and V).
    store = 0 if z_out is None else 2 if load == 1 and _tma_ok(z_out) and _tma_store_z else 1
    zp = pm if z_out is None else z_out
    z_arg = TensorDescriptor.from_tensor(z_out, [cfg.block_t, cfg.block_v]) if store == 2 else zp
    args = (ha, wa, y, pm, ps, pa, zy, z_arg, n, v, hid, h.stride(0), w.stride(0), zp.stride(0), inv_temp)
    if cfg.persistent:
        progs = min(n_tiles, _sm_count(dev))
        _stats_kernel_persistent[(progs,)](*args, LOAD=load, STORE_Z=store, NUM_PROGS=progs, **meta)
    else:
        _stats_kernel[(n_tiles,)](*args, LOAD=load, STORE_Z=store, **meta)
    top = pm.amax(0)
    scale = (pm - top).exp_() if store else pm.sub_(top).exp_()
    total = (ps * scale).sum(0)
    lse = top + torch.log(total)
    ez = (pa * scale).sum(0) / total if with_entropy else None
    if store:
        return zy, lse, ez, pm
    return zy, lse, ez


# The dL/dz pass over stored logits: (rows, warps) a program (its columns: the stats tiles').
_DZ_BLOCK = (16, 4)

# Whether forward's stored logits go out through bulk tensor stores where they can (benchmarks
# compare both ways).
_tma_store_z = True


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _triton_grads(h, w, y, lse, ez, g_logp, g_ent, inv_temp, need_h, need_w, w_grad_dtype, cfg: TileConfig):
    """(dL/dh fp32 or None, dL/dW in `w_grad_dtype` (or fp32) or None), one vocabulary slice at a time."""
    n, hid = h.shape
    v = w.shape[0]
    dev = h.device
    out_w = w_grad_dtype if w_grad_dtype in (w.dtype, torch.float32) else torch.float32
    grad_h = torch.zeros(n, hid, device=dev, dtype=torch.float32) if need_h else None
    grad_w = torch.empty(v, hid, device=dev, dtype=out_w) if need_w else None
    if n == 0 or not (need_h or need_w):
        if grad_w is not None:
            grad_w.zero_()
        return grad_h, grad_w
    # An fp32 weight gradient (fp32 master weights) gets dL/dz as a bf16 pair hi + lo, one more
    # product: bf16 dL/dz alone would leave ~1e-3 relative error wherever the softmax is peaked.
    split = grad_w is not None and out_w == torch.float32
    chunk = min(cfg.vocab_chunk, triton.cdiv(v, cfg.block_v) * cfg.block_v)
    dz_buf = torch.empty(n * chunk, device=dev, dtype=h.dtype)
    lo_buf = torch.empty_like(dz_buf) if split else dz_buf
    with_ent = g_ent is not None
    meta = dict(
        WITH_ENT=with_ent,
        SPLIT=split,
        EVEN_K=hid % cfg.block_k == 0,
        BLOCK_T=cfg.block_t,
        BLOCK_V=cfg.block_v,
        BLOCK_K=cfg.block_k,
        GROUP_V=cfg.group_v,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    fp32_acc = _addmm_accumulates_fp32(dev)
    for v0 in range(0, v, chunk):
        vc = min(chunk, v - v0)
        wc = w[v0 : v0 + vc]
        dz = dz_buf[: n * vc].view(n, vc)
        lo = lo_buf[: n * vc].view(n, vc)
        n_tiles = triton.cdiv(n, cfg.block_t) * triton.cdiv(vc, cfg.block_v)
        ha, wa, load = _operands(h, wc, cfg)
        da, la, store = dz, lo, 0
        if load == 1 and _tma_ok(dz):
            da = TensorDescriptor.from_tensor(dz, [cfg.block_t, cfg.block_v])
            la = TensorDescriptor.from_tensor(lo, [cfg.block_t, cfg.block_v]) if split else da
            store = 1
        args = (
            ha, wa, y - v0, lse, ez if with_ent else lse, g_logp, g_ent if with_ent else g_logp, da, la,
            n, vc, hid, h.stride(0), wc.stride(0), dz.stride(0), inv_temp,
        )  # fmt: skip
        kw = dict(LOAD=load, STORE=store, OUT_F16=h.dtype == torch.float16, **meta)
        if cfg.persistent:
            progs = min(n_tiles, _sm_count(dev))
            _dz_kernel_persistent[(progs,)](*args, NUM_PROGS=progs, **kw)
        else:
            _dz_kernel[(n_tiles,)](*args, **kw)
        if grad_w is not None:
            gw = grad_w[v0 : v0 + vc]
            if split:
                torch.mm(dz.t(), h, out_dtype=torch.float32, out=gw)
                _add_product_fp32(gw, lo.t(), h, fp32_acc)
            else:
                torch.mm(dz.t(), h, out=gw)
        if grad_h is not None:
            _add_product_fp32(grad_h, dz, wc, fp32_acc)
    return grad_h, grad_w


def _add_product_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, in_place: bool) -> None:
    """acc (fp32) += a @ b (bf16/fp16 operands), in cuBLAS's epilogue where torch allows it."""
    if in_place:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += torch.mm(a, b, out_dtype=torch.float32)


def _triton_dz_from_z(
    z, pm, y, lse, ez, g_logp, g_ent, inv_temp, out_dtype, cfg: TileConfig, lo: torch.Tensor | None = None
) -> torch.Tensor:
    """dL/dz / temperature [T, V] from the logits `_triton_stats` stored (fp16, shifted by the
    tile maxima `pm`), written over them in `out_dtype` (bf16/fp16: the same bytes per element).
    With `lo` ([T, V], `out_dtype`) its rounding error goes there (dz + lo carries ~16 bits)."""
    n, v = z.shape
    dz = z.view(out_dtype)
    if n == 0:
        return dz
    with_ent = g_ent is not None
    bt, warps = _DZ_BLOCK
    grid = (triton.cdiv(n, bt), triton.cdiv(v, cfg.block_v))
    _dz_from_z_kernel[grid](
        z, dz, lo if lo is not None else dz, pm, y, lse, ez if with_ent else lse, g_logp,
        g_ent if with_ent else g_logp, n, v, z.stride(0), inv_temp,
        WITH_ENT=with_ent, SPLIT=lo is not None, BLOCK_T=bt, BLOCK_V=cfg.block_v, num_warps=warps,
    )  # fmt: skip
    return dz


if triton is not None:

    @triton.jit
    def _tile_coords(tile, T, V, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_V: tl.constexpr):
        """Tile id -> (token tile, vocab tile): GROUP_V vocab tiles sweep all token tiles
        together, so a group's W rows stay in L2 while h streams past."""
        n_t = tl.cdiv(T, BLOCK_T)
        n_v = tl.cdiv(V, BLOCK_V)
        per_group = GROUP_V * n_t
        first_v = (tile // per_group) * GROUP_V
        size = tl.minimum(n_v - first_v, GROUP_V)
        pid_v = first_v + (tile % per_group) % size
        pid_t = (tile % per_group) // size
        return pid_t, pid_v

    @triton.jit
    def _load_ab(h, w, a_ptrs, b_ptrs, off_t, off_v, k, H, LOAD: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
        rk = tl.arange(0, BLOCK_K)
        if LOAD == 1:
            a = h.load([off_t, k * BLOCK_K])
            b = w.load([off_v, k * BLOCK_K]).T
        else:
            if EVEN_K:
                a = tl.load(a_ptrs + k * BLOCK_K)
                b = tl.load(b_ptrs + k * BLOCK_K)
            else:
                a = tl.load(a_ptrs + k * BLOCK_K, mask=rk[None, :] < H - k * BLOCK_K, other=0.0)
                b = tl.load(b_ptrs + k * BLOCK_K, mask=rk[:, None] < H - k * BLOCK_K, other=0.0)
        return a, b

    @triton.jit
    def _logit_tile(
        h, w, off_t, off_v, T, V, H, stride_h, stride_w,
        LOAD: tl.constexpr, EVEN_K: tl.constexpr, PROMOTE: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """fp32 [BLOCK_T, BLOCK_V] tile of h @ w^T (LOAD 0: pointers, 1: tensor descriptors).
        PROMOTE > 0 adds the tensor cores' partial sum into a register accumulator every PROMOTE
        k-blocks (their own fp32 accumulation truncates)."""
        acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = h
        b_ptrs = w
        if LOAD == 0:
            rt = (off_t + tl.arange(0, BLOCK_T)) % T
            rv = (off_v + tl.arange(0, BLOCK_V)) % V
            a_ptrs = h + rt[:, None].to(tl.int64) * stride_h + rk[None, :]
            b_ptrs = w + rv[None, :].to(tl.int64) * stride_w + rk[:, None]
        n_k = tl.cdiv(H, BLOCK_K)
        if PROMOTE == 0:
            for k in range(0, n_k):
                a, b = _load_ab(h, w, a_ptrs, b_ptrs, off_t, off_v, k, H, LOAD, EVEN_K, BLOCK_K)
                acc = tl.dot(a, b, acc)
        else:
            for k0 in range(0, n_k, PROMOTE):
                part = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
                for k in range(k0, tl.minimum(k0 + PROMOTE, n_k)):
                    a, b = _load_ab(h, w, a_ptrs, b_ptrs, off_t, off_v, k, H, LOAD, EVEN_K, BLOCK_K)
                    part = tl.dot(a, b, part)
                acc += part
        return acc

    @triton.jit
    def _stats_epilogue(
        acc, pid_t, pid_v, y_ptr, pm_ptr, ps_ptr, pa_ptr, zy_ptr, z_ptr, T, V, stride_z, inv_temp,
        WITH_ENT: tl.constexpr, EVEN_V: tl.constexpr, STORE_Z: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        """Per row of one logit tile: max m, sum exp(z - m), sum exp(z - m) z into row pid_v of
        the [n_tiles, T] partials; the target's logit where the tile holds it. STORE_Z also writes
        the tile as z - m in fp16 (z_ptr [T, V]; floored at -60000, where exp is 0 anyway): 1 by
        pointer stores, 2 through a tensor descriptor (the bulk copy engine: 1.33x -> 1.22x of
        three matmuls for fused_token_loss on an H100, benchmarks/RESULTS.md)."""
        off_t = pid_t * BLOCK_T
        off_v = pid_v * BLOCK_V
        rt = off_t + tl.arange(0, BLOCK_T)
        rv = off_v + tl.arange(0, BLOCK_V)
        row_ok = rt < T
        if EVEN_V:
            zt = acc * inv_temp
        else:
            zt = tl.where((rv < V)[None, :], acc * inv_temp, float("-inf"))
        m = tl.max(zt, axis=1)
        e = tl.exp(zt - m[:, None])
        out = pid_v.to(tl.int64) * T + rt
        tl.store(pm_ptr + out, m, mask=row_ok)
        tl.store(ps_ptr + out, tl.sum(e, axis=1), mask=row_ok)
        if WITH_ENT:
            if EVEN_V:
                tl.store(pa_ptr + out, tl.sum(e * zt, axis=1), mask=row_ok)
            else:
                tl.store(pa_ptr + out, tl.sum(e * tl.where((rv < V)[None, :], zt, 0.0), axis=1), mask=row_ok)
        y = tl.load(y_ptr + rt, mask=row_ok, other=-1).to(tl.int32)  # a vocabulary fits int32
        here = row_ok & (y >= off_v) & (y < off_v + BLOCK_V) & (y < V)
        zy = tl.sum(tl.where(rv[None, :] == y[:, None], zt, 0.0), axis=1)
        tl.store(zy_ptr + rt, zy, mask=here)
        if STORE_Z == 1:
            offs = rt[:, None].to(tl.int64) * stride_z + rv[None, :]
            zs = tl.maximum(zt - m[:, None], -60000.0).to(tl.float16)
            tl.store(z_ptr + offs, zs, mask=row_ok[:, None] & (rv < V)[None, :])
        elif STORE_Z == 2:
            z_ptr.store([off_t, off_v], tl.maximum(zt - m[:, None], -60000.0).to(tl.float16))

    @triton.jit(do_not_specialize=["T", "V"])
    def _stats_kernel(
        h, w, y_ptr, pm_ptr, ps_ptr, pa_ptr, zy_ptr, z_ptr,
        T, V, H, stride_h, stride_w, stride_z, inv_temp,
        LOAD: tl.constexpr, WITH_ENT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
        STORE_Z: tl.constexpr,
        PROMOTE: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr,
    ):  # fmt: skip
        """One logit tile per program: the tile's per-row softmax partials (`_stats_epilogue`)."""
        pid_t, pid_v = _tile_coords(tl.program_id(0), T, V, BLOCK_T, BLOCK_V, GROUP_V)
        acc = _logit_tile(
            h, w, pid_t * BLOCK_T, pid_v * BLOCK_V, T, V, H, stride_h, stride_w,
            LOAD, EVEN_K, PROMOTE, BLOCK_T, BLOCK_V, BLOCK_K,
        )  # fmt: skip
        _stats_epilogue(
            acc, pid_t, pid_v, y_ptr, pm_ptr, ps_ptr, pa_ptr, zy_ptr, z_ptr, T, V, stride_z, inv_temp,
            WITH_ENT, EVEN_V, STORE_Z, BLOCK_T, BLOCK_V,
        )  # fmt: skip

    @triton.jit(do_not_specialize=["T", "V"])
    def _stats_kernel_persistent(
        h, w, y_ptr, pm_ptr, ps_ptr, pa_ptr, zy_ptr, z_ptr,
        T, V, H, stride_h, stride_w, stride_z, inv_temp,
        LOAD: tl.constexpr, WITH_ENT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
        STORE_Z: tl.constexpr,
        PROMOTE: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr,
        NUM_PROGS: tl.constexpr,
    ):  # fmt: skip
        """`_stats_kernel` with one program per multiprocessor walking the tiles (one flattened
        loop), so the next tile's bulk copies are in flight during this tile's epilogue."""
        n_tiles = tl.cdiv(T, BLOCK_T) * tl.cdiv(V, BLOCK_V)
        for tile in tl.range(tl.program_id(0), n_tiles, NUM_PROGS, flatten=True):
            pid_t, pid_v = _tile_coords(tile, T, V, BLOCK_T, BLOCK_V, GROUP_V)
            acc = _logit_tile(
                h, w, pid_t * BLOCK_T, pid_v * BLOCK_V, T, V, H, stride_h, stride_w,
                LOAD, EVEN_K, PROMOTE, BLOCK_T, BLOCK_V, BLOCK_K,
            )  # fmt: skip
            _stats_epilogue(
                acc, pid_t, pid_v, y_ptr, pm_ptr, ps_ptr, pa_ptr, zy_ptr, z_ptr, T, V, stride_z, inv_temp,
                WITH_ENT, EVEN_V, STORE_Z, BLOCK_T, BLOCK_V,
            )  # fmt: skip

    @triton.jit
    def _dz_tile(
        zt, rt, rv, row_ok, col_ok, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, inv_temp, WITH_ENT: tl.constexpr
    ):  # fmt: skip
        """dL/dz / temperature (fp32) of a tile of logits zt (rows rt, vocabulary ids rv):
        g_logp (onehot(y) - p) + g_ent p (E_p[z] - z)."""
        lse = tl.load(lse_ptr + rt, mask=row_ok, other=0.0)
        gl = tl.load(glp_ptr + rt, mask=row_ok, other=0.0)
        p = tl.exp(zt - lse[:, None])
        if WITH_ENT:
            ez = tl.load(ez_ptr + rt, mask=row_ok, other=0.0)
            ge = tl.load(gent_ptr + rt, mask=row_ok, other=0.0)
            dz = p * (ge[:, None] * (ez[:, None] - zt) - gl[:, None])
        else:
            dz = -p * gl[:, None]
        y = tl.load(y_ptr + rt, mask=row_ok, other=-1).to(tl.int32)  # a vocabulary fits int32
        hit = (rv[None, :] == y[:, None]) & col_ok[None, :]
        return tl.where(hit, dz + gl[:, None], dz) * inv_temp

    @triton.jit
    def _store_dz(dz, dz_ptr, lo_ptr, offs, inside, SPLIT: tl.constexpr):
        """dz in dz_ptr's dtype; with SPLIT its rounding error in lo_ptr's (same layout)."""
        dzc = dz.to(dz_ptr.dtype.element_ty)
        tl.store(dz_ptr + offs, dzc, mask=inside)
        if SPLIT:
            tl.store(lo_ptr + offs, (dz - dzc.to(tl.float32)).to(lo_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _dz_epilogue(
        acc, pid_t, pid_v, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, dz_ptr, lo_ptr, T, V, stride_dz, inv_temp,
        WITH_ENT: tl.constexpr, SPLIT: tl.constexpr, STORE: tl.constexpr, OUT_F16: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        """dL/dz / temperature of one tile into dz (STORE 0: pointers, 1: a tensor descriptor)."""
        off_t = pid_t * BLOCK_T
        off_v = pid_v * BLOCK_V
        rt = off_t + tl.arange(0, BLOCK_T)
        rv = off_v + tl.arange(0, BLOCK_V)
        row_ok = rt < T
        col_ok = rv < V
        dz = _dz_tile(
            acc * inv_temp, rt, rv, row_ok, col_ok, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, inv_temp, WITH_ENT
        )  # fmt: skip
        if STORE == 1:  # tensor descriptors: the bulk copy engine clips the tile at T and V
            dzc = dz.to(tl.float16 if OUT_F16 else tl.bfloat16)
            dz_ptr.store([off_t, off_v], dzc)
            if SPLIT:
                lo_ptr.store(
                    [off_t, off_v], (dz - dzc.to(tl.float32)).to(tl.float16 if OUT_F16 else tl.bfloat16)
                )
        else:
            offs = rt[:, None].to(tl.int64) * stride_dz + rv[None, :]
            _store_dz(dz, dz_ptr, lo_ptr, offs, row_ok[:, None] & col_ok[None, :], SPLIT)

    @triton.jit(do_not_specialize=["T", "V"])
    def _dz_kernel(
        h, w, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, dz_ptr, lo_ptr,
        T, V, H, stride_h, stride_w, stride_dz, inv_temp,
        LOAD: tl.constexpr, WITH_ENT: tl.constexpr, SPLIT: tl.constexpr, STORE: tl.constexpr,
        OUT_F16: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr,
    ):  # fmt: skip
        """dL/dz / temperature for one logit tile, written in dz's dtype; with SPLIT, its rounding
        error too (lo, same dtype and layout: dz + lo carries ~16 bits)."""
        pid_t, pid_v = _tile_coords(tl.program_id(0), T, V, BLOCK_T, BLOCK_V, GROUP_V)
        acc = _logit_tile(
            h, w, pid_t * BLOCK_T, pid_v * BLOCK_V, T, V, H, stride_h, stride_w,
            LOAD, EVEN_K, 0, BLOCK_T, BLOCK_V, BLOCK_K,
        )  # fmt: skip
        _dz_epilogue(
            acc, pid_t, pid_v, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, dz_ptr, lo_ptr, T, V, stride_dz,
            inv_temp, WITH_ENT, SPLIT, STORE, OUT_F16, BLOCK_T, BLOCK_V,
        )  # fmt: skip

    @triton.jit(do_not_specialize=["T", "V"])
    def _dz_kernel_persistent(
        h, w, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, dz_ptr, lo_ptr,
        T, V, H, stride_h, stride_w, stride_dz, inv_temp,
        LOAD: tl.constexpr, WITH_ENT: tl.constexpr, SPLIT: tl.constexpr, STORE: tl.constexpr,
        OUT_F16: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr,
        NUM_PROGS: tl.constexpr,
    ):  # fmt: skip
        n_tiles = tl.cdiv(T, BLOCK_T) * tl.cdiv(V, BLOCK_V)
        for tile in tl.range(tl.program_id(0), n_tiles, NUM_PROGS, flatten=True):
            pid_t, pid_v = _tile_coords(tile, T, V, BLOCK_T, BLOCK_V, GROUP_V)
            acc = _logit_tile(
                h, w, pid_t * BLOCK_T, pid_v * BLOCK_V, T, V, H, stride_h, stride_w,
                LOAD, EVEN_K, 0, BLOCK_T, BLOCK_V, BLOCK_K,
            )  # fmt: skip
            _dz_epilogue(
                acc, pid_t, pid_v, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, dz_ptr, lo_ptr, T, V, stride_dz,
                inv_temp, WITH_ENT, SPLIT, STORE, OUT_F16, BLOCK_T, BLOCK_V,
            )  # fmt: skip

    @triton.jit(do_not_specialize=["T", "V"])
    def _dz_from_z_kernel(
        z_ptr, dz_ptr, lo_ptr, pm_ptr, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, T, V, stride_z, inv_temp,
        WITH_ENT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        """One [BLOCK_T, BLOCK_V] block of dL/dz / temperature from stored logits z - m (m: the
        row maxima of stats tile pid_v, so BLOCK_V is the stats kernel's). Each element is read
        before it is written in place, by the same thread (one layout throughout)."""
        pid_t = tl.program_id(0)
        pid_v = tl.program_id(1)
        rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        rv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        row_ok = rt < T
        col_ok = rv < V
        inside = row_ok[:, None] & col_ok[None, :]
        offs = rt[:, None].to(tl.int64) * stride_z + rv[None, :]  # lo has z's row pitch too
        zs = tl.load(z_ptr + offs, mask=inside, other=-60000.0).to(tl.float32)
        m = tl.load(pm_ptr + pid_v.to(tl.int64) * T + rt, mask=row_ok, other=0.0)
        dz = _dz_tile(
            zs + m[:, None], rt, rv, row_ok, col_ok, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, inv_temp, WITH_ENT
        )  # fmt: skip
        _store_dz(dz, dz_ptr, lo_ptr, offs, inside, SPLIT)
