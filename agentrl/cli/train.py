"""`agentrl train ...`: `run`, a training run of any environment and model through the library
runtime, beside the trainer's own `replay` (`agentrl.cli.train_replay`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from agentrl.cli.train_replay import app
from agentrl.errors import AgentRLError
from agentrl.overrides import ConfigError
from agentrl.runtime import RunConfig, resolve

# The loop, its parts and torch (the `local` extra) load after --dry-run, which needs none of them.


@app.command("run")
def run_cmd(
    config_arg: Path = typer.Argument(
        None, metavar="CONFIG", help="A .toml / .json / .yaml file of run settings."
    ),
    config: Path = typer.Option(None, "--config", help="The same, as an option."),
    set_: list[str] = typer.Option(None, "--set", help="Override a setting: --set trainer.lr=1e-5 (dotted)."),
    resume: Path = typer.Option(
        None,
        "--resume",
        help="Continue the run in this directory from its last checkpoint (its config.json, "
        "then --set; e.g. --set steps=8 to go further).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every resolved setting and exit."),
) -> None:
    """A training run of any environment and model through the library runtime (the same loop the
    recipes call): `agentrl train run run.toml --set engine.model=<dir>`; `agentrl train run
    --resume runs/x --set steps=8` continues one."""

    if config_arg is not None and config is not None:
        typer.echo("give the config file once: as CONFIG or as --config", err=True)
        raise typer.Exit(2)
    config = config or config_arg
    overrides = list(set_ or [])
    try:
        if resume is not None:
            if config is not None:
                raise ConfigError(
                    "--resume reads the run's own config.json: give --set overrides, not a file"
                )
            config = resume / "config.json"
            if not config.is_file():
                raise ConfigError(f"--resume {resume}: no config.json there (is it a run directory?)")
            overrides = [f"out={resume}", "checkpoint.resume=true", *overrides]
        cfg = resolve(RunConfig, config_file=config, overrides=overrides)
    except AgentRLError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if dry_run:
        typer.echo(json.dumps(cfg.dump(), indent=1))
        return
    import torch

    from agentrl.runtime import close_parts, train
    from agentrl.runtime.build import build_parts
    from agentrl.runtime.ranks import run_ranks, world_size

    torch.set_num_threads(cfg.torch_threads)
    if world_size() > 1:  # torchrun: rank 0 drives, the others follow (agentrl.runtime.ranks)
        try:
            run_ranks(cfg, reporter=typer.echo)
        except AgentRLError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        return
    try:
        parts = build_parts(cfg)
    except AgentRLError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None

    async def go() -> None:
        try:
            await train(cfg, parts, reporter=typer.echo)
        finally:
            await close_parts(parts)

    asyncio.run(go())


SET = typer.Option(None, "--set", help="Override a setting: --set trainer.lr=3e-5 (dotted, JSON values).")
CONFIG = typer.Option(None, "--config", help="A .toml / .json / .yaml file of settings.")
DRY = typer.Option(False, help="Print every resolved setting and exit.")


def configure(
    model: type[Any],
    defaults: dict[str, Any],
    config: Path | None,
    overrides: list[str] | None,
    dry_run: bool,
) -> Any:
    """A recipe's config resolved (defaults <- file <- --set); printed and None on --dry-run; a
    ConfigError exits 2 with its message. Sets torch's thread count for the run."""

    console = Console()
    try:
        cfg = resolve(model, defaults=defaults, config_file=config, overrides=overrides)
    except ConfigError as exc:
        console.print(str(exc), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if dry_run:
        console.print_json(json.dumps(cfg.dump()))
        return None
    import torch

    torch.set_num_threads(cfg.torch_threads)
    return cfg
