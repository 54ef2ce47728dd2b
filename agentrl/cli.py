"""The `agentrl` command. Each area owns its sub-command group in its own `cli.py`."""

from __future__ import annotations

import importlib
import signal

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Agentic RL on terminal tasks.")

# (module, attribute, name) of each sub-command group; imported lazily-at-start so that a missing
# optional extra only disables its own group.
_GROUPS = [
    ("agentrl.tasks_cli", "app", "tasks"),
    ("agentrl.sandbox.cli", "app", "sandbox"),
    ("agentrl.engine.cli", "app", "engine"),
    ("agentrl.episode_cli", "app", "episode"),
    ("agentrl.runtime.cli", "app", "train"),  # the trainer's `replay` plus the runtime's `run`
    ("agentrl.rollout.cli", "app", "rollout"),
]

for _module, _attr, _name in _GROUPS:
    try:
        _group = getattr(importlib.import_module(_module), _attr)
    except ModuleNotFoundError as _exc:
        if _exc.name and _exc.name.startswith("agentrl"):
            continue  # that area is not built in this install
        raise
    app.add_typer(_group, name=_name)


@app.command("sft")
def sft_cmd(
    records: str = typer.Argument(..., help="Directory of episode records to learn from."),
    model: str = typer.Option(..., help="Model directory (transformers) to start from."),
    output: str = typer.Option(..., help="Where to save the fine-tuned model and tokenizer."),
    steps: int = typer.Option(100),
    lr: float = typer.Option(1e-3),
    batch_size: int = typer.Option(8),
    seed: int = typer.Option(0),
) -> None:
    """Supervised warm start on recorded trajectories (loss on assistant tokens only)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.sft import SFTConfig, load_record_samples, run_sft

    samples = load_record_samples(Path(records))
    net = AutoModelForCausalLM.from_pretrained(model)
    run_sft(net, samples, SFTConfig(steps=steps, lr=lr, batch_size=batch_size, seed=seed))
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
    # SIGTERM unwinds like Ctrl-C: sandboxes are closed and atexit clean-up runs.
    signal.signal(signal.SIGTERM, _interrupt)
    app()


if __name__ == "__main__":
    main()
