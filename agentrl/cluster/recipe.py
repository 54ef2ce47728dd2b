"""The resolved plan of a GLM-5.2 cluster recipe: which node does what, every process's command
line and environment, the parallel layout and the memory estimate. Pure functions: `resolve`
builds a `ClusterPlan` from `RecipeOptions`, `render` prints it (`--dry-run`), the Ray launcher
starts exactly these command lines.

SGLang server flags are SGLang's own (`python -m sglang.launch_server --help`; names checked
against `sglang/srt/server_args.py`), the router is `smg launch` (consistent hashing), the trainer
is `agentrl train run` with `--set` overrides that `agentrl.runtime.config.resolve` validates here.
Host names `node-NN` stand for the address of the NN-th node of the placement (Ray fills them in).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from agentrl.cluster.launch import keyed
from agentrl.cluster.model import HF_REPOS, ModelSpec
from agentrl.cluster.planner import (
    GiB,
    Layout,
    LayoutChoice,
    LayoutError,
    choose_layout,
    hardware,
)
from agentrl.errors import AgentRLError

Recipe = Literal["tbench2", "dapo_math"]
SGLANG_PORT = 30000
ROUTER_PORT = 8000
BOOTSTRAP_PORT = 8998
DIST_PORT = 20000
TRAINER_PORT = 29500

# GRPO with clip 0.2 / 0.28, TIS 0.5 / 2.0, Adam lr 1e-6 constant, weight decay 0.1, betas 0.9 / 0.98.
ALGORITHM: dict[str, Any] = {
    "trainer.lr": 1e-6,
    "trainer.weight_decay": 0.1,
    "trainer.betas": [0.9, 0.98],
    "trainer.loss.eps_clip": 0.2,
    "trainer.loss.eps_clip_high": 0.28,
    "trainer.loss.use_tis": True,
    "trainer.loss.tis_clip_low": 0.5,
    "trainer.loss.tis_clip": 2.0,
    "trainer.logprob_chunk_size": 16384,
}
# The terminal-bench-2 run's rollout and eval settings, as the reference run script sets them
# (radixark/miles examples/experimental/openenv/glm52_tbench2/run_glm5_2_744b_a40b_daytona.py):
# 100 rollout steps of 8 tasks x 8 samples (global batch 64: one optimizer step per rollout step),
# 128 episodes in flight (each with its own sandbox), no staleness bound, temperature 0.8, 30 turns
# of up to 8,192 new tokens in a 65,536-token session and 3,600 s of wall clock (a policy outcome:
# the episode is verified as it stands), TIS with no lower clip, the in_place pause for weight
# updates, and an eval every 10 steps of 2 samples per held-out task.
TBENCH2_RUN: dict[str, Any] = {
    "steps": 100,
    "rollout.batch_size": 64,
    "rollout.n_samples_per_prompt": 8,
    "rollout.max_in_flight": 128,
    "rollout.max_staleness": None,
    "rollout.episode_timeout_s": 3600 + 900,  # the agent's 3,600 s, then setup and the verifier
    "sampling.temperature": 0.8,
    "env.agent.max_turns": 30,
    "env.agent.max_new_tokens": 8192,
    "env.agent.max_total_tokens": 65536,
    "env.agent.wall_clock_s": 3600,
    "trainer.loss.tis_clip_low": 0.0,
    "sync.pause_mode": "in_place",
    "eval.every": 10,
    "eval.samples_per_row": 2,
    "eval.concurrency": 40,
}
SGLANG_ENV = {"SGLANG_NSA_FORCE_MLA": "1", "INDEXER_ROPE_NEOX_STYLE": "0", "NVSHMEM_DISABLE_NCCL": "1"}
TRAINER_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1"}


class RecipeError(AgentRLError):
    """Recipe flags that contradict each other or the hardware."""


@dataclass(frozen=True)
class RecipeOptions:
    """Every flag of the recipes. None means "the recipe's default" (resolved in `resolve`)."""

    recipe: Recipe
    model_name: str = "GLM-5.2"
    num_nodes: int = 16
    gpus_per_node: int | None = None
    hardware: str = "GB300"
    sglang_config: Literal["low-latency", "balanced"] | None = None
    fp8_rollout: bool | None = None
    enable_mtp: bool = False
    enable_pd: bool | None = None
    use_deepep: bool | None = None  # Megatron DeepEP; default on, off on GB300
    enable_optimizer_offload: bool | None = None
    root: str = "/shared/glm52"  # shared storage: checkpoints, data, the run directory
    local_root: str = "/local/glm52"  # node-local disk: prepare-cp's copy, offloaded optimizer state
    daytona_key_file: str = "~/.daytona/api_key"
    engine_auth: bool = True  # engines and router require the run's key (agentrl.cluster.launch)
    engine_key_file: str | None = None  # default <root>/engine.key, created 0600 by the driver


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
class Engine:
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
    engines: list[Engine]
    processes: list[Process]
    run_overrides: list[str]
    notes: list[str]

    @property
    def layout(self) -> Layout:
        return self.choice.layout


def _reference_layouts(o: RecipeOptions, gpn: int, train_nodes: int) -> list[tuple[str, Layout]]:
    """The Miles recipe's branches (shared/reference/glm52.md)."""
    if o.model_name == "GLM-5.2_5layer":
        return [("1 node, pruned 5-layer", Layout(4, 1, 1, gpn, 1, None, None, 2048))]
    if o.recipe == "tbench2":
        return [("tbench2 16 x GB300", Layout(2, 4, 4, 8, 1, 18, 20, 8192))]
    refs = []
    if train_nodes >= 16 and gpn == 4:
        refs.append((">= 16 nodes of 4 GPUs", Layout(8, 4, 1, 16, 1, 18, 20, 8192)))
    if train_nodes >= 16 and gpn == 8:
        refs.append((">= 16 nodes of 8 GPUs", Layout(4, 8, 8, 32, 1, 14, 16, 8192)))
    return refs


def resolve(o: RecipeOptions) -> ClusterPlan:
    """The whole plan, or a `RecipeError` / `LayoutError` that says which flag or size to change."""
    model = ModelSpec.named(o.model_name)
    hw = hardware(o.hardware)
    gpn = o.gpus_per_node or hw.gpus_per_node
    if o.num_nodes < 1 or gpn < 1:
        raise RecipeError(f"--num-nodes {o.num_nodes} / --gpus-per-node {gpn}: both must be >= 1")
    pruned = o.model_name == "GLM-5.2_5layer"
    notes: list[str] = []
    if o.enable_mtp and not model.mtp_layers:
        raise RecipeError(
            f"--enable-mtp: {o.model_name} has no MTP layer; MTP runs with the full GLM-5.2 only"
        )
    if o.use_deepep is None:
        o = replace(o, use_deepep=o.hardware != "GB300")
    if o.hardware == "GB300" and o.use_deepep:
        raise RecipeError(
            "--hardware GB300 needs --no-megatron-use-deepep: Megatron's DeepEP dispatcher is not "
            "supported there (the reference launcher asserts it)"
        )
    config = o.sglang_config or ("balanced" if o.recipe == "tbench2" else "low-latency")
    if config == "balanced" and gpn % 4:
        raise RecipeError(
            f"--sglang-config balanced runs one 4-GPU engine per node: --gpus-per-node {gpn} % 4 != 0"
        )
    if o.num_nodes == 1:
        if o.enable_pd:
            notes.append("--enable-pd forced off: prefill/decode disaggregation needs more than one node")
        enable_pd = False
    elif config == "balanced":
        if o.enable_pd:
            raise RecipeError("--sglang-config balanced is incompatible with --enable-pd: choose one")
        enable_pd = False
    else:
        enable_pd = True if o.enable_pd is None else o.enable_pd
    fp8 = (o.recipe == "tbench2") if o.fp8_rollout is None else o.fp8_rollout
    offload = (
        (o.recipe == "tbench2" and not pruned)
        if o.enable_optimizer_offload is None
        else o.enable_optimizer_offload
    )

    # tbench2: training and rollout on separate nodes (the reference: 8 + 8 of 16); math: colocated.
    colocated = o.recipe == "dapo_math" or o.num_nodes == 1
    if colocated:
        train_nodes = list(range(o.num_nodes))
        rollout_nodes = list(range(o.num_nodes))
    else:
        half = o.num_nodes // 2
        train_nodes, rollout_nodes = list(range(half)), list(range(half, o.num_nodes))
    refs = _reference_layouts(o, gpn, len(train_nodes))
    tokens = 2048 if pruned else 8192
    choice = choose_layout(
        model, gpus=len(train_nodes) * gpn, hw=hw, offload=offload, references=refs, tokens=tokens
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
    engines = _engines(o, config, enable_pd, rollout_nodes, gpn, notes)
    model_dir = local_model_dir(o, rollout_kind(fp8))
    processes = [
        p for e in engines for p in _sglang(o, e, config, enable_pd, fp8, colocated, model_dir, gpn, hw.name)
    ]
    router_node = train_nodes[0]
    processes.append(_router(engines, enable_pd, router_node, engine_key_file(o)))
    overrides = _run_overrides(o, choice, engines, router_node, fp8, offload)
    processes += _trainers(o, train_nodes, gpn, overrides)
    return ClusterPlan(
        o, model, gpn, train_nodes, rollout_nodes, colocated, config, fp8, enable_pd, offload, choice,
        engines, processes, overrides, notes,
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
    o: RecipeOptions, config: str, pd: bool, nodes: list[int], gpn: int, notes: list[str]
) -> list[Engine]:
    gpus = len(nodes) * gpn
    if config == "balanced":
        size = 4 if o.model_name == "GLM-5.2_5layer" else gpn
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
        out.append(Engine(k, role, span, size, f"http://node-{span[0]:02d}:{port}"))
    return out


def _sglang(
    o: RecipeOptions, e: Engine, config: str, pd: bool, fp8: bool, colocated: bool, model_dir: str,
    gpn: int, hw: str,
) -> list[Process]:  # fmt: skip
    """One process per node of the engine (`--node-rank` k of `--nnodes`)."""
    pruned = o.model_name == "GLM-5.2_5layer"
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
    if config == "balanced" or pd:
        argv += [
            "--enable-dp-attention",
            "--dp-size",
            str(e.gpus),
            "--moe-dense-tp-size",
            "1",
            "--enable-dp-lm-head",
        ]
    if config == "balanced" or (fp8 and o.use_deepep):
        argv += ["--moe-a2a-backend", "deepep", "--deepep-mode", "auto"]
    elif hw in ("B200", "GB300"):
        argv += ["--moe-runner-backend", "flashinfer_trtllm_routed" if fp8 else "triton"]
    mem = 0.70 if (o.num_nodes == 1 and pruned) else 0.85
    argv += ["--mem-fraction-static", f"{mem:.2f}", "--kv-cache-dtype", "fp8_e4m3"]
    argv += ["--attention-backend", "nsa", "--nsa-prefill-backend", "flashmla_sparse"]
    argv += ["--nsa-decode-backend", "flashmla_kv", "--page-size", "64"]
    argv += ["--max-running-requests", "256" if config == "balanced" else "512", "--watchdog-timeout", "3600"]
    if o.enable_mtp:
        steps, drafts = (5, 6) if config == "low-latency" else (1, 2)
        argv += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps)]
        argv += ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(drafts)]
        argv += ["--speculative-draft-attention-backend", "nsa"]
    if pd:
        argv += ["--disaggregation-mode", e.role, "--disaggregation-transfer-backend", "mooncake"]
        if e.role == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    if colocated:
        argv += ["--enable-memory-saver"]  # its memory is released while the trainer runs
    name = f"sglang-{e.role}-{e.index}"
    key = engine_key_file(o)
    if len(e.nodes) == 1:
        return [Process(name, e.nodes[0], argv, dict(SGLANG_ENV), e.gpus, key)]
    return [
        Process(f"{name}-node{k}", node, [*argv, "--node-rank", str(k)], dict(SGLANG_ENV), gpn, key)
        for k, node in enumerate(e.nodes)
    ]


def _router(engines: list[Engine], pd: bool, node: int, key_file: str) -> Process:
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
    o: RecipeOptions, choice: LayoutChoice, engines: list[Engine], router_node: int, fp8: bool, offload: bool
) -> list[str]:
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
        "trainer.megatron.ddp": "megatron",
        "trainer.megatron.distributed_optimizer": True,
        "trainer.megatron.optimizer_cpu_offload": offload,
        "trainer.max_tokens_per_micro_batch": lay.max_tokens_per_gpu,
        "sync.transport": "distributed",
        **ALGORITHM,
    }
    if o.recipe == "tbench2":
        sets.update({"env.name": "tbench2", "env.backend": "daytona", "env.tasks": f"{o.root}/data/tbench2"})
        sets["env.eval_tasks"] = f"{o.root}/data/tbench2-eval"  # held-out tasks, disjoint from env.tasks
        sets.update(TBENCH2_RUN)
    else:
        sets.update({"env.name": "dapo_math"})
    return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in sets.items()]


def _trainers(o: RecipeOptions, nodes: list[int], gpn: int, overrides: list[str]) -> list[Process]:
    out = []
    env = dict(TRAINER_ENV)
    if o.recipe == "tbench2":
        env["DAYTONA_API_KEY_FILE"] = o.daytona_key_file  # a path, never the key
    for rank, node in enumerate(nodes):
        argv = ["torchrun", f"--nnodes={len(nodes)}", f"--nproc-per-node={gpn}", f"--node-rank={rank}"]
        argv += [f"--master-addr=node-{nodes[0]:02d}", f"--master-port={TRAINER_PORT}"]
        argv += ["-m", "agentrl.cli", "train", "run"]
        for s in overrides:
            argv += ["--set", s]
        out.append(Process(f"trainer-{rank}", node, argv, env, gpn))
    return out


def validate_overrides(plan: ClusterPlan) -> None:
    """The trainer's `--set` list is a valid agentrl run configuration (else `LayoutError`)."""
    from agentrl.overrides import ConfigError
    from agentrl.runtime.config import RunConfig, resolve

    try:
        resolve(RunConfig, overrides=plan.run_overrides)
    except ConfigError as exc:
        raise LayoutError(f"the resolved trainer settings are not a valid run config: {exc}") from exc


def render(plan: ClusterPlan) -> str:
    """The plan as text (`--dry-run`): deterministic, one snapshot per flag combination."""
    o, lay, mem = plan.options, plan.layout, plan.choice.memory
    lines = [f"# {o.recipe}: {o.model_name} on {o.num_nodes} x {plan.gpus_per_node} {o.hardware}"]
    lines.append(f"model: {HF_REPOS[o.model_name]}, {plan.model.total_params() / 1e9:.1f}B parameters "
                 f"({plan.model.total_params(with_mtp=False) / 1e9:.1f}B without MTP), "
                 f"{plan.model.num_layers} layers")  # fmt: skip
    lines.append(f"DSA computing layers (1-indexed): {', '.join(map(str, plan.model.computing_layers))}")
    lines.append(f"sglang config: {plan.sglang_config}; fp8 rollout: {plan.fp8_rollout}; PD: {plan.enable_pd}; "
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
        from agentrl.train.megatron.plan import pipeline_layout

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
    lines.append("")
    lines.append("## algorithm")
    lines += [f"{k} = {v}" for k, v in ALGORITHM.items()]
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


def memory_gib(plan: ClusterPlan) -> float:
    return plan.choice.memory.total / GiB
