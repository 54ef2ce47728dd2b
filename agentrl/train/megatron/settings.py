"""`MegatronSettings`: the Megatron backend's own knobs (parallel layout, precision, recompute).

Pure Python (no megatron import): it is part of the run configuration (`trainer.megatron`), which
the 3.11 side validates and prints with `--dry-run` too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ConfigDict


@dataclass
class MegatronSettings:
    """Parallel layout and model-side options of the Megatron trainer.

    `tp`, `pp`, `cp`, `ep`, `etp` (expert TP; None: same as `tp`) are megatron-core's sizes;
    sequence parallelism is on whenever `tp > 1` (the absorbed MLA that DSA uses requires it).
    `cp` splits every packed sequence over CP ranks (zigzag THD, DSA's all-gather CP; each
    sequence is padded at its end to a multiple of 2 x cp).
    `first_stage_layers` / `last_stage_layers` make the pipeline ends uneven (GLM-5.2: 18 / 20 with
    PP4), `vpp` cuts each rank's layers into virtual stages. Every stage must start on a layer
    that computes its DSA indices (checked before the model is built).
    `recompute`: "none", "selective" or "full" (uniform, `recompute_num_layers` per chunk).
    `routing_replay` (R3): every MoE router takes the experts the engine chose for each token
    (the samples' `routed_experts`) instead of its own top-k, scoring them with its own weights
    (megatron-core's `RouterReplay`), under every layout and recompute (`replay.py`).
    `dsa_indexer_loss_coeff`: the indexer's KL loss against the main attention (its inputs are
    detached, so without it the indexer does not train); None leaves the indexer frozen, as in
    the GLM-5.2 RL recipe.
    `moe_token_dispatcher_type`: "allgather" runs everywhere (CPU included); "alltoall" needs CUDA.
    `params_dtype`: weights and compute dtype ("float32" on CPU, "bfloat16" on GPU).
    `tf32`: fp32 matrix products of the trainer's passes on TF32 tensor cores (CUDA). None: on
    with bf16 weights, where those products multiply bf16 values upcast (megatron's local DSA path
    computes attention and indexer scores so), which TF32 holds exactly, and the rest (their
    gradients) keep more precision than bf16 products would; measured 1.31x on a GLM-5.2-shaped
    step (docs/megatron.md). Off with fp32 weights.
    `ddp`: how gradients are reduced and the optimizer steps. "megatron": megatron-core's
    `DistributedDataParallel` (contiguous fp32 gradient buffers) and `get_megatron_optimizer`
    (CUDA only: its buffers and the fused Adam live on the GPU); "local": the trainer's own
    flat all-reduces over the same process groups and torch AdamW (what runs on a CPU over gloo);
    "auto": megatron on CUDA, local otherwise (and always with LoRA, which refuses "megatron": its
    adapters are a few MB, nothing for megatron's buffers to save). `distributed_optimizer`
    shards the optimizer state over data-parallel ranks (megatron only); `optimizer_cpu_offload`
    keeps it and the Adam step on the CPU (megatron only, needs the distributed optimizer).
    `export_layout`: the names `export_weights` yields. "transformers": the in-memory names of
    `GlmMoeDsaForCausalLM` (experts stacked), which agentrl's engine server loads; "checkpoint":
    the names of HF checkpoint files (one tensor per expert and projection), which SGLang loads.
    `export_quantization`: "fp8_block128" exports the decoder's linear weights block-quantised to
    FP8 with their `weight_scale_inv` for FP8 rollout engines (`agentrl.train.megatron.fp8`; needs
    the checkpoint layout); "none" exports every weight as trained (or cast to the sync dtype).
    `init_checkpoint`: the initial weights as a megatron-core `torch_dist` model checkpoint, the
    one `prepare` writes (the directory holding `model/`, or `model/` itself), instead of the HF
    weights of `engine.model` (which then gives only the config and tokenizer). torch_dist
    reshards on load, so a checkpoint converted for one layout loads into any other. A run
    checkpoint being resumed replaces these weights (it is not part of the layout a resume checks).
    """

    __pydantic_config__ = ConfigDict(extra="forbid")

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    recompute: str = "none"
    recompute_num_layers: int = 1
    dsa_indexer_loss_coeff: float | None = None
    moe_token_dispatcher_type: str = "allgather"
    params_dtype: str = "float32"
    tf32: bool | None = None
    ddp: str = "auto"
    distributed_optimizer: bool = True
    optimizer_cpu_offload: bool = False
    export_layout: str = "transformers"
    export_quantization: str = "none"
    init_checkpoint: str | None = None
    routing_replay: bool = False

    def __post_init__(self) -> None:
        problems = []
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.vpp is not None and self.vpp < 1:
            problems.append(f"vpp must be >= 1 or None (got {self.vpp})")
        if self.recompute not in ("none", "selective", "full"):
            problems.append(f"recompute={self.recompute!r}: choose none, selective or full")
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall", "flex"):
            problems.append(f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}")
        if self.params_dtype not in ("float32", "bfloat16"):
            problems.append(f"params_dtype={self.params_dtype!r}: choose float32 or bfloat16")
        if self.ddp not in ("auto", "megatron", "local"):
            problems.append(f"ddp={self.ddp!r}: choose auto, megatron or local")
        if self.optimizer_cpu_offload and (self.ddp == "local" or not self.distributed_optimizer):
            problems.append(
                "optimizer_cpu_offload needs ddp='megatron' (or auto on CUDA) and distributed_optimizer"
            )
        if self.export_layout not in ("transformers", "checkpoint"):
            problems.append(f"export_layout={self.export_layout!r}: choose transformers or checkpoint")
        if self.export_quantization not in ("none", "fp8_block128"):
            problems.append(f"export_quantization={self.export_quantization!r}: choose none or fp8_block128")
        elif self.export_quantization != "none" and self.export_layout != "checkpoint":
            problems.append(
                "export_quantization fp8_block128 needs export_layout='checkpoint' (2-D expert weights)"
            )
        if self.init_checkpoint is not None and not self.init_checkpoint.strip():
            problems.append("init_checkpoint is empty: give a directory prepare wrote, or leave it unset")
        if problems:
            raise ValueError("MegatronSettings: " + "; ".join(problems))

    @property
    def world_size(self) -> int:
        """Ranks of one model replica (data parallelism multiplies it)."""
        return self.tp * self.pp * self.cp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def layout_dict(self) -> dict[str, Any]:
        """What a run checkpoint must have been saved with to resume here: every setting but
        where the initial weights came from."""
        out = self.to_dict()
        out.pop("init_checkpoint")
        return out
