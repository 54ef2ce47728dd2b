"""The Typer app behind `recipes/glm52_tbench2.py` and `recipes/glm52_dapo_math.py`.

Subcommands: `prepare` (download, validate, convert, FP8 copy), `prepare-cp` (to node-local disk),
`train` (`--dry-run` prints the resolved plan; otherwise it writes the plan and one launch script
per node), `full-train` (all three).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from agentrl.cluster.model import HF_REPOS, MODELS, ModelSpec
from agentrl.cluster.planner import HARDWARE, LayoutError
from agentrl.cluster.recipe import (
    ClusterPlan,
    Recipe,
    RecipeError,
    RecipeOptions,
    render,
    resolve,
    validate_overrides,
)
from agentrl.errors import AgentRLError

ModelName = Annotated[str, typer.Option("--model-name", help=f"One of {', '.join(MODELS)}.")]
NumNodes = Annotated[int, typer.Option("--num-nodes", min=1)]
GpusPerNode = Annotated[
    int | None, typer.Option("--gpus-per-node", help="Default: the hardware's (8; GB300 4).")
]
Hw = Annotated[str, typer.Option("--hardware", help="H200, B200 or GB300.")]
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


def _options(recipe: Recipe, **kw: object) -> RecipeOptions:
    if kw.get("hardware") not in HARDWARE:
        raise typer.BadParameter(f"--hardware {kw.get('hardware')}: choose one of {', '.join(HARDWARE)}")
    if kw.get("sglang_config") not in (None, "low-latency", "balanced"):
        raise typer.BadParameter(f"--sglang-config {kw.get('sglang_config')}: choose low-latency or balanced")
    if kw.get("model_name") not in MODELS:
        raise typer.BadParameter(f"--model-name {kw.get('model_name')}: choose one of {', '.join(MODELS)}")
    return RecipeOptions(recipe=recipe, **kw)  # type: ignore[arg-type]


def _plan(opts: RecipeOptions) -> ClusterPlan:
    try:
        plan = resolve(opts)
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


def make_app(recipe: Recipe) -> typer.Typer:
    default_hw = "GB300"
    app = typer.Typer(no_args_is_help=True, add_completion=False, help=f"GLM-5.2 {recipe} recipe.")

    @app.command()
    def train(
        model_name: ModelName = "GLM-5.2",
        num_nodes: NumNodes = 16,
        gpus_per_node: GpusPerNode = None,
        hardware: Hw = default_hw,
        sglang_config: SglangConfig = None,
        fp8_rollout: Fp8 = None,
        enable_mtp: Mtp = False,
        enable_pd: Pd = None,
        use_deepep: DeepEP = None,
        enable_optimizer_offload: Offload = None,
        root: Root = "/shared/glm52",
        local_root: LocalRoot = "/local/glm52",
        dry_run: DryRun = False,
    ) -> None:
        """Resolve the plan; --dry-run prints it, otherwise plan.json and node-NN.sh are written."""
        opts = _options(
            recipe, model_name=model_name, num_nodes=num_nodes, gpus_per_node=gpus_per_node, hardware=hardware,
            sglang_config=sglang_config, fp8_rollout=fp8_rollout, enable_mtp=enable_mtp, enable_pd=enable_pd,
            use_deepep=use_deepep, enable_optimizer_offload=enable_optimizer_offload, root=root,
            local_root=local_root,
        )  # fmt: skip
        plan = _plan(opts)
        if dry_run:
            typer.echo(render(plan), nl=False)
            return
        out = Path(root) / "runs" / recipe / "launch"
        scripts = write_launch(plan, out)
        typer.echo(f"wrote {out}/plan.json and {len(scripts)} node scripts: run node-NN.sh on node NN")

    @app.command()
    def prepare(
        model_name: ModelName = "GLM-5.2",
        model_source: Annotated[str | None, typer.Option(help="Hub repo id or local directory.")] = None,
        root: Root = "/shared/glm52",
        convert: Annotated[bool, typer.Option("--convert/--no-convert", help="HF -> Megatron.")] = True,
        fp8_rollout: Fp8 = None,
        tp: Annotated[int, typer.Option(help="Conversion TP.")] = 1,
        ep: Annotated[int, typer.Option(help="Conversion EP.")] = 1,
        data: Annotated[bool, typer.Option("--data/--no-data", help="Download the dataset too.")] = True,
        dry_run: DryRun = False,
    ) -> None:
        """Download the checkpoint (and data), validate it, convert it, optionally FP8-quantise."""
        from agentrl.cluster import prepare as prep
        from agentrl.cluster.planner import Layout

        if model_name not in MODELS:
            raise typer.BadParameter(f"--model-name {model_name}: choose one of {', '.join(MODELS)}")
        src = model_source or HF_REPOS[model_name]
        fp8 = (recipe == "tbench2") if fp8_rollout is None else fp8_rollout
        hf_dir = Path(root) / "hf" / model_name
        steps = [f"download {src} -> {hf_dir}", "validate config.json"]
        if convert:
            steps.append(
                f"convert HF -> Megatron torch_dist (TP{tp} EP{ep}) -> {Path(root) / 'megatron' / model_name}"
            )
        if fp8:
            steps.append(f"block-FP8 copy -> {Path(root) / 'fp8' / model_name}")
        if data and recipe == "dapo_math":
            steps.append(f"download dapo-math-17k and aime-2024 -> {Path(root) / 'data' / 'dapo_math'}")
        if dry_run:
            typer.echo("\n".join(f"prepare: {s}" for s in steps))
            return
        try:
            local = prep.download_model(src, hf_dir)
            prep.validate_checkpoint(local, num_layers=ModelSpec.named(model_name).num_layers)
            typer.echo(f"validated {local}")
            if convert:
                r = prep.convert_to_megatron(
                    local, Path(root) / "megatron" / model_name, Layout(tp, 1, 1, ep)
                )
                typer.echo(
                    f"converted {r['hf_tensors']} tensors on {r['ranks']} ranks, round trip max |diff| {r['max_abs_diff']:.3g}"
                )
            if fp8:
                n = prep.quantize_fp8(local, Path(root) / "fp8" / model_name)
                typer.echo(f"quantised {n} weights to block FP8")
            if data and recipe == "dapo_math":
                from envs.dapo_math.hub import download_datasets

                download_datasets(Path(root) / "data" / "dapo_math", report=typer.echo)
        except AgentRLError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

    @app.command("prepare-cp")
    def prepare_cp(
        model_name: ModelName = "GLM-5.2",
        root: Root = "/shared/glm52",
        local_root: LocalRoot = "/local/glm52",
        dry_run: DryRun = False,
    ) -> None:
        """Copy the prepared checkpoints from shared storage to this node's local disk."""
        from agentrl.cluster import prepare as prep

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

    @app.command("full-train")
    def full_train(
        model_name: ModelName = "GLM-5.2",
        num_nodes: NumNodes = 16,
        gpus_per_node: GpusPerNode = None,
        hardware: Hw = default_hw,
        sglang_config: SglangConfig = None,
        fp8_rollout: Fp8 = None,
        enable_mtp: Mtp = False,
        enable_pd: Pd = None,
        use_deepep: DeepEP = None,
        enable_optimizer_offload: Offload = None,
        root: Root = "/shared/glm52",
        local_root: LocalRoot = "/local/glm52",
        dry_run: DryRun = False,
    ) -> None:
        """prepare, prepare-cp, then train."""
        prepare(model_name=model_name, model_source=None, root=root, convert=True, fp8_rollout=fp8_rollout,
                tp=1, ep=1, data=True, dry_run=dry_run)  # fmt: skip
        prepare_cp(model_name=model_name, root=root, local_root=local_root, dry_run=dry_run)
        train(model_name=model_name, num_nodes=num_nodes, gpus_per_node=gpus_per_node, hardware=hardware,
              sglang_config=sglang_config, fp8_rollout=fp8_rollout, enable_mtp=enable_mtp, enable_pd=enable_pd,
              use_deepep=use_deepep, enable_optimizer_offload=enable_optimizer_offload, root=root,
              local_root=local_root, dry_run=dry_run)  # fmt: skip

    return app
