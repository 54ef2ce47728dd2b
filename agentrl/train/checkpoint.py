"""Checkpoints: model weights, optimizer state, step and an opaque buffer position, written atomically.

Layout under a root directory:
    step-00000012/   model.safetensors, config.json (when the model has a config), optimizer.pt, state.json
                     (a LoRA policy: adapter_model.safetensors and adapter_config.json instead of the
                     model's files: the base weights never change, so they are not written again)
    latest           the name of the newest complete checkpoint directory
A checkpoint is written into a hidden temporary directory and renamed into place only when complete,
and `latest` is replaced by rename, so a crash mid-write never leaves a half checkpoint that a
resume would pick up.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from agentrl.engine.lora import ADAPTER_WEIGHTS, read_adapter
from agentrl.errors import AgentRLError
from agentrl.train.lora import adapter_weights, is_lora, write_adapter


class CheckpointError(AgentRLError):
    """A checkpoint is missing, incomplete or does not match the model it is loaded into."""


@dataclass
class TrainState:
    """What a resume needs besides tensors. `buffer_state` belongs to the rollout buffer, opaque here."""

    step: int
    buffer_state: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_model_dir(model: Any, directory: Path) -> None:
    """model.safetensors (+ config.json) in `directory`, loadable by transformers and SGLang."""
    directory.mkdir(parents=True, exist_ok=True)
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(str(directory / "config.json"))


def atomic_dir(final: Path, fill: Any) -> Path:
    """Create `final` by filling a temporary sibling directory, then renaming it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        fill(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def save_checkpoint(
    root: str | Path, *, model: Any, optimizer: torch.optim.Optimizer, state: TrainState
) -> Path:
    """Write `root/step-NNNNNNNN` atomically and point `root/latest` at it."""
    root = Path(root)

    def fill(tmp: Path) -> None:
        if is_lora(model):
            write_adapter(model, tmp)
        else:
            write_model_dir(model, tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / "state.json").write_text(
            json.dumps(
                {"step": state.step, "buffer_state": state.buffer_state, "config": state.config}, indent=1
            )
        )

    final = atomic_dir(root / f"step-{state.step:08d}", fill)
    latest_tmp = root / f".latest-{uuid.uuid4().hex[:8]}"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    return final


def _load_adapter(model: Any, path: Path) -> tuple[list[str], list[str]]:
    """Load a LoRA checkpoint's adapters into `model`; (missing, unexpected) names."""
    from peft import set_peft_model_state_dict

    _, tensors = read_adapter(path)
    own = adapter_weights(model)
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if not missing and not unexpected:
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise RuntimeError(f"{name}: shape {tuple(t.shape)} != the model's {tuple(own[name].shape)}")
        set_peft_model_state_dict(model, tensors)
    return missing, unexpected


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None when there is none yet."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def load_checkpoint(
    path: str | Path, *, model: Any, optimizer: torch.optim.Optimizer | None = None
) -> TrainState:
    """Load weights (strict) and optimizer state into the given objects; return the saved TrainState.

    `path` is a checkpoint directory or a root with a `latest` pointer.
    """
    path = Path(path)
    if (path / "latest").exists():
        resolved = latest_checkpoint(path)
        if resolved is None:
            raise CheckpointError(
                f"{path}/latest points to a missing checkpoint: delete it or restore the directory"
            )
        path = resolved
    weights = ADAPTER_WEIGHTS if is_lora(model) else "model.safetensors"
    if not (path / "state.json").exists():
        raise CheckpointError(f"{path} has no state.json: not a complete agentrl checkpoint")
    if not (path / weights).exists():
        other = "model.safetensors" if weights == ADAPTER_WEIGHTS else ADAPTER_WEIGHTS
        hint = (
            f" (it holds {other}: it was saved with trainer.lora.rank "
            f"{'0' if other == 'model.safetensors' else '> 0'}; resume with the same setting)"
            if (path / other).exists()
            else ": not a complete agentrl checkpoint"
        )
        raise CheckpointError(f"{path} has no {weights}{hint}")
    try:
        if weights == ADAPTER_WEIGHTS:
            missing, unexpected = _load_adapter(model, path)
        else:
            missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise CheckpointError(f"{path} does not match the model: {str(exc)[:400]}") from exc
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            " (was it saved from a different architecture or size?)"
        )
    if optimizer is not None:
        if not (path / "optimizer.pt").exists():
            raise CheckpointError(f"{path} has no optimizer.pt: cannot resume the optimizer")
        device = next(iter(model.parameters())).device
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    raw = json.loads((path / "state.json").read_text())
    return TrainState(
        step=int(raw["step"]), buffer_state=raw.get("buffer_state", {}), config=raw.get("config", {})
    )
