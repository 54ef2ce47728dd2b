"""Where `fused_token_loss`'s time goes at the GLM-5.2 head shape (CUDA, Triton).

Times, side by side in one process against the plain matmul `h @ W.T`:
- the whole loss, forward + backward (three products), for each way forward stores its logits;
- each phase alone, summed over the chunks as the loss runs them: the forward kernel (logits and
  their softmax statistics) without and with the stored logits, the dL/dz pass over them, dL/dh,
  and dL/dW accumulated chunk by chunk (bf16 read-modify-write), written fresh per chunk (no
  read: what the accumulation costs) and as one product over all positions (what chunking costs);
- optionally forward tilings (`--fwd-tiles`) and a profiler table of one forward + backward.

    python3 benchmarks/fused_loss_parts.py --iters 5 --profile --fwd-tiles "num_stages=4;group_v=16"
"""

from __future__ import annotations

import argparse
import json

import torch


def once_ms(fn) -> float:
    """GPU milliseconds of one call of fn (CUDA events, synchronised)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def cuda_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    return median([once_ms(fn) for _ in range(iters)])


def paired(fn, ref, iters: int) -> tuple[float, float]:
    """(median ms of fn, median of fn / ref over adjacent pairs): each call of fn right after one
    of ref, so a GPU whose clock drifts (power or heat) moves both alike."""
    fn()
    ref()
    torch.cuda.synchronize()
    pairs = [(once_ms(ref), once_ms(fn)) for _ in range(iters)]
    return median([f for _, f in pairs]), median([f / r for r, f in pairs])


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    from agentrl.algo import fused_logprobs as fl
    from agentrl.algo.fused_loss import CHUNK_BYTES, fused_token_loss

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--vocab", type=int, default=154880)
    ap.add_argument("--chunk", type=int, default=0, help="positions per chunk (0: the loss's default)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--fwd-tiles", default="", help="';'-separated TileConfig fields for the forward phase")
    ap.add_argument(
        "--dz-blocks", default="", help="';'-separated ROWSxWARPS for the dL/dz pass, e.g. '32x4;64x8'"
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    n, hid, v = args.tokens, args.hidden, args.vocab
    tiles = fl.default_tiles(torch.device("cuda"))
    chunk = args.chunk or max(tiles.block_t, CHUNK_BYTES // (2 * v) // tiles.block_t * tiles.block_t)
    print(
        f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  tokens {n}  hidden {hid}  vocab {v}  chunk {chunk}"
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hid, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, hid, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    bounds = [(c0, min(c0 + chunk, n)) for c0 in range(0, n, chunk)]
    rows: dict[str, tuple[float, float] | float] = {}

    def matmul():
        torch.mm(h, w.t())

    mm = cuda_ms(matmul, args.iters)
    rows["matmul h @ W.T"] = (mm, 1.0)

    def pair(fn):
        return paired(fn, matmul, args.iters)

    print(f"plain matmul: {mm:.2f} ms ({2 * n * hid * v / mm / 1e9:.0f} TFLOP/s); 3 matmuls {3 * mm:.1f} ms")

    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    g_ent = torch.randn(n, device="cuda", generator=g)

    def linear(lp, et, sl):
        return g_lp[sl] * lp + (g_ent[sl] * et if et is not None else 0.0)

    def loss_fb(cfg=None, ent=False):
        r = fused_token_loss(hg, wg, y, linear, kernel="triton", chunk=chunk, tiles=cfg, with_entropy=ent)
        return torch.autograd.grad(r.loss, [hg, wg])

    for label, tma in (("pointer stores", False), ("bulk tensor stores", True)):
        fl._tma_store_z = tma
        rows[f"loss f+b, logits by {label}"] = pair(loss_fb)
        rows[f"loss f+b peak GiB, {label}"] = peak_gib(loss_fb)
    fl._tma_store_z = True
    for label in ("entropy too", "no entropy, again", "entropy too, again"):
        rows[f"loss f+b, bulk stores, {label}"] = pair(lambda e="entropy" in label: loss_fb(None, e))
    (dh_ref, dw_ref) = loss_fb()

    zbuf = torch.empty(chunk * v, device="cuda", dtype=torch.float16)
    stats = []
    for c0, c1 in bounds:
        z = zbuf[: (c1 - c0) * v].view(c1 - c0, v)
        _, lse, _, pm = fl._triton_stats(h[c0:c1], w, y[c0:c1], 1.0, False, tiles, z_out=z)
        stats.append((lse, pm))

    def fwd(cfg, store, tma=True):
        fl._tma_store_z = tma
        for c0, c1 in bounds:
            z = zbuf[: (c1 - c0) * v].view(c1 - c0, v) if store else None
            fl._triton_stats(h[c0:c1], w, y[c0:c1], 1.0, False, cfg, z_out=z)

    rows["forward kernel, no stored logits"] = pair(lambda: fwd(tiles, False))
    rows["forward kernel, logits by pointer stores"] = pair(lambda: fwd(tiles, True, False))
    rows["forward kernel, logits by bulk tensor stores"] = pair(lambda: fwd(tiles, True, True))
    for spec in filter(None, args.fwd_tiles.split(";")):
        kw = {k: (val if k == "load" else int(val)) for k, val in (kv.split("=") for kv in spec.split(","))}
        cfg = fl.TileConfig(**kw)
        try:
            rows[f"forward kernel, bulk stores, {spec}"] = pair(lambda cfg=cfg: fwd(cfg, True, True))
            rows[f"loss f+b, bulk stores, {spec}"] = pair(lambda cfg=cfg: loss_fb(cfg))
        except Exception as exc:  # a tiling that does not fit this GPU's shared memory
            print(f"forward {spec}: {type(exc).__name__}: {str(exc)[:200]}")
    fl._tma_store_z = True

    def dz_pass():
        for (c0, c1), (lse, pm) in zip(bounds, stats, strict=True):
            z = zbuf[: (c1 - c0) * v].view(c1 - c0, v)
            fl._triton_dz_from_z(z, pm, y[c0:c1], lse, None, g_lp[c0:c1], None, 1.0, torch.bfloat16, tiles)

    rows["dL/dz pass"] = pair(dz_pass)
    default_dz = fl._DZ_BLOCK
    for spec in filter(None, args.dz_blocks.split(";")):
        fl._DZ_BLOCK = tuple(int(x) for x in spec.split("x"))
        rows[f"dL/dz pass, {spec} (rows x warps)"] = pair(dz_pass)
        rows[f"loss f+b, dL/dz {spec}"] = pair(loss_fb)
    fl._DZ_BLOCK = default_dz
    zbuf.zero_()  # timing only from here: finite bf16 values
    dz = zbuf.view(torch.bfloat16)
    gh = torch.empty_like(h)
    gw = torch.empty_like(w)

    def dh_pass():
        for c0, c1 in bounds:
            torch.mm(dz[: (c1 - c0) * v].view(c1 - c0, v), w, out=gh[c0:c1])

    def dw_acc():
        for i, (c0, c1) in enumerate(bounds):
            d = dz[: (c1 - c0) * v].view(c1 - c0, v)
            if i == 0:
                torch.mm(d.t(), h[c0:c1], out=gw)
            else:
                gw.addmm_(d.t(), h[c0:c1])

    def dw_fresh():
        for c0, c1 in bounds:
            torch.mm(dz[: (c1 - c0) * v].view(c1 - c0, v).t(), h[c0:c1], out=gw)

    rows["dL/dh products"] = pair(dh_pass)
    rows["dL/dW products, accumulated (the loss)"] = pair(dw_acc)
    rows["dL/dW products, written fresh each chunk"] = pair(dw_fresh)
    zbuf = dz = None  # the buffer's memory back before the one-product case
    try:
        dz_all = torch.zeros(n, v, device="cuda", dtype=torch.bfloat16)
        rows["dL/dW as one product over all positions"] = pair(lambda: torch.mm(dz_all.t(), h, out=gw))
        dz_all = None
    except torch.OutOfMemoryError:
        print("one dL/dW product over all positions: out of memory")
    torch.cuda.empty_cache()

    print(
        f"\n{'part':52s} {'ms':>8s} {'/ matmul':>9s}   (ratios: medians over pairs with an adjacent matmul)"
    )
    for name, val in rows.items():
        if isinstance(val, float):
            print(f"{name:52s} {val:8.2f} GiB")
            continue
        ms, ratio = val
        extra = f"  ({ratio / 3:.3f} of 3 matmuls)" if name.startswith("loss") else ""
        print(f"{name:52s} {ms:8.2f} {ratio:9.3f}{extra}")
    parts = [
        "forward kernel, logits by bulk tensor stores",
        "dL/dz pass",
        "dL/dh products",
        "dL/dW products, accumulated (the loss)",
    ]
    total = sum(rows[p][1] for p in parts)
    print(f"{'sum of the four phases (ratios)':52s} {'':8s} {total:9.3f}")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            loss_fb()
            torch.cuda.synchronize()
        agg: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                agg[e.name[:90]] = agg.get(e.name[:90], 0.0) + e.device_time_total / 1e3
        busy = sum(agg.values())
        print(f"\nprofiled loss f+b: {busy:.1f} ms of kernels")
        for name, ms in sorted(agg.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {ms:8.2f} ms {100 * ms / busy:5.1f}%  {name}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "chunk": chunk, "rows": rows}, fh, indent=1)
    del dh_ref, dw_ref


if __name__ == "__main__":
    main()
