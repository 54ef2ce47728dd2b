"""The Megatron trainer on one GPU: a small glm_moe_dsa model against transformers, then GRPO steps.

Run on a CUDA machine with megatron-core 0.19 importable (docs/megatron.md):

    PYTHONPATH=.:$SITE python benchmarks/megatron_gpu.py --steps 20 --json out.json

In one go, printed side by side:
1. log-probs of the Megatron model (fp32, then bf16) against `GlmMoeDsaForCausalLM` on the same
   weights, packed (THD) sequences longer than the DSA top-k, so the sparse path selects;
2. `--steps` GRPO steps with bf16 weights, megatron's DDP and distributed optimizer
   (`trainer.megatron.ddp=megatron`): each step's rollouts are sampled from the transformers model
   holding the trainer's exported weights (the rollout engine: the weight sync is real), so the
   rollout-vs-trainer mismatch KL is measured, not zero by construction; reward = the share of
   response tokens in the lower half of the vocabulary (learnable, so the loss moves);
3. a `torch_dist` checkpoint of the model and the distributed optimizer: save, step, load, the
   same step again: the weights after both must be equal.
Per step: loss, mismatch KL, reward, gradient norm, rollout and train seconds, train tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
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


def parity(tr: Any, hf: Any, samples: list[Sample]) -> dict[str, float]:
    """Packed Megatron log-probs vs the HF model, row by row, on the trainer's micro-batches."""
    batch = build_batch(samples, max_tokens_per_micro_batch=tr.config.max_tokens_per_micro_batch)
    for chunk in tr.chunks:
        chunk.eval()
    worst = total = 0.0
    count = 0
    with torch.no_grad():
        for mb in batch.micro_batches:
            mb = mb.to(tr.device)
            logp = tr.logprobs(mb)[0]
            for r in range(mb.num_rows):
                n = int(mb.attention_mask[r].sum())
                ids = mb.input_ids[r : r + 1, :n]
                ref = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
                d = (logp[r, 1:n].float() - ref).abs()
                worst = max(worst, float(d.max()))
                total += float(d.sum())
                count += n - 1
    return {"max_abs_diff": worst, "mean_abs_diff": total / max(count, 1), "tokens": count}


def hf_vs_hf(a: Any, b: Any, samples: list[Sample]) -> dict[str, float]:
    """The same comparison between two HF models (the bf16 noise yardstick: bf16 vs fp32)."""
    worst = total = 0.0
    count = 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens], device="cuda")
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


@torch.no_grad()
def rollouts(engine: Any, cfg: Any, args: argparse.Namespace, step: int) -> tuple[list[Sample], float]:
    """Sample `groups` x `group_size` responses from the engine model (bf16, plain sampling at
    temperature 1, no cache: the full forward per token keeps it simple and exact)."""
    t0 = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    prompts = torch.randint(0, cfg.vocab_size, (args.groups, args.prompt_len), generator=g, device="cuda")
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
    out = []
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
    torch.cuda.synchronize()
    return with_advantages(out), time.perf_counter() - t0


def sync(tr: Any, engine: Any) -> float:
    """The trainer's exported weights (HF names, bf16 buckets) into the engine model."""
    t0 = time.perf_counter()
    state = engine.state_dict()
    with torch.no_grad():
        for bucket in tr.export_weights(torch.bfloat16):
            for name, t in bucket:
                state[name].copy_(t)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def weights(tr: Any) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in tr.hf_weights()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=192)
    parser.add_argument("--mb-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--json")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"

    from agentrl.algo import LossConfig
    from agentrl.train.megatron.settings import MegatronSettings
    from agentrl.train.megatron.trainer import MegatronTrainer

    cfg = small_config(args)
    hf = hf_model(cfg).cuda()
    result: dict[str, Any] = {"args": vars(args), "device": torch.cuda.get_device_name()}
    probe = random_samples(cfg, 8, 320, seed=5)  # 320 tokens > top-k 64: DSA selects

    t0 = time.perf_counter()
    fp32 = MegatronTrainer(
        cfg,
        TrainConfig(lr=args.lr, max_tokens_per_micro_batch=args.mb_tokens),
        MegatronSettings(params_dtype="float32", ddp="local"),
        hf_state=hf.state_dict(),
    )
    result["fp32_build_seconds"] = time.perf_counter() - t0
    result["fp32_parity"] = parity(fp32, hf, probe)
    print("fp32 parity", result["fp32_parity"], flush=True)
    del fp32
    torch.cuda.empty_cache()

    train_config = TrainConfig(
        lr=args.lr,
        max_tokens_per_micro_batch=args.mb_tokens,
        loss=LossConfig(use_tis=True, tis_clip=2.0),
        grad_clip=1.0,
    )
    settings = MegatronSettings(
        params_dtype="bfloat16",
        ddp="megatron",
        distributed_optimizer=True,
        moe_token_dispatcher_type="alltoall",
    )
    t0 = time.perf_counter()
    tr = MegatronTrainer(cfg, train_config, settings, hf_state=hf.state_dict())
    result["bf16_build_seconds"] = time.perf_counter() - t0
    result["optimizer"] = type(tr.optimizer).__name__
    hf32 = hf_model(cfg).cuda()  # the same weights, kept in fp32: the yardstick for bf16
    engine = hf.to(torch.bfloat16)
    result["bf16_parity"] = parity(tr, engine, probe)
    result["bf16_vs_hf_fp32"] = parity(tr, hf32, probe)
    result["hf_bf16_vs_hf_fp32"] = hf_vs_hf(engine, hf32, probe)
    for key in ("bf16_parity", "bf16_vs_hf_fp32", "hf_bf16_vs_hf_fp32"):
        print(key, result[key], flush=True)
    del hf32

    rows = []
    for step in range(args.steps):
        samples, rollout_s = rollouts(engine, cfg, args, step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = tr.train_step(samples)
        torch.cuda.synchronize()
        train_s = time.perf_counter() - t0
        sync_s = sync(tr, engine)
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
            "tokens": tokens,
            "train_tokens_per_s": tokens / train_s,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["steps"] = rows
    timed = rows[1:] or rows
    result["train_s_median"] = sorted(r["train_s"] for r in timed)[len(timed) // 2]
    result["train_tokens_per_s_median"] = sorted(r["train_tokens_per_s"] for r in timed)[len(timed) // 2]
    result["bf16_parity_after_training"] = parity(tr, engine, probe)
    print("bf16 parity after training (engine = synced weights)", result["bf16_parity_after_training"])

    # torch_dist checkpoint with the distributed optimizer: save, step, load, the same step again.
    try:
        with tempfile.TemporaryDirectory() as tmp:
            samples, _ = rollouts(engine, cfg, args, 999)
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
    print("checkpoint", result.get("checkpoint_resume_max_abs_diff", result.get("checkpoint_error")))
    losses = [r["loss"] for r in rows]
    result["all_finite"] = all(math.isfinite(x) for x in losses)
    result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, default=str))


if __name__ == "__main__":
    main()
