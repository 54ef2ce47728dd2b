"""`agentrl env ...`: environments as OpenEnv servers. Imports nothing heavy until a command runs."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import ValidationError

from agentrl.errors import AgentRLError
from agentrl.openenv.config import ServeConfig
from agentrl.openenv.server import serve
from agentrl.overrides import apply_overrides, load_file

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Environments as OpenEnv environment servers."
)


@app.callback()
def _group() -> None:
    """Environments as OpenEnv environment servers (`serve`); to train on one, use env.name=openenv."""


@app.command("serve")
def serve_cmd(
    environment: str = typer.Argument("tbench2", help="The environment plugin to serve (tbench2)."),
    backend: str = typer.Option(None, help="Sandbox backend: podman | docker | daytona | fake."),
    tasks: Path = typer.Option(None, help="Directory of task directories (default: the bundled ones)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback: only this machine)."),
    port: int = typer.Option(8000, help="Port (0: any free one)."),
    max_sessions: int = typer.Option(8, help="Concurrent sessions, hence sandboxes."),
    idle_timeout: float = typer.Option(600.0, help="Seconds a silent session keeps its sandbox."),
    run_id: str = typer.Option(None, help="Label of this server's sandboxes (default: random)."),
    config: Path = typer.Option(None, "--config", help="A .toml / .json / .yaml file of settings."),
    set_: list[str] = typer.Option(
        None,
        "--set",
        help="Override a setting: --set command_timeout_s=120, --set env.max_solution_chars=64.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every resolved setting and exit."),
) -> None:
    """Serve an environment over OpenEnv (reset / step / state on /ws, the upstream tbench2_env
    schema for terminal tasks): one sandbox per session, closed on disconnect and when idle."""

    data: dict = load_file(config) if config is not None else {}
    data.setdefault("env", {})["name"] = environment
    if backend is not None:
        data["env"]["backend"] = backend
    if tasks is not None:
        data["env"]["tasks"] = str(tasks)
    data.update(host=host, port=port, max_sessions=max_sessions, idle_timeout_s=idle_timeout)
    if run_id is not None:
        data["run_id"] = run_id
    try:
        apply_overrides(data, set_)
        cfg = ServeConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors()]
        typer.echo("invalid settings:\n" + "\n".join(lines), err=True)
        raise typer.Exit(2) from None
    except AgentRLError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if dry_run:
        typer.echo(json.dumps(cfg.model_dump(mode="json"), indent=1))
        return
    typer.echo(
        f"serving {environment} ({cfg.env.get('backend')}) on http://{cfg.host}:{cfg.port} "
        f"(ws://{cfg.host}:{cfg.port}/ws), at most {cfg.max_sessions} sessions, sandboxes labelled "
        f"agentrl.run-id={cfg.run_id}"
    )
    try:
        serve(cfg)
    except AgentRLError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
