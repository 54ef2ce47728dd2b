"""The resolved plan of a cluster recipe: which node does what, every process's command line and
environment, the parallel layout and the memory estimate. Pure functions: `plan_recipe` builds a
`ClusterPlan` from `RecipeOptions` (the flags) and a `RecipeSpec` (the recipe: its models, defaults,
algorithm, run settings, SGLang flags and reference layouts; the recipes under `recipes/` build
theirs), `render` prints it (`--dry-run`), the Ray launcher starts exactly these command lines.

SGLang server flags are SGLang's own (`python -m sglang.launch_server --help`; names checked
against `sglang/srt/server_args.py`), the router is `smg launch` (consistent hashing), the trainer
is `agentrl train run` with `--set` overrides that `agentrl.runtime.config.resolve` validates here.
Host names `node-NN` stand for the address of the NN-th node of the placement (Ray fills them in).
The environment's data (where `prepare` puts it, the settings that point the run at it, its
local-mode stand-in) comes from the environment plugin's optional `data` hooks (`env_data`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from agentrl.cluster.launch import keyed
from agentrl.cluster.model import ModelEntry, ModelSpec
from agentrl.cluster.planner import (
    HARDWARE,
    GiB,
    Layout,
    LayoutChoice,
    LayoutError,
    choose_layout,
    hardware,
    memory_estimate,
)
from agentrl.errors import AgentRLError
from agentrl.overrides import ConfigError
from agentrl.rollout.environment import get_plugin
from agentrl.runtime.config import RunConfig
from agentrl.runtime.config import resolve as resolve_run_config
from agentrl.train.megatron.plan import MODEL_TYPES, pipeline_layout

SGLANG_PORT = 30000
ROUTER_PORT = 8000
BOOTSTRAP_PORT = 8998
DIST_PORT = 20000
TRAINER_PORT = 29500
TRAINER_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1"}


class RecipeError(AgentRLError):
    """Recipe flags that contradict each other or the hardware."""


@dataclass(frozen=True, kw_only=True)
class RecipeOptions:
    """Every flag of a recipe. None means "the recipe's default" (resolved in `plan_recipe`); the
    recipe's own defaults for the rest come from `RecipeSpec.options`."""

    recipe: str  # the recipe's label: the plan's title, the run directory <root>/runs/<recipe>
    model_name: str
    num_nodes: int
    gpus_per_node: int | None = None
    hardware: str
    sglang_config: Literal["low-latency", "balanced"] | None = None
    fp8_rollout: bool | None = None
    enable_mtp: bool = False
    enable_pd: bool | None = None
    use_deepep: bool | None = None  # Megatron DeepEP; default on, off on GB300
    enable_optimizer_offload: bool | None = None
    root: str  # shared storage: checkpoints, data, the run directory
    local_root: str  # node-local disk: prepare-cp's copy, offloaded optimizer state
    daytona_key_file: str = "~/.daytona/api_key"
    engine_auth: bool = True  # engines and router require the run's key (agentrl.cluster.launch)
    engine_key_file: str | None = None  # default <root>/engine.key, created 0600 by the driver


@dataclass(frozen=True)
class EngineShape:
    """A recipe's own SGLang engine shape, in place of the low-latency / balanced configurations:
    `gpus` per engine (fewer where the rollout nodes have fewer), data-parallel attention over
    `dp_size` groups (with a dense-TP-1 MoE and a dp LM head), the static memory fraction and the
    request cap. No prefill/decode split."""

    gpus: int
    dp_size: int | None = None
    mem_fraction: float = 0.85
    max_running_requests: int = 512

    def describe(self) -> str:
        dp = f", dp attention {self.dp_size}" if self.dp_size else ""
        return f"{self.gpus}-GPU engines{dp}, mem fraction {self.mem_fraction:.2f}"


ReferenceLayouts = Callable[[RecipeOptions, ModelEntry, int, int], list[tuple[str, Layout]]]


def _no_references(
    o: RecipeOptions, model: ModelEntry, gpn: int, train_nodes: int
) -> list[tuple[str, Layout]]:
    return []


@dataclass(frozen=True)
class RecipeSpec:
    """A recipe: everything model-, environment- or run-specific that `plan_recipe` and the recipe CLI
    (`agentrl.cluster.cli.make_app`) read. The generic code holds no recipe of its own."""

    name: str  # the label: the plan's title, the run directory <root>/runs/<name>
    env: str  # the environment plugin (`env.name`; its `data` hooks prepare the data)
    models: Mapping[str, ModelEntry]
    default_model: str
    local_model: str  # `--local`'s model (a few simulated nodes)
    root: str  # default shared storage
    local_root: str  # default node-local disk
    local_run_root: str  # default shared storage of `--local`
    title: str = ""  # the CLI's help
    hardware: str = "H200"
    num_nodes: int = 1
    colocated: bool = False  # training and rollout on the same nodes (else half and half)
    sglang_config: Literal["low-latency", "balanced"] = "low-latency"
    fp8_rollout: bool = False
    optimizer_offload: bool = False  # default of --enable-optimizer-offload (never for smoke models)
    daytona: bool = False  # the trainer gets DAYTONA_API_KEY_FILE (a path, never the key)
    algorithm: Mapping[str, Any] = field(default_factory=dict)  # printed under "## algorithm"
    env_settings: Mapping[str, Any] = field(default_factory=dict)  # env.* after env.name
    run_settings: Mapping[str, Any] = field(default_factory=dict)  # last: on top of everything
    sglang_env: Mapping[str, str] = field(default_factory=dict)
    sglang_args: tuple[str, ...] = ()  # model-specific server flags (attention backends, KV cache dtype)
    mtp_args: Callable[[str], list[str]] | None = None  # --enable-mtp's flags for an SGLang config
    mtp: bool = False  # the default of --enable-mtp
    engine_shape: EngineShape | None = None  # fixed engines (then --sglang-config is refused)
    reference_layouts: ReferenceLayouts = _no_references
    hardware_choices: tuple[str, ...] = ()  # the GPU kinds the recipe runs on (empty: every kind known)
    hardware_refusal: str = ""  # why the others are refused (said in the error)
    notes: tuple[str, ...] = ()  # said at the end of every plan (what the recipe does not do as upstream)

    @property
    def lora_rank(self) -> int:
        """The run's `trainer.lora.rank` (0: every weight trains)."""
        return int({**self.algorithm, **self.run_settings}.get("trainer.lora.rank", 0) or 0)

    def check_hardware(self, name: str) -> None:
        """`RecipeError` unless the recipe runs on GPU kind `name`."""
        choices = self.hardware_choices or tuple(HARDWARE)
        if name not in choices or name not in HARDWARE:
            why = f" ({self.hardware_refusal})" if self.hardware_refusal and name in HARDWARE else ""
            raise RecipeError(f"--hardware {name}: choose one of {', '.join(choices)}{why}")

    def model(self, name: str) -> ModelEntry:
        if name not in self.models:
            raise RecipeError(f"--model-name {name}: choose one of {', '.join(self.models)}")
        return self.models[name]

    def options(self, **kw: Any) -> RecipeOptions:
        """`RecipeOptions` with this recipe's defaults for what `kw` leaves out."""
        defaults: dict[str, Any] = {
            "recipe": self.name, "model_name": self.default_model, "num_nodes": self.num_nodes,
            "hardware": self.hardware, "root": self.root, "local_root": self.local_root, "enable_mtp": self.mtp,
        }  # fmt: skip
        return RecipeOptions(**{**defaults, **kw})


def env_data(env: str) -> Any | None:
    """The environment plugin's data hooks (its optional `data` attribute), or None. Hooks, each
    optional: `settings(data_dir)` the run settings that point the environment at what `prepare`
    wrote under `data_dir` (<root>/data); `describe(data_dir, source=, eval_count=, seed=)` the
    `prepare --dry-run` line; `prepare(data_dir, source=, eval_count=, seed=, report=)`;
    `smoke_settings(run_dir)` local mode's settings; `prepare_smoke(run_dir, seed=)` local mode's data."""
    return getattr(get_plugin(env), "data", None)


def _data_hook(env: str, hook: str) -> Callable[..., Any] | None:
    return getattr(env_data(env), hook, None)


@dataclass(frozen=True)
class Process:
    name: str
    node: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    gpus: int = 0
    key_file: str = ""  # started through agentrl.cluster.launch with the run's engine key

    def command(self) -> str:
        return shlex.join(keyed(self.argv, self.key_file) if self.key_file else self.argv)


def engine_key_file(o: RecipeOptions) -> str:
    """Where the run's engine key lives ('' with --no-engine-auth)."""
    if not o.engine_auth:
        return ""
    return o.engine_key_file or f"{o.root}/engine.key"


@dataclass(frozen=True)
class EnginePlan:
    """One SGLang server (possibly spanning nodes): `role` regular / prefill / decode."""

    index: int
    role: str
    nodes: tuple[int, ...]
    gpus: int
    url: str


@dataclass
class ClusterPlan:
    options: RecipeOptions
    model: ModelSpec
    gpus_per_node: int
    train_nodes: list[int]
    rollout_nodes: list[int]
    colocated: bool
    sglang_config: str
    fp8_rollout: bool
    enable_pd: bool
    offload: bool
    choice: LayoutChoice
    engines: list[EnginePlan]
    processes: list[Process]
    run_overrides: list[str]
    notes: list[str]
    spec: RecipeSpec

    @property
    def layout(self) -> Layout:
        return self.choice.layout


def plan_recipe(o: RecipeOptions, spec: RecipeSpec) -> ClusterPlan:
    """The whole plan, or a `RecipeError` / `LayoutError` that says which flag or size to change."""
    entry = spec.model(o.model_name)
    model = entry.spec()
    spec.check_hardware(o.hardware)
    hw = hardware(o.hardware)
    gpn = o.gpus_per_node or hw.gpus_per_node
    if o.num_nodes < 1 or gpn < 1:
        raise RecipeError(f"--num-nodes {o.num_nodes} / --gpus-per-node {gpn}: both must be >= 1")
    smoke = entry.smoke
    notes: list[str] = []
    if o.enable_mtp and not model.mtp_layers:
        with_mtp = [n for n, m in spec.models.items() if m.spec().mtp_layers and not m.smoke]
        raise RecipeError(
            f"--enable-mtp: {o.model_name} has no MTP layer; MTP runs with the full {', '.join(with_mtp)} only"
        )
    if o.use_deepep is None:
        o = replace(o, use_deepep=o.hardware != "GB300")
    if o.hardware == "GB300" and o.use_deepep:
        raise RecipeError(
            "--hardware GB300 needs --no-megatron-use-deepep: Megatron's DeepEP dispatcher is not "
            "supported there (the reference launcher asserts it)"
        )
    shape = spec.engine_shape
    if shape is not None and (o.sglang_config or o.enable_pd):
        flag = "--sglang-config" if o.sglang_config else "--enable-pd"
        raise RecipeError(
            f"{flag}: the {spec.name} recipe's engines have their own shape ({shape.describe()})"
        )
    config = "recipe" if shape is not None else (o.sglang_config or spec.sglang_config)
    if config == "balanced" and gpn % 4:
        raise RecipeError(
            f"--sglang-config balanced runs one 4-GPU engine per node: --gpus-per-node {gpn} % 4 != 0"
        )
    if o.num_nodes == 1:
        if o.enable_pd:
            notes.append("--enable-pd forced off: prefill/decode disaggregation needs more than one node")
        enable_pd = False
    elif config in ("balanced", "recipe"):
        if o.enable_pd:
            raise RecipeError("--sglang-config balanced is incompatible with --enable-pd: choose one")
        enable_pd = False
    else:
        enable_pd = True if o.enable_pd is None else o.enable_pd
    fp8 = spec.fp8_rollout if o.fp8_rollout is None else o.fp8_rollout
    offload = (
        (spec.optimizer_offload and not smoke)
        if o.enable_optimizer_offload is None
        else o.enable_optimizer_offload
    )

    # Training and rollout on separate nodes (half and half), or colocated (one node always is).
    colocated = spec.colocated or o.num_nodes == 1
    if colocated:
        train_nodes = list(range(o.num_nodes))
        rollout_nodes = list(range(o.num_nodes))
    else:
        half = o.num_nodes // 2
        train_nodes, rollout_nodes = list(range(half)), list(range(half, o.num_nodes))
    refs = spec.reference_layouts(o, entry, gpn, len(train_nodes))
    choice = choose_layout(
        model,
        gpus=len(train_nodes) * gpn,
        hw=hw,
        offload=offload,
        references=refs,
        tokens=entry.tokens_per_gpu,
        lora_rank=spec.lora_rank,
    )
    if offload:
        host = choice.memory.optimizer_offloaded * gpn / GiB
        notes.append(
            f"optimizer offload: Adam state and step on the host (trainer.megatron.optimizer_cpu_offload), "
            f"{host:.0f} GiB per {gpn}-GPU training node; where host memory is smaller, it streams to "
            f"node-local disk under {o.local_root}"
        )
    if model.mtp_layers and not o.enable_mtp:
        notes.append("the MTP layer is not trained (agentrl's Megatron backend builds no MTP layer)")
    if o.engine_auth:
        notes.append(
            f"engine key: {engine_key_file(o)} (created 0600 by the driver if missing); SGLang and smg get it "
            "through agentrl.cluster.launch (--api-key in-process, never on a command line, redacted from "
            "their logs), the trainer through engine.api_key_file; --no-engine-auth turns it off"
        )
    else:
        notes.append("--no-engine-auth: engines and router take any request from anyone who reaches them")
    notes += spec.notes
    engines = _engines(config, enable_pd, rollout_nodes, gpn, notes, smoke, shape)
    model_dir = local_model_dir(o, rollout_kind(fp8))
    processes = [
        p for e in engines
        for p in _sglang(o, spec, e, config, enable_pd, fp8, colocated, model_dir, gpn, hw.name, smoke)
    ]  # fmt: skip
    router_node = train_nodes[0]
    processes.append(_router(engines, enable_pd, router_node, engine_key_file(o)))
    overrides = _run_overrides(o, spec, choice, engines, router_node, fp8, offload)
    processes += _trainers(o, spec, train_nodes, gpn, overrides)
    return ClusterPlan(
        o, model, gpn, train_nodes, rollout_nodes, colocated, config, fp8, enable_pd, offload, choice,
        engines, processes, overrides, notes, spec,
    )  # fmt: skip


def rollout_kind(fp8: bool) -> str:
    """The checkpoint the SGLang servers load: `prepare`'s block-FP8 copy, or the HF one."""
    return "fp8" if fp8 else "hf"


def shared_model_dir(o: RecipeOptions, kind: str) -> str:
    """Where `prepare` writes a checkpoint of `kind` (hf, fp8, megatron): shared storage."""
    return f"{o.root}/{kind}/{o.model_name}"


def local_model_dir(o: RecipeOptions, kind: str) -> str:
    """Where `prepare-cp` copies it on each node that loads it (`prepare.node_needs`): node-local disk."""
    return f"{o.local_root}/{kind}/{o.model_name}"


def _engines(
    config: str, pd: bool, nodes: list[int], gpn: int, notes: list[str], smoke: bool,
    shape: EngineShape | None = None,
) -> list[EnginePlan]:  # fmt: skip
    gpus = len(nodes) * gpn
    if shape is not None:
        size = min(shape.gpus, gpus)
        if size < shape.gpus:
            notes.append(f"engines of {shape.gpus} GPUs capped to the {gpus} rollout GPUs")
    elif config == "balanced":
        size = 4 if smoke else gpn
    elif pd:
        size = 16 if len(nodes) < 16 else 64
        if 2 * size > gpus:
            notes.append(
                f"PD engines of {size} GPUs capped to {gpus // 2}: {gpus} rollout GPUs hold one prefill and "
                "one decode engine"
            )
            size = gpus // 2
    else:
        size = min(8, gpus)  # TP-8 engines (fewer GPUs only where the placement has fewer)
    if size < 1 or gpus % size:
        raise RecipeError(f"{gpus} rollout GPUs do not divide into {config} engines of {size} GPUs")
    if size > gpn and size % gpn:
        raise RecipeError(f"an engine of {size} GPUs does not cover whole {gpn}-GPU nodes")
    out = []
    for k in range(gpus // size):
        first_gpu = k * size
        span = tuple(nodes[g // gpn] for g in range(first_gpu, first_gpu + size, gpn)) or (
            nodes[first_gpu // gpn],
        )
        role = ("prefill" if k % 2 == 0 else "decode") if pd else "regular"
        port = SGLANG_PORT + (first_gpu % gpn)
        out.append(EnginePlan(k, role, span, size, f"http://node-{span[0]:02d}:{port}"))
    return out


def _sglang(
    o: RecipeOptions, spec: RecipeSpec, e: EnginePlan, config: str, pd: bool, fp8: bool, colocated: bool,
    model_dir: str, gpn: int, hw: str, smoke: bool,
) -> list[Process]:  # fmt: skip
    """One process per node of the engine (`--node-rank` k of `--nnodes`)."""
    port = int(e.url.rsplit(":", 1)[1])
    argv = ["python", "-m", "sglang.launch_server", "--model-path", model_dir]
    argv += ["--served-model-name", o.model_name, "--host", "0.0.0.0", "--port", str(port)]
    argv += ["--tp-size", str(e.gpus), "--ep-size", str(e.gpus)]
    if len(e.nodes) > 1:
        argv += [
            "--dist-init-addr",
            f"node-{e.nodes[0]:02d}:{DIST_PORT + e.index}",
            "--nnodes",
            str(len(e.nodes)),
        ]
    elif e.gpus < gpn:
        argv += ["--base-gpu-id", str(port - SGLANG_PORT)]
    shape = spec.engine_shape
    dp_attention = (
        (min(shape.dp_size, e.gpus) if shape.dp_size else None)
        if shape is not None
        else (e.gpus if config == "balanced" or pd else None)
    )
    if dp_attention:
        argv += [
            "--enable-dp-attention",
            "--dp-size",
            str(dp_attention),
            "--moe-dense-tp-size",
            "1",
            "--enable-dp-lm-head",
        ]
    if config == "balanced" or (fp8 and o.use_deepep):
        argv += ["--moe-a2a-backend", "deepep", "--deepep-mode", "auto"]
    elif hw in ("B200", "GB300"):
        argv += ["--moe-runner-backend", "flashinfer_trtllm_routed" if fp8 else "triton"]
    if shape is not None:
        mem, running = shape.mem_fraction, shape.max_running_requests
    else:
        mem = 0.70 if (o.num_nodes == 1 and smoke) else 0.85
        running = 256 if config == "balanced" else 512
    argv += ["--mem-fraction-static", f"{mem:.2f}", *spec.sglang_args]
    argv += ["--max-running-requests", str(running), "--watchdog-timeout", "3600"]
    if o.enable_mtp:
        if spec.mtp_args is None:
            raise RecipeError(f"--enable-mtp: the {spec.name} recipe has no speculative decoding settings")
        argv += spec.mtp_args(config)
    if pd:
        argv += ["--disaggregation-mode", e.role, "--disaggregation-transfer-backend", "mooncake"]
        if e.role == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    if colocated:
        argv += ["--enable-memory-saver"]  # its memory is released while the trainer runs
    name = f"sglang-{e.role}-{e.index}"
    key = engine_key_file(o)
    if len(e.nodes) == 1:
        return [Process(name, e.nodes[0], argv, dict(spec.sglang_env), e.gpus, key)]
    return [
        Process(f"{name}-node{k}", node, [*argv, "--node-rank", str(k)], dict(spec.sglang_env), gpn, key)
        for k, node in enumerate(e.nodes)
    ]


def _router(engines: list[EnginePlan], pd: bool, node: int, key_file: str) -> Process:
    argv = ["smg", "launch", "--host", "0.0.0.0", "--port", str(ROUTER_PORT)]
    if pd:
        argv += ["--pd-disaggregation"]
        for e in engines:
            argv += ["--prefill", e.url, str(BOOTSTRAP_PORT)] if e.role == "prefill" else ["--decode", e.url]
        argv += ["--prefill-policy", "consistent_hashing", "--decode-policy", "consistent_hashing"]
    else:
        argv += ["--worker-urls", *(e.url for e in engines), "--policy", "consistent_hashing"]
    argv += ["--request-timeout-secs", "14400"]
    return Process("router", node, argv, {}, 0, key_file)


def _run_overrides(
    o: RecipeOptions, spec: RecipeSpec, choice: LayoutChoice, engines: list[EnginePlan], router_node: int,
    fp8: bool, offload: bool,
) -> list[str]:  # fmt: skip
    lay = choice.layout
    sets: dict[str, Any] = {
        "out": f"{o.root}/runs/{o.recipe}",
        "engine.kind": "sglang",
        # Config and tokenizer only: the weights come from init_checkpoint (and the servers' copies).
        "engine.model": shared_model_dir(o, "hf"),
        "engine.router_url": f"http://node-{router_node:02d}:{ROUTER_PORT}",
        "engine.urls": [e.url for e in engines if e.role != "prefill"],
        "engine.request_timeout_s": 14400,
        **({"engine.api_key_file": engine_key_file(o)} if o.engine_auth else {}),
        "trainer.backend": "megatron",
        "trainer.megatron.tp": lay.tp,
        "trainer.megatron.pp": lay.pp,
        "trainer.megatron.cp": lay.cp,
        "trainer.megatron.ep": lay.ep,
        "trainer.megatron.etp": lay.etp,
        "trainer.megatron.first_stage_layers": lay.first_stage_layers,
        "trainer.megatron.last_stage_layers": lay.last_stage_layers,
        "trainer.megatron.recompute": "full",
        "trainer.megatron.recompute_num_layers": 1,
        "trainer.megatron.params_dtype": "bfloat16",
        "trainer.megatron.moe_token_dispatcher_type": "flex" if o.use_deepep else "alltoall",
        "trainer.megatron.export_layout": "checkpoint",
        "trainer.megatron.export_quantization": "fp8_block128" if fp8 else "none",
        "trainer.megatron.init_checkpoint": local_model_dir(o, "megatron"),
        # LoRA steps its adapters on the trainer's own reduction and AdamW (auto picks it)
        "trainer.megatron.ddp": "auto" if spec.lora_rank else "megatron",
        "trainer.megatron.distributed_optimizer": not spec.lora_rank,
        "trainer.megatron.optimizer_cpu_offload": offload,
        "trainer.max_tokens_per_micro_batch": lay.max_tokens_per_gpu,
        "sync.transport": "distributed",
        **spec.algorithm,
    }
    sets["env.name"] = spec.env
    sets.update(spec.env_settings)
    data_settings = _data_hook(spec.env, "settings")
    if data_settings is not None:  # where `prepare` put the environment's data
        sets.update(data_settings(f"{o.root}/data"))
    sets.update(spec.run_settings)
    return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in sets.items()]


def _trainers(
    o: RecipeOptions, spec: RecipeSpec, nodes: list[int], gpn: int, overrides: list[str]
) -> list[Process]:
    out = []
    env = dict(TRAINER_ENV)
    if spec.daytona:
        env["DAYTONA_API_KEY_FILE"] = o.daytona_key_file  # a path, never the key
    for rank, node in enumerate(nodes):
        argv = ["torchrun", f"--nnodes={len(nodes)}", f"--nproc-per-node={gpn}", f"--node-rank={rank}"]
        argv += [f"--master-addr=node-{nodes[0]:02d}", f"--master-port={TRAINER_PORT}"]
        argv += ["-m", "agentrl.cli", "train", "run"]
        for s in overrides:
            argv += ["--set", s]
        out.append(Process(f"trainer-{rank}", node, argv, env, gpn))
    return out


def _lora_lines(plan: ClusterPlan) -> list[str]:
    """What LoRA saves on this layout: the same estimate with every weight trained, side by side."""
    m, lay, rank = plan.model, plan.layout, plan.spec.lora_rank
    o = plan.options
    full = memory_estimate(m, lay, dp=plan.choice.dp, hw=hardware(o.hardware), offload=plan.offload)
    lora = plan.choice.memory
    adapters = sum(m.lora_params(i, rank) for i in range(m.num_layers))
    out = [
        "",
        f"## LoRA rank {rank} (attention and MLP projections; routed experts, indexer, embeddings frozen)",
        f"trainable parameters {adapters / 1e6:.1f}M of {m.total_params(with_mtp=False) / 1e9:.1f}B "
        f"({100 * adapters / m.total_params(with_mtp=False):.3f}%)",
        f"{'per GPU, GiB':42s} {'LoRA':>8s} {'full':>8s}",
    ]
    for (name, a), (_, b) in zip(lora.rows(), full.rows(), strict=True):
        if name in ("capacity",):
            continue
        out.append(f"{name:42s} {a:8.2f} {b:8.2f}")
    return out


def check_trainable(spec: RecipeSpec, model_name: str) -> None:
    """`RecipeError` unless the Megatron backend builds this model (plans of other models print with
    --dry-run; their training needs the backend to support the architecture first)."""
    model_type = spec.model(model_name).config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise RecipeError(
            f"{model_name} is a {model_type!r} model and agentrl's Megatron backend builds "
            f"{', '.join(MODEL_TYPES)} only: its plan prints with --dry-run, `prepare --no-convert` "
            "downloads, validates and stages its data, and --local runs the loop on a tiny model; "
            "training it on a cluster needs the architecture in agentrl.train.megatron (model and converter)"
        )


def validate_overrides(plan: ClusterPlan) -> None:
    """The trainer's `--set` list is a valid agentrl run configuration (else `LayoutError`)."""
    try:
        resolve_run_config(RunConfig, overrides=plan.run_overrides)
    except ConfigError as exc:
        raise LayoutError(f"the resolved trainer settings are not a valid run config: {exc}") from exc


def render(plan: ClusterPlan) -> str:
    """The plan as text (`--dry-run`): deterministic, one snapshot per flag combination."""
    o, lay, mem = plan.options, plan.layout, plan.choice.memory
    lines = [f"# {o.recipe}: {o.model_name} on {o.num_nodes} x {plan.gpus_per_node} {o.hardware}"]
    lines.append(f"model: {plan.spec.model(o.model_name).hf_repo}, {plan.model.total_params() / 1e9:.1f}B parameters "
                 f"({plan.model.total_params(with_mtp=False) / 1e9:.1f}B without MTP), "
                 f"{plan.model.num_layers} layers")  # fmt: skip
    m = plan.model
    if m.dsa:
        lines.append(f"DSA computing layers (1-indexed): {', '.join(map(str, m.computing_layers))}")
    elif not m.mla:
        lines.append(f"attention: grouped-query, {m.num_attention_heads} heads, {m.num_key_value_heads} KV heads "
                     f"of {m.head_dim}")  # fmt: skip
    shape = plan.spec.engine_shape
    sglang = plan.sglang_config if shape is None else shape.describe()
    lines.append(f"sglang config: {sglang}; fp8 rollout: {plan.fp8_rollout}; PD: {plan.enable_pd}; "
                 f"MTP: {o.enable_mtp}; megatron DeepEP: {o.use_deepep}; optimizer offload: {plan.offload}")  # fmt: skip
    lines.append("")
    lines.append("## nodes")
    for n in range(o.num_nodes):
        roles = []
        if n in plan.train_nodes:
            roles.append("train")
        if n in plan.rollout_nodes:
            roles.append("rollout")
        procs = [p.name for p in plan.processes if p.node == n]
        lines.append(
            f"node-{n:02d}: {'+'.join(roles)}: {', '.join(procs) or '(part of a multi-node engine)'}"
        )
    lines.append("")
    lines.append(f"## parallel layout ({plan.choice.source})")
    lines.append(f"{lay.short()} DP{plan.choice.dp}, max tokens per GPU {lay.max_tokens_per_gpu}, "
                 f"{len(plan.train_nodes) * plan.gpus_per_node} training GPUs")  # fmt: skip
    for what, why in plan.choice.rejected:
        lines.append(f"rejected {what}: {why}")
    if lay.pp > 1:
        split = pipeline_layout(plan.model.num_layers, lay.pp, first_stage_layers=lay.first_stage_layers,
                                last_stage_layers=lay.last_stage_layers)  # fmt: skip
        lines.append(f"stage sizes {[len(s) for s in split.stages]}, stage starts {split.stage_starts}")
    lines.append("")
    lines.append(
        "## weights (`prepare` writes them to shared storage, `prepare-cp` copies them to node-local disk)"
    )
    both = "every node" if plan.colocated else None
    kind = rollout_kind(plan.fp8_rollout)
    lines.append(f"{both or 'rollout nodes'}: SGLang --model-path {local_model_dir(o, kind)} "
                 f"(copy of {shared_model_dir(o, kind)})")  # fmt: skip
    lines.append(f"{both or 'training nodes'}: trainer.megatron.init_checkpoint {local_model_dir(o, 'megatron')} "
                 f"(copy of {shared_model_dir(o, 'megatron')}, torch_dist)")  # fmt: skip
    lines.append(f"engine.model {shared_model_dir(o, 'hf')} (shared storage): the trainer reads its config "
                 "and tokenizer only")  # fmt: skip
    lines.append("")
    lines.append(f"## memory per GPU (stage {mem.stage}, GiB)")
    lines += [f"{k:42s} {v:8.1f}" for k, v in mem.rows()]
    if plan.spec.lora_rank:
        lines += _lora_lines(plan)
    lines.append("")
    lines.append("## algorithm")
    lines += [f"{k} = {v}" for k, v in plan.spec.algorithm.items()]
    lines.append("")
    lines.append("## processes")
    for p in plan.processes:
        env = " ".join(f"{k}={v}" for k, v in sorted(p.env.items()))
        lines.append(f"[node-{p.node:02d}] {p.name} ({p.gpus} GPUs)")
        if env:
            lines.append(f"  env: {env}")
        lines.append(f"  {p.command()}")
    if plan.notes:
        lines.append("")
        lines.append("## notes")
        lines += [f"- {n}" for n in plan.notes]
    return "\n".join(lines) + "\n"
