"""`agentrl train ...`: `run`, a training run of any environment and model through the library
runtime, beside the trainer's own `replay` (`agentrl.train.cli`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from agentrl.train.cli import app


@app.command("run")
def run_cmd(
    config: Path = typer.Option(None, "--config", help="A .toml / .json / .yaml file of run settings."),
    set_: list[str] = typer.Option(None, "--set", help="Override a setting: --set trainer.lr=1e-5 (dotted)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every resolved setting and exit."),
) -> None:
    """A training run of any environment and model through the library runtime (the same loop the
    recipes call): `agentrl train run --config run.toml --set engine.model=<dir>`."""
    import asyncio

    from agentrl.errors import AgentRLError
    from agentrl.runtime import RunConfig, close_parts, resolve, train
    from agentrl.runtime.build import build_parts

    try:
        cfg = resolve(RunConfig, config_file=config, overrides=set_ or [])
    except AgentRLError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if dry_run:
        typer.echo(json.dumps(cfg.dump(), indent=1))
        return
    import torch

    torch.set_num_threads(cfg.torch_threads)
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
