"""Optional metric sinks of the training runtime: Weights & Biases and TensorBoard.

A run sends its metrics to them only when its config asks (`sinks = ["wandb", "tensorboard"]`);
neither package is a dependency of agentrl. `metrics.jsonl` is always written and stays the source
of truth: a sink receives the same numbers, flattened (`failures_by_cause/sandbox_create`,
`extra/trainer/loss`), at the trainer step, and eval summaries under `eval/`.

    wandb        project from $WANDB_PROJECT (default "agentrl"), run name = the run directory's
                 name, the resolved config attached; $WANDB_MODE=offline works without network.
    tensorboard  event files under <out>/tensorboard (torch.utils.tensorboard; needs `tensorboard`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Protocol

from agentrl.errors import AgentRLError

SINKS = ("wandb", "tensorboard")


class SinkError(AgentRLError):
    """A sink the config asks for cannot be used."""


class Sink(Protocol):
    def log_step(self, step: int, values: dict[str, float]) -> None: ...

    def log_eval(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def flatten(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number of a metrics row under a slash-joined name (booleans and text left out)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class WandbSink:
    def __init__(self, out_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise SinkError(
                "sinks: 'wandb' is asked for but the wandb package is not installed: pip install wandb "
                "(or drop it from `sinks`)"
            ) from None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "agentrl"),
            name=out_dir.resolve().name,
            dir=str(out_dir),
            config=config,
        )
        self.run.define_metric("eval/*", step_metric="eval/step")

    def log_step(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"eval/step": step, **{f"eval/{k}": v for k, v in values.items()}})

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    def __init__(self, out_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SinkError(
                "sinks: 'tensorboard' is asked for but the tensorboard package is not installed: "
                "pip install tensorboard (or drop it from `sinks`)"
            ) from None
        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"), flush_secs=10)

    def log_step(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"eval/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


class MetricSinks:
    """The sinks of one run; with none asked for, every call does nothing."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks
        self._evals_logged = 0

    def log(self, evals: list[dict[str, Any]], *, step: int | None = None, metrics: Any = None) -> None:
        """A step's metrics (a `StepMetrics` or a row dict) and the evals not sent yet."""
        if not self.sinks:
            return
        if metrics is not None and step is not None:
            row = (
                asdict(metrics) if is_dataclass(metrics) and not isinstance(metrics, type) else dict(metrics)
            )
            row.pop("step", None)
            values = flatten(row)
            for sink in self.sinks:
                sink.log_step(step, values)
        for e in evals[self._evals_logged :]:
            values = flatten(
                {k: v for k, v in e.items() if k not in ("step", "per_task", "per_task_pass_at")}
            )
            for sink in self.sinks:
                sink.log_eval(int(e.get("step", 0)), values)
        self._evals_logged = len(evals)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(names: Iterable[str], out_dir: Path, config: dict[str, Any]) -> MetricSinks:
    """The sinks named in a run config (raises SinkError for one that is not installed)."""
    sinks: list[Sink] = []
    try:
        for name in names:
            if name == "wandb":
                sinks.append(WandbSink(out_dir, config))
            elif name == "tensorboard":
                sinks.append(TensorBoardSink(out_dir))
            else:
                raise SinkError(f"sinks: unknown sink {name!r}; choose from {', '.join(SINKS)}")
    except BaseException:
        MetricSinks(sinks).close()
        raise
    return MetricSinks(sinks)
