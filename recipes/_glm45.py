"""GLM-4.5 (`zai-org/GLM-4.5`, 355B-A32B) and GLM-4.5-Air (`zai-org/GLM-4.5-Air`, 106B-A12B), both
`glm4_moe` models, as cluster recipes: their configs, the Miles launchers' layouts, SGLang engines,
algorithms and hardware rules (shared/reference/glm45.md), as the `RecipeSpec`s the generic cluster
code (`agentrl.cluster`) plans and launches. The launchers are `glm45_dapo_math.py` (the Python
launcher), `glm45_dapo_math_gspo.py` (the bash launcher) and `glm45_air_dapo_math.py` (Air).

agentrl's Megatron backend builds `glm4_moe` (grouped-query attention with its packed core
attention, `agentrl.train.megatron.gqa`), so `prepare` converts the checkpoint and `train` launches
as for GLM-5.2.
"""

from __future__ import annotations

from typing import Any

from agentrl.cluster.cli import make_app
from agentrl.cluster.model import ModelEntry
from agentrl.cluster.planner import Layout, find_pipeline_split
from agentrl.cluster.recipe import EngineShape, RecipeOptions, RecipeSpec

# The fields both models share (their config.json files; the Miles model scripts pass the same
# numbers to Megatron: 96 heads, 8 query groups of 128, half-rotary RoPE with base 1e6, QKV bias,
# vocabulary 151,552, untied embeddings, sigmoid router with expert bias, top-8, one shared expert).
_GLM4_MOE: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": True,
    "partial_rotary_factor": 0.5,
    "rope_theta": 1000000.0,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}
# GLM-4.5: 92 layers (3 dense), hidden 5120, 160 routed experts of 1536, QK norm, top-k scale 2.5.
GLM45_CONFIG: dict[str, Any] = {
    **_GLM4_MOE,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "first_k_dense_replace": 3,
    "n_routed_experts": 160,
    "routed_scaling_factor": 2.5,
    "use_qk_norm": True,
}
# GLM-4.5-Air: 46 layers (1 dense), hidden 4096, 128 routed experts of 1408, no QK norm.
GLM45_AIR_CONFIG: dict[str, Any] = {
    **_GLM4_MOE,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 46,
    "first_k_dense_replace": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "use_qk_norm": False,
}

TOKENS_PER_GPU = 16384  # max_tokens_per_gpu of every launcher
MODELS: dict[str, ModelEntry] = {
    "GLM-4.5": ModelEntry("GLM-4.5", "zai-org/GLM-4.5", GLM45_CONFIG, tokens_per_gpu=TOKENS_PER_GPU),
    "GLM-4.5-Air": ModelEntry(
        "GLM-4.5-Air", "zai-org/GLM-4.5-Air", GLM45_AIR_CONFIG, tokens_per_gpu=TOKENS_PER_GPU
    ),
}

# Both launchers clip at 1e-4 / 2e-4 with TIS on; the bash launcher's advantage is GSPO's sequence
# ratio, the Python launcher's GRPO. The reference gives no optimizer numbers: Adam as in the GLM-5.2
# recipe (lr 1e-6 constant, weight decay 0.1, betas 0.9 / 0.98), TIS bounds agentrl's (0.5 / 2.0).
_OPTIMIZER: dict[str, Any] = {"trainer.lr": 1e-6, "trainer.weight_decay": 0.1, "trainer.betas": [0.9, 0.98]}
GRPO: dict[str, Any] = {
    **_OPTIMIZER,
    "trainer.loss.objective": "grpo",
    "trainer.loss.eps_clip": 1e-4,
    "trainer.loss.eps_clip_high": 2e-4,
    "trainer.loss.use_tis": True,
}
GSPO: dict[str, Any] = {**GRPO, "trainer.loss.objective": "gspo"}

# SGLang: 32-GPU engines (EP 32), dp attention over 4 groups, MoE dense TP 1, dp LM head, static
# memory fraction 0.7; MTP as EAGLE with 1 step, top-k 1, 2 draft tokens, draft weights kept on the
# CPU while the trainer holds the GPUs.
ENGINE = EngineShape(gpus=32, dp_size=4, mem_fraction=0.70)


def mtp_args(sglang_config: str) -> list[str]:
    return [
        "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "2", "--enable-draft-weights-cpu-backup",
    ]  # fmt: skip


def bash_layouts(o: RecipeOptions, model: ModelEntry, gpn: int, train_nodes: int) -> list[tuple[str, Layout]]:
    """The bash launcher: 8 nodes x 8 GPUs, TP8 PP4 CP2 EP16 (92 layers: 23 per stage)."""
    return [("bash launcher, 8 x 8", Layout(8, 4, 2, 16, 1, None, None, TOKENS_PER_GPU))]


def python_layouts(
    o: RecipeOptions, model: ModelEntry, gpn: int, train_nodes: int
) -> list[tuple[str, Layout]]:
    """The Python launcher's branches: a debug layout on <= 4 nodes, TP4 PP8 CP2 EP8 on 8 nodes."""
    if train_nodes <= 4:
        return [("Python launcher, <= 4 nodes (debug)", Layout(4, 1, 1, 4, 1, None, None, TOKENS_PER_GPU))]
    first, last = find_pipeline_split(model.spec(), 8)
    return [("Python launcher, 8 nodes", Layout(4, 8, 2, 8, 1, first, last, TOKENS_PER_GPU))]


_COMMON: dict[str, Any] = {
    "models": MODELS,
    "env": "dapo_math",  # DAPO-Math-17k for training, AIME-2024 for the evals (staged by `prepare`)
    "colocated": True,
    "optimizer_offload": True,  # Adam on the CPU (overlapped D2H / H2D, precision-aware)
    "mtp": True,
    "mtp_args": mtp_args,
    "engine_shape": ENGINE,
    "num_nodes": 8,
    "root": "/shared/glm45",
    "local_root": "/local/glm45",
    "local_run_root": "runs/glm45-local",
}

# The bash launcher: GSPO, 8 nodes x 8 GPUs of any kind.
GSPO_SPEC = RecipeSpec(
    name="glm45_gspo",
    title="GLM-4.5 on DAPO-Math, the Miles bash launcher (GSPO, TP8 PP4 CP2 EP16 on 8 x 8).",
    default_model="GLM-4.5",
    local_model="GLM-4.5",
    hardware="H100",
    algorithm=GSPO,
    reference_layouts=bash_layouts,
    **_COMMON,
)

# The Python launcher: GRPO, Blackwell only.
GRPO_SPEC = RecipeSpec(
    name="glm45",
    title="GLM-4.5 on DAPO-Math, the Miles Python launcher (GRPO; Blackwell only).",
    default_model="GLM-4.5",
    local_model="GLM-4.5",
    hardware="B200",
    hardware_choices=("B200", "GB300"),
    hardware_refusal=(
        "the Miles GLM-4.5 Python launcher is Blackwell-only and refuses H100; "
        "recipes/glm45_dapo_math_gspo.py is the launcher that runs on Hopper"
    ),
    algorithm=GRPO,
    reference_layouts=python_layouts,
    **_COMMON,
)

# GLM-4.5-Air: the reference has no launcher of its own, only an 8-node example of P2P weight
# transfer: training and rollout on separate nodes (4 + 4), the planner's layout, one TP-8 engine
# per rollout node, the bash launcher's GSPO settings.
AIR_SPEC = RecipeSpec(
    name="glm45_air",
    title="GLM-4.5-Air on DAPO-Math (8 nodes, training and rollout apart).",
    default_model="GLM-4.5-Air",
    local_model="GLM-4.5-Air",
    hardware="H100",
    algorithm=GSPO,
    notes=(
        "weight transfer: the reference example sends weights peer to peer from trainer ranks to engine "
        "ranks; agentrl has no P2P transport, the plan syncs over sync.transport=distributed (an NCCL "
        "broadcast into the engines' update_weights_from_distributed)",
    ),
    **{**_COMMON, "colocated": False, "engine_shape": EngineShape(gpus=8, mem_fraction=0.70)},
)

SPECS = {"glm45": GRPO_SPEC, "glm45_gspo": GSPO_SPEC, "glm45_air": AIR_SPEC}


def app(name: str) -> Any:
    """The Typer app of the recipe `name` (glm45, glm45_gspo or glm45_air)."""
    return make_app(SPECS[name])
