"""`agentrl sandbox ...`: base images and clean-up of sandboxes a dead process left behind."""

from __future__ import annotations

import os

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(no_args_is_help=True, help="Local sandboxes: base images, reaping.")
console = Console()


def default_cli() -> str:
    return os.environ.get("AGENTRL_CONTAINER_CLI", "podman")


@app.command("build-bases")
def build_bases_cmd(
    cli: str = typer.Option(None, help="Container CLI (default: $AGENTRL_CONTAINER_CLI or podman)."),
    force_standins: bool = typer.Option(False, help="Tag stand-ins even over images that exist."),
    pull: bool = typer.Option(True, help="Try pulling real images first where a registry answers."),
) -> None:
    """Make the base images task Dockerfiles start FROM available offline."""
    from agentrl.errors import AgentRLError
    from agentrl.sandbox.images import build_bases

    try:
        status = build_bases(
            cli=cli or default_cli(), force_standins=force_standins, try_pull=pull, log=console.print
        )
    except AgentRLError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    table = Table(title="base images")
    table.add_column("name")
    table.add_column("source")
    for name, source in status.items():
        table.add_row(name, source)
    console.print(table)
