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


def parse_duration(text: str) -> float:
    """'90s', '30m', '2h', '1d' or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise typer.BadParameter(f"cannot parse duration {text!r}: use e.g. 90s, 30m, 2h") from None


@app.command()
def reap(
    run_id: str | None = typer.Option(None, help="Only sandboxes of this run."),
    older_than: str | None = typer.Option(None, help="Only sandboxes older than this (e.g. 2h)."),
    backend: str = typer.Option("podman", help="podman | docker | daytona"),
) -> None:
    """Remove sandboxes a dead process left behind, found by their agentrl labels."""
    import asyncio

    age = parse_duration(older_than) if older_than else None
    if backend == "daytona":
        try:
            from agentrl.sandbox.daytona import reap_daytona
        except ImportError as exc:
            console.print(
                f"[red]error:[/red] daytona backend unavailable ({exc}): pip install 'agentrl[daytona]'"
            )
            raise typer.Exit(1) from None
        removed = asyncio.run(reap_daytona(run_id=run_id, older_than_s=age))
        console.print(f"removed {removed} daytona sandboxes")
        return
    from agentrl.sandbox.podman import reap as reap_podman

    names = asyncio.run(reap_podman(cli=backend, run_id=run_id, older_than_s=age))
    for name in names:
        console.print(f"removed {name}")
    console.print(f"removed {len(names)} containers")
