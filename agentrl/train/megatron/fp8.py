"""Block-quantised FP8 export for FP8 rollout engines (DeepSeek-V3 / GLM-5 FP8 checkpoint format).

A quantised weight W [m, n] travels as two tensors: `<name>` in float8_e4m3fn and
`<name minus ".weight">.weight_scale_inv` in float32 of shape [ceil(m / 128), ceil(n / 128)], one
scale per 128 x 128 block, such that W ~= fp8 * scale_inv block-wise (the convention of the FP8
checkpoints SGLang loads: its `block_quant` weight loader multiplies by `weight_scale_inv`).

Which weights are quantised must match the FP8 checkpoint the engines serve (its config's
`quantization_config`): `DEFAULT_TARGETS` is DeepSeek-V3's rule (every decoder linear projection;
not the norms, the router, the indexer's `weights_proj` that HF keeps in fp32, the embeddings or
the LM head). It has not been checked against a GLM-5-FP8 SGLang engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
DEFAULT_TARGETS = re.compile(
    r"^model\.layers\.\d+\.("
    r"self_attn\.(q_proj|k_proj|v_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r")\.weight$"
)


def block_quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight of the same shape, float32 scale_inv [ceil(m / block), ceil(n / block)])."""
    if weight.dim() != 2:
        raise ValueError(f"block quantisation takes a 2-D weight, got shape {tuple(weight.shape)}")
    m, n = weight.shape
    bm, bn = -(-m // block), -(-n // block)
    w = torch.zeros(bm * block, bn * block, dtype=torch.float32, device=weight.device)
    w[:m, :n] = weight.float()
    blocks = w.view(bm, block, bn, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(bm * block, bn * block)[:m, :n].contiguous(), scale


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 weight from its fp8 blocks and their scales."""
    m, n = q.shape
    s = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:m, :n]
    return q.float() * s


def quantize_named(
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = torch.bfloat16,
    targets: re.Pattern[str] = DEFAULT_TARGETS,
    block: int = BLOCK,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (checkpoint-layout) tensors -> the FP8 engine's: targeted weights as fp8 plus their
    `weight_scale_inv`, every other floating tensor cast to `dtype`."""
    for name, tensor in named:
        if targets.match(name):
            q, scale = block_quantize(tensor, block)
            yield name, q
            yield name[: -len("weight")] + "weight_scale_inv", scale
        elif dtype is not None and tensor.is_floating_point():
            yield name, tensor.to(dtype)
        else:
            yield name, tensor
