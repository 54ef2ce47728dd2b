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
at the end the peak memory of the busiest rank (GPU: allocated; CPU: resident set).
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

from agentrl.sample import Sample  # noqa: E402
from agentrl.train.batch import build_batch, with_advantages  # noqa: E402
from agentrl.train.config import TrainConfig  # noqa: E402


def tiny_config(args: argparse.Namespace) -> Any:
    """`--tiny`: the CI test model's shape (4 layers: 1 dense + 3 MoE with 4 experts top-2 and a
    shared expert, MLA, DSA top-k 4 with index sharing: layers 1, 2, 4 compute, 3 reuses 2's)."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=4,
        index_head_dim=16,
        index_n_heads=8,
        index_topk_freq=2,
        index_skip_topk_offset=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def small_config(args: argparse.Namespace) -> Any:
    """8 layers (1 dense + 7 MoE), hidden 1024, 16 experts top-4 + a shared expert, MLA, DSA top-k
    64 with index sharing (layers 1, 2, 4, 6, 8 compute their indices; 3, 5, 7 reuse them)."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        vocab_size=args.vocab,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        first_k_dense_replace=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        kv_lora_rank=256,
        q_lora_rank=512,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        index_topk=64,
        index_head_dim=64,
        index_n_heads=16,
        index_topk_freq=2,
        index_skip_topk_offset=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def hf_model(cfg: Any, seed: int = 0) -> Any:
    """The HF model on the CPU, fp32; the same weights on every rank (same seed, CPU generator)."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
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


def parity(tr: Any, hf: Any | None, samples: list[Sample]) -> dict[str, float] | None:
    """Packed Megatron log-probs vs the HF model, row by row, on the trainer's micro-batches.
    Every rank runs the trainer's forward (collectives); rank 0 (`hf` given) compares."""
    batch = build_batch(samples, max_tokens_per_micro_batch=tr.config.max_tokens_per_micro_batch)
    for chunk in tr.chunks:
        chunk.eval()
    worst = total = 0.0
    count = 0
    with torch.no_grad():
        for mb in batch.micro_batches:
            mb = mb.to(tr.device)
            logp = tr.logprobs(mb)[0]
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


def max_over_ranks(x: float, device: torch.device) -> float:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    t = torch.tensor(x, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


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
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.vocab is None:
        args.vocab = 128 if args.tiny else 16384
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here (use --device cpu --tiny to check the code path)")
    if not on_gpu:
        torch.set_num_threads(int(os.environ.get("TORCH_NUM_THREADS", "1")))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    lead = rank() == 0

    import torch.distributed as dist

    from agentrl.algo import LossConfig
    from agentrl.train.megatron.settings import MegatronSettings
    from agentrl.train.megatron.trainer import MegatronTrainer

    parallel = dict(
        tp=args.tp,
        ep=args.ep,
        etp=args.etp,
        pp=args.pp,
        cp=args.cp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
    )
    cfg = tiny_config(args) if args.tiny else small_config(args)
    from agentrl.train.megatron.model import layout_of
    from agentrl.train.megatron.plan import check_pipeline_split

    check_pipeline_split(cfg, layout_of(cfg, MegatronSettings(**parallel)))  # before any weight exists
    hf = hf_model(cfg)  # every rank: the trainer's initial weights (each keeps its shard)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    result: dict[str, Any] = {
        "args": vars(args),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "world_size": world,
    }
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
    result["fp32_parity"] = parity(fp32, hf if lead else None, probe)
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
    result["train_parity"] = parity(tr, engine, probe)
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
    result["peak_memory_gib_rank0"] = peak_memory_gib(device)
    result["peak_memory_gib_max_rank"] = max_over_ranks(peak_memory_gib(device), device)
    result["peak_memory_kind"] = "cuda max_memory_allocated" if on_gpu else "CPU max resident set"
    if lead:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({k: v for k, v in result.items() if k != "steps"}, default=str))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
