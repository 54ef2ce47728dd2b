"""The Megatron backend's models on megatron-core's own modules, from a Hugging Face config:
`glm_moe_dsa` (GLM-5) here, `glm4_moe` (GLM-4.5: grouped-query attention) with its core attention
in `gqa.py`; both share the MoE (a sigmoid router with expert bias and a shared expert).

`glm_moe_dsa`: MLA (the absorbed form megatron uses for DSA), MoE with a sigmoid router, expert bias and a shared
expert, and the experimental attention variant `dsa` with index sharing
(`dsa_indexer_topk_freq` / `dsa_indexer_skip_topk_offset`). Nothing here re-implements a layer:
the module specs are megatron-core's (`get_transformer_layer_with_experimental_attention_variant_spec`)
with a backend provider that needs no TransformerEngine, so the same code builds on a CPU (gloo)
and on a GPU without TE. Settings that make the megatron model compute what HF's
`GlmMoeDsaForCausalLM` computes are in `transformer_config` with the reason for each.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from agentrl.train.megatron.plan import (
    MODEL_TYPES,
    ModelConfigError,
    PipelineLayout,
    check_pipeline_split,
    has_dsa,
    megatron_index_sharing,
    pipeline_layout,
)
from agentrl.train.megatron.settings import MegatronSettings


def plain_jit_on_cpu() -> None:
    """On a CPU, megatron's JIT fuser off before its modules are imported: they decorate their
    fused functions at import with `torch.compile`, which costs ~16 s of C++ builds on the first
    CPU forward for the same numbers. On a GPU the fuser stays."""
    if torch.cuda.is_available():
        return
    import megatron.core.jit as jit

    jit.disable_jit_fuser()


def require_megatron() -> None:
    """Fail with the way out when megatron-core (Python >= 3.12) is not importable here."""
    try:
        plain_jit_on_cpu()
        import megatron.core.transformer.experimental_attention_variant.dsa  # noqa: F401
    except ImportError as exc:
        raise ModelConfigError(
            f"the megatron backend needs megatron-core 0.19 on Python >= 3.12 ({exc}): build its "
            "environment with `python -m agentrl.train.megatron.venv` and run with that interpreter "
            "(docs/megatron.md)"
        ) from None


def cpu_shims() -> None:
    """What megatron-core needs to run without CUDA: `torch.cuda.current_device` answers (the
    indexer-loss tracker and the RNG tracker ask), `torch.cuda.synchronize` is a no-op (the
    `torch_dist` checkpoint writer calls it), and the RNG tracker in its inference mode (the CUDA
    one needs a device)."""
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Tensors megatron asks for on "cuda" are made on the CPU instead."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def schedule_device_shim() -> contextlib.AbstractContextManager[Any]:
    """Around megatron's pipeline schedules on a CPU. They run over gloo as they are except for
    one line each: their token counter is made with `device="cuda"`
    (`pipeline_parallel/schedules.py` in 0.19.2: line 749 `forward_backward_no_pipelining`,
    1121 `..._with_interleaving`, 2292 `..._without_interleaving`:
    `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`). This mode makes
    factory calls that name the "cuda" device make CPU tensors; on a GPU it is not used."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _CudaFactoriesOnCpu()


def check_hf_config(hf_config: Any) -> None:
    """Refuse what this backend does not build, before any weight is allocated."""
    if getattr(hf_config, "model_type", None) not in MODEL_TYPES:
        raise ModelConfigError(
            f"the megatron backend builds {', '.join(MODEL_TYPES)} models; this config is "
            f"{getattr(hf_config, 'model_type', None)!r}"
        )
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ModelConfigError("tie_word_embeddings=True: GLM-5 models have untied embeddings")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ModelConfigError(f"rope_type {rope.get('rope_type')!r}: only the default RoPE is mapped")
    if not has_dsa(hf_config):
        # glm4_moe: its checkpoints' MTP layer is not part of `Glm4MoeForCausalLM` (transformers
        # builds none), so it is not trained here either; only the QKV projections have biases.
        if getattr(hf_config, "mlp_bias", False):
            raise ModelConfigError("mlp_bias: glm4_moe models have bias-free MLPs")
        return
    if getattr(hf_config, "num_nextn_predict_layers", 0):
        raise ModelConfigError("MTP layers (num_nextn_predict_layers > 0) are not built by this backend")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ModelConfigError("attention_bias / mlp_bias: DSA in megatron-core requires bias-free linears")


def moe_layer_pattern(hf_config: Any) -> list[int]:
    types = getattr(hf_config, "mlp_layer_types", None)
    if types is None:
        k = int(hf_config.first_k_dense_replace)
        return [0] * k + [1] * (hf_config.num_hidden_layers - k)
    return [1 if t == "sparse" else 0 for t in types]


def _recompute(settings: MegatronSettings) -> dict[str, Any]:
    if settings.recompute != "none" and not torch.cuda.is_available():
        raise ModelConfigError(
            f"recompute={settings.recompute!r} needs CUDA (megatron's activation checkpointing saves the "
            "CUDA RNG state): use recompute='none' on a CPU"
        )
    if settings.recompute == "none":
        return {}
    return {
        "recompute_granularity": settings.recompute,
        **(
            {"recompute_method": "uniform", "recompute_num_layers": settings.recompute_num_layers}
            if settings.recompute == "full"
            else {}
        ),
    }


def _shared_fields(hf_config: Any, settings: MegatronSettings) -> dict[str, Any]:
    """What both model types set alike: the decoder's shape and norms, the MoE (sigmoid scores,
    expert bias for choice only, top-k weights renormalised then scaled), the parallel layout,
    precision and recompute."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[settings.params_dtype]
    n_group = int(getattr(hf_config, "n_group", 1) or 1)
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        apply_rope_fusion=False,  # DSA requires it off; the unfused RoPE runs everywhere
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=hf_config.initializer_range,
        num_moe_experts=hf_config.n_routed_experts,
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=hf_config.moe_intermediate_size * hf_config.n_shared_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # RL: the bias stays as loaded
        moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=int(hf_config.topk_group) if n_group > 1 else None,
        moe_token_dispatcher_type=settings.moe_token_dispatcher_type,
        moe_enable_routing_replay=settings.routing_replay,  # R3: megatron-core's RouterReplay per router
        moe_grouped_gemm=False,
        tensor_model_parallel_size=settings.tp,
        pipeline_model_parallel_size=settings.pp,
        virtual_pipeline_model_parallel_size=settings.vpp,
        num_layers_in_first_pipeline_stage=settings.first_stage_layers,
        num_layers_in_last_pipeline_stage=settings.last_stage_layers,
        context_parallel_size=settings.cp,
        expert_model_parallel_size=settings.ep,
        expert_tensor_parallel_size=settings.etp,
        sequence_parallel=settings.tp > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        transformer_impl="local",
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        **_recompute(settings),
    )


def rotary(hf_config: Any) -> tuple[float, float]:
    """(base, fraction of each head's dimensions rotated) of the config's RoPE; transformers 5
    keeps both in `rope_parameters`, older configs at the top level."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    base = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    fraction = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return float(base), float(fraction)


def transformer_config(hf_config: Any, settings: MegatronSettings) -> Any:
    """The megatron config that makes megatron compute what HF's `GlmMoeDsaForCausalLM` /
    `Glm4MoeForCausalLM` computes."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_hf_config(hf_config)
    shared = _shared_fields(hf_config, settings)
    if not has_dsa(hf_config):
        if settings.dsa_indexer_loss_coeff:
            raise ModelConfigError(
                f"dsa_indexer_loss_coeff={settings.dsa_indexer_loss_coeff}: a {hf_config.model_type} "
                "model has no DSA indexer; leave it unset"
            )
        return TransformerConfig(
            **shared,
            # grouped-query attention: q/k/v fused per query group, bias on them only
            num_query_groups=hf_config.num_key_value_heads,
            kv_channels=getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads,
            add_qkv_bias=bool(hf_config.attention_bias),
            add_bias_linear=False,
            qk_layernorm=bool(getattr(hf_config, "use_qk_norm", False)),
        )
    freq, offset = megatron_index_sharing(hf_config)
    return MLATransformerConfig(
        **shared,
        # MLA
        multi_latent_attention=True,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        qk_layernorm=True,
        rope_type="rope",
        rotary_base=rotary(hf_config)[0],
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        add_bias_linear=False,  # DSA requires it; HF GLM-5 has no biases
        # DSA with index sharing; GLM-5's indexer: interleaved RoPE, LayerNorm eps 1e-6, no Hadamard
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=hf_config.index_n_heads,
        dsa_indexer_head_dim=hf_config.index_head_dim,
        dsa_indexer_topk=hf_config.index_topk,
        dsa_indexer_topk_freq=freq,
        dsa_indexer_skip_topk_offset=offset,
        dsa_indexer_rope_interleaved=True,
        dsa_indexer_rotate_activation=False,
        dsa_indexer_k_norm_epsilon=1e-6,
        dsa_indexer_loss_coeff=settings.dsa_indexer_loss_coeff,
        dsa_kernel_backend="none",
        cp_comm_type="allgather" if settings.cp > 1 else None,
    )


_DUPLICATED_LINEAR: type | None = None


def _plain_linear() -> type:
    """megatron's plain duplicated `Linear` (the DSA indexer's projections, the absorbed MLA's
    down-projections), with a `sharded_state_dict` that gives each TP rank's copy its own replica
    id. megatron's own (`post_training/modelopt/layers.py`, 0.19.2 line 175) builds its sharded
    tensors with `tp_group=self.tp_group`, which is None for a duplicated linear, so every TP rank
    claims TP replica 0 of the same tensor and `dist_checkpointing.save` rejects the checkpoint
    under TP > 1 ("Invalid access pattern"). Here the TP rank goes into the replica id, as it does
    for every other replicated weight (norms, the router): TP rank 0 writes, the others are
    replicas. One class, made once (megatron matches the module class by identity)."""
    global _DUPLICATED_LINEAR
    if _DUPLICATED_LINEAR is not None:
        return _DUPLICATED_LINEAR
    from megatron.core import parallel_state as ps
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )

    class DuplicatedLinear(Linear):
        def sharded_state_dict(
            self, prefix: str = "", sharded_offsets: Any = (), metadata: Any = None
        ) -> Any:
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True),
                prefix,
                sharded_offsets=sharded_offsets,
                tp_group=self.tp_group or ps.get_tensor_model_parallel_group(),
                dp_cp_group=metadata["dp_cp_group"],
            )

    _DUPLICATED_LINEAR = DuplicatedLinear
    return DuplicatedLinear


class SequenceParallelTorchNorm:
    """torch's RMSNorm / LayerNorm that accepts sequence parallelism. Under it each rank
    normalises its own tokens, so the weights' gradients are partial sums: they are marked
    `sequence_parallel` for the TP all-reduce (megatron's torch wrapper refuses sequence
    parallelism instead, and the absorbed MLA demands it). A class, as `build_module` calls
    classes and passes plain functions through."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(config=plain, hidden_size=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class QKNorm(SequenceParallelTorchNorm):
    """The MLA q/kv latent norms (and the indexer's k norm). HF's `GlmMoeDsaAttention` builds
    `q_a_layernorm` / `kv_a_layernorm` with the RMSNorm default eps 1e-6, not `rms_norm_eps`
    (megatron would pass `layernorm_epsilon`): with 1e-5 the tiny model's logits differ by 4e-2."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> Any:
        return SequenceParallelTorchNorm.__new__(cls, config, hidden_size, eps=1e-6)


def spec_provider() -> Any:
    """megatron's local (non-TE) spec provider plus what the DSA spec asks of a backend: a plain
    duplicated `linear()` (indexer projections, MLA down-projections) and norms that accept
    sequence parallelism. Duplicated MLA down-projections also avoid a TP gradient error of the
    column-parallel ones (the RoPE slice of `linear_kv_down_proj` is never reduced)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    linear = _plain_linear()
    # Without TE absorbed_mla binds its `Linear` to None and then refuses the plain linear; it
    # accepts the down-projections' class by identity (`in [Linear, ...]`), so it gets ours.
    if absorbed_mla.Linear is None or absorbed_mla.Linear is linear.__base__:
        absorbed_mla.Linear = linear

    class Provider(LocalSpecProvider):
        def linear(self) -> type:
            return linear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> Any:
            return QKNorm if for_qk else SequenceParallelTorchNorm

    return Provider()


def layout_of(hf_config: Any, settings: MegatronSettings) -> PipelineLayout:
    return pipeline_layout(
        hf_config.num_hidden_layers,
        settings.pp,
        vpp=settings.vpp,
        first_stage_layers=settings.first_stage_layers,
        last_stage_layers=settings.last_stage_layers,
    )


def build_model(hf_config: Any, settings: MegatronSettings, *, vp_stage: int | None = None) -> Any:
    """This rank's `GPTModel` (its pipeline stage). Process groups must be initialised
    (`agentrl.train.megatron.parallel.initialize`). The pipeline split is checked first."""
    layout = layout_of(hf_config, settings)
    check_pipeline_split(hf_config, layout)
    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    config = transformer_config(hf_config, settings)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    pp = settings.pp
    stage = (vp_stage or 0) * pp + pp_rank
    backend = spec_provider()
    dsa = has_dsa(hf_config)
    if dsa:
        specs = get_transformer_layer_with_experimental_attention_variant_spec(config=config, backend=backend)
    else:
        from agentrl.train.megatron import gqa

        specs = gqa.layer_specs(config, backend)
        base, fraction = rotary(hf_config)
    local = list(layout.stages[stage])
    block = TransformerBlockSubmodules(
        layer_specs=[specs[i] for i in local],
        layer_norm=backend.layer_norm(rms_norm=True),
    )
    first = stage == 0
    last = stage == len(layout.stages) - 1
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        vp_stage=vp_stage,
        # MLA applies its own RoPE; grouped-query attention takes GPTModel's (rotate-half, the
        # first `fraction` of each head's dimensions, as HF's glm4_moe)
        **(
            {"position_embedding_type": "none"}
            if dsa
            else {"position_embedding_type": "rope", "rotary_percent": fraction, "rotary_base": base}
        ),
    )
    return model
