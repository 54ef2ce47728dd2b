"""Cases run inside the Megatron environment (Python 3.12, megatron-core 0.19), one per process
(or per torchrun job): `python cases.py CASE --out RESULT.json --tmp DIR [options]`.

Each case measures and writes numbers; the assertions live in `tests/test_megatron.py`. The model is
a tiny `glm_moe_dsa`: 4 layers (1 dense + 3 MoE with 4 experts top-2 and a shared expert), MLA,
DSA with index top-k 4 and index sharing (layers 1, 2, 4 compute, layer 3 reuses layer 2's).
Its indexer has 8 heads: with a random init and only 2 heads, all heads' ReLU scores are often
exactly 0 for several keys, and top-k ties then break differently in HF and megatron.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.episode.sample import Sample
from agentrl.train.batch import build_batch, with_advantages
from agentrl.train.config import TrainConfig


def tiny_config(**changes: Any) -> Any:
    from transformers import GlmMoeDsaConfig

    kw: dict[str, Any] = dict(
        vocab_size=128,
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
    kw.update(changes)
    return GlmMoeDsaConfig(**kw)


def tiny_glm4_config(**changes: Any) -> Any:
    """A tiny `glm4_moe` (GLM-4.5's architecture): 4 layers (1 dense + 3 MoE, 4 experts top-2, a
    shared expert), 4 query heads in 2 groups of head size 16, QKV bias, QK norm, half-rotary RoPE."""
    from transformers import Glm4MoeConfig

    kw: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        attention_bias=True,
        use_qk_norm=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    kw.update(changes)
    return Glm4MoeConfig(**kw)


def tiny_hf(seed: int = 0, model: str = "dsa", **changes: Any) -> Any:
    """The HF model (`model`: "dsa", a glm_moe_dsa; "glm4", a glm4_moe) with every weight
    non-trivial: norms off 1, router, expert bias and QKV biases random."""
    from transformers import Glm4MoeForCausalLM, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    if model == "glm4":
        hf = Glm4MoeForCausalLM(tiny_glm4_config(**changes)).float().eval()
    else:
        hf = GlmMoeDsaForCausalLM(tiny_config(**changes)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return hf


def samples(seed: int = 1, vocab: int = 128, routes: tuple[int, int, int] | None = None) -> list[Sample]:
    """Two GRPO groups of two single-segment episodes, of different lengths, advantages set.
    `routes` (layers, experts, top-k): each token also carries seeded random experts per layer
    (R3's `routed_experts`, as an engine that routes nothing like the trainer would)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate([(5, 7), (3, 9), (6, 4), (8, 8)]):
        toks = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        lps = (-torch.rand(r, generator=g) * 4).tolist()
        chosen = None
        if routes is not None:
            layers, experts, k = routes
            chosen = [[torch.randperm(experts, generator=g)[:k].tolist() for _ in range(layers)]
                      for _ in range(p + r - 1)]  # fmt: skip
        out.append(
            Sample(
                prompt_id="a" if i < 2 else "b",
                tokens=toks,
                prompt_length=p,
                loss_mask=[1] * r,
                rollout_logprobs=lps,
                reward=float(i % 2),
                sample_index=i,
                routed_experts=chosen,
            )
        )
    return with_advantages(out)


def trainer(
    hf: Any,
    *,
    tp: int = 1,
    lr: float = 1e-3,
    mb_tokens: int = 64,
    logprob_impl: str = "auto",
    loss: dict[str, Any] | None = None,
    old_logprobs: str = "auto",
    lora: dict[str, Any] | None = None,
    grad_clip: float = 1.0,
    **settings: Any,
) -> Any:
    from agentrl.train.megatron.settings import MegatronSettings
    from agentrl.train.megatron.trainer import MegatronTrainer

    config = TrainConfig(
        lr=lr,
        max_tokens_per_micro_batch=mb_tokens,
        weight_decay=0.0,
        logprob_impl=logprob_impl,
        loss=loss or {},
        old_logprobs=old_logprobs,
        lora=lora or {},
        grad_clip=grad_clip,
    )
    return MegatronTrainer(
        hf.config,
        config,
        MegatronSettings(tp=tp, **settings),
        hf_state=hf.state_dict(),
    )


def hf_grads(tr: Any) -> dict[str, torch.Tensor]:
    """The trainer's current gradients in HF names and shapes (gathered like the weights)."""
    params = [p for chunk in tr.chunks for p in chunk.parameters() if p.grad is not None]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return {k: v.clone() for k, v in tr.hf_weights()}
    finally:
        for p, d in zip(params, saved, strict=True):
            p.data = d


def _tensors(model: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _adapters(tr: Any) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for bucket in tr.export_adapter() for k, v in bucket]


def adapter_grads(tr: Any) -> dict[str, torch.Tensor]:
    """The LoRA adapters' current gradients under PEFT's names (gathered like the adapters)."""
    params = [p for p in tr.lora.parameters() if p.grad is not None]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return {k: v.clone() for k, v in _adapters(tr)}
    finally:
        for p, d in zip(params, saved, strict=True):
            p.data = d


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# --- cases ------------------------------------------------------------------------------------


def case_build(args: argparse.Namespace) -> dict[str, Any]:
    """Builds, forward and backward; which layers own indexer weights; every weight trains when the
    indexer loss is on."""
    hf = tiny_hf()
    t0 = time.perf_counter()
    tr = trainer(hf, dsa_indexer_loss_coeff=0.01)
    build_s = time.perf_counter() - t0
    batch = build_batch(samples(), max_tokens_per_micro_batch=64)
    tr.model.train()
    mb = batch.micro_batches[0]
    seen: dict[str, Any] = {}

    def nll(i: int, logp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
        seen["loss"], seen["ent"] = -(logp * mb.loss_mask).sum() / mb.loss_mask.sum(), ent
        return seen["loss"]

    # The training path: megatron's schedule runs the forward and the backward.
    tr._schedule([mb], nll, chunks=tr.chunks, forward_only=False, with_entropy=True)
    loss, ent = seen["loss"], seen["ent"]
    names = [n for n, _ in tr.model.named_parameters()]
    no_grad = [
        n for n, p in tr.model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
    ]
    indexer_layers = sorted({int(n.split(".")[2]) + 1 for n in names if ".indexer." in n})
    step = tr.train_step(samples())
    return {
        "build_seconds": build_s,
        "loss": float(loss),
        "entropy_mean": float(ent[batch.micro_batches[0].loss_mask > 0].mean()),
        "megatron_params": sum(p.numel() for p in tr.model.parameters()),
        "hf_params": sum(p.numel() for p in hf.parameters()),
        "params_without_grad": no_grad,
        "indexer_layers": indexer_layers,
        "hf_indexer_types": list(hf.config.indexer_types),
        "train_step": {k: step[k] for k in ("loss", "grad_norm", "skipped", "step")},
    }


def case_hf_parity(args: argparse.Namespace) -> dict[str, Any]:
    """Packed (THD) log-probs and entropy against GlmMoeDsaForCausalLM row by row (fp32), and the
    HF -> megatron -> HF round trip."""
    return hf_parity(tiny_hf(), Path(args.tmp) / "dsa")


def case_lora(args: argparse.Namespace) -> dict[str, Any]:
    """LoRA on both model types against brute force: the adapters' gradients against the full
    model's gradient at the merged weights W' = W + s B A (dL/dB = s G A^T, dL/dA = s sum B^T G over
    a fused group), the merged export against W + s B A from the exported adapters, the adapters
    as an engine loads them (`agentrl.engine.lora`) into the HF model giving the trainer's
    log-probs, only adapters in the optimizer, and a checkpoint of adapters alone that resumes."""
    return {m: lora_against_brute_force(m, Path(args.tmp) / f"lora-{m}") for m in ("dsa", "glm4")}


def lora_against_brute_force(model: str, tmp: Path) -> dict[str, Any]:
    from agentrl.engine.lora import adapter_updates

    hf = tiny_hf(model=model)
    rank, alpha = 4, 8.0
    scale = alpha / rank
    tr = trainer(hf, lora={"rank": rank, "alpha": alpha}, grad_clip=0.0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in tr.lora.parameters():
            if not p.any():  # B: non-zero, so that A has a gradient
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    base = {k: v.clone() for k, v in hf.state_dict().items()}
    frozen = {k: v.clone() for k, v in _tensors(tr.model).items()}
    adapters = {k: v.clone() for k, v in _adapters(tr)}  # the export is of the live adapters
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in adapters})
    delta = {m: scale * adapters[f"base_model.model.{m}.lora_B.weight"] @ adapters[f"base_model.model.{m}.lora_A.weight"]
             for m in modules}  # fmt: skip
    merged = {k: (v + delta[k.removesuffix(".weight")] if k.removesuffix(".weight") in delta else v)
              for k, v in base.items()}  # fmt: skip
    exported = dict(tr.hf_weights())
    merged_export_diff = max_diff(exported, merged)
    # What an engine does with the adapter: agentrl's SGLang-compatible loader, into the HF model.
    config = tr.adapter_config()
    updates = adapter_updates(hf, config, adapters)
    engine_hf = tiny_hf(model=model)
    with torch.no_grad():
        for name, upd in updates.items():
            engine_hf.get_submodule(name).weight.add_(upd)
    batch = build_batch(samples(), max_tokens_per_micro_batch=64)
    tr.model.eval()
    lp_diff = 0.0
    with torch.no_grad():
        for mb in batch.micro_batches:
            logp, _ = tr.logprobs(mb)
            for r in range(mb.num_rows):
                n = int(mb.attention_mask[r].sum())
                ids = mb.input_ids[r : r + 1, :n]
                ref = torch.log_softmax(engine_hf(ids).logits[0, :-1].float(), -1).gather(
                    1, ids[0, 1:, None]
                )[:, 0]
                lp_diff = max(lp_diff, float((logp[r, 1:n] - ref).abs().max()))
    # One step; the adapters' gradients against the full model's at the merged weights.
    tr.train_step(samples())
    got = adapter_grads(tr)
    full_hf = tiny_hf(model=model)
    full_hf.load_state_dict(merged)
    full = trainer(full_hf, grad_clip=0.0)
    full.train_step(samples())
    G = hf_grads(full)
    want: dict[str, torch.Tensor] = {}
    for m in modules:
        A = adapters[f"base_model.model.{m}.lora_A.weight"]
        want[f"base_model.model.{m}.lora_B.weight"] = scale * G[f"{m}.weight"] @ A.t()

    def fused(m: str) -> tuple[str, str]:  # megatron's fused projections share one A
        parent, leaf = m.rsplit(".", 1)
        return parent, {
            "q_proj": "qkv",
            "k_proj": "qkv",
            "v_proj": "qkv",
            "gate_proj": "fc1",
            "up_proj": "fc1",
        }.get(leaf, leaf)

    for m in modules:
        group = [n for n in modules if fused(n) == fused(m)]
        want[f"base_model.model.{m}.lora_A.weight"] = sum(
            scale * adapters[f"base_model.model.{n}.lora_B.weight"].t() @ G[f"{n}.weight"] for n in group
        )
    trainable = sum(p.numel() for group in tr.optimizer.param_groups for p in group["params"])
    # A checkpoint holds the adapters alone and resumes to the same next step.
    saved = tr.save(tmp / "ckpt")
    files = sorted(p.name for p in (saved / "model").iterdir())
    nxt = tr.train_step(samples())
    again = trainer(tiny_hf(model=model), lora={"rank": rank, "alpha": alpha}, grad_clip=0.0)
    again.load(saved)
    resumed = again.train_step(samples())
    # A LoRA checkpoint into a trainer without LoRA, and a full one into a LoRA trainer: refused.
    mismatch = {}
    full_saved = full.save(tmp / "ckpt-full")
    for name, (tr_kw, path) in {
        "lora_into_full": ({}, saved),
        "full_into_lora": ({"lora": {"rank": rank, "alpha": alpha}}, full_saved),
    }.items():
        try:
            trainer(tiny_hf(model=model), grad_clip=0.0, **tr_kw).load(path)
            mismatch[name] = None
        except Exception as exc:  # CheckpointError
            mismatch[name] = f"{type(exc).__name__}: {exc}"
    refusals = {}
    for name, kw in {
        "partial_fused_group": {
            "lora": {"rank": 4, "targets": ["q_proj", "o_proj", "q_a_proj", "kv_b_proj"]}
        },
        "no_target": {"lora": {"rank": 4, "targets": ["nothing_proj"]}},
        "megatron_ddp": {"lora": {"rank": 4}, "ddp": "megatron"},
    }.items():
        try:
            trainer(tiny_hf(model=model), **kw)
            refusals[name] = None
        except Exception as exc:  # LoraError / ConfigError
            refusals[name] = f"{type(exc).__name__}: {exc}"
    return {
        "refusals": refusals,
        "adapted_modules": modules,
        "targets": config["target_modules"],
        "merged_export_max_abs_diff": merged_export_diff,
        "engine_logprob_max_abs_diff": lp_diff,
        "grad_max_abs_diff": max_diff(got, want),
        "grad_max_abs": max(float(v.abs().max()) for v in want.values()),
        "trainable_params": trainable,
        "adapter_params": sum(p.numel() for p in tr.lora.parameters()),
        "model_params": sum(p.numel() for p in tr.model.parameters()),
        "frozen_weights_unchanged": all(torch.equal(v, frozen[k]) for k, v in _tensors(tr.model).items()),
        "checkpoint_files": files,
        "resume_loss_abs_diff": abs(nxt["loss"] - resumed["loss"]),
        "resume_grad_norm_abs_diff": abs(nxt["grad_norm"] - resumed["grad_norm"]),
        "checkpoint_mismatch": mismatch,
    }


def case_glm4_parity(args: argparse.Namespace) -> dict[str, Any]:
    """The same against Glm4MoeForCausalLM (grouped-query attention, QKV bias, QK norm, half RoPE),
    and without QK norm (GLM-4.5's own setting), with a refusal of the DSA-only indexer loss."""
    out = hf_parity(tiny_hf(model="glm4"), Path(args.tmp) / "glm4")
    plain = hf_parity(tiny_hf(model="glm4", use_qk_norm=False), Path(args.tmp) / "glm4-plain")
    out["no_qk_norm_logprob_max_abs_diff"] = plain["logprob_max_abs_diff"]
    out["no_qk_norm_round_trip_exact"] = plain["round_trip_exact"]
    out["no_qk_norm_tensors"] = plain["hf_tensors"]
    try:
        trainer(tiny_hf(model="glm4"), dsa_indexer_loss_coeff=0.1)
        out["indexer_loss_refusal"] = None
    except Exception as exc:  # ModelConfigError
        out["indexer_loss_refusal"] = f"{type(exc).__name__}: {exc}"
    return out


def hf_parity(hf: Any, tmp: Path) -> dict[str, Any]:
    tr = trainer(hf)
    tr.model.eval()
    batch = build_batch(samples(), max_tokens_per_micro_batch=64)
    lp_diff = ent_diff = 0.0
    rows = 0
    with torch.no_grad():
        for mb in batch.micro_batches:
            logp, ent = tr.logprobs(mb, with_entropy=True)
            for r in range(mb.num_rows):
                n = int(mb.attention_mask[r].sum())
                ids = mb.input_ids[r : r + 1, :n]
                ref = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
                ref_lp = ref.gather(1, ids[0, 1:, None])[:, 0]
                ref_ent = -(ref.exp() * ref).sum(-1)
                lp_diff = max(lp_diff, float((logp[r, 1:n] - ref_lp).abs().max()))
                ent_diff = max(ent_diff, float((ent[r, 1:n] - ref_ent).abs().max()))
                rows += 1
    hf_state = hf.state_dict()
    back = dict(tr.hf_weights())
    exact = set(back) == set(hf_state) and all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    # The checkpoint layout is what transformers' save_pretrained writes (and SGLang loads).
    from safetensors.torch import load_file

    hf.save_pretrained(tmp / "saved")
    saved = load_file(str(tmp / "saved" / "model.safetensors"))
    tr.settings.export_layout = "checkpoint"
    ckpt = {k: t for b in tr.export_weights() for k, t in b}
    tr.settings.export_layout = "transformers"
    checkpoint_exact = set(ckpt) == set(saved) and all(torch.equal(ckpt[k], saved[k]) for k in saved)
    limit = 64 * 1024
    buckets = list(tr.export_weights(torch.bfloat16, bucket_bytes=limit))
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    flat = {k: t for b in buckets for k, t in b}
    return {
        "rows": rows,
        "packed_rows_per_micro_batch": [mb.num_rows for mb in batch.micro_batches],
        "logprob_max_abs_diff": lp_diff,
        "entropy_max_abs_diff": ent_diff,
        "round_trip_exact": exact,
        "checkpoint_layout_equals_save_pretrained": checkpoint_exact,
        "checkpoint_tensors": len(saved),
        "buckets": len(buckets),
        "buckets_within_limit": all(n <= limit or len(b) == 1 for n, b in zip(sizes, buckets, strict=True)),
        "bucket_names_and_shapes_are_hf": {k: tuple(t.shape) for k, t in flat.items()}
        == {k: tuple(t.shape) for k, t in hf_state.items()},
        "bucket_dtypes": sorted({str(t.dtype) for t in flat.values()}),
        "hf_tensors": len(hf_state),
        "exported_tensors": len(back),
        "missing": sorted(set(hf_state) - set(back)),
        "extra": sorted(set(back) - set(hf_state)),
    }


# Two-rank layouts (name -> trainer settings, plus "layers"): each takes the same GRPO step as one
# rank. The 4-layer model: layers 1, 2, 4 compute their DSA indices; the 8-layer one: odd layers.
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp": 2},  # experts TP-sharded too (expert TP = TP)
    "tp2-ep2": {"tp": 2, "ep": 2, "etp": 1},  # experts spread over the two ranks instead
    "dp2": {},  # DP=2: one micro-batch per rank, gradients summed
    "dp2-ep2": {"ep": 2},  # DP=2 with experts spread over the data-parallel ranks
    "pp2": {"pp": 2, "first_stage_layers": 3, "last_stage_layers": 1},  # 1F1B, layers 1-3 | 4
    "vpp2": {"layers": 8, "pp": 2, "vpp": 2},  # interleaved: 1-2, 5-6 | 3-4, 7-8
    "cp2": {"cp": 2},  # every sequence split over two ranks (zigzag THD, all-gather CP in DSA)
    "cp2-ep2": {"cp": 2, "ep": 2},  # CP with experts spread over the CP ranks
    # CP with the DSA indexer's KL loss on: sequences padded for CP, padding rows marked for it
    "cp2-indexer-loss": {"cp": 2, "dsa_indexer_loss_coeff": 0.05, "reference": "4-indexer-loss"},
    # GSPO: each sequence's ratio is the mean over its tokens, half of which are on the other rank
    "cp2-gspo": {"cp": 2, "loss": {"objective": "gspo"}, "reference": "4-gspo"},
    # R3: each rank's routers replay the engine's routes of the tokens they see (random routes)
    "tp2-r3": {"tp": 2, "routing_replay": True, "reference": "4-r3"},  # this TP rank's SP slice
    "cp2-r3": {"cp": 2, "routing_replay": True, "reference": "4-r3"},  # this CP rank's zigzag share
    # 1F1B: each stage's routers take the routes of the micro-batch they run
    "pp2-r3": {
        "pp": 2,
        "first_stage_layers": 3,
        "last_stage_layers": 1,
        "routing_replay": True,
        "reference": "4-r3",
    },
    # glm4_moe (grouped-query attention): query groups split over TP with SP; every sequence over
    # two CP ranks (keys and values gathered); two pipeline stages
    "glm4-tp2": {"model": "glm4", "tp": 2, "reference": "glm4"},
    "glm4-cp2": {"model": "glm4", "cp": 2, "reference": "glm4"},
    "glm4-pp2": {"model": "glm4", "pp": 2, "reference": "glm4"},
    # LoRA: adapters cut like their linears (A whole and B by rows on column-parallel ones, A by
    # columns and B whole on row-parallel ones), the low-rank products gathered / reduce-scattered
    "lora-tp2": {"tp": 2, "lora": {"rank": 4, "alpha": 8.0}, "reference": "4-lora"},
    "lora-cp2": {"cp": 2, "lora": {"rank": 4, "alpha": 8.0}, "reference": "4-lora"},
    "lora-pp2": {
        "pp": 2,
        "first_stage_layers": 3,
        "last_stage_layers": 1,
        "lora": {"rank": 4, "alpha": 8.0},
        "reference": "4-lora",
    },
    # two model chunks per rank (interleaved): each chunk's adapters, folded and exported per chunk
    "lora-vpp2": {"layers": 8, "pp": 2, "vpp": 2, "lora": {"rank": 4, "alpha": 8.0}, "reference": "8-lora"},
    "glm4-lora-tp2": {"model": "glm4", "tp": 2, "lora": {"rank": 4, "alpha": 8.0}, "reference": "glm4-lora"},
    # torch_dist save at TP=2 and a resume in a fresh trainer (not a step against one rank)
    "tp2-checkpoint": {"tp": 2, "checkpoint": True},
    # Four ranks (by hand, not in CI: four processes on a two-core machine):
    "cp2-tp2": {"cp": 2, "tp": 2},  # CP with TP and sequence parallelism
    "cp2-pp2": {"cp": 2, "pp": 2, "first_stage_layers": 3, "last_stage_layers": 1},
    "cp2-dp2": {"cp": 2},  # CP inside each of two data-parallel replicas
}


def grads_step(
    *,
    layers: int = 4,
    model: str = "dsa",
    save: str | None = None,
    reference: str | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """One GRPO step: old log-probs, loss, gradient norm, the gradients and the updated weights in
    HF layout. With `save`, stores them (the one-rank reference); with `reference`, reports the
    largest differences from it."""
    hf = tiny_hf(model=model, **(_shape(layers) if model == "dsa" else {}))
    # A budget of 32 tokens makes two micro-batches: one per data-parallel rank at DP=2.
    tr = trainer(hf, mb_tokens=32, **settings)
    c = hf.config
    routes = (
        (c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok)
        if settings.get("routing_replay")
        else None
    )
    batch = build_batch(samples(routes=routes), max_tokens_per_micro_batch=32)
    if tr.lora is not None:  # B is 0 at first: the second step is the one that moves A too
        tr.train_step(samples(routes=routes))
    tr.model.eval()
    with torch.no_grad():
        logp = torch.cat([tr.logprobs(mb)[0].flatten() for mb in batch.micro_batches])
    metrics = tr.train_step(samples(routes=routes))
    result = {
        "logp": logp,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "grads": adapter_grads(tr) if tr.lora is not None else hf_grads(tr),
        "weights": {k: v.clone() for k, v in tr.hf_weights()},
    }
    if tr.lora is not None:
        result["weights"].update({k: v.clone() for k, v in _adapters(tr)})
    # The checkpoint layout's export (experts streamed one local slot at a time over EP / expert
    # TP, never a layer's stack) equals the stacked export split per expert.
    from agentrl.train.megatron import convert

    streamed = dict(tr.hf_weights("checkpoint"))
    hf_only = ((k, v) for k, v in result["weights"].items() if not k.startswith("base_model."))
    split = dict(convert.checkpoint_layout(hf_only))
    exact_here = set(streamed) == set(split) and all(torch.equal(streamed[k], split[k]) for k in split)
    checkpoint_layout_exact = _max_over_ranks(float(not exact_here)) == 0.0
    from megatron.core import parallel_state as ps

    out: dict[str, Any] = {
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "micro_batches": len(batch.micro_batches),
        "tp": tr.tp_size,
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "chunks": len(tr.chunks),
        "stage_layers": [[i + 1 for i in c.agentrl_stage_layers] for c in tr.chunks],
        # Global numbers of the layers whose indexer weights this rank's chunks own.
        "indexer_layers": [
            sorted(  # (none in glm4_moe)
                {
                    c.agentrl_stage_layers[int(n.split(".")[2])] + 1
                    for n, _ in c.named_parameters()
                    if ".indexer." in n
                }
            )
            for c in tr.chunks
        ],
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "seq_ratio_mean": metrics.get("seq_ratio_mean"),
        "checkpoint_layout_exact": checkpoint_layout_exact,
        "checkpoint_layout_tensors": len(streamed),
    }
    if tr.cp_size > 1:  # what each CP rank ran: its share of the first micro-batch's packed row
        rows = packed_rows_of(tr, batch.micro_batches[0])
        out["cp_local_tokens"] = int(rows.model_inputs()[0].shape[1])
        out["cp_global_tokens"] = rows.total
    if dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        mine = {k: out[k] for k in ("stage_layers", "indexer_layers", "cp_local_tokens") if k in out}
        dist.all_gather_object(everyone, mine)
        out["ranks"] = everyone
    if save and dist.get_rank() == 0:
        torch.save(result, save)
    if reference:
        ref = torch.load(reference, weights_only=True)
        out.update(
            logprob_max_abs_diff=float((result["logp"] - ref["logp"]).abs().max()),
            loss_abs_diff=abs(result["loss"] - ref["loss"]),
            grad_norm_abs_diff=abs(result["grad_norm"] - ref["grad_norm"]),
            grad_max_abs_diff=max_diff(result["grads"], ref["grads"]),
            grad_max_abs=max(float(g.abs().max()) for g in ref["grads"].values()),
            weight_max_abs_diff=max_diff(result["weights"], ref["weights"]),
            weight_max_abs_diff_at=max(
                ref["weights"], key=lambda k: float((result["weights"][k] - ref["weights"][k]).abs().max())
            ),
            # Adam's first step is g / (|g| + eps): where the reference gradient is near eps (1e-8)
            # a last-bit difference of the gradient moves the weight by a sizeable share of the lr,
            # so those elements say nothing of the layout. The weights elsewhere, and how many:
            **_conditioned_weight_diff(result, ref),
        )
    return out


def _conditioned_weight_diff(result: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    worst, ill = 0.0, 0
    for k, w in ref["weights"].items():
        diff = (result["weights"][k].float() - w.float()).abs()
        g = ref["grads"].get(k)
        if g is not None:
            tiny = g.abs() < 1e-6
            ill += int(tiny.sum())
            diff = diff.masked_fill(tiny, 0.0)
        worst = max(worst, float(diff.max()))
    return {"weight_max_abs_diff_conditioned": worst, "weight_elements_at_adam_eps": ill}


def packed_rows_of(tr: Any, mb: Any) -> Any:
    from agentrl.train.megatron.trainer import PackedRows

    return PackedRows(mb, multiple=tr.tp_size, cp=tr.cp_size, cp_rank=tr.cp_rank)


def case_grads(args: argparse.Namespace) -> dict[str, Any]:
    """One layout's GRPO step (by hand, or on the GPU machine): --tp/--ep/--pp/... as settings."""
    settings = dict(tp=args.tp, ep=args.ep, etp=args.etp, pp=args.pp, vpp=args.vpp, cp=args.cp)
    settings.update(first_stage_layers=args.first, last_stage_layers=args.last)
    settings.update(dsa_indexer_loss_coeff=args.indexer_loss)
    return grads_step(
        layers=args.layers, model=args.model, save=args.save, reference=args.reference, **settings
    )


def case_references(args: argparse.Namespace) -> dict[str, Any]:
    """The one-rank steps the layouts are compared with: the 4- and the 8-layer model."""
    out = {}
    for name, settings in REFERENCES.items():
        path = str(Path(args.tmp) / f"reference-{name}.pt")
        out[name] = {"path": path, **grads_step(save=path, **settings)}
    return out


def case_head_loss(args: argparse.Namespace) -> dict[str, Any]:
    """The one-rank step with the loss made from log-probs (logprob_impl="chunked":
    `vocab_parallel_logprobs`, then `grpo_loss` through autograd) against the default, where the
    LM head makes the loss itself (`vocab_parallel_token_loss`); needs `references` first."""
    from unittest import mock

    from agentrl.train.megatron import trainer as megatron_trainer

    calls = {}
    real = megatron_trainer.vocab_parallel_token_loss
    reference = str(Path(args.tmp) / "reference-4.pt")
    for impl in ("auto", "chunked"):
        with mock.patch.object(megatron_trainer, "vocab_parallel_token_loss", wraps=real) as spy:
            out = grads_step(layers=4, logprob_impl=impl, reference=reference)
        calls[impl] = spy.call_count
    return {**out, "head_loss_calls": calls}


def case_on_policy(args: argparse.Namespace) -> dict[str, Any]:
    """The one-rank step with the old log-probs recomputed against the update's own (on-policy),
    with the loss made in the head and from log-probs, TIS weights clipped and a KL term: the same
    step, one forward-only schedule less."""
    from unittest import mock

    from agentrl.train.megatron import trainer as megatron_trainer

    out: dict[str, Any] = {}
    loss = {"tis_clip": 1.5, "tis_clip_low": 0.5, "kl_coef": 0.05}
    for impl in ("auto", "chunked"):
        path = str(Path(args.tmp) / f"on-policy-{impl}.pt")
        schedules = {}
        for mode, kw in (("recompute", {"save": path}), ("on_policy", {"reference": path})):
            real = megatron_trainer.MegatronTrainer._schedule
            with mock.patch.object(
                megatron_trainer.MegatronTrainer, "_schedule", autospec=True, side_effect=real
            ) as spy:
                r = grads_step(layers=4, logprob_impl=impl, old_logprobs=mode, loss=loss, **kw)
            schedules[mode] = [c.kwargs["forward_only"] for c in spy.call_args_list]
        out[impl] = {**r, "schedules": schedules}
    return out


# The one-rank steps (name -> settings) the layouts are compared with (a layout's "reference";
# default: its number of layers).
REFERENCES: dict[str, dict[str, Any]] = {
    "4": {"layers": 4},
    "8": {"layers": 8},
    "4-indexer-loss": {"layers": 4, "dsa_indexer_loss_coeff": 0.05},
    "4-gspo": {"layers": 4, "loss": {"objective": "gspo"}},
    "4-r3": {"layers": 4, "routing_replay": True},
    "glm4": {"model": "glm4"},
    "4-lora": {"layers": 4, "lora": {"rank": 4, "alpha": 8.0}},
    "8-lora": {"layers": 8, "lora": {"rank": 4, "alpha": 8.0}},
    "glm4-lora": {"model": "glm4", "lora": {"rank": 4, "alpha": 8.0}},
}


def case_layouts(args: argparse.Namespace) -> dict[str, Any]:
    """Several two-rank layouts (--layouts a,b,...) one after another in one torchrun world (one
    start-up; each builds its own trainer and model-parallel groups), each against the one-rank
    reference of its model (--reference-dir: `case_references`' files)."""
    out = {}
    for name in args.layouts.split(","):
        settings = dict(LAYOUTS[name])
        t0 = time.perf_counter()
        if settings.pop("checkpoint", False):
            out[name] = {
                **checkpoint_step(Path(args.tmp) / f"ckpt-{name}", **settings),
                "seconds": time.perf_counter() - t0,
            }
            continue
        layers = settings.pop("layers", 4)
        reference = settings.pop("reference", str(layers))
        ref = str(Path(args.reference_dir) / f"reference-{reference}.pt")
        out[name] = {
            **grads_step(layers=layers, reference=ref, **settings),
            "seconds": time.perf_counter() - t0,
        }
    return out


def _shape(layers: int) -> dict[str, Any]:
    """8 layers: odd layers compute their DSA indices and even ones reuse them (HF offset 1,
    frequency 2), so two-layer virtual stages all start on a computing layer."""
    if layers == 4:
        return {}
    return {"num_hidden_layers": layers, "index_skip_topk_offset": 1}


def case_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    """torch_dist save after one step, load into a fresh trainer, both take the same next step."""
    return checkpoint_step(Path(args.tmp) / "ckpt")


def local_weights_of(tr: Any) -> list[torch.Tensor]:
    """This rank's weights and floating buffers (detached views of them, not copies)."""
    from agentrl.train.megatron import convert

    return [
        v
        for chunk in tr.chunks
        for k, v in chunk.state_dict().items()
        if torch.is_tensor(v) and v.is_floating_point() and not convert._SKIP.search(k)
    ]


def local_weights(tr: Any) -> dict[str, torch.Tensor]:
    """This rank's own shards (every chunk's weights), as megatron holds them."""
    from agentrl.train.megatron import convert

    return {
        f"{i}.{k}": v.detach().clone()
        for i, chunk in enumerate(tr.chunks)
        for k, v in chunk.state_dict().items()
        if torch.is_tensor(v) and v.is_floating_point() and not convert._SKIP.search(k)
    }


def _max_over_ranks(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def checkpoint_step(root: Path, **settings: Any) -> dict[str, Any]:
    """One step, `save`, a fresh trainer with other initial weights `load`s it, both take the same
    next step. Compared in HF layout (gathered) and on every rank's own shards (so a TP rank's
    replicated weight, e.g. the DSA indexer's, that the load missed shows too)."""
    hf = tiny_hf()
    a = trainer(hf, **settings)
    a.train_step(samples(1))
    path = a.save(root, buffer_state={"step": 1, "rollout": {"cursor": 3}})
    saved = {k: v.clone() for k, v in a.hf_weights()}
    saved_local = local_weights(a)
    b = trainer(tiny_hf(seed=7), **settings)  # other initial weights: the load must replace all of them
    before_local = local_weights(b)
    state = b.load(root)
    loaded = {k: v.clone() for k, v in b.hf_weights()}
    loaded_local = local_weights(b)
    ma = a.train_step(samples(2))
    mb = b.train_step(samples(2))
    after_a = dict(a.hf_weights())
    after_b = dict(b.hf_weights())
    return {
        "path": str(path),
        "files": sorted(p.name for p in Path(path).iterdir()),
        "latest": (root / "latest").read_text(),
        "state_step": state.step,
        "buffer_state": state.buffer_state,
        "tp": a.tp_size,
        "loaded_max_abs_diff": max_diff(saved, loaded),
        "local_loaded_max_abs_diff": _max_over_ranks(max_diff(saved_local, loaded_local)),
        # What the load had to change on each rank (for scale: the fresh trainer's own init).
        "local_init_min_max_abs_diff": -_max_over_ranks(
            -min(float((saved_local[k] - before_local[k]).abs().max()) for k in saved_local)
        ),
        "next_step_loss": [ma["loss"], mb["loss"]],
        "after_next_step_max_abs_diff": _max_over_ranks(max_diff(after_a, after_b)),
        "local_after_next_step_max_abs_diff": _max_over_ranks(max_diff(local_weights(a), local_weights(b))),
        "steps": [a.step, b.step],
    }


# Layouts a checkpoint converted at TP1 PP1 is loaded into (torch_dist reshards): TP2, and two
# pipeline stages of two virtual stages each (8 layers: 1-2, 5-6 | 3-4, 7-8).
INIT_LAYOUTS: dict[str, dict[str, Any]] = {"tp2": {"tp": 2}, "pp2-vpp2": {"pp": 2, "vpp": 2}}


def case_init_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    """Trainers that start from `trainer.megatron.init_checkpoint` (--init: what `prepare`
    converted from --hf) at the INIT_LAYOUTS: their export in checkpoint names against the HF
    checkpoint's own tensors. Then a run checkpoint (of moved weights) loaded into a trainer built
    from the init checkpoint wins over it, and a model of fewer layers refuses the checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from agentrl.train.megatron.settings import MegatronSettings
    from agentrl.train.megatron.trainer import InitCheckpointError, MegatronTrainer

    cfg = AutoConfig.from_pretrained(args.hf)
    hf_state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(args.hf).glob("*.safetensors")):
        hf_state.update(load_file(str(f)))
    train = TrainConfig(lr=1e-3, max_tokens_per_micro_batch=64, weight_decay=0.0)

    def build(config: Any = cfg, **settings: Any) -> Any:
        return MegatronTrainer(config, train, MegatronSettings(init_checkpoint=args.init, **settings))

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name, settings in INIT_LAYOUTS.items():
        tr = build(**settings)
        exported = {k: v.cpu().clone() for k, v in tr.hf_weights("checkpoint")}  # CPU or CUDA
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [[i + 1 for i in c.agentrl_stage_layers] for c in tr.chunks])
        out[name] = {
            "tp": tr.tp_size,
            "pp": tr.pp_size,
            "stage_layers": everyone,
            "missing": sorted(set(hf_state) - set(exported)),
            "extra": sorted(set(exported) - set(hf_state)),
            "tensors": len(exported),
            "dtypes_equal": all(exported[k].dtype == hf_state[k].dtype for k in exported if k in hf_state),
            "max_abs_diff": _max_over_ranks(
                max(float((exported[k] - hf_state[k]).abs().max()) for k in exported if k in hf_state)
            ),
            "seconds": time.perf_counter() - t0,
        }
        t0 = time.perf_counter()
    a = build(tp=2)
    # Stands for a step (cheaper): every weight and the router's expert bias move off the init
    # checkpoint, by the same amount on every rank (replicated weights stay equal).
    for t in local_weights_of(a):
        t.add_(0.25)
    a.step = 1
    trained = {k: v.cpu().clone() for k, v in a.hf_weights("checkpoint")}
    a.save(Path(args.tmp) / "run-ckpt", buffer_state={"step": 1})
    # Another spelling of the init checkpoint (its model/ directly): not part of what a resume checks.
    b = MegatronTrainer(cfg, train, MegatronSettings(init_checkpoint=f"{args.init}/model", tp=2))
    state = b.load(Path(args.tmp) / "run-ckpt")
    resumed = {k: v.cpu() for k, v in b.hf_weights("checkpoint")}
    out["resume"] = {
        "step": state.step,
        "trained_vs_init_min_abs_diff": min(float((trained[k] - hf_state[k]).abs().max()) for k in trained),
        "resumed_vs_trained_max_abs_diff": _max_over_ranks(max_diff(resumed, trained)),
        "seconds": time.perf_counter() - t0,
    }
    try:
        fewer = (
            tiny_config(num_hidden_layers=4, index_skip_topk_offset=1)
            if cfg.model_type == "glm_moe_dsa"
            else tiny_glm4_config(num_hidden_layers=4)
        )
        build(fewer, tp=2)
        out["fewer_layers_error"] = None
    except InitCheckpointError as exc:
        out["fewer_layers_error"] = str(exc)
    return out


def case_split(args: argparse.Namespace) -> dict[str, Any]:
    """A pipeline split whose second stage starts on a sharing layer is refused before anything is
    built (no process group exists here); megatron-core's own check agrees on both splits."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        _validate_dsa_index_share_pipeline_split,
    )

    from agentrl.train.megatron.model import build_model, transformer_config
    from agentrl.train.megatron.plan import PipelineSplitError
    from agentrl.train.megatron.settings import MegatronSettings

    cfg = tiny_config()
    out: dict[str, Any] = {"dist_initialized": dist.is_initialized()}
    for label, first in (("bad", 2), ("good", 3)):
        settings = MegatronSettings(pp=2, first_stage_layers=first, last_stage_layers=4 - first)
        try:
            build_model(cfg, settings)
            ours = None
        except PipelineSplitError as exc:
            ours = str(exc)
        except Exception as exc:  # the good split gets past the check and needs process groups
            ours = f"passed the check, then {type(exc).__name__}"
        mcfg = transformer_config(cfg, MegatronSettings())
        try:
            _validate_dsa_index_share_pipeline_split(mcfg, range(first, 4))
            theirs = None
        except RuntimeError as exc:
            theirs = str(exc)
        out[label] = {"ours": ours, "megatron": theirs}
    out["dist_initialized_after"] = dist.is_initialized()
    return out


def _engine_serve(model: Path, port: int, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """An `agentrl engine serve` process of `model` on `port` (its output in `log`), once it
    answers /health."""
    import urllib.request

    with log.open("wb") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentrl.cli",
                "engine",
                "serve",
                "--model",
                str(model),
                "--port",
                str(port),
                *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                _stop(server)
                raise RuntimeError(f"engine serve did not start: {log.read_text()[-3000:]}") from None
            time.sleep(0.5)


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def _fake_tbench2_env() -> dict[str, Any]:
    """The bundled tasks on fake sandboxes, one short turn per episode."""
    return {
        "name": "tbench2",
        "tasks": str(Path(__file__).resolve().parents[2] / "envs" / "tbench2" / "tasks"),
        "max_solution_chars": 64,
        "backend": "fake",
        "action_format": "fenced-bash",
        "agent": {"max_turns": 1, "max_new_tokens": 12, "min_turn_tokens": 4, "max_total_tokens": 2048},
    }


def case_runtime(args: argparse.Namespace) -> dict[str, Any]:
    """One GRPO step of `agentrl.runtime.train` with trainer.backend=megatron on the tiny
    glm_moe_dsa model (agentrl.models.tiny), rollouts from an `agentrl engine serve` process, and
    a weight sync to it; then the engine's log-probs of a sampled episode against the trainer's.
    --transport a,b,...: one run per transport against the same server (one start-up), the
    server set back to the initial weights (`/update_weights_from_disk`, version 0) between runs."""
    import urllib.request

    from agentrl.models.tiny import tiny_model_dir

    model = Path(tiny_model_dir())
    port = int(args.port)
    lora = ["--enable-lora"] if "lora_adapter" in args.transport.split(",") else []
    server = _engine_serve(model, port, Path(args.tmp) / "engine-serve.log", *lora)
    url = f"http://127.0.0.1:{port}"
    try:
        out = {}
        for i, transport in enumerate(args.transport.split(",")):
            if i:
                reset = json.dumps({"model_path": str(model), "weight_version": "0"}).encode()
                req = urllib.request.Request(
                    url + "/update_weights_from_disk", reset, {"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=120) as resp:
                    assert json.loads(resp.read())["success"]
            t0 = time.perf_counter()
            out[transport] = _runtime_step(args, model, url, transport, Path(args.tmp) / f"run-{transport}")
            out[transport]["seconds"] = time.perf_counter() - t0
        return out
    finally:
        _stop(server)


def _runtime_step(
    args: argparse.Namespace, model: Path, url: str, transport: str, out_dir: Path
) -> dict[str, Any]:
    import socket
    import urllib.request

    from agentrl.runtime import RunConfig, close_parts, resolve, train
    from agentrl.runtime.build import build_parts

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sync_port = int(sock.getsockname()[1])
    cfg = resolve(
        RunConfig,
        defaults={
            "out": str(out_dir),
            "steps": 1,
            "env": _fake_tbench2_env(),
            "engine": {"model": str(model), "kind": "sglang", "urls": [url]},
            "rollout": {
                "batch_size": 4,
                "n_samples_per_prompt": 2,
                "max_in_flight": 4,
                "max_staleness": 1,
            },
            # lora_adapter: the trainer's LoRA adapters alone, loaded by the server by name
            "trainer": {"backend": "megatron", "lr": 1e-3}
            if transport != "lora_adapter"
            else {"backend": "megatron", "lr": 1e-2, "lora": {"rank": 4, "alpha": 8.0}},
            "sync": {"transport": transport, "master_port": sync_port},
            "eval": {"before": False, "after": False},
        },
    )
    parts = build_parts(cfg)
    # A random-init model never solves a task: alternate rewards so groups carry signal.
    parts.env.provider.grader = lambda sb: float(int(sb.sandbox_id.rsplit("-", 1)[-1]) % 2)
    try:
        result = asyncio.run(train(cfg, parts))
        rows = [json.loads(line) for line in (cfg.out_dir / "metrics.jsonl").read_text().splitlines()]
        record = sorted((cfg.out_dir / "records").glob("*.jsonl"))[0]
        tokens = _episode_tokens(record)
        body = json.dumps(
            {
                "input_ids": tokens,
                "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                "return_logprob": True,
                "logprob_start_len": 0,
                # the adapter the runtime pushed (AdapterTransport's name for the version)
                **(
                    {"lora_path": f"agentrl-policy-v{rows[0]['extra']['version']}"}
                    if transport == "lora_adapter"
                    else {}
                ),
            }
        ).encode()
        req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            meta = json.loads(resp.read())["meta_info"]
        engine_lp = torch.tensor([e[0] for e in meta["input_token_logprobs"]][1:])
        sample = Sample(
            prompt_id="x",
            tokens=tokens,
            prompt_length=1,
            loss_mask=[1] * (len(tokens) - 1),
            rollout_logprobs=[0.0] * (len(tokens) - 1),
            reward=1.0,
            advantage=0.0,
        )
        mb = build_batch([sample], max_tokens_per_micro_batch=10**6).micro_batches[0]
        parts.trainer.model.eval()
        with torch.no_grad():
            trainer_lp = parts.trainer.logprobs(mb)[0][0, 1:]
        version = meta["weight_version"]  # the version that served this request
        from transformers import AutoModelForCausalLM

        initial = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        with torch.no_grad():
            ids = torch.tensor([tokens])
            initial_lp = torch.log_softmax(initial(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    finally:
        asyncio.run(close_parts(parts))
    return {
        "steps": result.steps,
        "trainer": rows[0]["extra"]["trainer"],
        "version": rows[0]["extra"]["version"],
        "engine_version": version,
        "tokens": len(tokens),
        "engine_vs_trainer_max_abs_diff": float((engine_lp - trainer_lp).abs().max()),
        "engine_vs_initial_max_abs_diff": float((engine_lp - initial_lp).abs().max()),
        "mismatch_kl": rows[0]["extra"]["trainer"].get("mismatch_kl"),
    }


def case_runtime_ranks(args: argparse.Namespace) -> dict[str, Any]:
    """`agentrl.runtime.ranks.run_ranks` under torchrun, as `agentrl train run` runs it: two steps
    of the training loop with the Megatron trainer over every rank (DP over the ranks by default),
    rank 0 driving rollouts from an `agentrl engine serve` process, a tensor weight sync and a
    checkpoint each step; the others follow. Returns rank 0's metrics and what each rank did."""
    from agentrl.models.tiny import tiny_model_dir
    from agentrl.runtime import RunConfig, resolve
    from agentrl.runtime.ranks import Followed, run_ranks

    model = Path(tiny_model_dir())
    url = f"http://127.0.0.1:{args.port}"
    server = None
    if int(os.environ.get("RANK", "0")) == 0:
        server = _engine_serve(model, int(args.port), Path(args.tmp) / "engine-serve.log")
    out_dir = Path(args.tmp) / "run-ranks"
    cfg = resolve(
        RunConfig,
        defaults={
            "out": str(out_dir),
            "steps": 2,
            "env": _fake_tbench2_env(),
            "engine": {"model": str(model), "kind": "sglang", "urls": [url]},
            "rollout": {"batch_size": 4, "n_samples_per_prompt": 2, "max_in_flight": 4, "max_staleness": 1},
            "trainer": {"backend": "megatron", "lr": 1e-3, "weight_decay": 0.1, "megatron": {"tp": args.tp}},
            "sync": {"transport": "tensor"},
            "checkpoint": {"every": 1},
            "eval": {"before": False, "after": False},
        },
    )
    try:
        result = run_ranks(cfg)
    finally:
        if server is not None:
            _stop(server)
    mine = result if isinstance(result, Followed) else None
    done = {"rank": dist.get_rank(), "calls": mine.calls if mine else {}, "step": mine.step if mine else None}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, done)
    if mine is not None:
        return {}
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    ckpts = out_dir / "checkpoints"
    state = json.loads((ckpts / (ckpts / "latest").read_text() / "state.json").read_text())
    return {
        "steps": result.steps,
        "versions": [r["extra"]["version"] for r in rows],
        "trainer_steps": [r["extra"]["trainer"]["step"] for r in rows],
        "checkpoint_world_size": state["world_size"],
        "checkpoint_step": state["step"],
        "ranks": everyone,
    }


def _episode_tokens(record: Path) -> list[int]:
    """The token ids of the first sample in an episode record (prompt + response)."""
    for line in record.read_text().splitlines():
        row = json.loads(line)
        for key in ("samples", "segments"):
            for s in row.get(key) or []:
                if isinstance(s, dict) and s.get("tokens"):
                    return list(s["tokens"])
        if row.get("tokens"):
            return list(row["tokens"])
    raise RuntimeError(f"no tokens in {record}")


def case_kl(args: argparse.Namespace) -> dict[str, Any]:
    """GRPO with a KL term to a frozen copy of the initial weights: 0 on the first step (the
    policy is the reference), positive after it; the reference does not move."""
    from agentrl.algo import LossConfig
    from agentrl.train.megatron.trainer import MegatronTrainer

    hf = tiny_hf()
    tr = MegatronTrainer(
        hf.config,
        TrainConfig(lr=1e-3, max_tokens_per_micro_batch=64, loss=LossConfig(kl_coef=0.1)),
        hf_state=hf.state_dict(),
    )

    def weights(model: Any) -> dict[str, torch.Tensor]:
        return {
            k: v.clone()
            for k, v in model.state_dict().items()
            if torch.is_tensor(v) and v.is_floating_point()
        }

    before = weights(tr.ref_model)
    kl = [tr.train_step(samples())["kl"] for _ in range(2)]
    moved = max_diff(weights(tr.ref_model), before)
    policy_moved = max_diff(weights(tr.model), before)
    return {"kl": kl, "reference_moved": moved, "policy_moved": policy_moved}


def case_fp8(args: argparse.Namespace) -> dict[str, Any]:
    """The FP8 export of the tiny model: names, dtypes, and the HF model's log-probs with the
    dequantised weights against the original's (what an FP8 engine would compute, roughly)."""
    from agentrl.train.megatron.fp8 import block_dequantize

    hf = tiny_hf()
    tr = trainer(hf, export_layout="checkpoint", export_quantization="fp8_block128")
    out = {k: t for b in tr.export_weights() for k, t in b}
    fp8 = sorted(k for k, t in out.items() if t.dtype == torch.float8_e4m3fn)
    restored = {}
    for k, t in out.items():
        if k in fp8:
            restored[k] = block_dequantize(t, out[k.removesuffix("weight") + "weight_scale_inv"])
        elif not k.endswith("weight_scale_inv"):
            restored[k] = t.float()
    from transformers import GlmMoeDsaForCausalLM

    ids = torch.tensor([samples()[0].tokens])
    deq = GlmMoeDsaForCausalLM(hf.config).eval()
    missing, unexpected = deq.load_state_dict(_from_checkpoint_names(restored, hf), strict=False)
    with torch.no_grad():
        a = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])
        b = torch.log_softmax(deq(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])
    return {
        "fp8_tensors": len(fp8),
        "scale_tensors": sum(k.endswith("weight_scale_inv") for k in out),
        "other_dtypes": sorted(
            {str(t.dtype) for k, t in out.items() if k not in fp8 and "scale_inv" not in k}
        ),
        "fp8_names_sample": fp8[:3],
        "missing": list(missing),
        "unexpected": list(unexpected),
        "dequantised_logprob_max_abs_diff": float((a - b).abs().max()),
    }


def _from_checkpoint_names(state: dict[str, torch.Tensor], hf: Any) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> transformers' stacked in-memory ones."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for name in hf.state_dict():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name.removesuffix("gate_up_proj")
            n = hf.config.n_routed_experts
            out[name] = torch.stack(
                [
                    torch.cat([state[f"{p}{e}.gate_proj.weight"], state[f"{p}{e}.up_proj.weight"]])
                    for e in range(n)
                ]
            )
        elif name.endswith("mlp.experts.down_proj"):
            p = name.removesuffix("down_proj")
            out[name] = torch.stack(
                [state[f"{p}{e}.down_proj.weight"] for e in range(hf.config.n_routed_experts)]
            )
    return out


def case_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """GPU only (never run in CI): bf16 weights, the all-to-all MoE dispatcher and full recompute;
    packed log-probs against the HF model in bf16, and one GRPO step; the same with LoRA (two steps,
    the trainer's own reduction on CUDA, the absorbed MLA's folded adapter under recompute); for
    `glm_moe_dsa` and `glm4_moe` (the packed SDPA core attention on CUDA)."""
    out = {}
    for model in ("dsa", "glm4"):
        hf = tiny_hf(model=model).cuda()
        gpu = {"params_dtype": "bfloat16", "moe_token_dispatcher_type": "alltoall", "recompute": "full"}
        tr = trainer(hf.float(), **gpu)
        batch = build_batch(samples(), max_tokens_per_micro_batch=64)
        tr.model.eval()
        diff = 0.0
        with torch.no_grad():
            hf_bf16 = hf.to(torch.bfloat16)
            for mb in batch.micro_batches:
                mb = mb.to(tr.device)
                logp = tr.logprobs(mb)[0]
                for r in range(mb.num_rows):
                    n = int(mb.attention_mask[r].sum())
                    ids = mb.input_ids[r : r + 1, :n]
                    ref = torch.log_softmax(hf_bf16(ids).logits[0, :-1].float(), -1)
                    ref = ref.gather(1, ids[0, 1:, None])[:, 0]
                    diff = max(diff, float((logp[r, 1:n] - ref).abs().max()))
        step = tr.train_step(samples())
        lora = trainer(tiny_hf(model=model), lora={"rank": 4, "alpha": 8.0}, **gpu)
        steps = [lora.train_step(samples()) for _ in range(2)]
        out[model] = {
            "logprob_max_abs_diff_bf16": diff,
            "loss": step["loss"],
            "skipped": step["skipped"],
            "lora_megatron_ddp": lora.megatron_ddp,
            "lora_losses": [s["loss"] for s in steps],
            "lora_skipped": [s["skipped"] for s in steps],
            "lora_first_loss_equals_full": abs(steps[0]["loss"] - step["loss"]),
            "lora_b_moved": max(float(a.B.abs().max()) for a in lora.lora.adapters),
        }
    return out


def case_gpu_r3_recompute(args: argparse.Namespace) -> dict[str, Any]:
    """GPU only: R3 under full recompute. A checkpointed layer's recompute (in the backward pass)
    must replay its own micro-batch's routes, or its gradients are those of other experts than
    its forward's. One GRPO step with random engine routes, fp32 weights, two micro-batches: with
    recompute, without it, and with recompute but no replay (the routes matter)."""
    hf = tiny_hf()
    c = hf.config
    routes = (c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok)
    out: dict[str, Any] = {}
    for name, settings in (
        ("replay_recompute", {"routing_replay": True, "recompute": "full"}),
        ("replay", {"routing_replay": True}),
        ("recompute", {"recompute": "full"}),
    ):
        # the local reduction keeps gradients on the parameters (megatron's DDP moves them to its buffers)
        tr = trainer(hf, mb_tokens=32, ddp="local", distributed_optimizer=False, **settings)
        step = tr.train_step(samples(routes=routes))
        out[name] = {"loss": step["loss"], "grad_norm": step["grad_norm"], "grads": hf_grads(tr)}
    a, b, c_ = out["replay_recompute"], out["replay"], out["recompute"]
    return {
        "grad_norm": {k: v["grad_norm"] for k, v in out.items()},
        "recompute_vs_not_max_abs": max_diff(a["grads"], b["grads"]),
        "replay_vs_not_max_abs": max_diff(a["grads"], c_["grads"]),
        "grad_max_abs": max(float(g.abs().max()) for g in b["grads"].values()),
    }


def _optimizer_state(tr: Any) -> list[dict[str, torch.Tensor]]:
    """Every wrapped optimizer's per-parameter state (fp32 main params, Adam moments, step), in
    parameter-group order: the same order in two trainers of one layout."""
    out = []
    for opt in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                out.append({"param": p.detach().clone(), **{k: v.detach().clone() for k, v in st.items()}})
    return out


def case_gpu_resume(args: argparse.Namespace) -> dict[str, Any]:
    """GPU only: megatron's DDP and distributed optimizer (torch's Adam without TE / apex) save
    after one step; a fresh trainer (another initialisation, no step taken: a new process
    resuming) loads it; its optimizer state equals the saved one, and both take the same next
    step."""
    root = Path(args.tmp) / "ckpt-gpu"
    a = trainer(tiny_hf(), params_dtype="bfloat16", lr=1e-3)
    a.train_step(samples(1))
    a.save(root)
    saved = _optimizer_state(a)
    b = trainer(tiny_hf(seed=7), params_dtype="bfloat16", lr=1e-3)
    b.load(root)
    loaded = _optimizer_state(b)
    state_diff = max(
        float((x[k].float() - y[k].float()).abs().max())
        for x, y in zip(saved, loaded, strict=True)
        for k in x
    )
    keys = sorted({k for x in loaded for k in x})
    before_a = {k: v.clone() for k, v in a.hf_weights()}
    ma, mb = a.train_step(samples(2)), b.train_step(samples(2))
    after_a, after_b = dict(a.hf_weights()), dict(b.hf_weights())
    steps_b = sorted({float(x["step"]) for x in _optimizer_state(b)})
    return {
        "optimizer": type(a.optimizer).__name__,
        "inner": sorted(
            {type(o.optimizer).__name__ for o in getattr(b.optimizer, "chained_optimizers", [b.optimizer])}
        ),
        "states": len(loaded),
        "state_keys": keys,
        "loaded_state_max_abs_diff": state_diff,
        "next_loss": [ma["loss"], mb["loss"]],
        "next_grad_norm": [ma["grad_norm"], mb["grad_norm"]],
        "skipped": [ma["skipped"], mb["skipped"]],
        "after_next_step_max_abs_diff": max_diff(after_a, after_b),
        "next_step_moved": max_diff(after_a, before_a),  # what the next step changes, for scale
        "adam_steps_after": steps_b,
        "trainer_steps": [a.step, b.step],
    }


def _engine_routes(model: Any, tokens: list[int]) -> tuple[list[list[list[int]]], torch.Tensor]:
    """What an engine returns for one sequence: the experts each MoE router chose per token
    ([len - 1][layers][top_k], -1 on dense layers: SGLang's `routed_experts` layout) and the
    log-probs of tokens 1.. under its logits."""
    cfg = model.config
    k, layers = cfg.num_experts_per_tok, cfg.num_hidden_layers
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2])))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    routes = [
        [seen[i][t].tolist() if i in seen else [-1] * k for i in range(layers)]
        for t in range(len(tokens) - 1)
    ]
    logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return routes, logp


def case_routing_replay(args: argparse.Namespace) -> dict[str, Any]:
    """R3 on one rank. The "engine" is the HF model in bf16 with its routers' weights off by a
    little (an inference engine's own numerics: other kernels, bf16 scores), so some tokens go to
    other experts there than in the fp32 trainer. The trainer's log-probs of the samples, against
    the engine's, without and with the engine's routes replayed."""
    import copy

    hf = tiny_hf(**_shape(4))
    engine = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in engine.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine = engine.to(torch.bfloat16).eval()
    rows = samples()
    engine_logp = []
    trainer_routes = []
    for s in rows:
        s.routed_experts, lp = _engine_routes(engine, s.tokens)
        engine_logp.append(lp[s.prompt_length - 1 :])
        trainer_routes.append(_engine_routes(hf, s.tokens)[0])
    moe = [i for i in range(hf.config.num_hidden_layers) if i >= hf.config.first_k_dense_replace]
    routed = [(set(a[i]), set(b[i])) for s, tr in zip(rows, trainer_routes, strict=True)
              for a, b in zip(s.routed_experts, tr, strict=True) for i in moe]  # fmt: skip
    out: dict[str, Any] = {"routed": len(routed), "flipped": sum(a != b for a, b in routed)}
    # Predicted tokens whose position (the one before them) the engine routed elsewhere somewhere.
    flip = torch.cat([
        torch.tensor([any(set(a[i]) != set(b[i]) for i in moe) for a, b in zip(s.routed_experts, tr, strict=True)])[s.prompt_length - 1 :]
        for s, tr in zip(rows, trainer_routes, strict=True)
    ])  # fmt: skip

    def trainer_logp(routes: list[Any] | None, replay: bool) -> torch.Tensor:
        for s, r in zip(rows, routes or [None] * len(rows), strict=True):
            s.routed_experts = r
        tr = trainer(hf, mb_tokens=4096, routing_replay=replay)
        got: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for mb in build_batch(rows, max_tokens_per_micro_batch=4096).micro_batches:
                logp = tr.logprobs(mb)[0]
                for r, i in enumerate(mb.sample_indices):
                    got[i] = logp[r, rows[i].prompt_length : len(rows[i].tokens)]
        return torch.cat([got[i] for i in range(len(rows))])

    engine_routes = [s.routed_experts for s in rows]
    target = torch.cat(engine_logp)
    for name, logp in (
        ("own_routing", trainer_logp(None, False)),
        ("replay", trainer_logp(engine_routes, True)),
    ):
        d = (logp - target).abs()
        out[name] = {
            "mean_abs": float(d.mean()),
            "max_abs": float(d.max()),
            "flipped_mean_abs": float(d[flip].mean()),
        }
    # Replaying the trainer's own routes changes nothing: the routes land on the right tokens.
    out["own_routes_replayed_max_abs"] = float(
        (trainer_logp(trainer_routes, True) - trainer_logp(None, False)).abs().max()
    )
    out["flipped_tokens"] = int(flip.sum())
    for s, r in zip(rows, engine_routes, strict=True):
        s.routed_experts = r
    # The samples' routes reach the optimizer step too: a GRPO step with replay on runs.
    tr = trainer(hf, mb_tokens=4096, routing_replay=True)
    out["train_step_skipped"] = tr.train_step(rows)["skipped"]
    return out


CASES = {
    "routing_replay": case_routing_replay,
    "gpu_r3_recompute": case_gpu_r3_recompute,
    "build": case_build,
    "hf_parity": case_hf_parity,
    "glm4_parity": case_glm4_parity,
    "lora": case_lora,
    "grads": case_grads,
    "references": case_references,
    "head_loss": case_head_loss,
    "on_policy": case_on_policy,
    "layouts": case_layouts,
    "checkpoint": case_checkpoint,
    "init_checkpoint": case_init_checkpoint,
    "split": case_split,
    "runtime": case_runtime,
    "runtime_ranks": case_runtime_ranks,
    "kl": case_kl,
    "fp8": case_fp8,
    "gpu": case_gpu,
    "gpu_resume": case_gpu_resume,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="a case, or several joined by commas (run in order in one process)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tmp", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--first", type=int, default=None)
    parser.add_argument("--last", type=int, default=None)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", default="dsa", help="dsa (glm_moe_dsa) or glm4 (glm4_moe)")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--indexer-loss", type=float, default=None)
    parser.add_argument("--layouts", default="")
    parser.add_argument("--reference-dir")
    parser.add_argument("--save")
    parser.add_argument("--reference")
    parser.add_argument("--port", default="0")
    parser.add_argument("--transport", default="tensor")
    parser.add_argument("--sync-port")
    parser.add_argument("--hf", help="an HF checkpoint directory (init_checkpoint)")
    parser.add_argument("--init", help="its torch_dist conversion (init_checkpoint)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("TORCH_NUM_THREADS", "1")))
    names = args.case.split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}: choose from {sorted(CASES)}")
    # Several cases share one process start (imports and megatron's set-up are most of a small
    # case's time); each builds its own trainer and process groups, so they stay independent.
    results = {name: CASES[name](args) for name in names}
    result = results[names[0]] if len(names) == 1 else results
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
