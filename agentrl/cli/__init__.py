"""The `agentrl` command. Each area's sub-command group is a module of this package (thin faces: parse,
call the stage, print)."""

from __future__ import annotations

import importlib
import os
import signal
import sys

import click
import typer
from rich.markup import escape
from typer.core import TyperGroup

from agentrl.errors import AgentRLError
from agentrl.sandbox.base import printable

# Sub-command groups, each in its own module, imported only when that group runs: `agentrl --help`
# lists them from this table without importing torch or any backend, and a group whose optional
# extra is missing fails alone, saying which extra to install.
_GROUPS = {
    "tasks": ("agentrl.cli.tasks", "Validate, lint and inspect Harbor-format tasks.", None),
    "sandbox": (
        "agentrl.cli.sandbox",
        "Sandbox backends: stand-in base images, smoke checks, clean-up.",
        None,
    ),
    "engine": ("agentrl.cli.engine", "Serve a model over an SGLang-compatible HTTP API.", "local"),
    "episode": ("agentrl.cli.episode", "Run, record and replay single episodes.", None),
    "eval": (
        "agentrl.cli.eval",
        "Evaluate a model on tasks with Harbor's semantics; write a Harbor job (ATIF trajectories).",
        None,
    ),
    "train": (
        "agentrl.cli.train",
        "Train with the library runtime (run), or replay a trainer step.",
        "local",
    ),
    "env": (
        "agentrl.cli.env",
        "Serve an environment as an OpenEnv server (reset / step / state).",
        "openenv",
    ),
}


# Groups that moved: the old spelling names the new one instead of "no such command".
_MOVED = {
    "rollout": "`agentrl rollout sim` moved to `python benchmarks/rollout_faults.py sim` (same options): the "
    "simulated workload is a test double (agentrl.testing.rollout_sim), which commands never import",
}


def safe_text(text: str) -> str:
    """Text from a task or a sandbox as inert terminal text: escape sequences shown, never obeyed,
    and no rich markup."""
    return escape(printable(text))


class _LazyRoot(TyperGroup):
    """The root group: lists `_GROUPS` from the table, imports one only to run it."""

    _resolving = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*_GROUPS, *super().list_commands(ctx)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _MOVED:
            click.echo(f"error: {_MOVED[cmd_name]}", err=True)
            raise typer.Exit(2)
        if cmd_name not in _GROUPS:
            return super().get_command(ctx, cmd_name)
        module, help_text, extra = _GROUPS[cmd_name]
        if not self._resolving:  # listing for --help: the table's line is enough
            return click.Group(cmd_name, help=help_text)
        try:
            group = importlib.import_module(module).app
        except ModuleNotFoundError as exc:
            missing = exc.name or "a module"
            hint = f"pip install -e '.[{extra}]'" if extra else "reinstall agentrl"
            click.echo(f"`agentrl {cmd_name}` needs {missing!r}, which is not installed: {hint}", err=True)
            raise typer.Exit(2) from None
        command = typer.main.get_command(group)
        command.name = cmd_name
        return command

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        self._resolving = True
        try:
            return super().resolve_command(ctx, args)
        finally:
            self._resolving = False


app = typer.Typer(
    cls=_LazyRoot, no_args_is_help=True, add_completion=False, help="Agentic RL on terminal tasks."
)

LOG_LEVELS = ("debug", "info", "warning", "error")


@app.callback()
def _root(
    log_level: str = typer.Option(
        "warning",
        "--log-level",
        help=f"Logging to stderr: {', '.join(LOG_LEVELS)} (runs also log to <out>/run.log).",
    ),
) -> None:
    """Agentic RL on terminal tasks."""
    import logging

    if log_level.lower() not in LOG_LEVELS:
        raise typer.BadParameter(f"choose one of {', '.join(LOG_LEVELS)}", param_hint="--log-level")
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


@app.command("sft")
def sft_cmd(
    records: str = typer.Argument(..., help="Directory of episode records to learn from."),
    model: str = typer.Option(..., help="Model directory (transformers) to start from."),
    output: str = typer.Option(..., help="Where to save the fine-tuned model and tokenizer."),
    steps: int = typer.Option(100, help="The most optimizer steps."),
    lr: float = typer.Option(1e-3),
    batch_size: int = typer.Option(8),
    seed: int = typer.Option(0),
    target: float = typer.Option(
        None,
        help="Stop once the model, sampling at --temperature, reproduces the records' replies with this"
        " mean probability (e.g. 0.3: a warm start that leaves RL something to learn).",
    ),
    temperature: float = typer.Option(1.0, help="The sampling temperature --target is measured at."),
) -> None:
    """Supervised warm start on recorded trajectories (loss on assistant tokens only)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.episode.record import load_samples
    from agentrl.train.sft import SFTConfig, run_sft

    samples = load_samples([Path(records)], min_reward=1.0)
    net = AutoModelForCausalLM.from_pretrained(model)
    run_sft(
        net,
        samples,
        SFTConfig(
            steps=steps, lr=lr, batch_size=batch_size, seed=seed, target=target, temperature=temperature
        ),
    )
    net.save_pretrained(output)
    AutoTokenizer.from_pretrained(model).save_pretrained(output)


@app.command("dashboard")
def dashboard_cmd(
    run_dirs: list[str] = typer.Argument(..., help="Run directories (a run's --out); several are overlaid."),
    port: int = typer.Option(8765, help="Port to serve on."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback: only this machine sees it)."),
    tokenizer: str = typer.Option(
        None, help="Tokenizer directory for the token view (default: the run config's engine.model)."
    ),
) -> None:
    """A local web page with a run's curves and its episodes, updating while the run goes."""
    from pathlib import Path

    from agentrl.dashboard.server import DashboardError, serve

    try:
        serve([Path(d) for d in run_dirs], host=host, port=port, tokenizer=tokenizer)
    except DashboardError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    """The console script. A user's mistake (any `AgentRLError`: a bad task, a missing model
    directory, an unknown backend, a missing file) is one clear line and exit status 2; `--debug`
    (anywhere on the line) or AGENTRL_DEBUG=1 shows the traceback instead."""
    # SIGTERM unwinds like Ctrl-C: sandboxes are closed and atexit clean-up runs.
    signal.signal(signal.SIGTERM, _interrupt)
    debug = "--debug" in sys.argv[1:] or os.environ.get("AGENTRL_DEBUG") == "1"
    if "--debug" in sys.argv[1:]:
        sys.argv.remove("--debug")
    try:
        app()
    except AgentRLError as exc:
        if debug:
            raise
        from agentrl.sandbox.base import printable

        print(f"error: {printable(str(exc))}", file=sys.stderr)
        print("(run again with --debug for the traceback)", file=sys.stderr)
        sys.exit(2)
