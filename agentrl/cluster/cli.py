"""The Typer app of a cluster recipe: `make_app(spec)` for a `RecipeSpec` (the launchers under
`recipes/` build theirs and call it).

Subcommands: `prepare` (download, validate, convert, FP8 copy), `prepare-cp` (to node-local disk),
`train` (`--dry-run` prints the resolved plan; otherwise it places and supervises the plan on a
Ray cluster, `agentrl.cluster.ray_runtime`; `--local` runs the same Ray code on this machine with
simulated nodes; `--write-scripts` only writes the plan and one shell script per node),
`full-train` (all three). The environment's data steps of `prepare` are the environment
plugin's `data` hooks (`agentrl.cluster.recipe.env_data`). Annotations are evaluated (no
`from __future__ import annotations`): the options' help texts name the spec's models.
"""

import json
import os
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from agentrl.cluster import prepare as prep
from agentrl.cluster import prepare_ray, ray_runtime
from agentrl.cluster.launch import ensure_key
from agentrl.cluster.model import ModelSpec
from agentrl.cluster.planner import HARDWARE, Layout, LayoutError, find_pipeline_split
from agentrl.cluster.prepare import CONVERT_PORT, MEGATRON_PYTHON, ConvertPlacement, convert_argv
from agentrl.cluster.prepare_ray import conversion_specs
from agentrl.cluster.ray_runtime import LocalSettings, build_specs
from agentrl.cluster.recipe import (
    ClusterPlan,
    RecipeError,
    RecipeOptions,
    RecipeSpec,
    check_trainable,
    env_data,
    plan_recipe,
    render,
    validate_overrides,
)
from agentrl.cluster.recipe import engine_key_file as run_key_file
from agentrl.errors import AgentRLError

NumNodes = Annotated[int, typer.Option("--num-nodes", min=1)]
GpusPerNode = Annotated[
    int | None, typer.Option("--gpus-per-node", help="Default: the hardware's (8; GB300 4).")
]
Hw = Annotated[
    str, typer.Option("--hardware", help=f"GPU kind: {', '.join(HARDWARE)} (as the recipe allows).")
]
SglangConfig = Annotated[
    str | None, typer.Option("--sglang-config", help="low-latency or balanced (default: the recipe's).")
]
Fp8 = Annotated[
    bool | None, typer.Option("--fp8-rollout/--no-fp8-rollout", help="Block-FP8 rollout weights.")
]
Mtp = Annotated[
    bool, typer.Option("--enable-mtp/--no-enable-mtp", help="EAGLE speculative decoding (full model).")
]
Pd = Annotated[bool | None, typer.Option("--enable-pd/--no-enable-pd", help="Prefill/decode disaggregation.")]
DeepEP = Annotated[
    bool | None,
    typer.Option("--use-deepep/--no-megatron-use-deepep", help="Megatron DeepEP (default on; off on GB300)."),
]
Offload = Annotated[
    bool | None,
    typer.Option("--enable-optimizer-offload/--no-enable-optimizer-offload", help="Adam state off GPU."),
]
Root = Annotated[str, typer.Option("--root", help="Shared storage for checkpoints, data and runs.")]
LocalRoot = Annotated[str, typer.Option("--local-root", help="Node-local disk.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved plan and exit.")]
EngineAuth = Annotated[
    bool,
    typer.Option(
        "--engine-auth/--no-engine-auth",
        help="Engines and router require the run's key (Authorization: Bearer); off only on a network "
        "no one else reaches.",
    ),
]
EngineKeyFile = Annotated[
    str | None,
    typer.Option(
        "--engine-key-file",
        help="The run's engine key, a path every node sees (default ROOT/engine.key; created 0600 with a "
        "random key if missing).",
    ),
]
Local = Annotated[
    bool,
    typer.Option(
        "--local",
        help="Run the same Ray code on this machine: simulated nodes, `agentrl engine serve` in place of "
        "SGLang behind the real smg router, the torch trainer on a tiny model, podman sandboxes.",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Run setting on top of the plan's (local mode): --set steps=8 (dotted)."),
]
PrepLocal = Annotated[
    bool,
    typer.Option(
        "--local", help="Through the same Ray code on simulated nodes of this machine (agentrl_node_NN)."
    ),
]
SingleHost = Annotated[
    bool,
    typer.Option("--single-host", help="One torchrun on this host, no Ray (refused if it does not fit)."),
]
RayAddress = Annotated[str | None, typer.Option("--ray-address", help="Ray cluster address (default: auto).")]
HostMemory = Annotated[
    float | None,
    typer.Option(
        "--host-memory-gib",
        help="Host memory of a node, GiB (default: the hardware's reference system: H100 / H200 / B200 2048, GB300 960; "
        "--local: this machine's divided among the simulated nodes).",
    ),
]


def _options(spec: RecipeSpec, **kw: object) -> RecipeOptions:
    try:
        spec.check_hardware(str(kw.get("hardware")))
    except RecipeError as exc:
        raise typer.BadParameter(str(exc)) from None
    if kw.get("sglang_config") not in (None, "low-latency", "balanced"):
        raise typer.BadParameter(f"--sglang-config {kw.get('sglang_config')}: choose low-latency or balanced")
    if kw.get("model_name") not in spec.models:
        raise typer.BadParameter(
            f"--model-name {kw.get('model_name')}: choose one of {', '.join(spec.models)}"
        )
    return spec.options(**kw)


def _trainable(spec: RecipeSpec, model_name: str) -> None:
    try:
        check_trainable(spec, model_name)
    except RecipeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _plan(opts: RecipeOptions, spec: RecipeSpec) -> ClusterPlan:
    try:
        plan = plan_recipe(opts, spec)
        validate_overrides(plan)
    except (LayoutError, RecipeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return plan


def write_launch(plan: ClusterPlan, out: Path) -> list[Path]:
    """plan.json and `node-NN.sh` per node: every process of that node with its environment,
    started in the background, the script waiting on them (what the Ray launcher runs per node)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(
        json.dumps(
            {
                "options": asdict(plan.options),
                "layout": plan.layout.to_dict(),
                "dp": plan.choice.dp,
                "processes": [asdict(p) for p in plan.processes],
                "run_overrides": plan.run_overrides,
            },
            indent=1,
        )
    )
    paths = []
    for node in range(plan.options.num_nodes):
        lines = ["#!/usr/bin/env bash", "set -euo pipefail", f"# node-{node:02d} of {plan.options.recipe}"]
        for p in plan.processes:
            if p.node == node:
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p.env.items()))
                lines.append(f"{env + ' ' if env else ''}{p.command()} > {p.name}.log 2>&1 &")
        lines.append("wait")
        path = out / f"node-{node:02d}.sh"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o755)
        paths.append(path)
    return paths


def _run_dir(plan: ClusterPlan) -> Path:
    return Path(plan.options.root) / "runs" / plan.options.recipe


def _prep_options(
    spec: RecipeSpec, model_name: str, num_nodes: int, gpus_per_node: int | None, hardware: str,
    fp8_rollout: bool | None, local: bool, root: str,
) -> RecipeOptions:  # fmt: skip
    """The plan `prepare` and `prepare-cp` work for: its training and rollout nodes, its layout."""
    return _options(
        spec, model_name=model_name, num_nodes=num_nodes, gpus_per_node=gpus_per_node, hardware=hardware,
        fp8_rollout=fp8_rollout, enable_pd=False if local else None, root=root,
    )  # fmt: skip


def _this_host_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _convert_lines(
    placement: ConvertPlacement, layout: Layout, hf_dir: Path, out: Path, single_host: bool, local: bool
) -> list[str]:
    """What each node of the conversion runs (`prepare --dry-run`); in local mode the port is picked
    at launch, on a cluster node 0's name becomes its address."""
    report = out.parent / f".{out.name}-report-<id>.json"
    if single_host:
        argv = convert_argv(
            MEGATRON_PYTHON, hf_dir, out, report, layout, nnodes=1, node_rank=0, nproc=placement.ranks,
            master_addr="127.0.0.1", master_port=CONVERT_PORT,
        )  # fmt: skip
        return [f"[this host] {shlex.join(argv)}"]
    master = "127.0.0.1" if local else f"node-{placement.nodes[0]:02d}"
    port = "<free port>" if local else CONVERT_PORT
    specs = conversion_specs(placement, layout, hf_dir, out, report, master_addr=master, master_port=port)
    return [f"[node-{s.node:02d}] node rank {r}: {shlex.join(s.argv)}" for r, s in enumerate(specs)]


def _render_local(plan: ClusterPlan, overrides: list[str]) -> str:
    """The processes local mode starts in place of the plan's (ports are picked at launch)."""
    settings = LocalSettings(
        run_dir=_run_dir(plan).resolve(), model_dir=Path("<tiny model>"), overrides=tuple(overrides)
    )
    lines = ["", "## local mode (simulated nodes on one Ray cluster)"]
    for spec in build_specs(plan, {n: "127.0.0.1" for n in range(plan.options.num_nodes)}, settings):
        lines.append(f"[node-{spec.node:02d}] {spec.name} ({spec.role})")
        lines.append(f"  {shlex.join(spec.argv)}")
    return "\n".join(lines) + "\n"


def _launch(plan: ClusterPlan, *, local: bool, overrides: list[str], ray_address: str | None) -> None:
    try:
        if local:
            outcome = ray_runtime.run_local(plan, _run_dir(plan), overrides=overrides)
        else:
            if overrides:
                raise ray_runtime.ClusterError(
                    "--set is for --local runs; on a cluster the plan's settings are the run's"
                )
            outcome = ray_runtime.run_cluster(plan, ray_address=ray_address)
    except AgentRLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    restarts = ", ".join(f"{k} x{v}" for k, v in outcome.restarts.items()) or "none"
    typer.echo(f"run finished in {outcome.seconds:.0f} s (restarts: {restarts}); results in {_run_dir(plan)}")


def make_app(spec: RecipeSpec) -> typer.Typer:
    """The recipe's commands (`prepare`, `prepare-cp`, `train`, `full-train`), its defaults the spec's."""
    default_hw = spec.hardware
    default_model = spec.default_model
    default_nodes = spec.num_nodes
    models = ", ".join(spec.models)
    ModelName = Annotated[str, typer.Option("--model-name", help=f"One of {models}.")]
    app = typer.Typer(
        no_args_is_help=True, add_completion=False, help=spec.title or f"The {spec.name} recipe."
    )

    @app.command()
    def train(
        model_name: Annotated[
            str | None,
            typer.Option(
                "--model-name",
                help=f"One of {models} (default {default_model}; --local: {spec.local_model}).",
            ),
        ] = None,
        num_nodes: NumNodes = default_nodes,
        gpus_per_node: GpusPerNode = None,
        hardware: Hw = default_hw,
        sglang_config: SglangConfig = None,
        fp8_rollout: Fp8 = None,
        enable_mtp: Mtp = spec.mtp,
        enable_pd: Pd = None,
        use_deepep: DeepEP = None,
        enable_optimizer_offload: Offload = None,
        root: Annotated[
            str | None,
            typer.Option(
                "--root", help=f"Shared storage (default {spec.root}; --local: {spec.local_run_root})."
            ),
        ] = None,
        local_root: LocalRoot = spec.local_root,
        dry_run: DryRun = False,
        local: Local = False,
        set_: SetOpt = None,
        write_scripts: Annotated[
            bool, typer.Option("--write-scripts", help="Only write plan.json and node-NN.sh (no Ray).")
        ] = False,
        ray_address: Annotated[
            str | None, typer.Option("--ray-address", help="Ray cluster address (default: auto).")
        ] = None,
        engine_auth: EngineAuth = True,
        engine_key_file: EngineKeyFile = None,
    ) -> None:
        """Resolve the plan; --dry-run prints it; otherwise run it on Ray (a cluster, or --local)."""
        model_name = model_name or (spec.local_model if local else default_model)
        root = root or (spec.local_run_root if local else spec.root)
        if local and enable_pd:
            typer.echo(
                "error: --local runs `agentrl engine serve`, which has no prefill/decode split: drop --enable-pd",
                err=True,
            )
            raise typer.Exit(2)
        opts = _options(
            spec, model_name=model_name, num_nodes=num_nodes, gpus_per_node=gpus_per_node, hardware=hardware,
            sglang_config=sglang_config, fp8_rollout=fp8_rollout, enable_mtp=enable_mtp,
            enable_pd=False if local else enable_pd, use_deepep=use_deepep,
            enable_optimizer_offload=enable_optimizer_offload, root=root, local_root=local_root,
            engine_auth=engine_auth, engine_key_file=engine_key_file,
        )  # fmt: skip
        plan = _plan(opts, spec)
        if dry_run:
            typer.echo(render(plan), nl=False)
            if local:
                typer.echo(_render_local(plan, set_ or []), nl=False)
            return
        if not local:
            _trainable(spec, model_name)
        out = Path(root) / "runs" / spec.name / "launch"
        scripts = write_launch(plan, out)
        if write_scripts:
            if run_key_file(plan.options):  # the scripts' servers and router read it
                ensure_key(run_key_file(plan.options))
            typer.echo(f"wrote {out}/plan.json and {len(scripts)} node scripts: run node-NN.sh on node NN")
            return
        _launch(plan, local=local, overrides=set_ or [], ray_address=ray_address)

    @app.command()
    def prepare(
        model_name: ModelName = default_model,
        model_source: Annotated[str | None, typer.Option(help="Hub repo id or local directory.")] = None,
        root: Root = spec.root,
        convert: Annotated[bool, typer.Option("--convert/--no-convert", help="HF -> Megatron.")] = True,
        fp8_rollout: Fp8 = None,
        num_nodes: NumNodes = default_nodes,
        gpus_per_node: GpusPerNode = None,
        hardware: Hw = default_hw,
        tp: Annotated[int | None, typer.Option(help="Conversion TP (default: the plan's layout).")] = None,
        pp: Annotated[
            int | None, typer.Option(help="Conversion PP (each rank reads only its stage).")
        ] = None,
        first_stage_layers: Annotated[int | None, typer.Option(help="Layers of the first stage.")] = None,
        last_stage_layers: Annotated[int | None, typer.Option(help="Layers of the last stage.")] = None,
        ep: Annotated[int | None, typer.Option(help="Conversion EP.")] = None,
        convert_nodes: Annotated[
            int | None,
            typer.Option(help="Training nodes the conversion spreads over (default: the fewest that fit)."),
        ] = None,
        host_memory_gib: HostMemory = None,
        data: Annotated[bool, typer.Option("--data/--no-data", help="Download the dataset too.")] = True,
        tasks_source: Annotated[
            str | None,
            typer.Option(
                help="A local copy of the environment's data instead of the hub (where the environment "
                "takes one, e.g. a directory of tasks)."
            ),
        ] = None,
        eval_tasks: Annotated[
            int, typer.Option(help="Rows held out for the evals (where the environment splits its data).")
        ] = 20,
        split_seed: Annotated[int, typer.Option(help="The seed that picks the held-out rows.")] = 0,
        dry_run: DryRun = False,
        local: PrepLocal = False,
        single_host: SingleHost = False,
        ray_address: RayAddress = None,
    ) -> None:
        """Download the checkpoint (and data), validate it, convert it across the training nodes
        (one torchrun per node through Ray), optionally FP8-quantise."""
        if model_name not in spec.models:
            raise typer.BadParameter(f"--model-name {model_name}: choose one of {models}")
        if local and single_host:
            raise typer.BadParameter("--local and --single-host: choose one")
        if convert:
            _trainable(spec, model_name)
        entry = spec.models[model_name]
        src = model_source or entry.hf_repo
        fp8 = spec.fp8_rollout if fp8_rollout is None else fp8_rollout
        data_hooks = env_data(spec.env) if data else None
        data_dir = Path(root) / "data"
        data_opts = {"source": tasks_source, "eval_count": eval_tasks, "seed": split_seed}
        hf_dir = Path(root) / "hf" / model_name
        out = Path(root) / "megatron" / model_name
        explicit = any(v is not None for v in (tp, pp, ep, first_stage_layers, last_stage_layers))
        plan = None
        if not (single_host and explicit):
            plan = _plan(_prep_options(spec, model_name, num_nodes, gpus_per_node, hardware, fp8_rollout, local,
                                       root), spec)  # fmt: skip
        if explicit:
            if (pp or 1) > 1 and first_stage_layers is None and last_stage_layers is None:
                try:  # the split that starts every stage on a layer computing its DSA indices
                    first_stage_layers, last_stage_layers = find_pipeline_split(entry.spec(), pp or 1)
                except LayoutError as exc:
                    typer.echo(f"error: {exc}", err=True)
                    raise typer.Exit(2) from None
            layout = Layout(tp or 1, pp or 1, 1, ep or 1, first_stage_layers=first_stage_layers,
                            last_stage_layers=last_stage_layers)  # fmt: skip
        else:
            assert plan is not None
            layout = plan.layout

        def placement(model: ModelSpec, bytes_per_param: int) -> prep.ConvertPlacement:
            if single_host:
                memory = host_memory_gib or _this_host_gib()
                return prep.place_conversion(model, layout, train_nodes=[0], host_memory_gib=memory,
                                             gpus_per_node=None, bytes_per_param=bytes_per_param, nodes=1,
                                             scope="this host (--single-host)")  # fmt: skip
            assert plan is not None
            memory = host_memory_gib or (
                _this_host_gib() / num_nodes if local else prep.HOST_MEMORY_GIB[plan.options.hardware]
            )
            return prep.place_conversion(
                model, layout, train_nodes=plan.train_nodes, host_memory_gib=memory,
                gpus_per_node=None if local else plan.gpus_per_node, bytes_per_param=bytes_per_param,
                nodes=convert_nodes,
            )  # fmt: skip

        where = "this host" if single_host else ("simulated nodes, local Ray" if local else "Ray")
        try:
            if dry_run:
                steps = [f"download {src} -> {hf_dir}", "validate config.json"]
                if convert:
                    model = entry.spec()
                    bpp = prep.param_bytes(model.config) if "torch_dtype" in model.config else 2
                    pl = placement(model, bpp)
                    steps.append(
                        f"convert HF -> Megatron torch_dist ({layout.short()}, {pl.ranks} ranks on "
                        f"{len(pl.nodes)} node{'s' if len(pl.nodes) > 1 else ''}, {where}) -> {out}"
                    )
                    steps += [f"  {line}" for line in pl.explain(layout, bpp)]
                    steps += [
                        f"  {line}" for line in _convert_lines(pl, layout, hf_dir, out, single_host, local)
                    ]
                if fp8:
                    steps.append(f"block-FP8 copy -> {Path(root) / 'fp8' / model_name}")
                describe = getattr(data_hooks, "describe", None)
                if describe is not None:
                    steps.append(describe(data_dir, **data_opts))
                typer.echo("\n".join(s if s.startswith("  ") else f"prepare: {s}" for s in steps))
                return
            local_dir = prep.download_model(src, hf_dir)
            cfg = prep.validate_checkpoint(
                local_dir, num_layers=entry.spec().num_layers, model_type=entry.config["model_type"],
                architectures=entry.config["architectures"],
            )  # fmt: skip
            typer.echo(f"validated {local_dir}")
            if convert:
                bpp = prep.param_bytes(cfg)
                pl = placement(ModelSpec(model_name, cfg), bpp)
                typer.echo("\n".join(pl.explain(layout, bpp)))
                if single_host:
                    r = prep.convert_to_megatron(local_dir, out, layout)
                else:
                    r = prepare_ray.run_conversion(
                        pl, layout, local_dir, out, num_nodes=num_nodes, log_dir=Path(root) / "prepare" / "logs",
                        local=local, ray_address=ray_address,
                    )  # fmt: skip
                    for n in r["nodes"]:
                        typer.echo(f"node-{n['node']:02d} ({n['host']}): node rank {n['node_rank']}, "
                                   f"{n['ranks']} ranks, done in {n['seconds']:.0f} s")  # fmt: skip
                typer.echo(
                    f"converted {r['hf_tensors']} tensors on {r['ranks']} ranks over {len(pl.nodes)} "
                    f"node{'s' if len(pl.nodes) > 1 else ''}, round trip max |diff| {r['max_abs_diff']:.3g}"
                )
            if fp8:
                n = prep.quantize_fp8(local_dir, Path(root) / "fp8" / model_name)
                typer.echo(f"quantised {n} weights to block FP8")
            prepare_data = getattr(data_hooks, "prepare", None)
            if prepare_data is not None:
                prepare_data(data_dir, **data_opts, report=typer.echo)
        except AgentRLError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

    @app.command("prepare-cp")
    def prepare_cp(
        model_name: ModelName = default_model,
        root: Root = spec.root,
        local_root: LocalRoot = spec.local_root,
        num_nodes: NumNodes = default_nodes,
        gpus_per_node: GpusPerNode = None,
        hardware: Hw = default_hw,
        fp8_rollout: Fp8 = None,
        dry_run: DryRun = False,
        local: PrepLocal = False,
        single_host: Annotated[
            bool,
            typer.Option("--single-host", help="Copy every prepared checkpoint to this host only (no Ray)."),
        ] = False,
        ray_address: RayAddress = None,
    ) -> None:
        """Copy the prepared checkpoints from shared storage to node-local disk on every node of the
        plan, through Ray: training nodes the Megatron checkpoint, rollout nodes the one their
        engines load (FP8 or HF)."""
        if local and single_host:
            raise typer.BadParameter("--local and --single-host: choose one")
        if single_host:
            pairs = [
                (Path(root) / kind / model_name, Path(local_root) / kind / model_name)
                for kind in ("megatron", "fp8", "hf")
                if (Path(root) / kind / model_name).is_dir() or dry_run
            ]
            if not pairs:
                typer.echo(
                    f"error: nothing prepared under {root} for {model_name}: run `prepare` first", err=True
                )
                raise typer.Exit(2)
            for src, dest in pairs:
                if dry_run:
                    typer.echo(f"prepare-cp: {src} -> {dest}")
                    continue
                try:
                    prep.copy_to_local(src, dest)
                except AgentRLError as exc:
                    typer.echo(f"error: {exc}", err=True)
                    raise typer.Exit(2) from None
                typer.echo(f"copied {src} -> {dest}")
            return
        plan = _plan(
            _prep_options(spec, model_name, num_nodes, gpus_per_node, hardware, fp8_rollout, local, root),
            spec,
        )
        needs = prep.node_needs(plan)
        if dry_run:
            for node, kinds in needs.items():
                dest = Path(local_root) / f"node-{node:02d}" if local else Path(local_root)
                roles = "+".join(r for r, ns in (("train", plan.train_nodes), ("rollout", plan.rollout_nodes))
                                 if node in ns)  # fmt: skip
                for kind in kinds:
                    typer.echo(f"prepare-cp: [node-{node:02d}] {roles}: {Path(root) / kind / model_name} -> "
                               f"{dest / kind / model_name}")  # fmt: skip
            if not local:
                typer.echo("prepare-cp: (a Ray cluster whose nodes lack the agentrl_node_NN resources does not pin "
                           "plan nodes to hosts: there every node gets every role's files)")  # fmt: skip
            return
        try:
            copies, notes = prepare_ray.copy_to_nodes(
                needs, root=Path(root).resolve(), local_root=Path(local_root).resolve(), model_name=model_name,
                num_nodes=num_nodes, local=local, ray_address=ray_address,
            )  # fmt: skip
        except AgentRLError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        for note in notes:
            typer.echo(f"note: {note}")
        for c in copies:
            for item in c.copied:
                typer.echo(f"[node-{c.node:02d}] ({c.host}) copied {item['source']} -> {item['dest']}: "
                           f"{item['files']} files, {item['bytes'] / 1e6:.1f} MB in {item['seconds']:.1f} s")  # fmt: skip

    @app.command("full-train")
    def full_train(
        model_name: ModelName = default_model,
        num_nodes: NumNodes = default_nodes,
        gpus_per_node: GpusPerNode = None,
        hardware: Hw = default_hw,
        sglang_config: SglangConfig = None,
        fp8_rollout: Fp8 = None,
        enable_mtp: Mtp = spec.mtp,
        enable_pd: Pd = None,
        use_deepep: DeepEP = None,
        enable_optimizer_offload: Offload = None,
        root: Root = spec.root,
        local_root: LocalRoot = spec.local_root,
        dry_run: DryRun = False,
        engine_auth: EngineAuth = True,
        engine_key_file: EngineKeyFile = None,
    ) -> None:
        """prepare, prepare-cp, then train."""
        prepare(model_name=model_name, model_source=None, root=root, convert=True, fp8_rollout=fp8_rollout,
                num_nodes=num_nodes, gpus_per_node=gpus_per_node, hardware=hardware, data=True,
                dry_run=dry_run)  # fmt: skip
        prepare_cp(model_name=model_name, root=root, local_root=local_root, num_nodes=num_nodes,
                   gpus_per_node=gpus_per_node, hardware=hardware, fp8_rollout=fp8_rollout,
                   dry_run=dry_run)  # fmt: skip
        train(model_name=model_name, num_nodes=num_nodes, gpus_per_node=gpus_per_node, hardware=hardware,
              sglang_config=sglang_config, fp8_rollout=fp8_rollout, enable_mtp=enable_mtp, enable_pd=enable_pd,
              use_deepep=use_deepep, enable_optimizer_offload=enable_optimizer_offload, root=root,
              local_root=local_root, dry_run=dry_run, local=False, set_=None, write_scripts=False,
              ray_address=None, engine_auth=engine_auth, engine_key_file=engine_key_file)  # fmt: skip

    return app
