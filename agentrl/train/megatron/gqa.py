"""Grouped-query attention models (`glm4_moe`, GLM-4.5) on megatron-core's own modules.

megatron's `SelfAttention` (fused QKV, optional QK norm, partial rotary embeddings) and its MoE,
with one module of ours: `PackedCoreAttention`, the core attention over packed (THD) sequences (`packing.PackedRows`'
`packed_seq_params`, which carry the sequence lengths and the CP gather order).
megatron's local `DotProductAttention` refuses packed sequences and context parallelism (both are
TransformerEngine-only there), and the trainer packs every micro-batch; this one runs torch's
`scaled_dot_product_attention` per sequence (flash / memory-efficient kernels on a GPU, causal
masks aligned at the bottom right), on a CPU and on a GPU, under TP (local heads), SP and CP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention.bias import causal_lower_right


class _GatherKeysValues(torch.autograd.Function):
    """All-gather [T_local, ...] over the CP group -> [cp x T_local, ...] in rank order. Every rank
    attends its own queries to all keys, so rank r's key gradient is the sum over ranks of their
    gradients for its slice (all-reduce, then its slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n].contiguous(), None


class PackedCoreAttention(MegatronModule):
    """Causal softmax attention of packed sequences (`packed_seq_params.qkv_format == "thd"`):
    query [T, heads, d], key and value [T, groups, d] of this TP rank (grouped-query: each group
    serves heads / groups consecutive heads, as in HF's `repeat_kv`), out [T, heads x d]. Under
    context parallelism the keys and values of the whole packed row are gathered over the CP
    group and each local chunk attends to its sequence's keys up to its own positions."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackedCoreAttention takes packed (THD) sequences: pass packed_seq_params")
        # The packed row's sequence lengths and (under CP) the order that puts the gathered ranks'
        # tokens back in place: `PackedRows` made both on the host once per micro-batch.
        lengths = packed_seq_params.agentrl_lengths
        cp = ps.get_context_parallel_world_size()
        if cp > 1:
            group = ps.get_context_parallel_group()
            order = packed_seq_params.agentrl_gather_order
            key = _GatherKeysValues.apply(key, group)[order]
            value = _GatherKeysValues.apply(value, group)[order]
        rank = ps.get_context_parallel_rank() if cp > 1 else 0
        out, local, start = [], 0, 0
        for n in lengths:
            k = key[start : start + n].transpose(0, 1)[None]
            v = value[start : start + n].transpose(0, 1)[None]
            # This rank's chunks of the sequence: (first position, size); all of it without CP.
            half = n // (2 * cp)
            chunks = [(0, n)] if cp == 1 else [(rank * half, half), (n - (rank + 1) * half, half)]
            for first, size in chunks:
                if size == 0:
                    continue
                q = query[local : local + size].transpose(0, 1)[None]
                seen = first + size  # keys at positions < first + size; the chunk's causal part
                o = torch.nn.functional.scaled_dot_product_attention(
                    q,
                    k[:, :, :seen],
                    v[:, :, :seen],
                    attn_mask=causal_lower_right(size, seen),
                    scale=self.scale,
                    enable_gqa=True,
                )
                out.append(o[0].transpose(0, 1))
                local += size
            start += n
        result = torch.cat(out)
        return result.reshape(result.shape[0], -1)


def layer_specs(config: Any, backend: Any) -> list[Any]:
    """Every decoder layer's spec (dense or MoE per `config.moe_layer_freq`): megatron's
    `SelfAttention` and MLP / MoE from `backend` (the local provider with norms that accept
    sequence parallelism), the core attention `PackedCoreAttention`."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = backend.layer_norm(rms_norm=True)
    qk_norm = norm if config.qk_layernorm else IdentityOp  # HF's q_norm / k_norm: eps = rms_norm_eps
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_parallel_linear(),
            core_attention=PackedCoreAttention,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )

    def layer(num_experts: int | None) -> Any:
        return ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=norm,
                self_attention=attention,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=norm,
                mlp=get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts),
                mlp_bda=get_bias_dropout_add,
            ),
        )

    dense, moe = layer(None), layer(config.num_moe_experts)
    return [moe if is_moe else dense for is_moe in config.moe_layer_freq]
