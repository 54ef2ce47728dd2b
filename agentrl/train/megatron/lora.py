"""LoRA on the Megatron trainer: low-rank adapters on megatron's parallel linears, only they train.

    W' = W + (alpha / rank) B A        A: [rank, in], B: [out, rank], B = 0 at the start

Which projections get one is read from the converter's rules (`convert.Arch`): a megatron linear
is adapted when the HF projections it holds are in `trainer.lora.targets` (the same leaf names as
the torch trainer's peft targets: `q_proj`, `o_proj`, `gate_proj`, ...). megatron fuses some of
them (`linear_qkv` = q, k, v; `linear_fc1` = gate, up): a fused projection gets one adapter whose
B spans the fused rows, which is exactly one PEFT adapter per HF projection sharing A (how
`adapter_weights` writes it); naming only some of a fused group is refused. Routed experts, the
router, norms, embeddings and the DSA indexer stay frozen, as with peft.

How each adapter is cut over tensor-parallel ranks follows its linear (the activations are
sequence-parallel under TP, so the low-rank activations travel, never the wide ones):
  column-parallel (`col`, `glu`, `qkv`)  A whole on every rank, applied to the local tokens, the
      [tokens, rank] product gathered over the sequence; B split by output rows like the weight
  row-parallel (`row`)                   A split by input columns like the weight; the partial
      [tokens, rank] product reduce-scattered over the sequence; B whole on every rank
  duplicated (`dup`, DSA's down-projections) A and B whole, on the local tokens
Weights whole on every rank that see only their rank's tokens have partial gradients: they are
marked `sequence_parallel`, so the trainer's TP reduction sums them, as megatron does for norms.
Adapters are kept and computed in fp32 (a bf16 model's adapters would lose their small updates).
Their initial A is drawn per adapter from the run's seed and its global layer, whatever the layout,
so every layout starts from the same adapters.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.train.config import LoraConfig
from agentrl.train.lora import LoraError
from agentrl.train.megatron import convert

_COLUMN = ("col", "glu", "qkv")
# Linears whose weight megatron reads directly instead of calling them: the absorbed MLA folds the
# KV up-projection into its attention (megatron-core 0.19.2 `absorbed_mla.py` line 688,
# `self.linear_kv_up_proj.weight.view(...)`). Their adapter is folded into the weight for the
# length of the attention's forward (W + s B A, differentiable), not added to an output.
_WEIGHT_READ = {"self_attention.linear_kv_up_proj.weight"}
_KINDS = (*_COLUMN, "row", "dup")
_PEFT_PREFIX = "base_model.model."


@dataclass
class Adapter:
    """One adapted linear of this rank: where it sits, how it is cut, its A and B."""

    chunk: int
    key: str  # the weight's key in its chunk's state dict
    layer: int  # global layer id
    rule: Any  # convert._Rule
    module: Any
    A: torch.nn.Parameter
    B: torch.nn.Parameter


def _leaf(hf_name: str) -> str:
    """`self_attn.q_proj.weight` -> `q_proj`."""
    return hf_name.rsplit(".", 2)[-2]


class MegatronLora:
    """The adapters of every model chunk of this rank, patched into their linears' forward."""

    def __init__(
        self,
        chunks: Sequence[Any],
        arch: convert.Arch,
        config: LoraConfig,
        *,
        tp_size: int,
        tp_rank: int,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.scale = config.alpha / config.rank
        self.sequence_parallel = tp_size > 1
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.adapters: list[Adapter] = []
        targets = set(config.targets)
        projections: set[str] = set()
        for c, chunk in enumerate(chunks):
            for name, module in chunk.named_modules():
                m = convert._LAYER.match(f"{name}.weight")
                rule = arch.rules.get(m.group(2)) if m else None
                if (
                    m is None
                    or rule is None
                    or rule.kind not in _KINDS
                    or not rule.megatron.endswith(".weight")
                ):
                    continue
                leaves = [_leaf(h) for h in rule.hf]
                if "norm" in rule.megatron or leaves == ["gate"]:
                    continue  # norms and the router are not projections
                projections.update(leaves)
                hit = [leaf for leaf in leaves if leaf in targets]
                if not hit:
                    continue
                if len(hit) != len(leaves):
                    raise LoraError(
                        f"trainer.lora.targets names {hit} but not {sorted(set(leaves) - set(hit))}: megatron "
                        f"fuses {leaves} into one projection ({rule.megatron}); target all of them or none"
                    )
                layer = chunk.agentrl_stage_layers[int(m.group(1))]
                parent = (
                    chunk.get_submodule(name.rsplit(".", 1)[0]) if rule.megatron in _WEIGHT_READ else None
                )
                self.adapters.append(self._adapt(c, f"{name}.weight", layer, rule, module, seed, parent))
        for chunk in chunks:
            embedding = getattr(chunk, "embedding", None)  # the first pipeline stage's
            if embedding is not None:
                embedding.register_forward_hook(_require_grad)
        if not self.adapters:
            raise LoraError(
                f"trainer.lora.targets {sorted(targets)} match no projection of this model; its "
                f"projections are {sorted(projections)}"
            )
        self.targets = sorted({_leaf(h) for a in self.adapters for h in a.rule.hf})

    # -- building --------------------------------------------------------------------------------

    def _adapt(
        self, chunk: int, key: str, layer: int, rule: Any, module: Any, seed: int, parent: Any = None
    ) -> Adapter:
        weight = module.weight
        out_local, in_local = weight.shape
        r, kind = self.config.rank, rule.kind
        out_full = out_local * (self.tp_size if kind in _COLUMN else 1)
        in_full = in_local * (self.tp_size if kind == "row" else 1)
        # A's initial values (peft's: Kaiming-uniform with a = sqrt(5)) from the seed, the layer
        # and the projection, drawn whole and then cut: the same adapters under every layout.
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer}/{rule.megatron}".encode()))
        bound = 1.0 / math.sqrt(in_full)
        a_full = (torch.rand(r, in_full, generator=g) * 2 - 1) * bound
        if kind == "row":
            a_full = a_full.chunk(self.tp_size, dim=1)[self.tp_rank]
        A = torch.nn.Parameter(a_full.to(weight.device).contiguous())
        B = torch.nn.Parameter(
            torch.zeros(out_local if kind in _COLUMN else out_full, r, device=weight.device)
        )
        if kind in _COLUMN:
            _split(B, dim=0)
            A.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
        elif kind == "row":
            _split(A, dim=1)
            B.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
        else:
            for p in (A, B):
                p.sequence_parallel = bool(getattr(weight, "sequence_parallel", False))  # type: ignore[attr-defined]
        adapter = Adapter(chunk, key, layer, rule, module, A, B)
        if parent is not None:
            self._fold_around(parent, adapter)
            return adapter
        original = module.forward

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = original(x, *args, **kwargs)
            if isinstance(out, tuple):
                return (out[0] + self._delta(adapter, x).to(out[0].dtype), *out[1:])
            return out + self._delta(adapter, x).to(out.dtype)

        module.forward = forward
        return adapter

    def _fold_around(self, parent: Any, a: Adapter) -> None:
        """While `parent` runs (its recomputation included), the linear's `weight` is W + s B A."""
        linear = a.module

        def before(_module: Any, _args: Any) -> None:
            base = linear._parameters.pop("weight")
            linear._agentrl_base = base
            linear.weight = base + (self.scale * a.B @ a.A).to(base.dtype)

        def after(_module: Any, _args: Any, _out: Any) -> None:
            del linear.weight
            linear._parameters["weight"] = linear._agentrl_base
            del linear._agentrl_base

        parent.register_forward_pre_hook(before)
        parent.register_forward_hook(after)

    def _delta(self, a: Adapter, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        x = x.float()
        if self.config.dropout:
            x = torch.nn.functional.dropout(x, self.config.dropout, training=a.module.training)
        z = x @ a.A.t()
        if a.rule.kind in _COLUMN and self.sequence_parallel:
            z = mappings.gather_from_sequence_parallel_region(z)
        elif a.rule.kind == "row" and self.tp_size > 1:
            z = (
                mappings.reduce_scatter_to_sequence_parallel_region(z)
                if self.sequence_parallel
                else mappings.reduce_from_tensor_model_parallel_region(z)
            )
        return (z @ a.B.t()) * self.scale

    # -- what the trainer asks of it -------------------------------------------------------------

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for a in self.adapters:
            yield a.A
            yield a.B

    def fold(self, chunk: int) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """For `convert.megatron_to_hf`: a local weight with its adapter folded in (W + scale B A,
        this rank's shard of it), any other tensor as it is."""
        mine = {a.key: a for a in self.adapters if a.chunk == chunk}

        def fn(key: str, local: torch.Tensor) -> torch.Tensor:
            a = mine.get(key)
            if a is None:
                return local
            with torch.no_grad():
                return local + (self.scale * a.B @ a.A).to(local.dtype)

        return fn

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's adapters by chunk and weight key (a checkpoint's per-rank file)."""
        out = {}
        for a in self.adapters:
            out[f"{a.chunk}/{a.key}/A"] = a.A.detach()
            out[f"{a.chunk}/{a.key}/B"] = a.B.detach()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = set(self.state_dict())
        if set(state) != expected:
            raise LoraError(
                f"the checkpoint's adapters are not this model's: {len(set(state) - expected)} unexpected, "
                f"{len(expected - set(state))} missing (trainer.lora.targets or the layout changed?)"
            )
        with torch.no_grad():
            for a in self.adapters:
                a.A.copy_(state[f"{a.chunk}/{a.key}/A"])
                a.B.copy_(state[f"{a.chunk}/{a.key}/B"])

    def hf_adapters(self, group: Any, arch: convert.Arch) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's adapters as whole tensors under PEFT's names (`base_model.model.` + the HF
        module + `.lora_A.weight` / `.lora_B.weight`), gathered over TP; a fused projection gives
        one pair per HF projection, sharing A. Every rank of the TP group iterates it together."""
        size = self.tp_size
        for a in self.adapters:
            kind, hf = a.rule.kind, a.rule.hf
            A, B = a.A.detach(), a.B.detach()
            if kind == "row":
                A = torch.cat(convert._all_gather(A, group, size), dim=1)
            if kind in _COLUMN:
                parts = convert._all_gather(B, group, size)
                if kind == "glu":
                    halves = [p.chunk(2, dim=0) for p in parts]
                    Bs = [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
                elif kind == "qkv":
                    Bs = arch.split_groups(torch.cat(parts))
                else:
                    Bs = [torch.cat(parts)]
            else:
                Bs = [B]
            prefix = f"{_PEFT_PREFIX}model.layers.{a.layer}."
            for name, b in zip(hf, Bs, strict=True):
                module = prefix + name.removesuffix(".weight")
                # Copies: a fused group's projections share A, and safetensors refuses tensors
                # that share memory (the adapters are small).
                yield f"{module}.lora_A.weight", A.clone()
                yield f"{module}.lora_B.weight", b.clone()

    def adapter_config(self) -> dict[str, Any]:
        """`adapter_config.json` as PEFT writes it for these adapters."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.config.rank,
            "lora_alpha": self.config.alpha,
            "lora_dropout": self.config.dropout,
            "target_modules": self.targets,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
            "base_model_name_or_path": None,
            "modules_to_save": None,
        }


def _require_grad(_module: Any, _args: Any, out: Any) -> Any:
    """The frozen embedding's output made to require a gradient: megatron's activation
    recompute (a reentrant autograd function) runs no backward for a block whose inputs need no
    gradient, so without it the adapters inside a recomputed layer would get none."""
    if torch.is_tensor(out) and not out.requires_grad:
        return out.requires_grad_(True)
    return out


def _split(p: torch.Tensor, *, dim: int) -> None:
    """megatron's marks of a tensor-parallel shard (counted on every TP rank by the norm)."""
    p.tensor_model_parallel = True  # type: ignore[attr-defined]
    p.partition_dim = dim  # type: ignore[attr-defined]
    p.partition_stride = 1  # type: ignore[attr-defined]
