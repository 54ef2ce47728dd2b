"""Parallel layout of a model of the Megatron backend and the DSA pipeline-split rule, without megatron.

GLM-5's DeepSeek Sparse Attention computes its top-k token indices only on some layers
("computing" layers: HF `indexer_types[i] == "full"`) and the following layers reuse them. The
indices live in the forward pass of one pipeline stage, so every pipeline (and virtual pipeline)
stage must start on a computing layer. `check_pipeline_split` says so before any model is built,
naming the offending layer; megatron-core checks the same inside its builder, later and in its own
words.

Pure Python on purpose: the rule is checked on the 3.11 side too (recipes, `--dry-run`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.errors import AgentRLError

# The Hugging Face model types this backend builds (model and converter): `glm_moe_dsa` (MLA + DSA
# + MoE, GLM-5) and `glm4_moe` (grouped-query attention + MoE, GLM-4.5); the cluster recipes refuse
# to launch training of any other.
MODEL_TYPES = ("glm_moe_dsa", "glm4_moe")


def has_dsa(hf_config: Any) -> bool:
    """Whether the model has DeepSeek Sparse Attention (an indexer: `glm_moe_dsa`)."""
    return getattr(hf_config, "model_type", None) == "glm_moe_dsa"


class PipelineSplitError(AgentRLError):
    """A pipeline layout that cuts a DSA index-sharing run of layers."""


class ModelConfigError(AgentRLError):
    """A Hugging Face config that this backend cannot build."""


def indexer_types(hf_config: Any) -> list[str]:
    """Per layer "full" (computes its DSA top-k) or "shared" (reuses the last full layer's)."""
    types = getattr(hf_config, "indexer_types", None)
    n = int(hf_config.num_hidden_layers)
    if types is None:
        # A config from before transformers spelled the pattern out: HF's own rule on its fields
        # (0-indexed layer i computes iff max(i - offset + 1, 0) % freq == 0; offset default 2).
        freq = max(int(getattr(hf_config, "index_topk_freq", 1) or 1), 1)
        offset = int(getattr(hf_config, "index_skip_topk_offset", 2))
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = list(types)
    if len(types) != n or set(types) - {"full", "shared"}:
        raise ModelConfigError(
            f"indexer_types must list 'full' or 'shared' for each of the {n} layers, got {types}"
        )
    if types and types[0] != "full":
        raise ModelConfigError("indexer_types[0] must be 'full': the first layer has no indices to reuse")
    return types


def computing_layers(hf_config: Any) -> list[int]:
    """1-indexed numbers of the layers that compute their own DSA indices."""
    return [i + 1 for i, t in enumerate(indexer_types(hf_config)) if t == "full"]


def megatron_index_sharing(hf_config: Any) -> tuple[int, int]:
    """(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset) giving exactly the HF pattern.

    megatron-core: 1-indexed layer L computes iff max(L - max(offset, 1), 0) % freq == 0. The HF
    defaults differ (HF `index_skip_topk_offset` 2, megatron 0), so the pair is derived from the
    pattern itself rather than copied field by field."""
    types = indexer_types(hf_config)
    n = len(types)
    for freq in range(1, n + 1):
        for offset in range(0, n + 1):
            pattern = ["shared" if max(L - max(offset, 1), 0) % freq else "full" for L in range(1, n + 1)]
            if pattern == types:
                return freq, offset
    raise ModelConfigError(
        f"indexer_types {types} is not a (frequency, offset) pattern that megatron-core can express"
    )


@dataclass(frozen=True)
class PipelineLayout:
    """Which decoder layers each (virtual) pipeline stage holds, in stage order."""

    stages: tuple[tuple[int, ...], ...]  # 0-indexed layer ids per stage, stage order = model order

    @property
    def stage_starts(self) -> list[int]:
        return [s[0] + 1 for s in self.stages if s]


def pipeline_layout(
    num_layers: int,
    pp: int,
    *,
    vpp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> PipelineLayout:
    """Megatron's split: `first_stage_layers` / `last_stage_layers` set the uneven ends, the rest
    is divided evenly over the middle stages; with `vpp` every rank's share is cut into `vpp`
    virtual stages (model order: virtual stage 0 of every rank, then 1, ...)."""
    if pp < 1:
        raise PipelineSplitError(f"pipeline size must be >= 1, got {pp}")
    if pp == 1:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise PipelineSplitError("first/last stage layers need a pipeline size > 1")
        return PipelineLayout((tuple(range(num_layers)),))
    sizes: list[int]
    first, last = first_stage_layers, last_stage_layers
    middle_count = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_count == 0 and rest != 0) or (middle_count and rest % middle_count):
        raise PipelineSplitError(
            f"{num_layers} layers do not split over {pp} stages with first={first}, last={last}: "
            f"the {middle_count} middle stage(s) must share {rest} layers evenly"
        )
    middle = [rest // middle_count] * middle_count if middle_count else []
    sizes = ([first] if first is not None else []) + middle + ([last] if last is not None else [])
    v = vpp or 1
    if v > 1:
        if first is not None or last is not None:
            raise PipelineSplitError("virtual pipeline stages with uneven first/last stages: give a layout")
        per = num_layers // (pp * v)
        if per * pp * v != num_layers:
            raise PipelineSplitError(f"{num_layers} layers do not split into {pp} x {v} virtual stages")
        chunks = [tuple(range(k * per, (k + 1) * per)) for k in range(pp * v)]
        return PipelineLayout(tuple(chunks))
    stages, start = [], 0
    for size in sizes:
        stages.append(tuple(range(start, start + size)))
        start += size
    return PipelineLayout(tuple(stages))


def check_pipeline_split(hf_config: Any, layout: PipelineLayout | Sequence[Sequence[int]]) -> None:
    """Raise `PipelineSplitError` unless every stage starts on a computing layer (or holds the
    computing layer of every sharing layer it has, in order)."""
    stages = layout.stages if isinstance(layout, PipelineLayout) else tuple(tuple(s) for s in layout)
    if not has_dsa(hf_config):
        return  # no indices shared between layers: any split
    types = indexer_types(hf_config)
    for k, stage in enumerate(stages):
        seen_full = False
        for layer_id in stage:
            if types[layer_id] == "full":
                seen_full = True
            elif not seen_full:
                source = max(i for i in range(layer_id) if types[i] == "full") + 1
                raise PipelineSplitError(
                    f"pipeline stage {k} starts at layer {layer_id + 1} (1-indexed), which reuses the DSA "
                    f"top-k indices of layer {source} in an earlier stage: indices do not cross stage "
                    f"boundaries. Start every stage on a computing layer "
                    f"({', '.join(map(str, computing_layers(hf_config)))})"
                )
