"""Log-prob implementations side by side in one run: the LM head alone, or a whole trainer step.

--mode head (the GLM-5.2 head by default: 16,384 tokens, hidden 6,144, vocabulary 154,880, bf16)
times one plain `h @ W.T`, the naive path (`full_logprobs`), `chunked_logprobs`, Liger's fused
linear cross-entropy per token (when liger-kernel is installed) and `fused_logprobs` (Triton), each
forward and forward + backward with random per-token upstream gradients, with peak memory and
errors against an fp32 computation from the same bf16 inputs:

    python benchmarks/logprob_bench.py --mode head --iters 7

--mode model (the default) is the chunked-vs-unchunked comparison in a GRPO trainer step:

A random-init GLM-shaped model (Glm4Config, ~0.5B parameters, ~150k vocabulary) runs forward +
backward on one sequence of `--seq-len` tokens, computing token log-probs either all at once
(full-vocabulary logits, the usual `model(...).logits` path) or `--chunk-size` positions at a time
(`agentrl.algo.chunked_logprobs`). Three measurements, each chunked against unchunked:

  head   the log-prob + loss part alone (hidden states -> log-probs -> GRPO loss -> backward),
         the memory the chunking is about;
  step   the whole trainer step (decoder + head + loss, forward + backward), with gradient
         checkpointing in the decoder (so the decoder's activations do not hide the head's);
  step-nogc  the whole step without gradient checkpointing;
  trainer    `TorchTrainer.train_step` (old-log-prob recompute, fp32 weights under bf16 autocast,
             AdamW step), to show the real trainer path on GPU.

Peak = torch.cuda.max_memory_allocated during the measured call minus what was allocated before it.
Prints a table and the ratios (chunked peak / unchunked peak, chunked tokens/s / unchunked tokens/s).

    python benchmarks/logprob_bench.py --seq-len 16384 --chunk-sizes 1024,4096
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from transformers import Glm4Config, Glm4ForCausalLM

from agentrl.algo import LossConfig, chunked_logprobs, full_logprobs, grpo_loss
from agentrl.train.forward import model_logprobs


def build_model(args: argparse.Namespace) -> Glm4ForCausalLM:
    cfg = Glm4Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=args.seq_len + 16,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Glm4ForCausalLM(cfg)
    return model.to(torch.bfloat16).train()


def loss_of(logp: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(logp)
    old = logp.detach()
    loss, _ = grpo_loss(logp, old, old - 0.01, adv, mask, LossConfig())
    return loss


def measure(fn, iters: int) -> tuple[float, float]:
    """(peak bytes above the pre-call allocation, seconds per call) of fn(); one warm-up call first."""
    fn()
    torch.cuda.synchronize()
    peaks, times = [], []
    for _ in range(iters):
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() - base)
    return max(peaks), sorted(times)[len(times) // 2]


def trainer_rows(model: Glm4ForCausalLM, args: argparse.Namespace, chunk: int) -> list[dict]:
    """`TorchTrainer.train_step` itself: fp32 weights + AdamW, bf16 autocast, gradient checkpointing,
    old-log-prob recompute, one group of two sequences of seq_len / 2 tokens packed in one micro-batch."""
    from agentrl.episode.sample import Sample
    from agentrl.train.batch import with_advantages
    from agentrl.train.config import TrainConfig
    from agentrl.train.torch_backend import TorchTrainer

    g = torch.Generator().manual_seed(2)
    half, prompt = args.seq_len // 2, 256
    samples = []
    for k in range(2):
        toks = torch.randint(0, args.vocab, (half,), generator=g).tolist()
        n = half - prompt
        samples.append(
            Sample(
                "p0",
                toks,
                prompt,
                [1] * n,
                (-torch.rand(n, generator=g) * 5).tolist(),
                reward=float(k),
                sample_index=k,
            )
        )
    samples = with_advantages(samples)
    rows = []
    # chunked log-probs then the loss through autograd (all logits, then `chunk` at a time), and
    # the default on CUDA: the loss made in the LM head (`fused_token_loss`).
    for c, impl in ((None, "chunked"), (chunk, "chunked"), (None, "auto")):
        label = "fused loss" if impl == "auto" else str(c)
        cfg = TrainConfig(
            lr=1e-6,
            logprob_chunk_size=c,
            logprob_impl=impl,
            gradient_checkpointing=True,
            max_tokens_per_micro_batch=args.seq_len,
        )
        trainer = TorchTrainer(copy.deepcopy(model).float(), cfg, device="cuda")
        try:
            peak, sec = measure(lambda t=trainer: t.train_step(samples), args.iters)
        except torch.OutOfMemoryError:
            rows.append({"part": "trainer", "chunk": label, "oom": True})
            print(f"trainer    chunk={label:6s} OOM")
            continue
        finally:
            del trainer
            torch.cuda.empty_cache()
        row = {
            "part": "trainer",
            "chunk": c if impl == "chunked" else label,
            "peak_gib": peak / 2**30,
            "sec": sec,
            "tok_per_s": args.seq_len / sec,
        }
        rows.append(row)
        print(
            f"trainer    chunk={label:6s} peak {row['peak_gib']:8.2f} GiB   {sec * 1e3:8.1f} ms   {row['tok_per_s']:10.0f} tok/s"
        )
    return rows


# --------------------------------------------------------------------------------------------
# --mode head: the LM head alone at the GLM-5.2 shape, every implementation side by side.

GLM52 = {"seq_len": 16384, "hidden": 6144, "vocab": 154880}


def _cuda_ms(fn, iters: int) -> tuple[float, float]:
    """(median ms, peak GiB above what was allocated before) of fn() after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times, peaks = [], []
    for _ in range(iters):
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
    return sorted(times)[len(times) // 2], max(peaks)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm()).item()


def head_variants(args, y):
    """name -> fn(h, w, with_entropy) -> (logp, entropy or None), for every implementation here."""
    from agentrl.algo.fused_logprobs import TileConfig, fused_logprobs

    out = {
        "naive": lambda h, w, e: full_logprobs(h, w, y, with_entropy=e),
    }
    for c in (int(c) for c in args.chunk_sizes.split(",")):
        out[f"chunked {c}"] = lambda h, w, e, c=c: chunked_logprobs(h, w, y, chunk_size=c, with_entropy=e)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        print("liger-kernel not installed: its rows are skipped")
    else:
        for label, acc in (("bf16 sums", None), ("fp32 sums", torch.float32)):
            loss = LigerFusedLinearCrossEntropyLoss(reduction="none", accum_dtype=acc)
            out[f"liger ({label})"] = lambda h, w, e, loss=loss: (-loss(w, h, y), None)
    out["fused"] = lambda h, w, e: fused_logprobs(h, w, y, with_entropy=e, kernel="triton")
    for spec in filter(None, args.sweep.split(";")):
        kw = dict(kv.split("=") for kv in spec.removeprefix("fwd:").split(","))
        tiles = TileConfig(**{k: (v if k == "load" else int(v)) for k, v in kw.items()})
        out[f"fused {spec}"] = lambda h, w, e, t=tiles: fused_logprobs(
            h, w, y, with_entropy=e, kernel="triton", tiles=t
        )
    return out


def peaked_precision(args, h: torch.Tensor) -> None:
    """Forward log-prob error against fp64 with peaked logits (W std 0.06: logits of std ~4.7, the
    sampled token's probability ~0.16 on average) and targets drawn from the softmax (as an RL
    sampler draws them) or its argmax: the fp32 reference, the default tiles and `--promotes`."""
    from agentrl.algo.fused_logprobs import TileConfig, fused_logprobs
    from agentrl.algo.logprobs import chunk_stats

    n, vocab = h.shape[0], args.vocab
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(vocab, h.shape[1], device="cuda", generator=g) * 0.06).to(torch.bfloat16)
    wd = w.double()
    print(f"\npeaked logits (W std 0.06), forward log-prob error, max over all {n} tokens:")
    print(
        f"{'targets':10s} {'mean p_y':>9s} {'fp32 ref':>9s} "
        + " ".join(f"{k:>11s}" for k in _promote_labels(args))
    )
    for mode in ("sampled", "argmax"):
        ys, lps = [], []
        for c in range(0, n, 1024):
            z = h[c : c + 1024].double() @ wd.t()
            yc = (
                z.argmax(1)
                if mode == "argmax"
                else torch.multinomial(torch.softmax(z, 1).float(), 1, generator=g)[:, 0]
            )
            ys.append(yc)
            lps.append(z.gather(1, yc[:, None])[:, 0] - torch.logsumexp(z, dim=1))
            del z
        y, lp64 = torch.cat(ys), torch.cat(lps)
        zy, lse, _ = chunk_stats(
            h.float(), w.float(), y, chunk_size=2048, temperature=1.0, with_entropy=False
        )
        errs = [((zy - lse).double() - lp64).abs().max().item()]
        with torch.no_grad():
            for label in _promote_labels(args):
                tiles = (
                    None if label == "default" else TileConfig(promote=int(label.removeprefix("promote=")))
                )
                lp, _ = fused_logprobs(h, w, y, kernel="triton", tiles=tiles)
                errs.append((lp.double() - lp64).abs().max().item())
        print(f"{mode:10s} {lp64.exp().mean().item():9.3f} " + " ".join(f"{e:>9.1e}  " for e in errs))
    del w, wd
    torch.cuda.empty_cache()


def _promote_labels(args) -> list[str]:
    return ["default"] + [f"promote={p}" for p in filter(None, args.promotes.split(","))]


def loss_rows(args, hg, wg, y, g_lp, g_ent, ref, lp64) -> list[dict]:
    """`fused_token_loss` (gradients made in forward: three products) with the linear per-token
    loss g_lp * logp + g_ent * entropy, whose gradients are the other rows' upstream gradients."""
    from agentrl.algo.fused_loss import fused_token_loss

    def linear(lp, et, sl):
        return g_lp[sl] * lp + (g_ent[sl] * et if et is not None else 0.0)

    rows = []
    chunks = [None, *(int(c) for c in filter(None, args.loss_chunks.split(",")))]
    w32 = wg.detach().float().requires_grad_()
    cases = [(c, e, False) for c in chunks for e in (False, True)] + [(None, True, True)]
    for chunk, ent, master in cases:
        name = "fused loss" + (" + entropy" if ent else "") + (f", chunk {chunk}" if chunk else "")
        name += ", fp32 master weight (autocast)" if master else ""
        w = w32 if master else wg

        def fb(chunk=chunk, ent=ent, w=w, master=master):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=master):
                r = fused_token_loss(hg, w, y, linear, with_entropy=ent, kernel="triton", chunk=chunk)
            return torch.autograd.grad(r.loss, [hg, w]), r

        row: dict = {"name": name}
        try:
            row["fwdbwd_ms"], row["peak_gib"] = _cuda_ms(fb, args.iters)
            (dh, dw), r = fb()
            row["lp_err"] = (r.logp - ref["lp"]).abs().max().item()
            row["lp_err64"] = (r.logp.double() - lp64).abs().max().item()
            if ent:
                row["ent_err"] = (r.entropy - ref["ent"]).abs().max().item()
            row["dh_rel"], row["dw_rel"] = _rel(dh, ref[f"dh{ent:d}"]), _rel(dw, ref[f"dw{ent:d}"])
            del dh, dw, r
        except torch.OutOfMemoryError:
            row["oom"] = True
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def head_main(args: argparse.Namespace) -> None:
    from agentrl.algo.fused_logprobs import _addmm_accumulates_fp32
    from agentrl.algo.logprobs import chunk_grads, chunk_stats

    torch.backends.cuda.matmul.allow_tf32 = False
    n, hid, vocab = args.seq_len, args.hidden, args.vocab
    print(
        f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  tokens {n}  hidden {hid}  "
        f"vocab {vocab}  bf16  iters {args.iters}"
    )
    print(f"cuBLAS adds bf16 products into fp32 in place: {_addmm_accumulates_fp32(torch.device('cuda'))}")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hid, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(vocab, hid, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)

    t0 = time.perf_counter()
    hf, wf = h.float(), w.float()
    zy, lse, ez = chunk_stats(hf, wf, y, chunk_size=2048, temperature=1.0, with_entropy=True)
    ref = {"lp": zy - lse, "ent": lse - ez}
    for e in (False, True):
        ref[f"dh{e:d}"], ref[f"dw{e:d}"] = chunk_grads(
            hf, wf, y, lse, ez if e else None, g_lp, g_ent if e else None, chunk_size=2048,
            temperature=1.0, mm_dtype=torch.float32, need_h=True, need_w=True,
        )  # fmt: skip
    # fp64 truth on every token (1,024 at a time): how far the fp32 reference itself is from exact.
    wd = w.double()
    lp64 = torch.empty(n, device="cuda", dtype=torch.float64)
    for c in range(0, n, 1024):
        z64 = h[c : c + 1024].double() @ wd.t()
        lp64[c : c + 1024] = z64.gather(1, y[c : c + 1024, None])[:, 0] - torch.logsumexp(z64, dim=1)
    del z64, wd, hf, wf, zy, lse, ez
    torch.cuda.empty_cache()
    ref32_vs_64 = (ref["lp"].double() - lp64).abs().max().item()
    print(f"fp32 reference vs fp64 on all {n} tokens: logp max error {ref32_vs_64:.1e}")
    floor_dh, floor_dw = _rel(ref["dh0"].bfloat16(), ref["dh0"]), _rel(ref["dw0"].bfloat16(), ref["dw0"])
    print(
        f"fp32 reference in {time.perf_counter() - t0:.1f} s; bf16 rounding of the fp32 gradients "
        f"(the floor of any bf16 gradient): dh {floor_dh:.2e}, dW {floor_dw:.2e}"
    )

    mm_ms, _ = _cuda_ms(lambda: torch.mm(h, w.t()), args.iters)
    print(f"plain matmul h @ W.T: {mm_ms:.1f} ms ({2 * n * hid * vocab / mm_ms / 1e9:.0f} TFLOP/s)")
    rows = [{"name": "matmul h @ W.T", "fwd_ms": mm_ms, "fwdbwd_ms": 3 * mm_ms}]

    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    cases = []
    keep = [v for v in args.variants.split(",") if v]
    for name, fn in head_variants(args, y).items():
        if keep and not any(k in name for k in keep):
            continue
        cases.append((name, fn, False))
        if name == "fused":
            cases.append(("fused + entropy", fn, True))
    for name, fn, ent in cases:
        row: dict = {"name": name}
        try:
            with torch.no_grad():
                row["fwd_ms"], _ = _cuda_ms(lambda fn=fn, ent=ent: fn(h, w, ent), args.iters)

            def fwd_bwd(fn=fn, ent=ent):
                lp, et = fn(hg, wg, ent)
                outs, grads = ([lp, et], [g_lp, g_ent]) if ent else ([lp], [g_lp])
                return torch.autograd.grad(outs, [hg, wg], grads)

            if name.startswith("fused fwd:"):  # a forward-only tiling: no backward numbers
                with torch.no_grad():
                    lp, _ = fn(h, w, False)
                row["lp_err"] = (lp.float() - ref["lp"]).abs().max().item()
                row["lp_err64"] = (lp.double() - lp64).abs().max().item()
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            row["fwdbwd_ms"], row["peak_gib"] = _cuda_ms(fwd_bwd, args.iters)
            lp, et = fn(hg, wg, ent)
            outs, grads = ([lp, et], [g_lp, g_ent]) if ent else ([lp], [g_lp])
            dh, dw = torch.autograd.grad(outs, [hg, wg], grads)
            row["lp_err"] = (lp.detach().float() - ref["lp"]).abs().max().item()
            row["lp_err64"] = (lp.detach().double() - lp64).abs().max().item()
            if ent:
                row["ent_err"] = (et.detach() - ref["ent"]).abs().max().item()
            row["dh_rel"] = _rel(dh, ref[f"dh{ent:d}"])
            row["dw_rel"] = _rel(dw, ref[f"dw{ent:d}"])
            del lp, et, dh, dw
        except torch.OutOfMemoryError:
            row["oom"] = True
        except Exception as exc:  # a variant that fails still leaves the others' numbers
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)

    if not keep or any(k in "fused loss" for k in keep):
        rows += loss_rows(args, hg, wg, y, g_lp, g_ent, ref, lp64)

    # The trainer's case: fp32 master weights under bf16 autocast get an fp32 weight gradient.
    from agentrl.algo.fused_logprobs import fused_logprobs

    w32 = w.float().requires_grad_()

    def master():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, et = fused_logprobs(hg, w32, y, with_entropy=True, kernel="triton")
        return torch.autograd.grad([lp, et], [hg, w32], [g_lp, g_ent]), lp

    row = {"name": "fused + entropy, fp32 master weight (autocast)"}
    row["fwdbwd_ms"], row["peak_gib"] = _cuda_ms(master, args.iters)
    (dh, dw), lp = master()
    row["lp_err"] = (lp.detach() - ref["lp"]).abs().max().item()
    row["lp_err64"] = (lp.detach().double() - lp64).abs().max().item()
    row["dh_rel"], row["dw_rel"] = _rel(dh, ref["dh1"]), _rel(dw, ref["dw1"])
    rows.append(row)
    print(json.dumps(row), flush=True)
    del dh, dw

    print(f"\nGLM-5.2 LM head, {n} tokens x {hid} hidden x {vocab} vocab, bf16; medians of {args.iters}")
    print(
        f"{'variant':58s} {'fwd ms':>8s} {'fwd/mm':>7s} {'f+b ms':>8s} {'f+b/3mm':>8s} {'peak GiB':>9s} "
        f"{'logp err':>9s} {'lp e64':>8s} {'ent err':>9s} {'dh rel':>9s} {'dW rel':>9s}"
    )

    def f(x, spec):
        return format(x, spec) if isinstance(x, float) else "-"

    for r in rows:
        if "error" in r or "oom" in r:
            print(f"{r['name']:58s} {r.get('error', 'OOM')}")
            continue
        fwd, fb = r.get("fwd_ms"), r.get("fwdbwd_ms")
        print(
            f"{r['name']:58s} {f(fwd, '8.1f')} {f(fwd / mm_ms if fwd else None, '7.2f')} {f(fb, '8.1f')} "
            f"{f(fb / (3 * mm_ms) if fb else None, '8.2f')} {f(r.get('peak_gib'), '9.2f')} "
            f"{f(r.get('lp_err'), '9.1e')} {f(r.get('lp_err64'), '8.1e')} {f(r.get('ent_err'), '9.1e')} "
            f"{f(r.get('dh_rel'), '9.1e')} "
            f"{f(r.get('dw_rel'), '9.1e')}"
        )
    print(f"bf16 floor (fp32 reference rounded to bf16): dh {floor_dh:.1e}, dW {floor_dw:.1e}")
    print("logp err: max |logp - fp32 reference| over all tokens; lp e64: max |logp - fp64| over all tokens")
    print(f"(the fp32 reference itself is {ref32_vs_64:.1e} from fp64)")
    fused = next((r for r in rows if r["name"] == "fused"), {})
    fused_e = next((r for r in rows if r["name"] == "fused + entropy"), {})
    if "fwdbwd_ms" in fused and "fwdbwd_ms" in fused_e:
        print(f"entropy adds {100 * (fused_e['fwdbwd_ms'] / fused['fwdbwd_ms'] - 1):.1f}% to fused fwd+bwd")
    if args.promotes is not None:
        peaked_precision(args, h)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "floor": [floor_dh, floor_dw], "rows": rows}, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["model", "head"], default="model")
    ap.add_argument("--seq-len", type=int, default=None, help="model: 16384; head: 16384")
    ap.add_argument("--vocab", type=int, default=None, help="model: 151552; head: 154880")
    ap.add_argument("--hidden", type=int, default=None, help="model: 1024; head: 6144")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--chunk-sizes", default="1024,4096")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument(
        "--sweep",
        default="",
        help="head: extra fused tilings, ';'-separated TileConfig fields, e.g. 'load=ptr;block_v=128,num_warps=4'",
    )
    ap.add_argument(
        "--variants", default="", help="head: only rows whose name holds one of these (comma-separated)"
    )
    ap.add_argument(
        "--promotes",
        default=None,
        help="head: also the peaked-logits precision table, for the default tiles and these promote values, e.g. '0,8'",
    )
    ap.add_argument(
        "--loss-chunks",
        default="512,2048",
        help="head: fused-loss rows at these chunk sizes besides the default",
    )
    ap.add_argument("--parts", default="head,step,step-nogc,trainer", help="model: which parts to run")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    defaults = GLM52 if args.mode == "head" else {"seq_len": 16384, "hidden": 1024, "vocab": 151552}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.mode == "head":
        head_main(args)
        return
    chunks = [int(c) for c in args.chunk_sizes.split(",")]

    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  params {n_params / 1e9:.3f}B  "
        f"vocab {args.vocab}  seq {args.seq_len}  layers {args.layers}  hidden {args.hidden}"
    )
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, args.seq_len), device="cuda", generator=g)
    adv = torch.randn(1, args.seq_len, device="cuda", generator=g)
    weight = model.get_output_embeddings().weight
    hidden = (torch.randn(1, args.seq_len - 1, args.hidden, device="cuda", generator=g) * 0.5).to(
        torch.bfloat16
    )
    hidden.requires_grad_(True)
    targets = ids[:, 1:]

    # Same numbers either way (checked once, before timing).
    with torch.no_grad():
        a, _ = full_logprobs(hidden[:, :2048], weight, targets[:, :2048])
        b, _ = chunked_logprobs(hidden[:, :2048], weight, targets[:, :2048], chunk_size=chunks[0])
    print(f"max |chunked - full| log-prob on 2048 tokens: {(a - b).abs().max().item():.2e}")
    grads = []
    for fn in (full_logprobs, chunked_logprobs):
        h = hidden[:, :2048].detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        kw = {"chunk_size": chunks[0]} if fn is chunked_logprobs else {}
        lp, _ = fn(h, w, targets[:, :2048], **kw)
        (lp * adv[:, :2048]).sum().backward()
        grads.append((h.grad.float(), w.grad.float()))
    for name, k in (("hidden", 0), ("weight", 1)):
        ref, got = grads[0][k], grads[1][k]
        print(f"gradient wrt {name}: relative error {((got - ref).norm() / ref.norm()).item():.2e}")
    del grads

    def head(chunk: int | None):
        def run() -> None:
            if chunk:
                logp, _ = chunked_logprobs(hidden, weight, targets, chunk_size=chunk)
            else:
                logp, _ = full_logprobs(hidden, weight, targets)
            loss_of(logp, adv[:, 1:]).backward()
            hidden.grad = None
            weight.grad = None

        return run

    def step(chunk: int | None):
        def run() -> None:
            logp, _ = model_logprobs(model, ids, chunk_size=chunk, impl="chunked")
            loss_of(logp, adv).backward()
            model.zero_grad(set_to_none=True)

        return run

    rows = []
    variants = [None, *chunks]
    for part in ("head", "step", "step-nogc"):
        if part not in args.parts.split(","):
            continue
        if part == "step":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if part == "step-nogc":
            model.gradient_checkpointing_disable()
        for chunk in variants:
            fn = head(chunk) if part == "head" else step(chunk)
            try:
                peak, sec = measure(fn, args.iters)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                rows.append({"part": part, "chunk": chunk, "oom": True})
                print(f"{part:10s} chunk={chunk!s:6s} OOM")
                continue
            torch.cuda.empty_cache()
            row = {
                "part": part,
                "chunk": chunk,
                "peak_gib": peak / 2**30,
                "sec": sec,
                "tok_per_s": args.seq_len / sec,
            }
            rows.append(row)
            print(
                f"{part:10s} chunk={chunk!s:6s} peak {row['peak_gib']:8.2f} GiB   {sec * 1e3:8.1f} ms   "
                f"{row['tok_per_s']:10.0f} tok/s"
            )

    if "trainer" in args.parts.split(","):
        rows += trainer_rows(model, args, chunks[0])

    print("\nratios vs unchunked (goal: peak <= 0.125, speed >= 0.7)")
    for part in ("head", "step", "step-nogc", "trainer"):
        base = next((r for r in rows if r["part"] == part and r["chunk"] is None), None)
        if base is None:
            continue
        for r in rows:
            if r["part"] != part or r["chunk"] is None or r.get("oom") or base.get("oom"):
                continue
            print(
                f"{part:10s} chunk={r['chunk']!s:<10s} peak ratio {r['peak_gib'] / base['peak_gib']:.3f}   "
                f"speed ratio {r['tok_per_s'] / base['tok_per_s']:.3f}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "params": n_params, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
