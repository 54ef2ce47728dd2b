"""The Megatron trainer: a small glm_moe_dsa model against transformers, then GRPO steps, on one
rank or under torchrun with tensor / expert / pipeline / context parallelism.

Run on a CUDA machine with megatron-core 0.19 importable (docs/megatron.md):

    PYTHONPATH=.:$SITE python benchmarks/megatron_gpu.py --steps 20 --json out.json
    PYTHONPATH=.:$SITE torchrun --nproc-per-node=2 benchmarks/megatron_gpu.py --tp 2 --steps 20 --json tp2.json
    PYTHONPATH=.:$SITE torchrun --nproc-per-node=2 benchmarks/megatron_gpu.py --ep 2 --steps 20 --json ep2.json
    PYTHONPATH=.:$SITE torchrun --nproc-per-node=2 benchmarks/megatron_gpu.py --pp 2 \
        --first-stage-layers 5 --last-stage-layers 3 --steps 20 --json pp2.json

(`--pp 2` needs a split whose second stage starts on a layer that computes its DSA indices: the
8-layer model's layers 1, 2, 4, 6, 8 do, so 5 | 3 or 3 | 5; an even 4 | 4 split is refused.)

Issue 23 (4 and 8 GPUs): `--layers 16 --experts 32` (index sharing kept: layers 1, 2, 4, ..., 16
compute), e.g. `--pp 4 --first-stage-layers 5 --last-stage-layers 3` (stages start on 1, 6, 10,
14; the even 4 | 4 | 4 | 4 is refused), `--ep 4`, `--tp 2 --pp 2 --ep 2 --first-stage-layers 9
--last-stage-layers 7` on 8. `--dry-run` checks and prints the split (the computing layers, every
valid `--first-stage-layers/--last-stage-layers` pair, the stages) and the rank layout, then stops:
it needs neither megatron nor torchrun (set WORLD_SIZE). `--reference-json one.json` compares the
probe log-probs with an earlier run's (a 1-GPU run on the same seed-built weights). `--engine-export
tensor,distributed` starts `agentrl engine serve` on this host (`--engine-device`, default cuda:1
on a GPU host: NCCL refuses two group members on one GPU), and after training, per transport: the
engine is set back to the initial weights, the trainer's export is pushed through
`agentrl.train.weight_sync`'s transport, and the engine's log-probs of the probe are compared with
the trainer's (before the push too, so a push that did nothing shows). The commands are in
benchmarks/RESULTS.md.
`--device cpu --tiny` runs the same code over gloo with a tiny model (fp32, the local gradient
reduction: megatron's DDP needs CUDA), which is how the multi-rank path is checked without a GPU.

In one go, printed side by side (rank 0 prints and writes `--json`; every rank runs the trainer):
1. log-probs of the Megatron model (fp32, then bf16) against `GlmMoeDsaForCausalLM` on the same
   weights, packed (THD) sequences longer than the DSA top-k, so the sparse path selects;
2. `--steps` GRPO steps with bf16 weights, megatron's DDP and distributed optimizer
   (`trainer.megatron.ddp=megatron`): each step's rollouts are sampled on rank 0 from the
   transformers model holding the trainer's exported weights (the rollout engine: the weight sync
   is real; every rank iterates the export, whose gathers are collectives) and broadcast to every
   rank, so the rollout-vs-trainer mismatch KL is measured, not zero by construction; reward =
   the share of response tokens in the lower half of the vocabulary (learnable, so the loss moves);
3. a `torch_dist` checkpoint of the model and the optimizer: save, step, load, the same step
   again: the weights after both must be equal.
Per step: loss, mismatch KL, reward, gradient norm, rollout and train seconds, train tokens/s;
at the end every rank's peak memory (GPU: allocated and reserved; CPU: resident set).
"""

from __future__ import annotations

import os
import sys

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the backend follows torch.cuda.is_available()

import argparse
import json
import math
import resource
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrl.episode.sample import Sample  # noqa: E402
from agentrl.train.batch import build_batch, with_advantages  # noqa: E402
from agentrl.train.config import TrainConfig  # noqa: E402


def model_config(args: argparse.Namespace) -> Any:
    """The `glm_moe_dsa` model the run builds. Default: 8 layers (1 dense + 7 MoE), hidden 1024,
    16 experts top-4 + a shared expert, MLA, DSA top-k 64 with index sharing (frequency 2: layers
    1, 2, 4, 6, 8 compute their indices, 3, 5, 7 reuse them). `--layers/--experts/--hidden/...`
    resize it (issue 23: `--layers 16 --experts 32`, index sharing kept). `--tiny`: the CI test
    model's shape (hidden 64, 4 layers: 1 dense + 3 MoE with 4 experts top-2, DSA top-k 4), whose
    layer and expert counts the same flags change."""
    from transformers import GlmMoeDsaConfig

    if args.shape == "glm52":
        return glm52_proxy_config(args)
    if args.shape == "glm45":
        return glm45_proxy_config(args)
    tiny = args.tiny
    layers = args.layers or (4 if tiny else 8)
    hidden = args.hidden or (64 if tiny else 1024)
    heads = 4 if tiny else max(hidden // 64, 1)
    return GlmMoeDsaConfig(
        vocab_size=args.vocab,
        hidden_size=hidden,
        intermediate_size=128 if tiny else hidden * 11 // 4,
        moe_intermediate_size=32 if tiny else hidden // 2,
        num_hidden_layers=layers,
        first_k_dense_replace=args.dense_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=1,
        n_routed_experts=args.experts or (4 if tiny else 16),
        num_experts_per_tok=args.experts_per_token or (2 if tiny else 4),
        kv_lora_rank=16 if tiny else 256,
        q_lora_rank=32 if tiny else 512,
        qk_rope_head_dim=8 if tiny else 32,
        qk_nope_head_dim=16 if tiny else 64,
        v_head_dim=16 if tiny else 64,
        index_topk=args.index_topk or (4 if tiny else 64),
        index_head_dim=16 if tiny else 64,
        index_n_heads=8 if tiny else 16,
        index_topk_freq=args.index_topk_freq,
        index_skip_topk_offset=2,
        max_position_embeddings=256 if tiny else 4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def glm52_proxy_config(args: argparse.Namespace) -> Any:
    """GLM-5.2's layer shapes (shared/reference/glm52.md, recipes/_glm52.py): hidden 6144, dense FFN
    12288, MLA with 64 heads (q-LoRA 2048, kv-LoRA 512, qk 128 + 64, v 256), expert FFN 2048 top-8
    plus a shared expert, DSA top-k 2048 with a 32 x 128 indexer. Fewer layers (default 4: 1 dense +
    3 MoE), routed experts (default 8, so top-8 puts each token through as many expert FLOPs as
    GLM-5.2's top-8 of 256) and a smaller vocabulary (default 32768) so it trains on one GPU."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        vocab_size=args.vocab,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=args.layers or 4,
        first_k_dense_replace=args.dense_layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_shared_experts=1,
        n_routed_experts=args.experts or 8,
        num_experts_per_tok=args.experts_per_token or 8,
        kv_lora_rank=512,
        q_lora_rank=2048,
        qk_rope_head_dim=64,
        qk_nope_head_dim=192,
        v_head_dim=256,
        index_topk=args.index_topk or 2048,
        index_head_dim=128,
        index_n_heads=32,
        index_topk_freq=args.index_topk_freq,
        index_skip_topk_offset=2,
        max_position_embeddings=max(8192, args.seq_len),
        rope_parameters={"rope_type": "default", "rope_theta": 8000000.0},
    )


def glm45_proxy_config(args: argparse.Namespace) -> Any:
    """GLM-4.5's layer shapes (`glm4_moe`, shared/reference/glm45.md, recipes/_glm45.py): hidden
    5120, 96 query heads in 8 groups of 128, QKV bias, half-rotary RoPE (base 1e6), dense FFN 12288,
    expert FFN 1536 top-8 plus a shared expert. Fewer layers (default 4: 1 dense + 3 MoE), routed
    experts (default 8: each token still runs 8 experts, as in GLM-4.5) and a smaller vocabulary."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=args.vocab,
        hidden_size=5120,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=args.layers or 4,
        first_k_dense_replace=args.dense_layers,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        attention_bias=True,
        use_qk_norm=False,
        n_shared_experts=1,
        n_routed_experts=args.experts or 8,
        num_experts_per_tok=args.experts_per_token or 8,
        routed_scaling_factor=2.5,
        max_position_embeddings=max(8192, args.seq_len),
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    )


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """This device's matrix-product rate in the training dtype (bf16 on a GPU, fp32 on a CPU),
    measured now (n x n x n, random data): the yardstick for model FLOPs utilisation."""
    if device.type != "cuda":
        n, iters = 512, 5
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    synchronize(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def step_flops(cfg: Any, samples: list[Sample]) -> float:
    """Model FLOPs of one training step (forward and backward, 3x the forward; a recomputed
    forward is not counted: MFU's convention), from the config (`ModelSpec.forward_flops`)."""
    from agentrl.cluster.model import ModelSpec

    spec = ModelSpec("bench", cfg.to_dict())
    return 3 * sum(spec.forward_flops(len(s.tokens)) for s in samples)


def profile_step(tr: Any, samples: list[Sample], top: int = 15) -> dict[str, Any]:
    """One training step under torch's profiler: the GPU's busy time (kernels) against the step's
    wall time, and the kernels that take the most."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        tr.train_step(samples)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e6  # us -> s
    busy = sum(kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {
        "wall_s": wall,
        "gpu_kernel_s": busy,
        "gpu_idle_share": max(0.0, 1 - busy / wall),
        "top_kernels": [{"name": k[:120], "s": v, "share_of_wall": v / wall} for k, v in ranked],
    }


def perf_run(
    cfg: Any, args: argparse.Namespace, parallel: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    """`--perf-only`: the bf16 trainer on random sequences of `--seq-len` (no parity, no engine, no
    checkpoint): per step the phase times the trainer reports, the weight export, model FLOPs
    utilisation against this GPU's measured bf16 matrix-product rate, and one profiled step."""
    from agentrl.algo import LossConfig
    from agentrl.train.megatron.settings import MegatronSettings
    from agentrl.train.megatron.trainer import MegatronTrainer

    on_gpu = device.type == "cuda"
    result: dict[str, Any] = {
        "args": vars(args),
        "model": model_summary(cfg),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
    }
    result["matmul_tflops"] = matmul_tflops(device)
    print(f"matmul: {result['matmul_tflops']:.1f} TFLOP/s", flush=True)
    hf = hf_model(cfg)
    lora = args.lora_rank > 0  # adapters only: the trainer's own reduction and AdamW (ddp auto)
    settings = MegatronSettings(  # as the main run: CPU = fp32 and the local reduction
        params_dtype="bfloat16" if on_gpu else "float32",
        ddp="megatron" if on_gpu and not lora else ("auto" if lora else "local"),
        distributed_optimizer=on_gpu and not lora,
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        **parallel,
    )
    config = TrainConfig(
        lr=args.lr,
        max_tokens_per_micro_batch=args.mb_tokens,
        loss=LossConfig(use_tis=True, tis_clip=2.0),
        grad_clip=1.0,
        lora={"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank} if lora else {},
    )
    t0 = time.perf_counter()
    tr = MegatronTrainer(cfg, config, settings, hf_state=hf.state_dict())
    result["train_build_seconds"] = time.perf_counter() - t0
    result["params"] = sum(p.numel() for p in tr._params())
    del hf
    # The step once per `--old-logprobs` mode, one after another on the same trainer (a warm-up
    # step first for each): the modes' medians side by side.
    result["modes"] = {}
    step = 0
    for mode in args.modes.split(","):
        old, _, tf32 = mode.partition("/")
        tr.config.old_logprobs = old
        tr.settings.tf32 = {"on": True, "off": False}.get(tf32 or "auto")
        rows = []
        for _ in range(args.steps):
            step += 1
            samples = random_samples(cfg, args.seqs, args.seq_len, seed=100 + step)
            synchronize(device)
            t0 = time.perf_counter()
            m = tr.train_step(samples)
            synchronize(device)
            train_s = time.perf_counter() - t0
            export_s = sync(tr, None, device, torch.bfloat16 if on_gpu else torch.float32)
            flops = step_flops(cfg, samples)
            phases = {k[len("time_") : -len("_s")]: v for k, v in m.items() if k.startswith("time_")}
            row = {
                "mode": mode,
                "step": step,
                "loss": m["loss"],
                "train_s": train_s,
                "export_s": export_s,
                "tokens": sum(len(s.tokens) for s in samples),
                "model_tflop": flops / 1e12,
                "mfu": flops / train_s / (result["matmul_tflops"] * 1e12),
                "phases_s": phases,
            }
            fb = (
                phases.get("forward", 0.0) + phases.get("backward", 0.0) + phases.get("forward_backward", 0.0)
            )
            row["mfu_forward_backward"] = (
                flops / fb / (result["matmul_tflops"] * 1e12) if fb else float("nan")
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        timed = rows[1:] or rows
        med = sorted(timed, key=lambda r: r["train_s"])[len(timed) // 2]
        total = med["train_s"] + med["export_s"]
        ours = med["phases_s"].get("batch", 0.0) + med["phases_s"].get("loss_metrics", 0.0)
        result["modes"][mode] = {
            "steps": rows,
            "median_step": {
                **med,
                "tokens_per_s": med["tokens"] / med["train_s"],
                "share_of_step": {
                    k: v / total for k, v in {**med["phases_s"], "export": med["export_s"]}.items()
                },
                "ours_share": ours / total,
            },
        }
    medians = {mode: r["median_step"]["train_s"] for mode, r in result["modes"].items()}
    if len(medians) > 1:
        first = next(iter(medians.values()))
        result["train_s_ratio_to_first_mode"] = {mode: t / first for mode, t in medians.items()}
    if args.profile and on_gpu:
        result["profile"] = profile_step(tr, random_samples(cfg, args.seqs, args.seq_len, seed=7))
    result["peak_memory_gib"] = peak_memory_gib(device)
    return result


def model_summary(cfg: Any) -> dict[str, Any]:
    return {
        "layers": cfg.num_hidden_layers,
        "dense_layers": cfg.first_k_dense_replace,
        "hidden": cfg.hidden_size,
        "experts": cfg.n_routed_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "model_type": cfg.model_type,
        "index_topk": getattr(cfg, "index_topk", None),
        "index_topk_freq": getattr(cfg, "index_topk_freq", None),
        "vocab": cfg.vocab_size,
    }


def valid_splits(cfg: Any, pp: int) -> list[tuple[int, int]]:
    """Every (first, last) stage size whose pipeline split `check_pipeline_split` accepts (the
    middle stages share the rest evenly)."""
    from agentrl.train.megatron.plan import PipelineSplitError, check_pipeline_split, pipeline_layout

    out = []
    n = cfg.num_hidden_layers
    for first in range(1, n):
        for last in range(1, n - first + 1):
            try:
                layout = pipeline_layout(n, pp, first_stage_layers=first, last_stage_layers=last)
                check_pipeline_split(cfg, layout)
            except PipelineSplitError:
                continue
            if not all(layout.stages):
                continue  # an empty middle stage
            out.append((first, last))
    return out


def check_split(cfg: Any, args: argparse.Namespace, parallel: dict[str, Any], lead: bool) -> dict[str, Any]:
    """The pipeline split and the expert split, checked (and printed) before any weight exists:
    a stage that starts on a layer reusing an earlier stage's DSA indices is refused here."""
    from agentrl.train.megatron.model import layout_of
    from agentrl.train.megatron.plan import (
        ModelConfigError,
        PipelineSplitError,
        check_pipeline_split,
        computing_layers,
    )
    from agentrl.train.megatron.settings import MegatronSettings

    info: dict[str, Any] = {"computing_layers": computing_layers(cfg)}
    if args.pp > 1:
        info["valid_first_last_stage_layers"] = valid_splits(cfg, args.pp)
    if cfg.n_routed_experts % args.ep:
        raise ModelConfigError(
            f"--ep {args.ep} does not divide the {cfg.n_routed_experts} routed experts: "
            f"pick an expert count (--experts) that it divides"
        )
    layout = layout_of(cfg, MegatronSettings(**parallel))
    info["stage_layers"] = [[i + 1 for i in st] for st in layout.stages]
    if lead:
        print(f"model {model_summary(cfg)}", flush=True)
        print(f"DSA: layers {info['computing_layers']} compute their indices (a stage may start there)")
        if args.pp > 1:
            print(
                f"valid (--first-stage-layers, --last-stage-layers) at --pp {args.pp}: "
                f"{info['valid_first_last_stage_layers']}",
                flush=True,
            )
        print(f"stages {info['stage_layers']}", flush=True)
    try:
        check_pipeline_split(cfg, layout)
    except PipelineSplitError as exc:
        raise PipelineSplitError(
            f"refused before building: {exc}. Valid (first, last) stage sizes at --pp {args.pp}: "
            f"{info.get('valid_first_last_stage_layers')}"
        ) from None
    return info


def hf_model(cfg: Any, seed: int = 0) -> Any:
    """The HF model on the CPU, fp32; the same weights on every rank (same seed, CPU generator)."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    if cfg.model_type == "glm4_moe":
        from transformers import Glm4MoeForCausalLM

        hf = Glm4MoeForCausalLM(cfg).float().eval()
    else:
        hf = GlmMoeDsaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.3)  # routing that depends on the token
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return hf


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def parity(
    tr: Any, hf: Any | None, samples: list[Sample], keep: dict[int, list[float]] | None = None
) -> dict[str, float] | None:
    """Packed Megatron log-probs vs the HF model, row by row, on the trainer's micro-batches.
    Every rank runs the trainer's forward (collectives); rank 0 (`hf` given) compares. `keep`:
    filled with the trainer's log-probs per sample (by its index in `samples`), on every rank."""
    index = {tuple(s.tokens): i for i, s in enumerate(samples)}
    batch = build_batch(samples, max_tokens_per_micro_batch=tr.config.max_tokens_per_micro_batch)
    for chunk in tr.chunks:
        chunk.eval()
    worst = total = 0.0
    count = 0
    with torch.no_grad():
        for mb in batch.micro_batches:
            mb = mb.to(tr.device)
            logp = tr.logprobs(mb)[0]
            for r in range(mb.num_rows if keep is not None else 0):
                n = int(mb.attention_mask[r].sum())
                keep[index[tuple(mb.input_ids[r, :n].tolist())]] = logp[r, 1:n].float().cpu().tolist()
            if hf is None:
                continue
            for r in range(mb.num_rows):
                n = int(mb.attention_mask[r].sum())
                ids = mb.input_ids[r : r + 1, :n]
                ref = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
                d = (logp[r, 1:n].float() - ref).abs()
                worst = max(worst, float(d.max()))
                total += float(d.sum())
                count += n - 1
    if hf is None:
        return None
    return {"max_abs_diff": worst, "mean_abs_diff": total / max(count, 1), "tokens": count}


def hf_vs_hf(a: Any, b: Any, samples: list[Sample], device: torch.device) -> dict[str, float]:
    """The same comparison between two HF models (the bf16 noise yardstick: bf16 vs fp32)."""
    worst = total = 0.0
    count = 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens], device=device)
            la = torch.log_softmax(a(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
            lb = torch.log_softmax(b(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
            d = (la - lb).abs()
            worst = max(worst, float(d.max()))
            total += float(d.sum())
            count += len(s.tokens) - 1
    return {"max_abs_diff": worst, "mean_abs_diff": total / max(count, 1), "tokens": count}


def random_samples(cfg: Any, n: int, length: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        toks = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
        out.append(
            Sample(
                prompt_id=str(i // 2),
                tokens=toks,
                prompt_length=length // 4,
                loss_mask=[1] * (length - length // 4),
                rollout_logprobs=[0.0] * (length - length // 4),
                reward=float(i % 2),
                sample_index=i,
            )
        )
    return with_advantages(out)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def rollouts(
    engine: Any | None, cfg: Any, args: argparse.Namespace, step: int, device: torch.device
) -> tuple[list[Sample], float]:
    """Rank 0 samples `groups` x `group_size` responses from the engine model (plain sampling at
    temperature 1, no cache: the full forward per token keeps it simple and exact); every rank
    gets the same samples (broadcast), as every rank of an SPMD trainer must."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    out: list[Sample] = []
    if engine is not None:
        g = torch.Generator(device=device).manual_seed(1000 + step)
        prompts = torch.randint(0, cfg.vocab_size, (args.groups, args.prompt_len), generator=g, device=device)
        ids = prompts.repeat_interleave(args.group_size, 0)
        lps = []
        for _ in range(args.response_len):
            logits = engine(ids).logits[:, -1].float()
            logp = torch.log_softmax(logits, -1)
            nxt = torch.multinomial(logp.exp(), 1, generator=g)
            lps.append(logp.gather(1, nxt))
            ids = torch.cat([ids, nxt], 1)
        lps_t = torch.cat(lps, 1).cpu()
        resp = ids[:, args.prompt_len :].cpu()
        for i in range(ids.shape[0]):
            reward = float((resp[i] < cfg.vocab_size // 2).float().mean())
            out.append(
                Sample(
                    prompt_id=f"s{step}-p{i // args.group_size}",
                    tokens=ids[i].tolist(),
                    prompt_length=args.prompt_len,
                    loss_mask=[1] * args.response_len,
                    rollout_logprobs=lps_t[i].tolist(),
                    reward=reward,
                    sample_index=i % args.group_size,
                )
            )
        out = with_advantages(out)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box: list[Any] = [out]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
    synchronize(device)
    return out, time.perf_counter() - t0


def sync(tr: Any, engine: Any | None, device: torch.device, dtype: torch.dtype) -> float:
    """The trainer's exported weights (HF names, buckets) into the engine model on rank 0; every
    rank iterates the export (its gathers are collectives)."""
    t0 = time.perf_counter()
    state = engine.state_dict() if engine is not None else None
    with torch.no_grad():
        for bucket in tr.export_weights(dtype):
            if state is not None:
                for name, t in bucket:
                    state[name].copy_(t)
    synchronize(device)
    return time.perf_counter() - t0


def weights(tr: Any) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in tr.hf_weights()}


def peak_memory_gib(device: torch.device) -> float:
    """This rank's peak: GPU memory allocated by torch, or the process's resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def compare_rows(a: dict[Any, list[float]], b: dict[Any, list[float]]) -> dict[str, float]:
    """Max / mean abs difference of two sets of per-sample log-prob rows (same keys, same lengths)."""
    if sorted(map(str, a)) != sorted(map(str, b)):
        raise ValueError(f"different samples: {sorted(a)[:4]}... vs {sorted(b)[:4]}...")
    worst = total = 0.0
    count = 0
    for k, row in a.items():
        other = b[k] if k in b else b[str(k)]
        if len(row) != len(other):
            raise ValueError(f"sample {k}: {len(row)} vs {len(other)} log-probs")
        d = (torch.tensor(row) - torch.tensor(other)).abs()
        worst = max(worst, float(d.max()))
        total += float(d.sum())
        count += len(row)
    return {"max_abs_diff": worst, "mean_abs_diff": total / max(count, 1), "tokens": count}


def load_reference(path: str, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The probe log-probs of an earlier run (normally one rank, no torchrun) on the same weights:
    the same model shape, seed-built weights and probe, else the comparison means nothing."""
    ref = json.loads(Path(path).read_text())
    if "probe_logprobs" not in ref:
        raise SystemExit(f"--reference-json {path}: no probe_logprobs (written by this script's --json)")
    mine = model_summary(cfg)
    if ref.get("model") != mine or ref["args"].get("probe_len") != args.probe_len:
        raise SystemExit(
            f"--reference-json {path} is another model or probe: {ref.get('model')} probe "
            f"{ref['args'].get('probe_len')} vs this run's {mine} probe {args.probe_len}"
        )
    return ref


def peak_memory_per_rank(device: torch.device) -> list[dict[str, Any]]:
    """Every rank's peak (GPU: torch's allocated maximum and what the allocator reserved)."""
    import socket

    import torch.distributed as dist

    mine: dict[str, Any] = {"rank": rank(), "host": socket.gethostname(), "peak_gib": peak_memory_gib(device)}
    if device.type == "cuda":
        mine["device"] = f"cuda:{device.index}"
        mine["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_engine_model(hf: Any, directory: Path) -> None:
    """The initial weights as a transformers directory for `agentrl engine serve`, with a word-level
    tokenizer of the model's vocabulary (the benchmark sends token ids; the server loads one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf.save_pretrained(directory)
    vocab = {f"<t{i}>": i for i in range(hf.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", pad_token="<t0>", eos_token="<t1>")
    fast.save_pretrained(directory)


def start_engine(model_dir: Path, port: int, device: str, extra: list[str] | None = None) -> Any:
    """`agentrl engine serve` in its own process (the same interpreter and source tree)."""
    import subprocess

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # not a member of the trainer's torchrun job
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "agentrl.cli", "engine", "serve", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--device", device, "--no-request-log", *(extra or [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_engine(server: Any, url: str, timeout: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"engine serve did not start: {server.stdout.read()[-3000:]}") from None
            time.sleep(0.5)


def post(url: str, body: dict[str, Any], timeout: float = 600) -> Any:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def engine_logprobs(url: str, samples: list[Sample]) -> tuple[dict[int, list[float]], set[str]]:
    """The engine's log-probs of each sample's tokens (SGLang /generate, `logprob_start_len` 0) and
    the weight versions that served them."""
    rows, versions = {}, set()
    for i, s in enumerate(samples):
        body = {
            "input_ids": s.tokens,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        meta = post(url + "/generate", body)["meta_info"]
        rows[i] = [float(e[0]) for e in meta["input_token_logprobs"][1:]]  # the first has none
        versions.add(str(meta.get("weight_version")))
    return rows, versions


def engine_export(
    tr: Any,
    url: str | None,
    model_dir: Path | None,
    transports: list[str],
    probe: list[Sample],
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Per transport: the engine set back to the initial weights (`/update_weights_from_disk`,
    version 0), its log-probs against the trainer's (they differ: the trainer has trained), then
    the trainer's export pushed through the library's transport (`agentrl.train.weight_sync`, as
    `agentrl.runtime` builds it) and the log-probs compared again. Every rank iterates the export
    (its gathers are collectives); rank 0 (`url` given) pushes and compares."""
    import asyncio

    import torch.distributed as dist

    from agentrl.engine.sglang import SGLangEngine
    from agentrl.train import weight_sync as ws

    multi = dist.is_initialized() and dist.get_world_size() > 1
    trainer_rows: dict[int, list[float]] = {}
    parity(tr, None, probe, trainer_rows)
    out: dict[str, Any] = {}
    for i, name in enumerate(transports):
        version = 100 + i
        if url is None:
            for _ in tr.export_weights(dtype):  # rank 0 pushes; the gathers need every rank
                pass
            if multi:
                dist.barrier()
            continue
        post(url + "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "0"})
        before, _ = engine_logprobs(url, probe)

        async def push(name: str = name, version: int = version) -> float:
            engine = SGLangEngine([url])
            await engine.refresh_weight_version()
            if name == "tensor":
                transport: Any = ws.TensorTransport([engine])
            else:
                backend = "nccl" if device.type == "cuda" else "gloo"
                transport = ws.DistributedTransport([engine], master_port=free_port(), backend=backend)
            t0 = time.perf_counter()
            try:
                await transport.push(tr.export_weights(dtype), version=version)
                synchronize(device)
                return time.perf_counter() - t0
            finally:
                await transport.aclose()
                await engine.aclose()

        seconds = asyncio.run(push())
        after, versions = engine_logprobs(url, probe)
        out[name] = {
            "push_seconds": seconds,
            "version_served": sorted(versions),
            "engine_vs_trainer_before_push": compare_rows(before, trainer_rows),
            "engine_vs_trainer_after_push": compare_rows(after, trainer_rows),
        }
        print(f"engine export {name}: {json.dumps(out[name])}", flush=True)
        if multi:
            dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the CI test model's shape (for --device cpu)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert TP (default: megatron's, = TP)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--first-stage-layers", type=int, default=None)
    parser.add_argument("--last-stage-layers", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None, help="default 16384 (--tiny: 128)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=192)
    parser.add_argument("--probe-len", type=int, default=320, help="parity probe length (> the DSA top-k)")
    parser.add_argument("--mb-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --tiny: 4)")
    parser.add_argument("--dense-layers", type=int, default=1, help="leading dense layers")
    parser.add_argument("--experts", type=int, default=None, help="routed experts (default 16; --tiny: 4)")
    parser.add_argument("--experts-per-token", type=int, default=None, help="default 4 (--tiny: 2)")
    parser.add_argument("--hidden", type=int, default=None, help="default 1024 (--tiny: 64)")
    parser.add_argument("--index-topk", type=int, default=None, help="DSA top-k (default 64; --tiny: 4)")
    parser.add_argument(
        "--index-topk-freq", type=int, default=None, help="DSA index sharing: 1 = none (default 2; glm52: 4)"
    )
    parser.add_argument(
        "--shape",
        choices=["small", "glm52", "glm45"],
        default="small",
        help="glm52: GLM-5.2's layer shapes (glm_moe_dsa); glm45: GLM-4.5's (glm4_moe)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="--perf-only: LoRA adapters of this rank (alpha 2 x rank)"
    )
    parser.add_argument(
        "--perf-only", action="store_true", help="time the bf16 step on random sequences only"
    )
    parser.add_argument("--seq-len", type=int, default=4096, help="--perf-only: tokens a sequence")
    parser.add_argument("--seqs", type=int, default=16, help="--perf-only: sequences a step")
    parser.add_argument(
        "--profile", action="store_true", help="--perf-only: one more step under the profiler"
    )
    parser.add_argument(
        "--modes",
        default="recompute/off,on_policy/off,on_policy/auto",
        help="--perf-only: comma list of OLD_LOGPROBS/TF32 (trainer.old_logprobs / "
        "trainer.megatron.tf32 auto, on or off), each timed for --steps steps on one trainer",
    )
    parser.add_argument(
        "--reference-json",
        help="a --json of an earlier run on the same model (normally one rank): its probe log-probs "
        "are compared with this run's (fp32 and training dtype)",
    )
    parser.add_argument(
        "--engine-export",
        default="",
        help="comma list of 'tensor', 'distributed': after training, push the trainer's weights into an "
        "`agentrl engine serve` process on this host through each, then compare its log-probs",
    )
    parser.add_argument(
        "--engine-device",
        default=None,
        help="the engine's device (default: cpu; GPU: cuda:1 when there are 2+)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check and print the model, split and layout, then stop"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    transports = [t for t in args.engine_export.split(",") if t]
    if set(transports) - {"tensor", "distributed"}:
        parser.error(f"--engine-export {args.engine_export}: give tensor, distributed or both")
    if args.vocab is None:
        args.vocab = 128 if args.tiny else (32768 if args.shape == "glm52" else 16384)
    if args.index_topk_freq is None:
        args.index_topk_freq = 4 if args.shape == "glm52" else 2
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available() and not args.dry_run:
        parser.error("--device cuda: no GPU here (use --device cpu --tiny to check the code path)")
    if not on_gpu:
        torch.set_num_threads(int(os.environ.get("TORCH_NUM_THREADS", "1")))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu and not args.dry_run:
        torch.cuda.set_device(device)
    lead = rank() == 0
    if args.engine_device is None:
        args.engine_device = (
            "cpu" if not on_gpu else ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
        )
    if on_gpu and "distributed" in transports and args.engine_device in ("cuda", "cuda:0"):
        parser.error(
            "--engine-export distributed on GPUs: NCCL refuses two members of the weight-update group "
            "on one GPU, and the trainer's rank 0 is on cuda:0: give --engine-device cuda:1 (2+ GPUs)"
        )

    import torch.distributed as dist

    from agentrl.algo import LossConfig
    from agentrl.train.megatron.settings import MegatronSettings

    parallel = dict(
        tp=args.tp,
        ep=args.ep,
        etp=args.etp,
        pp=args.pp,
        cp=args.cp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
    )
    cfg = model_config(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    split = check_split(cfg, args, parallel, lead)  # before any weight exists
    model_parallel = args.tp * args.pp * args.cp
    if world % model_parallel or (world // model_parallel * args.tp * args.cp) % (
        args.ep * (args.etp or args.tp)
    ):
        parser.error(
            f"{world} rank(s) do not fit TP {args.tp} x PP {args.pp} x CP {args.cp} with EP {args.ep} x "
            f"expert TP {args.etp or args.tp}: ranks = TP x PP x CP x DP, and EP x expert TP must divide TP x CP x DP"
        )
    reference = load_reference(args.reference_json, cfg, args) if args.reference_json else None
    if args.dry_run:
        if lead:
            print(f"dry run: {world} rank(s), DP {world // model_parallel}: the split and layout are valid")
        return
    if args.perf_only:
        if world > 1:
            parser.error("--perf-only runs on one device")
        result = perf_run(cfg, args, parallel, device)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        summary = {k: v for k, v in result.items() if k != "modes"}
        summary["median_steps"] = {m: r["median_step"] for m, r in result["modes"].items()}
        print(json.dumps(summary, default=str))
        return
    from agentrl.train.megatron.trainer import MegatronTrainer

    hf = hf_model(cfg)  # every rank: the trainer's initial weights (each keeps its shard)
    result: dict[str, Any] = {
        "args": vars(args),
        "model": model_summary(cfg),
        "split": split,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "world_size": world,
    }
    server = url = model_dir = None
    if transports and lead:  # the engine starts while the trainer builds
        model_dir = Path(tempfile.mkdtemp(prefix="megatron-bench-engine-"))
        write_engine_model(hf, model_dir)
        url = f"http://127.0.0.1:{free_port()}"
        server = start_engine(model_dir, int(url.rsplit(":", 1)[1]), args.engine_device)
    probe = random_samples(cfg, 8, args.probe_len, seed=5)  # longer than top-k: DSA selects
    if lead:
        hf = hf.to(device)

    t0 = time.perf_counter()
    fp32 = MegatronTrainer(
        cfg,
        TrainConfig(lr=args.lr, max_tokens_per_micro_batch=args.mb_tokens),
        MegatronSettings(params_dtype="float32", ddp="local", **parallel),
        hf_state=hf.state_dict(),
    )
    result["fp32_build_seconds"] = time.perf_counter() - t0
    probe_fp32: dict[int, list[float]] = {}
    result["fp32_parity"] = parity(fp32, hf if lead else None, probe, probe_fp32)
    if lead:
        print("fp32 parity", result["fp32_parity"], flush=True)
    del fp32
    if on_gpu:
        torch.cuda.empty_cache()

    train_config = TrainConfig(
        lr=args.lr,
        max_tokens_per_micro_batch=args.mb_tokens,
        loss=LossConfig(use_tis=True, tis_clip=2.0),
        grad_clip=1.0,
    )
    # GPU: bf16 weights, megatron's DDP and distributed optimizer, all-to-all MoE dispatch. CPU:
    # fp32 and the local reduction (megatron's DDP and optimizer need CUDA).
    settings = MegatronSettings(
        params_dtype="bfloat16" if on_gpu else "float32",
        ddp="megatron" if on_gpu else "local",
        distributed_optimizer=on_gpu,
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        **parallel,
    )
    result["settings"] = settings.to_dict()
    t0 = time.perf_counter()
    tr = MegatronTrainer(cfg, train_config, settings, hf_state=hf.state_dict())
    result["train_build_seconds"] = time.perf_counter() - t0
    result["optimizer"] = type(tr.optimizer).__name__
    from megatron.core import parallel_state as ps

    result["layout"] = {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "stage_layers": [[i + 1 for i in c.agentrl_stage_layers] for c in tr.chunks],
    }
    if world > 1:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, result["layout"]["stage_layers"])
        result["layout"]["stage_layers"] = everyone
    engine_dtype = torch.bfloat16 if on_gpu else torch.float32
    engine = None
    if lead:
        engine = hf.to(engine_dtype)
        hf32 = hf_model(cfg).to(device)  # the same weights, kept in fp32: the yardstick for bf16
    else:
        del hf
    probe_train: dict[int, list[float]] = {}
    result["train_parity"] = parity(tr, engine, probe, probe_train)
    result["probe_logprobs"] = {"fp32": probe_fp32, "train": probe_train}
    if reference is not None:  # the same seed-built weights in an earlier (1-rank) run
        result["vs_reference"] = {
            k: compare_rows(result["probe_logprobs"][k], reference["probe_logprobs"][k])
            for k in ("fp32", "train")
        }
        if lead:
            print("vs reference run", result["vs_reference"], flush=True)
    if lead:
        result["train_vs_hf_fp32"] = parity(tr, hf32, probe)
        if on_gpu:
            result["hf_bf16_vs_hf_fp32"] = hf_vs_hf(engine, hf32, probe, device)
        del hf32
    else:
        parity(tr, None, probe)  # the collectives of rank 0's second comparison
    if lead:
        for key in ("train_parity", "train_vs_hf_fp32", "hf_bf16_vs_hf_fp32"):
            print(key, result.get(key), flush=True)

    rows = []
    for step in range(args.steps):
        samples, rollout_s = rollouts(engine, cfg, args, step, device)
        synchronize(device)
        t0 = time.perf_counter()
        m = tr.train_step(samples)
        synchronize(device)
        train_s = time.perf_counter() - t0
        sync_s = sync(tr, engine, device, engine_dtype)
        tokens = sum(len(s.tokens) for s in samples)
        row = {
            "step": step + 1,
            "loss": m["loss"],
            "mismatch_kl": m.get("mismatch_kl", float("nan")),
            "reward_mean": m["reward_mean"],
            "grad_norm": m["grad_norm"],
            "skipped": m["skipped_steps"],
            "rollout_s": rollout_s,
            "train_s": train_s,
            "sync_s": sync_s,
            "tokens": tokens,  # the whole step's tokens, over every rank
            "train_tokens_per_s": tokens / train_s,
            "phases_s": {k[len("time_") : -len("_s")]: v for k, v in m.items() if k.startswith("time_")},
        }
        rows.append(row)
        if lead:
            print(json.dumps(row), flush=True)
    result["steps"] = rows
    timed = rows[1:] or rows
    if timed:
        result["train_s_median"] = sorted(r["train_s"] for r in timed)[len(timed) // 2]
        result["train_tokens_per_s_median"] = sorted(r["train_tokens_per_s"] for r in timed)[len(timed) // 2]
    result["parity_after_training"] = parity(tr, engine, probe)
    if lead:
        print("parity after training (engine = synced weights)", result["parity_after_training"])

    if transports:
        try:
            if lead:
                wait_engine(server, url)
            result["engine_export"] = engine_export(
                tr, url, model_dir, transports, probe, args, device, engine_dtype
            )
        finally:
            if server is not None:
                server.terminate()
                try:
                    server.wait(timeout=30)
                except Exception:
                    server.kill()
                shutil.rmtree(model_dir, ignore_errors=True)

    # torch_dist checkpoint: save, step, load, the same step again (one directory for every rank).
    box: list[Any] = [tempfile.mkdtemp(prefix="megatron-bench-") if lead else None]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    tmp = box[0]
    try:
        samples, _ = rollouts(engine, cfg, args, 999, device)
        tr.save(tmp)
        tr.train_step(samples)
        after_a = weights(tr)
        tr.load(tmp)
        tr.train_step(samples)
        after_b = weights(tr)
        result["checkpoint_resume_max_abs_diff"] = max(
            float((after_a[k] - after_b[k]).abs().max()) for k in after_a
        )
    except Exception as exc:  # recorded, not hidden: the run's other numbers still come back
        result["checkpoint_error"] = f"{type(exc).__name__}: {exc}"
        result["checkpoint_traceback"] = traceback.format_exc()[-2000:]
    if world > 1:
        dist.barrier()
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)
        print("checkpoint", result.get("checkpoint_resume_max_abs_diff", result.get("checkpoint_error")))
    losses = [r["loss"] for r in rows]
    result["all_finite"] = all(math.isfinite(x) for x in losses)
    result["peak_memory_per_rank"] = peak_memory_per_rank(device)
    result["peak_memory_gib_max_rank"] = max(r["peak_gib"] for r in result["peak_memory_per_rank"])
    result["peak_memory_kind"] = "cuda max_memory_allocated" if on_gpu else "CPU max resident set"
    if lead:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        print(
            json.dumps({k: v for k, v in result.items() if k not in ("steps", "probe_logprobs")}, default=str)
        )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
