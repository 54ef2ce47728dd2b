"""GLM-5.2 (`zai-org/GLM-5.2`, a `glm_moe_dsa` model) as a cluster recipe: its models, layouts,
SGLang flags, algorithm and run settings, as the `RecipeSpec`s the generic cluster code
(`agentrl.cluster`) plans and launches. `glm52_tbench2.py` and `glm52_dapo_math.py` are the launchers.

The reference layouts are the Miles recipe's branches (shared/reference/glm52.md); the terminal
bench run's settings are the reference run script's.
"""

from __future__ import annotations

from typing import Any

from agentrl.cluster.cli import make_app
from agentrl.cluster.model import ModelEntry
from agentrl.cluster.planner import Layout
from agentrl.cluster.recipe import RecipeOptions, RecipeSpec

# GLM-5.2 (`zai-org/GLM-5.2`): the fields of its config.json that the planner reads. Source:
# shared/reference/glm52.md (78 layers, 3 dense, MLA 64 heads, 256 experts top-8, vocabulary
# 154,880, RoPE base 8e6, DSA index_topk_freq 4 with the 3 dense layers computing) and transformers'
# GlmMoeDsaConfig defaults for the GLM-5 family (head dims, indexer heads). `prepare` replaces it
# with the downloaded config.json and validates that one.
GLM52_CONFIG: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
    "num_attention_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "max_position_embeddings": 202752,
    "rope_theta": 8000000.0,
}

# The pruned smoke-test variant (`GLM-5.2_5layer`, published as `Pinaster/GLM-5.2_5layer`, not under
# zai-org): 3 dense + 2 MoE layers, no MTP layer.
GLM52_5LAYER_CONFIG: dict[str, Any] = {**GLM52_CONFIG, "num_hidden_layers": 5, "num_nextn_predict_layers": 0}

MODELS: dict[str, ModelEntry] = {
    "GLM-5.2": ModelEntry("GLM-5.2", "zai-org/GLM-5.2", GLM52_CONFIG),
    "GLM-5.2_5layer": ModelEntry(
        "GLM-5.2_5layer", "Pinaster/GLM-5.2_5layer", GLM52_5LAYER_CONFIG, smoke=True, tokens_per_gpu=2048
    ),
}
SMOKE_MODEL = "GLM-5.2_5layer"  # the plan of a few simulated nodes (--local): the pruned model's branch

# GRPO with clip 0.2 / 0.28, TIS 0.5 / 2.0, Adam lr 1e-6 constant, weight decay 0.1, betas 0.9 / 0.98.
ALGORITHM: dict[str, Any] = {
    "trainer.lr": 1e-6,
    "trainer.weight_decay": 0.1,
    "trainer.betas": [0.9, 0.98],
    "trainer.loss.eps_clip": 0.2,
    "trainer.loss.eps_clip_high": 0.28,
    "trainer.loss.use_tis": True,
    "trainer.loss.tis_clip_low": 0.5,
    "trainer.loss.tis_clip": 2.0,
    "trainer.logprob_chunk_size": 16384,
}
# The terminal-bench-2 run's rollout and eval settings, as the reference run script sets them
# (radixark/miles examples/experimental/openenv/glm52_tbench2/run_glm5_2_744b_a40b_daytona.py):
# 100 rollout steps of 8 tasks x 8 samples (global batch 64: one optimizer step per rollout step),
# 128 episodes in flight (each with its own sandbox), no staleness bound, temperature 0.8, 30 turns
# of up to 8,192 new tokens in a 65,536-token session and 3,600 s of wall clock (a policy outcome:
# the episode is verified as it stands), TIS with no lower clip, the in_place pause for weight
# updates, and an eval every 10 steps of 2 samples per held-out task.
TBENCH2_RUN: dict[str, Any] = {
    "steps": 100,
    "rollout.batch_size": 64,
    "rollout.n_samples_per_prompt": 8,
    "rollout.max_in_flight": 128,
    "rollout.max_staleness": None,
    "rollout.episode_timeout_s": 3600 + 900,  # the agent's 3,600 s, then setup and the verifier
    "sampling.temperature": 0.8,
    "env.agent.max_turns": 30,
    "env.agent.max_new_tokens": 8192,
    "env.agent.max_total_tokens": 65536,
    "env.agent.wall_clock_s": 3600,
    "trainer.loss.tis_clip_low": 0.0,
    "sync.pause_mode": "in_place",
    "eval.every": 10,
    "eval.samples_per_row": 2,
    "eval.concurrency": 40,
}
# SGLang: DSA through the NSA attention backend (FlashMLA sparse prefill, FlashMLA KV decode), an
# FP8 KV cache, 64-token pages; MTP as EAGLE speculative decoding with the NSA draft backend.
SGLANG_ENV = {"SGLANG_NSA_FORCE_MLA": "1", "INDEXER_ROPE_NEOX_STYLE": "0", "NVSHMEM_DISABLE_NCCL": "1"}
SGLANG_ARGS = (
    "--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "nsa", "--nsa-prefill-backend", "flashmla_sparse",
    "--nsa-decode-backend", "flashmla_kv", "--page-size", "64",
)  # fmt: skip


def mtp_args(sglang_config: str) -> list[str]:
    steps, drafts = (5, 6) if sglang_config == "low-latency" else (1, 2)
    return [
        "--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(drafts),
        "--speculative-draft-attention-backend", "nsa",
    ]  # fmt: skip


def tbench2_layouts(
    o: RecipeOptions, model: ModelEntry, gpn: int, train_nodes: int
) -> list[tuple[str, Layout]]:
    if model.smoke:
        return [("1 node, pruned 5-layer", Layout(4, 1, 1, gpn, 1, None, None, 2048))]
    return [("tbench2 16 x GB300", Layout(2, 4, 4, 8, 1, 18, 20, 8192))]


def miles_layouts(
    o: RecipeOptions, model: ModelEntry, gpn: int, train_nodes: int
) -> list[tuple[str, Layout]]:
    """The Miles recipe's branches (shared/reference/glm52.md)."""
    if model.smoke:
        return [("1 node, pruned 5-layer", Layout(4, 1, 1, gpn, 1, None, None, 2048))]
    refs = []
    if train_nodes >= 16 and gpn == 4:
        refs.append((">= 16 nodes of 4 GPUs", Layout(8, 4, 1, 16, 1, 18, 20, 8192)))
    if train_nodes >= 16 and gpn == 8:
        refs.append((">= 16 nodes of 8 GPUs", Layout(4, 8, 8, 32, 1, 14, 16, 8192)))
    return refs


_COMMON: dict[str, Any] = {
    "models": MODELS,
    "default_model": "GLM-5.2",
    "local_model": SMOKE_MODEL,
    "root": "/shared/glm52",
    "local_root": "/local/glm52",
    "local_run_root": "runs/glm52-local",
    "hardware": "GB300",
    "hardware_choices": ("H200", "B200", "GB300"),  # the Miles recipe's --hardware choices
    "num_nodes": 16,
    "algorithm": ALGORITHM,
    "sglang_env": SGLANG_ENV,
    "sglang_args": SGLANG_ARGS,
    "mtp_args": mtp_args,
}

# terminal-bench-2, fully asynchronous: training and rollout on separate nodes (the reference: 8 + 8
# of 16), one 4-GPU dp-attention FP8 engine per inference node, optimizer state off the GPU, one
# Daytona sandbox per task.
TBENCH2 = RecipeSpec(
    name="tbench2",
    env="tbench2",
    title="GLM-5.2 tbench2 recipe.",
    colocated=False,
    sglang_config="balanced",
    fp8_rollout=True,
    optimizer_offload=True,
    daytona=True,
    env_settings={"env.backend": "daytona"},
    run_settings=TBENCH2_RUN,
    reference_layouts=tbench2_layouts,
    **_COMMON,
)

# DAPO-Math-17k: colocated, the Miles recipe's branches.
DAPO_MATH = RecipeSpec(
    name="dapo_math",
    env="dapo_math",
    title="GLM-5.2 dapo_math recipe.",
    colocated=True,
    sglang_config="low-latency",
    fp8_rollout=False,
    optimizer_offload=False,
    reference_layouts=miles_layouts,
    **_COMMON,
)

# The LoRA variant of the math recipe: rank-32 adapters on the attention and MLP projections
# (routed experts frozen), alpha 32 (scale 1), lr 1e-5 (adapters take a larger step than full
# fine-tuning). The reference gives no LoRA numbers: these are agentrl's. The plan shows, side by
# side, what the same layout needs with every weight trained.
LORA: dict[str, Any] = {"trainer.lora.rank": 32, "trainer.lora.alpha": 32.0, "trainer.lr": 1e-5}
DAPO_MATH_LORA = RecipeSpec(
    name="dapo_math_lora",
    env="dapo_math",
    title="GLM-5.2 dapo_math recipe with LoRA adapters.",
    colocated=True,
    sglang_config="low-latency",
    fp8_rollout=False,
    optimizer_offload=False,
    reference_layouts=miles_layouts,
    **{**_COMMON, "algorithm": {**ALGORITHM, **LORA}},
)

SPECS = {"tbench2": TBENCH2, "dapo_math": DAPO_MATH, "dapo_math_lora": DAPO_MATH_LORA}


def app(name: str) -> Any:
    """The Typer app of the recipe `name` (tbench2, dapo_math or dapo_math_lora)."""
    return make_app(SPECS[name])
