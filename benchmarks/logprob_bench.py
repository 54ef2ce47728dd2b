"""Chunked vs unchunked log-prob computation in a GRPO trainer step, side by side in one run.

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
    from agentrl.sample import Sample
    from agentrl.train.config import TrainConfig
    from agentrl.train.torch_backend import TorchTrainer

    g = torch.Generator().manual_seed(2)
    half, prompt = args.seq_len // 2, 256
    samples = []
    for k in range(2):
        toks = torch.randint(0, args.vocab, (half,), generator=g).tolist()
        n = half - prompt
        samples.append(
            Sample("p0", toks, prompt, [1] * n, (-torch.rand(n, generator=g) * 5).tolist(), reward=float(k))
        )
    rows = []
    for c in (None, chunk):
        cfg = TrainConfig(
            lr=1e-6,
            logprob_chunk_size=c,
            gradient_checkpointing=True,
            max_tokens_per_micro_batch=args.seq_len,
        )
        trainer = TorchTrainer(copy.deepcopy(model).float(), cfg, device="cuda")
        try:
            peak, sec = measure(lambda t=trainer: t.train_step(samples), args.iters)
        except torch.OutOfMemoryError:
            rows.append({"part": "trainer", "chunk": c, "oom": True})
            print(f"trainer    chunk={c!s:6s} OOM")
            continue
        finally:
            del trainer
            torch.cuda.empty_cache()
        row = {
            "part": "trainer",
            "chunk": c,
            "peak_gib": peak / 2**30,
            "sec": sec,
            "tok_per_s": args.seq_len / sec,
        }
        rows.append(row)
        print(
            f"trainer    chunk={c!s:6s} peak {row['peak_gib']:8.2f} GiB   {sec * 1e3:8.1f} ms   {row['tok_per_s']:10.0f} tok/s"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151552)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--chunk-sizes", default="1024,4096")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
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
            logp, _ = model_logprobs(model, ids, chunk_size=chunk)
            loss_of(logp, adv).backward()
            model.zero_grad(set_to_none=True)

        return run

    rows = []
    variants = [None, *chunks]
    for part in ("head", "step", "step-nogc"):
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

    rows += trainer_rows(model, args, chunks[0])

    print("\nratios vs unchunked (goal: peak <= 0.125, speed >= 0.7)")
    for part in ("head", "step", "step-nogc", "trainer"):
        base = next(r for r in rows if r["part"] == part and r["chunk"] is None)
        for r in rows:
            if r["part"] != part or r["chunk"] is None or r.get("oom") or base.get("oom"):
                continue
            print(
                f"{part:10s} chunk={r['chunk']:<6d} peak ratio {r['peak_gib'] / base['peak_gib']:.3f}   "
                f"speed ratio {r['tok_per_s'] / base['tok_per_s']:.3f}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "params": n_params, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
