"""`agentrl train replay`: train-only steps over dumped samples, for debugging the trainer without
engines or sandboxes (`agentrl train run`, the whole loop, lives in `agentrl.cli.train`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer
from pydantic import TypeAdapter, ValidationError

from agentrl.episode.record import RecordError, load_samples
from agentrl.episode.sample import Sample
from agentrl.overrides import ConfigError, apply_overrides
from agentrl.train.config import TrainConfig

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Trainer: train-only runs, checkpoints.")


def resolve_config(overrides: list[str]) -> TrainConfig:
    """TrainConfig with the runtime's one override syntax (`lr=1e-5`, `loss.eps_clip=0.1`,
    `betas=[0.9,0.95]`, `logprob_chunk_size=null`: JSON values, else plain strings)."""

    try:
        data = apply_overrides(dataclasses.asdict(TrainConfig()), overrides)
        return TypeAdapter(TrainConfig).validate_python(data)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    except ValidationError as exc:
        raise typer.BadParameter(
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        ) from None


def _batches(samples: list[Sample], groups_per_step: int) -> list[list[Sample]]:
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.prompt_id, []).append(s)
    ordered = list(groups.values())
    return [
        [s for group in ordered[i : i + groups_per_step] for s in group]
        for i in range(0, len(ordered), groups_per_step)
    ]


@app.command("replay")
def replay_cmd(
    samples: list[Path] = typer.Argument(
        ..., help="Sample dumps: JSONL files or directories (episode records too)."
    ),
    model: Path = typer.Option(None, "--model", help="Model directory (transformers format) to start from."),
    output: Path = typer.Option(
        None, "--output", help="Checkpoint directory (resumed from when it has one)."
    ),
    steps: int = typer.Option(1, "--steps", min=1),
    groups_per_step: int = typer.Option(8, "--groups-per-step", min=1, help="Prompt groups per train step."),
    set_: list[str] = typer.Option(None, "--set", help="Override a TrainConfig field, e.g. --set lr=1e-5."),
    device: str = typer.Option(None, "--device", help="Default: cuda when available, else cpu."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved configuration and exit."),
) -> None:
    """GRPO steps over dumped samples, cycling through them; one JSON line of metrics per step."""
    config = resolve_config(set_ or [])
    if dry_run:
        typer.echo(json.dumps(config.to_dict(), indent=1))
        return
    if model is None or output is None:
        raise typer.BadParameter("--model and --output are required (unless --dry-run)")
    # torch and transformers (the `local` extra) load here: --dry-run runs without them.
    from transformers import AutoModelForCausalLM

    from agentrl.train.batch import with_advantages
    from agentrl.train.checkpoint import latest_checkpoint
    from agentrl.train.torch_backend import TorchTrainer

    try:
        rows = [s for s in load_samples(samples) if s.trainable]
    except RecordError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if not rows:
        raise typer.BadParameter(
            "no trainable samples (with a reward, not infra failures) in the given files"
        )
    batches = _batches(rows, groups_per_step)
    trainer = TorchTrainer(AutoModelForCausalLM.from_pretrained(str(model)), config, device=device)
    position = 0
    if latest_checkpoint(output) is not None:
        position = int(trainer.load(output).buffer_state.get("position", 0))
        typer.echo(
            f"resumed from {latest_checkpoint(output)} at step {trainer.step}, batch {position}", err=True
        )
    for _ in range(steps):
        metrics = trainer.train_step(with_advantages(batches[position % len(batches)]))
        position += 1
        typer.echo(json.dumps({k: round(v, 6) for k, v in metrics.items()}))
    path = trainer.save(output, buffer_state={"position": position})
    typer.echo(f"saved {path}", err=True)
