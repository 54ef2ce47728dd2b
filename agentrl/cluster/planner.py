"""The parallel layout of a `glm_moe_dsa` training job: pure functions, no Ray, no torch.

- `hardware(name)`: GPU memory and node shape of H200, B200 and GB300 nodes.
- `find_pipeline_split(model, pp)`: the uneven first/last stage sizes that start every stage on a
  layer that computes its DSA indices (the Megatron backend's rule, `check_pipeline_split`).
- `check_layout(...)`: a layout on a number of GPUs, or a typed rejection whose message carries
  the arithmetic: `WorldSizeError` (sizes that do not divide), `SkipLayerStageError` (a pipeline
  stage that starts on a layer reusing another stage's indices), `MemoryBudgetError` (the per-GPU
  estimate over the GPU's memory).
- `memory_estimate(...)`: per GPU, worst pipeline stage: weights, gradients, optimizer state with
  and without offload, activations at the token budget.
- `choose_layout(...)`: the reference layouts in order, then a search; every rejection is kept so a
  plan can print why the reference did not fit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.cluster.model import ModelSpec
from agentrl.errors import AgentRLError
from agentrl.train.megatron.plan import PipelineSplitError, check_pipeline_split, pipeline_layout

GiB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """One GPU kind. `memory_gib` is what a process can allocate (nvidia-smi's total for H100 SXM,
    H200 and B200; the 288 GB spec figure for GB300, which nvidia-smi reports no lower)."""

    name: str
    memory_gib: float
    gpus_per_node: int
    bf16_tflops: float  # dense peak, vendor data sheet
    fp8_tflops: float


HARDWARE = {
    "H100": Hardware("H100", memory_gib=79.6, gpus_per_node=8, bf16_tflops=989.0, fp8_tflops=1979.0),
    "H200": Hardware("H200", memory_gib=140.4, gpus_per_node=8, bf16_tflops=989.0, fp8_tflops=1979.0),
    "B200": Hardware("B200", memory_gib=179.1, gpus_per_node=8, bf16_tflops=2250.0, fp8_tflops=4500.0),
    "GB300": Hardware("GB300", memory_gib=268.2, gpus_per_node=4, bf16_tflops=2500.0, fp8_tflops=5000.0),
}

# Memory that is not model state: CUDA context, NCCL / DeepEP buffers, allocator fragmentation.
RESERVED_GIB = 6.0
# A searched layout must fit in this share of the GPU: its estimate is all that vouches for it
# (a reference layout has run upstream, so it only has to fit at all).
SEARCH_HEADROOM = 0.9


def hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise LayoutError(f"hardware {name!r}: choose one of {', '.join(HARDWARE)}", reason="hardware")
    return HARDWARE[name]


class LayoutError(AgentRLError):
    """A parallel layout that cannot run; `reason` is a short stable label."""

    reason = "layout"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        if reason is not None:
            self.reason = reason
        super().__init__(message)


class WorldSizeError(LayoutError):
    """Parallel sizes that do not divide the GPUs (or the experts)."""

    reason = "world_size"


class SkipLayerStageError(LayoutError):
    """A pipeline stage that starts on a layer reusing DSA indices of an earlier stage."""

    reason = "skip_layer_stage"


class MemoryBudgetError(LayoutError):
    """The per-GPU memory estimate exceeds the GPU's memory."""

    reason = "memory"

    def __init__(self, message: str, estimate: MemoryEstimate) -> None:
        super().__init__(message)
        self.estimate = estimate


@dataclass(frozen=True)
class Layout:
    """Megatron sizes of the training job. `dp` follows from the GPU count; expert-TP is `etp`."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    max_tokens_per_gpu: int = 8192

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def short(self) -> str:
        split = (
            f" first/last {self.first_stage_layers}/{self.last_stage_layers}"
            if self.first_stage_layers is not None
            else ""
        )
        return f"TP{self.tp} PP{self.pp} CP{self.cp} EP{self.ep} ETP{self.etp}{split}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the heaviest pipeline stage (`stage`), GiB in `rows()`."""

    stage: int
    weights: float
    grads: float
    optimizer_on_gpu: float
    optimizer_offloaded: float  # what offload moves to host memory / node-local disk, per GPU
    activations: float
    reserved: float
    capacity: float
    offload: bool

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer_on_gpu + self.activations + self.reserved

    @property
    def total_without_offload(self) -> float:
        return self.weights + self.grads + self.optimizer_offloaded + self.activations + self.reserved

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def rows(self) -> list[tuple[str, float]]:
        opt = "optimizer state (offloaded)" if self.offload else "optimizer state"
        return [
            ("weights (bf16)", self.weights / GiB),
            ("gradients (fp32 main grads)", self.grads / GiB),
            (opt, self.optimizer_on_gpu / GiB),
            ("activations at the token budget", self.activations / GiB),
            ("reserved (context, NCCL, fragmentation)", self.reserved / GiB),
            ("total", self.total / GiB),
            ("capacity", self.capacity / GiB),
            ("optimizer state without offload", self.optimizer_offloaded / GiB),
            ("total without offload", self.total_without_offload / GiB),
        ]


def find_pipeline_split(model: ModelSpec, pp: int) -> tuple[int | None, int | None]:
    """(first, last) stage sizes for `pp` stages whose middle stages are even and every stage starts
    on a computing layer, the largest stage as small as possible (a 78-layer model with 3 dense layers: PP4 18/20;
    PP8 2/4 with middle stages of 12, where 14/16 would have 16 on the last).
    Raises `SkipLayerStageError` when no such split exists."""
    n = model.num_layers
    if pp == 1:
        return None, None
    best: tuple[int, int, int] | None = None
    for first in range(1, n):
        for last in range(1, n - first + 1):
            try:
                layout = pipeline_layout(n, pp, first_stage_layers=first, last_stage_layers=last)
                check_pipeline_split(model.namespace, layout)
            except PipelineSplitError:
                continue
            if any(not s for s in layout.stages):
                continue
            key = (max(len(s) for s in layout.stages), first, last)
            if best is None or key < best:
                best = key
    if best is None:
        raise SkipLayerStageError(
            f"no split of {n} layers over {pp} pipeline stages starts every stage on a computing layer "
            f"({_short_list(model.computing_layers)})"
        )
    return best[1], best[2]


def _short_list(xs: Sequence[int]) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= 8 else f"{', '.join(map(str, xs[:5]))}, ..., {xs[-1]}"


def check_world(model: ModelSpec, layout: Layout, gpus: int) -> int:
    """The data-parallel size, or `WorldSizeError` with the arithmetic."""
    mp = layout.model_parallel
    if gpus % mp:
        raise WorldSizeError(
            f"{layout.short()}: one model replica needs TP x PP x CP = {layout.tp} x {layout.pp} x "
            f"{layout.cp} = {mp} GPUs, and {gpus} GPUs is not a multiple of {mp} "
            f"({gpus} / {mp} = {gpus / mp:.2f})"
        )
    dp = gpus // mp
    experts = int(model.config["n_routed_experts"])
    if experts % layout.ep:
        raise WorldSizeError(f"{layout.short()}: EP{layout.ep} does not divide the {experts} routed experts")
    # megatron-core carves the expert groups out of the TP x CP x DP ranks of a pipeline stage.
    span = layout.tp * layout.cp * dp
    if span % (layout.ep * layout.etp):
        raise WorldSizeError(
            f"{layout.short()}: expert parallelism EP x ETP = {layout.ep} x {layout.etp} = "
            f"{layout.ep * layout.etp} must divide the TP x CP x DP = {layout.tp} x {layout.cp} x {dp} = "
            f"{span} ranks of a pipeline stage"
        )
    return dp


def stages_of(model: ModelSpec, layout: Layout) -> list[list[int]]:
    """0-indexed layers per pipeline stage; `SkipLayerStageError` when a stage starts on a layer
    that reuses indices of the stage before."""
    try:
        split = pipeline_layout(
            model.num_layers,
            layout.pp,
            first_stage_layers=layout.first_stage_layers,
            last_stage_layers=layout.last_stage_layers,
        )
        check_pipeline_split(model.namespace, split)
    except PipelineSplitError as exc:
        raise SkipLayerStageError(f"{layout.short()}: {exc}") from exc
    return [list(s) for s in split.stages]


def memory_estimate(
    model: ModelSpec, layout: Layout, *, dp: int, hw: Hardware, offload: bool, logprob_chunk: int = 16384,
    lora_rank: int = 0,
) -> MemoryEstimate:  # fmt: skip
    """Per-GPU bytes on the heaviest stage. Assumptions (the cluster docs): bf16 weights; fp32 main
    gradients; Megatron's distributed optimizer (fp32 master + Adam m, v = 12 bytes per parameter)
    sharded over the data-parallel ranks (dense: DP x CP; experts: the expert-DP ranks); full
    recompute of every layer keeping its input (sequence-parallel over TP), one layer's working set
    (forward and backward), `pp - stage` micro-batches in flight (1F1B); the log-prob head in chunks
    of `logprob_chunk` tokens on the last stage. With `lora_rank`, only the adapters
    (`ModelSpec.lora_params`, split over TP) have gradients and optimizer state; the frozen weights
    and the activations (the backward still runs through every layer) are as before."""
    c = model.config
    h, t = int(c["hidden_size"]), layout.max_tokens_per_gpu
    stages = stages_of(model, layout)
    expert_dp = layout.tp * layout.cp * dp // (layout.ep * layout.etp)
    attn_work = 2 * model.attention_width() * t * 2 / layout.tp
    indexer_work = t * t * layout.cp * 4 + t * int(c["index_topk"]) * 4 if model.dsa else 0
    moe_work = 2 * t * int(c["num_experts_per_tok"]) * (h + 3 * int(c["moe_intermediate_size"])) * 2
    dense_work = 2 * t * 3 * int(c["intermediate_size"]) * 2 / layout.tp
    best: MemoryEstimate | None = None
    for s, layers in enumerate(stages):
        dense = sum(model.layer_params(i).tp for i in layers) / layout.tp
        dense += sum(model.layer_params(i).dup for i in layers)
        expert = sum(model.layer_params(i).expert for i in layers) / (layout.ep * layout.etp)
        logits = 0.0
        if s == 0:
            dense += model.embedding_params / layout.tp
        if s == len(stages) - 1:
            dense += model.embedding_params / layout.tp + h
            logits = 2 * min(logprob_chunk, t) * int(c["vocab_size"]) / layout.tp * 4
        params = dense + expert
        optimizer = 12 * (dense / (dp * layout.cp) + expert / expert_dp)
        trained = params
        if lora_rank:
            trained = sum(model.lora_params(i, lora_rank) for i in layers) / layout.tp
            optimizer = 12 * trained / (dp * layout.cp)
        in_flight = layout.pp - s
        kept = in_flight * len(layers) * t * h * 2 / layout.tp
        work = (
            attn_work + indexer_work + (moe_work if any(model.moe_layers[i] for i in layers) else dense_work)
        )
        est = MemoryEstimate(
            stage=s,
            weights=2 * params,
            grads=4 * trained,
            optimizer_on_gpu=0.0 if offload else optimizer,
            optimizer_offloaded=optimizer,
            activations=kept + work + logits,
            reserved=RESERVED_GIB * GiB,
            capacity=hw.memory_gib * GiB,
            offload=offload,
        )
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def check_layout(
    model: ModelSpec, layout: Layout, *, gpus: int, hw: Hardware, offload: bool, headroom: float = 1.0,
    lora_rank: int = 0,
) -> tuple[int, MemoryEstimate]:  # fmt: skip
    """(data-parallel size, memory estimate) of a layout that can run, else a `LayoutError`.
    `headroom`: the share of the GPU's memory the estimate may use."""
    dp = check_world(model, layout, gpus)
    if layout.tp > hw.gpus_per_node and hw.name != "GB300":
        raise WorldSizeError(
            f"{layout.short()}: TP{layout.tp} spans more than the {hw.gpus_per_node} GPUs of one {hw.name} "
            "node; tensor parallelism needs NVLink (only GB300's NVL72 racks reach across nodes)"
        )
    est = memory_estimate(model, layout, dp=dp, hw=hw, offload=offload, lora_rank=lora_rank)
    budget = est.capacity * headroom
    if est.total > budget:
        parts = " + ".join(f"{v:.1f}" for _, v in est.rows()[:5])
        share = "" if headroom == 1.0 else f" x {headroom:.0%} headroom = {budget / GiB:.1f} GiB"
        raise MemoryBudgetError(
            f"{layout.short()} on {gpus} {hw.name}: pipeline stage {est.stage} needs {parts} = "
            f"{est.total / GiB:.1f} GiB per GPU (weights + grads + optimizer + activations + reserved) "
            f"> {hw.memory_gib:.1f} GiB{share}",
            est,
        )
    return dp, est


@dataclass
class LayoutChoice:
    """The chosen layout, how it was found, and every layout rejected on the way."""

    layout: Layout
    dp: int
    memory: MemoryEstimate
    source: str  # "reference: <name>" or "search"
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (what, why)


def candidate_layouts(model: ModelSpec, gpus: int, tokens: int) -> list[Layout]:
    """Every TP / PP / CP / EP combination that divides `gpus` (PP with its best DSA split)."""
    out = []
    experts = int(model.config["n_routed_experts"])
    splits: dict[int, tuple[int | None, int | None] | None] = {}
    for pp, tp, cp in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8), (1, 2, 4, 8)):
        if gpus % (tp * pp * cp):
            continue
        if pp not in splits:
            try:
                splits[pp] = find_pipeline_split(model, pp)
            except SkipLayerStageError:
                splits[pp] = None
        if splits[pp] is None:
            continue
        first, last = splits[pp]  # type: ignore[misc]
        span = gpus // pp
        for ep in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            if ep <= span and span % ep == 0 and experts % ep == 0:
                out.append(Layout(tp, pp, cp, ep, 1, first, last, tokens))
    return out


def choose_layout(
    model: ModelSpec,
    *,
    gpus: int,
    hw: Hardware,
    offload: bool,
    references: Sequence[tuple[str, Layout]] = (),
    tokens: int = 8192,
    lora_rank: int = 0,
) -> LayoutChoice:
    """The first reference layout that runs; else the searched layout with the most data
    parallelism (then the least memory) that fits in `SEARCH_HEADROOM` of the GPU. `LayoutError` naming every rejection (and the
    closest miss's arithmetic) when nothing fits."""
    rejected: list[tuple[str, str]] = []
    for name, layout in references:
        try:
            dp, est = check_layout(model, layout, gpus=gpus, hw=hw, offload=offload, lora_rank=lora_rank)
        except LayoutError as exc:
            rejected.append((f"reference {name} ({layout.short()})", str(exc)))
            continue
        return LayoutChoice(layout, dp, est, f"reference: {name}", rejected)
    fits: list[tuple[tuple[float, ...], Layout, int, MemoryEstimate]] = []
    closest: tuple[float, str] | None = None
    reasons: dict[str, int] = {}
    for layout in candidate_layouts(model, gpus, tokens):
        try:
            dp, est = check_layout(
                model,
                layout,
                gpus=gpus,
                hw=hw,
                offload=offload,
                headroom=SEARCH_HEADROOM,
                lora_rank=lora_rank,
            )
        except MemoryBudgetError as exc:
            reasons[exc.reason] = reasons.get(exc.reason, 0) + 1
            if closest is None or exc.estimate.total < closest[0]:
                closest = (exc.estimate.total, str(exc))
            continue
        except LayoutError as exc:
            reasons[exc.reason] = reasons.get(exc.reason, 0) + 1
            continue
        fits.append(((layout.model_parallel, est.total), layout, dp, est))
    if not fits:
        summary = ", ".join(f"{n} by {r}" for r, n in sorted(reasons.items())) or "no candidates"
        refs = "".join(f"\n  {what}: {why}" for what, why in rejected)
        miss = f"\n  closest: {closest[1]}" if closest else ""
        raise LayoutError(
            f"no parallel layout of {model.name} fits {gpus} {hw.name} GPUs "
            f"(optimizer offload {'on' if offload else 'off'}; rejected {summary}).{refs}{miss}"
            + ("" if offload else "\n  try --enable-optimizer-offload or more nodes"),
            reason="no_layout",
        )
    fits.sort(key=lambda f: f[0])
    _, layout, dp, est = fits[0]
    return LayoutChoice(layout, dp, est, "search", rejected)
