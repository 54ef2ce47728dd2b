"""`agentrl sandbox ...`: offline stand-in bases, task-image pruning, and clean-up of sandboxes a
dead process left behind."""

from __future__ import annotations

import asyncio
import os
import time

import typer
from rich.console import Console
from rich.table import Table

from agentrl.errors import AgentRLError
from agentrl.sandbox.images import build_bases, list_standins, load_recipe, prune_task_images, remove_standins
from agentrl.sandbox.podman import reap as reap_podman

app = typer.Typer(no_args_is_help=True, help="Local sandboxes: base images, pruning, reaping.")
bases_app = typer.Typer(no_args_is_help=True, help="Offline stand-in base images.")
app.add_typer(bases_app, name="bases")
console = Console()


def default_cli() -> str:
    return os.environ.get("AGENTRL_CONTAINER_CLI", "podman")


@app.command("build-bases")
def build_bases_cmd(
    cli: str = typer.Option(None, help="Container CLI (default: $AGENTRL_CONTAINER_CLI or podman)."),
    force_standins: bool = typer.Option(False, help="Do not look for the real images at all."),
    pull: bool = typer.Option(True, help="Try pulling real images first where a registry answers."),
    family: list[str] = typer.Option(
        None, "--family", help="Also build this language stand-in now (node, golang, rust, gcc)."
    ),
) -> None:
    """Build the offline stand-in (under localhost/agentrl-base/ only) that task builds use for a
    known base which is neither local nor pullable. Language stand-ins (node, golang, rust, gcc)
    are built when a task first needs one, or now with --family."""

    try:
        status = build_bases(
            cli=cli or default_cli(),
            force_standins=force_standins,
            try_pull=pull,
            families=tuple(family or ()),
            log=console.print,
        )
    except AgentRLError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    table = Table(title="base images")
    table.add_column("name")
    table.add_column("served by")
    for name, source in status.items():
        table.add_row(name, source)
    console.print(table)


@bases_app.command("list")
def bases_list(
    cli: str = typer.Option(None, help="Container CLI (default: $AGENTRL_CONTAINER_CLI or podman)."),
) -> None:
    """The stand-ins that exist, their recipe hash and the repositories they answer for (and what
    they really contain); the families not built yet; names an older agentrl tagged on real
    image names are listed as legacy."""

    catalog = load_recipe()
    items = list_standins(cli or default_cli(), catalog)
    ours = [item for item in items if not item.legacy]
    legacy = [item for item in items if item.legacy]
    if not ours:
        console.print("no stand-ins: `agentrl sandbox build-bases` builds one")
    built = set()
    for item in ours:
        state = "current" if item.current else "stale recipe"
        console.print(f"[bold]{item.name}[/bold]  recipe {item.recipe or '-'} ({state})")
        family = next((f for f in catalog.families if f.standin == item.name), None)
        if item.serves and family is not None:
            built.add(family.family)
            repos = ", ".join(r.removeprefix("docker.io/library/") for r in item.serves)
            console.print(f"  answers for any tag of: {repos}")
            console.print(f"  {family.content}")
    for family in catalog.families:
        if family.family not in built:
            repos = ", ".join(r.removeprefix("docker.io/library/") for r in family.repositories)
            console.print(
                f"[dim]{family.standin}  not built: built when a task needs it (any tag of {repos}),"
                f" or `agentrl sandbox build-bases{' --family ' + family.family.split('-', 1)[1] if family.parent else ''}`[/dim]"
            )
            if family.parent is not None:
                console.print(f"  [dim]{family.content}[/dim]")
    if legacy:
        console.print(
            f"[yellow]{len(legacy)} names an older agentrl tagged on its stand-ins (real names now "
            "running Debian content); `agentrl sandbox bases remove --legacy` removes them:[/yellow]"
        )
        for item in legacy:
            console.print(f"  {item.name}  recipe {item.recipe or '-'}")


@bases_app.command("remove")
def bases_remove(
    cli: str = typer.Option(None, help="Container CLI (default: $AGENTRL_CONTAINER_CLI or podman)."),
    legacy: bool = typer.Option(
        False,
        "--legacy",
        help="Only the real-name tags (python:3.13-slim, ...) older agentrl versions put on its "
        "stand-ins; provably ours (the stand-in's image or its recipe label and layers), never an "
        "image you pulled.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be removed."),
) -> None:
    """Remove the stand-ins and the real-name tags older agentrl versions put on them (--legacy:
    only those tags)."""

    removed, failed = remove_standins(cli or default_cli(), legacy_only=legacy, dry_run=dry_run)
    for name in removed:
        console.print(f"{'would remove' if dry_run else 'removed'} {name}")
    for line in failed:
        console.print(f"[red]kept[/red] {line}")
    console.print(f"{len(removed)} {'to remove' if dry_run else 'removed'}, {len(failed)} kept")
    if failed:
        raise typer.Exit(1)


@app.command()
def prune(
    older_than: str | None = typer.Option(None, help="Only images older than this (e.g. 2h, 7d)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be removed."),
    cli: str = typer.Option(None, help="Container CLI (default: $AGENTRL_CONTAINER_CLI or podman)."),
) -> None:
    """Remove the images agentrl built for tasks (localhost/agentrl-task/*, and their terminal
    layers localhost/agentrl-terminal/*). Images any container uses are never touched."""

    age = parse_duration(older_than) if older_than else None
    now = time.time()
    chosen, failed = prune_task_images(cli or default_cli(), older_than_s=age, dry_run=dry_run, now=now)
    for image in chosen:
        hours = (now - image.created) / 3600
        console.print(f"{'would remove' if dry_run else 'removed'} {image.name} ({hours:.1f} h old)")
    for line in failed:
        console.print(f"[red]kept[/red] {line}")
    console.print(f"{len(chosen)} task images {'to remove' if dry_run else 'removed'}")
    if failed:
        raise typer.Exit(1)


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

    names = asyncio.run(reap_podman(cli=backend, run_id=run_id, older_than_s=age))
    for name in names:
        console.print(f"removed {name}")
    console.print(f"removed {len(names)} containers")
