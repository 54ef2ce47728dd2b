"""`agentrl tasks ...`: lint task directories and turn them into training rows."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from agentrl.cli import safe_text as _safe
from agentrl.episode.oracle import build_images, run_oracle
from agentrl.errors import AgentRLError, TaskFormatError
from agentrl.progress import progress_bar
from agentrl.sandbox.base import tail
from agentrl.sandbox.lint import build_plan, lint_tasks, warning_kinds
from agentrl.sandbox.registry import make_provider
from agentrl.tasks.dataset import split_rows, write_jsonl
from agentrl.tasks.task import discover_tasks

app = typer.Typer(no_args_is_help=True, help="Harbor / terminal-bench-2 task directories.")
console = Console()


def _discover(dirs: list[Path]) -> list:
    try:
        tasks = discover_tasks(*dirs)
    except TaskFormatError as exc:
        console.print(f"[red]error:[/red] {_safe(str(exc))}")
        raise typer.Exit(1) from None
    if not tasks:
        shown = ", ".join(str(d) for d in dirs)
        console.print(f"[red]error:[/red] no task found in {_safe(shown)} (a task directory holds task.toml)")
        raise typer.Exit(1)
    return tasks


@app.command()
def lint(
    dirs: list[Path] = typer.Argument(..., help="Task directories, or directories of tasks."),
    show_ok: bool = typer.Option(False, help="List tasks without errors or warnings too."),
    strict: bool = typer.Option(False, help="Exit 1 on warnings too."),
    builds: bool = typer.Option(
        False, "--builds", help="Say for every task how this machine would build it (or why it cannot)."
    ),
) -> None:
    """Check tasks against the format and what would fail later; exit 1 on an error (or, with
    --strict, a warning)."""
    tasks = _discover(dirs)
    results = lint_tasks(tasks)
    table = Table(title=f"{len(results)} tasks", show_lines=builds)
    table.add_column("task")
    table.add_column("status")
    table.add_column("details", overflow="fold")
    if builds:
        table.add_column("builds here", overflow="fold")
    n_err = n_warn = n_unbuildable = 0
    for r in results:
        n_err += bool(r.errors)
        n_warn += bool(r.warnings)
        row: list[str] = []
        if builds and not r.errors:
            ok, how = build_plan(r.task)
            n_unbuildable += not ok
            row = [("[green]yes[/green]\n" if ok else "[red]no[/red]\n") + _safe("\n".join(how))]
        elif builds:
            row = ["-"]
        if r.errors:
            table.add_row(r.task.task_id, "[red]error[/red]", _safe("\n".join(r.errors + r.warnings)), *row)
        elif r.warnings:
            table.add_row(r.task.task_id, "[yellow]warning[/yellow]", _safe("\n".join(r.warnings)), *row)
        elif show_ok or builds:
            table.add_row(r.task.task_id, "[green]ok[/green]", "", *row)
    if table.row_count:
        console.print(table)
    if builds:
        console.print(
            f"{len(results) - n_err - n_unbuildable} tasks build on this machine, {n_unbuildable} cannot"
        )
    kinds = warning_kinds(results)
    if len(results) > 1 and any(n > 1 for n in kinds.values()):
        console.print("warnings by kind: " + _safe("; ".join(f"{k} ({n})" for k, n in kinds.most_common())))
    console.print(f"{len(results)} tasks: {n_err} with errors, {n_warn} with warnings")
    if n_err or (strict and n_warn):
        raise typer.Exit(1)


@app.command("make-data")
def make_data(
    dirs: list[Path] = typer.Argument(..., help="Task directories, or directories of tasks."),
    output: Path = typer.Option(..., "--output", "-o", help="Training rows (JSONL)."),
    eval_output: Path | None = typer.Option(None, help="Eval rows (JSONL)."),
    eval_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help="Share of tasks held out."),
    seed: int = typer.Option(0, help="Seed of the hash split."),
) -> None:
    """Write one row per valid task; the split is a hash of (seed, task id)."""
    tasks = _discover(dirs)
    results = lint_tasks(tasks)
    bad = [r for r in results if r.errors]
    for r in bad:
        console.print(f"[yellow]skipped[/yellow] {r.task.task_id}: {_safe(r.errors[0])}")
    good = [r.task for r in results if not r.errors]
    if eval_fraction > 0 and eval_output is None:
        console.print("[red]error:[/red] --eval-fraction needs --eval-output")
        raise typer.Exit(2)
    train, evals = split_rows(good, eval_fraction, seed)
    write_jsonl(output, train)
    if eval_output is not None:
        write_jsonl(eval_output, evals)
    console.print(
        f"wrote {len(train)} train rows to {output}"
        + (f" and {len(evals)} eval rows to {eval_output}" if eval_output else "")
    )


@app.command()
def oracle(
    dirs: list[Path] = typer.Argument(..., help="Task directories, or directories of tasks."),
    backend: str = typer.Option("podman", help="Sandbox backend: podman, docker, daytona."),
    concurrency: int = typer.Option(2, min=1, help="Tasks checked at once."),
    no_solution: bool = typer.Option(False, "--no-solution", help="Run nothing: every reward must be 0."),
    run_id: str | None = typer.Option(None, help="Label of the sandboxes (default: a fresh id)."),
) -> None:
    """Run each task's solution (or nothing) and its verifier; exit 1 on an unexpected reward."""

    tasks = _discover(dirs)
    run_id = run_id or f"oracle-{uuid.uuid4().hex[:8]}"

    async def sweep() -> list:
        with progress_bar("images", total=len(tasks)) as bar:
            await build_images(
                provider,
                tasks,
                concurrency=concurrency,
                on_built=lambda task, error: bar.advance(
                    note=f"{task.task_id}: {'ok' if error is None else 'failed'}"
                ),
            )
        with progress_bar("oracle", total=len(tasks)) as bar:

            def done(result) -> None:  # type: ignore[no-untyped-def]
                bar.advance(note=f"{result.task_id}: {'ok' if result.ok else result.cause}")

            return await run_oracle(
                provider,
                tasks,
                run_id=run_id,
                solution=not no_solution,
                concurrency=concurrency,
                on_done=done,
            )

    try:
        provider = make_provider(backend)
        results = asyncio.run(sweep())
    except AgentRLError as exc:
        console.print(f"[red]error:[/red] {_safe(str(exc))}")
        raise typer.Exit(2) from None
    table = Table(title=f"oracle ({'no solution' if no_solution else 'solutions'}), run {run_id}")
    for col in ("task", "reward", "seconds", "failure cause"):
        table.add_column(col)
    for r in results:
        reward = "-" if r.reward is None else f"{r.reward:g}"
        color = "green" if r.ok else "red"
        table.add_row(
            _safe(r.task_id), f"[{color}]{reward}[/{color}]", f"{r.seconds:.1f}", _safe(r.cause or "")
        )
    console.print(table)
    bad = [r for r in results if not r.ok]
    for r in bad:
        console.print(
            f"[red]{_safe(r.task_id)}[/red] ({_safe(r.cause or '')}): {_safe(tail(r.detail, 1500))}"
        )
    console.print(f"{len(results) - len(bad)}/{len(results)} tasks gave the expected reward")
    if bad:
        raise typer.Exit(1)
