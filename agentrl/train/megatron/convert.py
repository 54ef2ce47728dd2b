"""Hugging Face `glm_moe_dsa` / `glm4_moe` <-> megatron-core names, shapes and shards.

One table per model type (`_DSA_RULES`, `_GQA_RULES`; `Arch.of(hf_config)` picks it) maps each
megatron parameter of a decoder layer to its HF tensor(s) and says how it is cut over
tensor-parallel ranks; both directions read it:

- `hf_to_megatron(hf_state, model, ...)` / `load_hf_into`: every rank cuts its own shard out of
  the HF tensors, reading only what it holds: its stage's layers, its experts, and (from a
  streaming `hf_io.HFCheckpoint`) only its TP slice of each tensor. `hf_state` may use
  transformers' in-memory names (stacked experts) or the checkpoint files' (one tensor per expert);
- `megatron_to_hf(models, ...)`: full HF tensors, in HF names and shapes, gathered over TP (and
  expert TP / EP) ranks, one at a time, in a fixed order that every rank follows (the weight
  source of every sync transport and of the HF export; `layout="checkpoint"` streams experts one
  at a time under the files' names).

Shard kinds: "dup" (the same on every TP rank), "col" (rows split over TP), "row" (columns split),
"glu" (megatron's fc1 holds [gate; up] per rank: rank r has gate_r then up_r), "qkv" (megatron's
fused `linear_qkv` holds, per query group, the group's query heads then its key and its value head;
TP splits the groups), "vocab" (rows of the embedding / LM head split over TP). The HF <-> Megatron name table is in
`shared/reference/megatron_glm5.md`; megatron-bridge's GLM5Bridge is not used (see docs/megatron.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agentrl.train.megatron.plan import PipelineLayout


class ConversionError(ValueError):
    """A tensor that is missing, unexpected or of the wrong shape in a conversion."""


@dataclass(frozen=True)
class _Rule:
    megatron: str  # suffix after `decoder.layers.{i}.`
    hf: tuple[str, ...]  # suffix(es) after `model.layers.{i}.`
    kind: str


_NORMS = [
    _Rule("input_layernorm.weight", ("input_layernorm.weight",), "dup"),
    _Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "dup"),
]
_MLP = [
    _Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu"),
    _Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "row"),
    _Rule("mlp.router.weight", ("mlp.gate.weight",), "dup"),
    _Rule("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), "dup"),
    _Rule(
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
        "glu",
    ),
    _Rule("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), "row"),
]
_DSA_RULES = [
    *_NORMS,
    *_MLP,
    _Rule("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), "dup"),
    _Rule("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",), "dup"),
    _Rule("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), "col"),
    _Rule("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",), "dup"),
    _Rule("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",), "dup"),
    _Rule("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), "col"),
    _Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "row"),
    _Rule(
        "self_attention.core_attention.indexer.linear_wq_b.weight", ("self_attn.indexer.wq_b.weight",), "dup"
    ),
    _Rule("self_attention.core_attention.indexer.linear_wk.weight", ("self_attn.indexer.wk.weight",), "dup"),
    _Rule("self_attention.core_attention.indexer.k_norm.weight", ("self_attn.indexer.k_norm.weight",), "dup"),
    _Rule("self_attention.core_attention.indexer.k_norm.bias", ("self_attn.indexer.k_norm.bias",), "dup"),
    _Rule(
        "self_attention.core_attention.indexer.linear_weights_proj.weight",
        ("self_attn.indexer.weights_proj.weight",),
        "dup",
    ),
]
_QKV = tuple(f"self_attn.{p}_proj" for p in "qkv")
_GQA_RULES = [
    *_NORMS,
    *_MLP,
    _Rule("self_attention.linear_qkv.weight", tuple(f"{p}.weight" for p in _QKV), "qkv"),
    _Rule("self_attention.linear_qkv.bias", tuple(f"{p}.bias" for p in _QKV), "qkv"),
    _Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "dup"),
    _Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "dup"),
    _Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "row"),
]
_TOP = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", "vocab"),
    "decoder.final_layernorm.weight": ("model.norm.weight", "dup"),
    "output_layer.weight": ("lm_head.weight", "vocab"),
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
# Megatron state that is not a weight of the HF model.
_SKIP = re.compile(r"(local_tokens_per_expert|_extra_state)$")


@dataclass(frozen=True)
class Arch:
    """What a conversion needs of the model: its layer rules (by megatron suffix), its routed
    expert count, and for the fused QKV its query heads, query groups and head size."""

    rules: Mapping[str, _Rule]
    num_experts: int
    heads: int = 0
    groups: int = 0
    head_dim: int = 0

    @classmethod
    def of(cls, hf_config: Any) -> Arch:
        if getattr(hf_config, "model_type", None) == "glm_moe_dsa":
            return cls({r.megatron: r for r in _DSA_RULES}, int(hf_config.n_routed_experts))
        heads, groups = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(
            {r.megatron: r for r in _GQA_RULES}, int(hf_config.n_routed_experts), heads, groups, head_dim
        )

    def split_groups(self, fused: torch.Tensor, tp_size: int = 1) -> list[torch.Tensor]:
        """megatron's fused QKV rows (of `groups / tp_size` groups) -> [q, k, v] rows."""
        if self.groups % tp_size:
            raise ConversionError(f"{self.groups} query groups do not split over {tp_size} TP ranks")
        per = self.heads // self.groups
        g = fused.reshape(self.groups // tp_size, (per + 2) * self.head_dim, *fused.shape[1:])
        q, k, v = g.split([per * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return [t.reshape(-1, *fused.shape[1:]) for t in (q, k, v)]

    def fuse_groups(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`split_groups`' inverse: [q, k, v] rows of some query groups -> megatron's fused rows."""
        n = k.shape[0] // self.head_dim
        parts = [t.reshape(n, -1, *t.shape[1:]) for t in (q, k, v)]
        return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


@dataclass(frozen=True)
class Ranks:
    """This rank's coordinates in the groups that shard weights."""

    tp: int = 0
    tp_size: int = 1
    etp: int = 0
    etp_size: int = 1
    ep: int = 0
    ep_size: int = 1

    @classmethod
    def current(cls) -> Ranks:
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            ep=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
        )


def _shard(full: torch.Tensor, kind: str, rank: int, size: int) -> torch.Tensor:
    if kind == "dup" or size == 1:
        return full
    if kind in ("col", "vocab"):
        return full.chunk(size, dim=0)[rank]
    if kind == "row":
        return full.chunk(size, dim=1)[rank]
    raise ConversionError(f"unknown shard kind {kind!r}")


def _glu_shard(gate: torch.Tensor, up: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)


def _read(hf_state: Mapping[str, torch.Tensor], name: str, kind: str, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of HF tensor `name`; a mapping with `read_chunk` (a streaming
    `hf_io.HFCheckpoint`) reads only that shard from disk."""
    if name not in hf_state:
        raise ConversionError(f"HF weight {name} is missing")
    dim = {"col": 0, "vocab": 0, "row": 1}.get(kind)
    read_chunk = getattr(hf_state, "read_chunk", None)
    if dim is not None and size > 1 and read_chunk is not None:
        return read_chunk(name, dim, rank, size)
    return _shard(hf_state[name], kind, rank, size)


def _read_glu(hf_state: Mapping[str, torch.Tensor], gate: str, up: str, rank: int, size: int) -> torch.Tensor:
    return torch.cat(
        [_read(hf_state, gate, "col", rank, size), _read(hf_state, up, "col", rank, size)], dim=0
    )


def _hf_values(
    hf_state: Mapping[str, torch.Tensor],
    model: torch.nn.Module,
    stage_layers: Sequence[int],
    arch: Arch,
    ranks: Ranks,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(megatron key, this rank's value from HF, the model's own tensor) for every weight of
    `model`, reading from `hf_state` only the tensors (and TP slices) this rank holds."""
    local_experts = arch.num_experts // ranks.ep_size
    for key, target in model.state_dict().items():
        if _SKIP.search(key):
            continue
        if key in _TOP:
            hf_name, kind = _TOP[key]
            value = _read(hf_state, hf_name, kind, ranks.tp, ranks.tp_size)
        else:
            m = _LAYER.match(key)
            if m is None:
                raise ConversionError(f"no HF source for megatron weight {key}")
            layer = stage_layers[int(m.group(1))]
            rest = m.group(2)
            prefix = f"model.layers.{layer}."
            e = _EXPERT.match(rest)
            if e is not None:
                value = _expert_value(
                    hf_state, prefix, ranks.ep * local_experts + int(e.group(1)), e.group(2), ranks
                )
            elif rest in arch.rules:
                rule = arch.rules[rest]
                if rule.kind == "qkv":
                    value = arch.fuse_groups(
                        *(_read(hf_state, prefix + n, "col", ranks.tp, ranks.tp_size) for n in rule.hf)
                    )
                elif rule.kind == "glu":
                    value = _read_glu(
                        hf_state, prefix + rule.hf[0], prefix + rule.hf[1], ranks.tp, ranks.tp_size
                    )
                else:
                    value = _read(hf_state, prefix + rule.hf[0], rule.kind, ranks.tp, ranks.tp_size)
            else:
                raise ConversionError(f"no HF source for megatron weight {key}")
        if tuple(value.shape) != tuple(target.shape):
            raise ConversionError(
                f"{key}: HF tensor gives shape {tuple(value.shape)} on this rank, the model has {tuple(target.shape)}"
            )
        yield key, value, target


def _expert_value(
    hf_state: Mapping[str, torch.Tensor], prefix: str, expert: int, fc: str, ranks: Ranks
) -> torch.Tensor:
    """One expert's fc1 ([gate; up] of this expert-TP rank) or fc2, from either HF layout: the
    checkpoint files' one tensor per expert, or transformers' stacked in-memory tensors."""
    one = f"{prefix}mlp.experts.{expert}."
    if one + "down_proj.weight" in hf_state:
        if fc == "1":
            return _read_glu(
                hf_state, one + "gate_proj.weight", one + "up_proj.weight", ranks.etp, ranks.etp_size
            )
        return _read(hf_state, one + "down_proj.weight", "row", ranks.etp, ranks.etp_size)
    if fc == "1":
        gate, up = _read(hf_state, prefix + "mlp.experts.gate_up_proj", "dup", 0, 1)[expert].chunk(2, dim=0)
        return _glu_shard(gate, up, ranks.etp, ranks.etp_size)
    return _shard(
        _read(hf_state, prefix + "mlp.experts.down_proj", "dup", 0, 1)[expert],
        "row",
        ranks.etp,
        ranks.etp_size,
    )


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    model: torch.nn.Module,
    *,
    stage_layers: Sequence[int],
    arch: Arch,
    ranks: Ranks | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's megatron state dict (the keys of `model.state_dict()` that hold weights) cut
    from the HF tensors. `stage_layers`: the global (0-indexed) ids of this stage's layers.
    `hf_state`: full HF tensors in transformers' names (a `state_dict()`) or in the checkpoint
    files' names (`hf_io.HFCheckpoint`, read lazily: only this rank's layers, experts and TP
    slices). Raises `ConversionError` naming any megatron weight without an HF source, or a shape
    mismatch."""
    ranks = ranks or Ranks.current()
    return {
        key: value.to(target.dtype)
        for key, value, target in _hf_values(hf_state, model, stage_layers, arch, ranks)
    }


def load_hf_into(
    hf_state: Mapping[str, torch.Tensor],
    model: torch.nn.Module,
    *,
    stage_layers: Sequence[int],
    arch: Arch,
    ranks: Ranks | None = None,
) -> None:
    """Copy the HF weights into `model` in place, one tensor at a time (strict: every weight of the
    model is set; peak memory is the model plus one tensor, whatever `hf_state` holds)."""
    ranks = ranks or Ranks.current()
    with torch.no_grad():
        for _, value, target in _hf_values(hf_state, model, stage_layers, arch, ranks):
            target.copy_(value)


def _all_gather(t: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _unshard(local: torch.Tensor, kind: str, group: Any, size: int) -> torch.Tensor:
    if kind == "dup" or size == 1:
        return local
    parts = _all_gather(local, group, size)
    return torch.cat(parts, dim=1 if kind == "row" else 0)


def _unshard_glu(local: torch.Tensor, group: Any, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = _all_gather(local, group, size)
    gates, ups = zip(*(p.chunk(2, dim=0) for p in parts), strict=True)
    return torch.cat(gates, dim=0), torch.cat(ups, dim=0)


def megatron_to_hf(
    model: torch.nn.Module,
    *,
    stage_layers: Sequence[int],
    arch: Arch,
    layout: str = "stacked",
    fold: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's weights as full HF tensors, in the model's order; every rank of the stage's
    TP / EP groups must iterate it together (the gathers are collectives). `layout="stacked"`:
    transformers' in-memory names, a layer's experts as two stacked tensors once its last expert
    is seen (every EP rank then holds the layer's experts); `layout="checkpoint"`: the checkpoint
    files' names, one tensor per expert, gathered one local expert slot at a time (at most EP
    experts held: what a streaming export of a large model needs). `fold(key, local)` replaces each
    local tensor before it is gathered (LoRA: the adapter folded into its weight's shard)."""
    if layout not in ("stacked", "checkpoint"):
        raise ValueError(f"layout {layout!r}: 'stacked' or 'checkpoint'")
    from megatron.core import parallel_state as ps

    tp_group, tp_size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    etp_group, etp_size = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()
    ep_group, ep_size = ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()
    local_experts = arch.num_experts // ep_size
    pending: dict[int, dict[str, list[torch.Tensor | None]]] = {}
    for key, local in model.state_dict(keep_vars=False).items():
        if _SKIP.search(key):
            continue
        local = local.detach()
        if fold is not None:
            local = fold(key, local)
        if key in _TOP:
            hf_name, kind = _TOP[key]
            yield hf_name, _unshard(local, kind, tp_group, tp_size)
            continue
        m = _LAYER.match(key)
        if m is None:
            raise ConversionError(f"no HF name for megatron weight {key}")
        layer = stage_layers[int(m.group(1))]
        rest = m.group(2)
        prefix = f"model.layers.{layer}."
        e = _EXPERT.match(rest)
        if e is not None and layout == "checkpoint":
            yield from _expert_to_checkpoint(
                prefix,
                int(e.group(1)),
                e.group(2),
                local,
                local_experts,
                etp_group,
                etp_size,
                ep_group,
                ep_size,
            )
            continue
        if e is not None:
            slots = pending.setdefault(layer, {"1": [None] * local_experts, "2": [None] * local_experts})
            slots[e.group(2)][int(e.group(1))] = local
            if all(t is not None for v in slots.values() for t in v):
                yield from _experts_to_hf(prefix, pending.pop(layer), etp_group, etp_size, ep_group, ep_size)
            continue
        rule = arch.rules.get(rest)
        if rule is None:
            raise ConversionError(f"no HF name for megatron weight {key}")
        if rule.kind == "qkv":
            fused = torch.cat(_all_gather(local, tp_group, tp_size), dim=0)
            for name, part in zip(rule.hf, arch.split_groups(fused), strict=True):
                yield prefix + name, part
        elif rule.kind == "glu":
            gate, up = _unshard_glu(local, tp_group, tp_size)
            yield prefix + rule.hf[0], gate
            yield prefix + rule.hf[1], up
        else:
            yield prefix + rule.hf[0], _unshard(local, rule.kind, tp_group, tp_size)
    if pending:
        raise ConversionError(f"experts of layers {sorted(pending)} were incomplete in the state dict")


def _experts_to_hf(
    prefix: str, slots: dict[str, list[Any]], etp_group: Any, etp_size: int, ep_group: Any, ep_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    fc1 = []
    for t in slots["1"]:
        gate, up = _unshard_glu(t, etp_group, etp_size) if etp_size > 1 else t.chunk(2, dim=0)
        fc1.append(torch.cat([gate, up], dim=0))
    fc2 = [_unshard(t, "row", etp_group, etp_size) for t in slots["2"]]
    gate_up = torch.stack(fc1)
    down = torch.stack(fc2)
    # Experts are spread over EP ranks in order: rank r holds experts r * E_local ... .
    gate_up = torch.cat(_all_gather(gate_up, ep_group, ep_size), dim=0)
    down = torch.cat(_all_gather(down, ep_group, ep_size), dim=0)
    yield prefix + "mlp.experts.gate_up_proj", gate_up
    yield prefix + "mlp.experts.down_proj", down


def _expert_to_checkpoint(
    prefix: str,
    slot: int,
    fc: str,
    local: torch.Tensor,
    local_experts: int,
    etp_group: Any,
    etp_size: int,
    ep_group: Any,
    ep_size: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    if fc == "1":
        full = torch.cat(_unshard_glu(local, etp_group, etp_size), dim=0)
    else:
        full = _unshard(local, "row", etp_group, etp_size)
    # EP rank r holds experts r * E_local ...: gathering slot j gives experts j, E_local + j, ...
    for r, t in enumerate(_all_gather(full, ep_group, ep_size)):
        one = f"{prefix}mlp.experts.{r * local_experts + slot}."
        if fc == "1":
            gate, up = t.chunk(2, dim=0)
            yield one + "gate_proj.weight", gate
            yield one + "up_proj.weight", up
        else:
            yield one + "down_proj.weight", t


_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_layout(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' in-memory names -> the names of HF checkpoint files: the stacked experts
    (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) become one tensor per expert
    and projection (`mlp.experts.{e}.gate_proj.weight`, `up_proj.weight`, `down_proj.weight`),
    as `save_pretrained` writes them and as SGLang's MoE loader expects them."""
    for name, tensor in named:
        m = _STACKED.match(name)
        if m is None:
            yield name, tensor
            continue
        prefix, kind = m.groups()
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up


def stage_layers(layout: PipelineLayout, stage: int) -> list[int]:
    return list(layout.stages[stage])
