"""Checkpoints of the Megatron trainer: `save` / `load` through megatron's `dist_checkpointing`
(model, distributed optimizer, the trainer's state), and the fixes torch's Adam state needs to load."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.train.checkpoint import CheckpointError, TrainState, latest_checkpoint

# The distributed optimizer's checkpoint format: its default ("fully_sharded_model_space") writes
# flattened ShardedTensors, which megatron-core 0.19.2's `torch_dist` writer refuses
# (dist_checkpointing/mapping.py: "ShardedTensor.flattened_range is not supported").
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


class InitCheckpointError(CheckpointError):
    """`trainer.megatron.init_checkpoint` is missing, incomplete or not this model's."""


_PREPARE_HINT = (
    "run the recipe's `prepare` (HF -> Megatron) and then `prepare-cp` (to every node's local disk), "
    "or leave trainer.megatron.init_checkpoint unset to start from engine.model's HF weights"
)


def init_checkpoint_dir(path: str | Path) -> Path:
    """The `torch_dist` directory of an initial checkpoint: `path/model` (what `prepare` writes:
    `model/` beside `convert.json`; a run checkpoint's `step-N/` has the same shape) or `path`
    itself. Complete means megatron's `metadata.json` (written last, once every shard is saved),
    torch's `.metadata` and shard files; anything else is an `InitCheckpointError`."""
    given = Path(path).expanduser()
    if not given.is_dir():
        raise InitCheckpointError(f"trainer.megatron.init_checkpoint {given} does not exist: {_PREPARE_HINT}")
    model = given / "model" if (given / "model").is_dir() else given
    missing = [name for name in ("metadata.json", ".metadata") if not (model / name).is_file()]
    if not any(model.glob("*.distcp")):
        missing.append("*.distcp shards")
    if missing:
        raise InitCheckpointError(
            f"trainer.megatron.init_checkpoint {model} is not a complete torch_dist checkpoint (no "
            f"{', '.join(missing)}): a conversion or copy that did not finish; {_PREPARE_HINT}"
        )
    return model


def _torch_adam_checkpoint_fixes(optimizer: Any) -> None:
    """What megatron-core 0.19.2's distributed optimizer needs to save and resume when it falls
    back to torch's Adam (no TransformerEngine, no apex: `HAVE_APEX_OR_TE` False), per wrapped
    optimizer:

    - torch's Adam makes its per-parameter state (`step`, `exp_avg`, `exp_avg_sq`) lazily at its
      first step, and `DistributedOptimizer.state_dict()` (distrib_optimizer.py:837-839) reads
      `step` from every state and asserts they agree: a fresh optimizer (a new process resuming)
      has none. They are made here as torch's Adam would (step a CPU float32 0, zero moments),
      which changes nothing about the next step.
    - loading the parameter state (`load_parameter_state_from_fully_reshardable`, line 2390)
      leaves the 0-dim `step` out of each parameter's tensors (it comes from the param groups and
      is already set by then: line 1025-1032), but `_set_main_param_and_optimizer_states`
      (line 1213-1223) copies every tensor of the optimizer's state, `step` included, from them:
      `KeyError: 'step'`. Its setter gets the missing `step` from the state it already holds
      (copied onto itself); any other missing key is an error."""
    from megatron.core.optimizer import distrib_optimizer as mdo

    if mdo.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, mdo.DistributedOptimizer) or getattr(opt, "_agentrl_step_fix", False):
            continue
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if "step" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param: Any, tensors: dict, *, _opt: Any = opt, _set: Any = original) -> None:
            index, order = _opt.model_param_group_index_map[model_param]
            state = _opt.optimizer.state[_opt.optimizer.param_groups[index]["params"][order]]
            missing = {k for k, v in state.items() if torch.is_tensor(v)} - set(tensors)
            if missing - {"step"}:
                raise CheckpointError(
                    f"the optimizer checkpoint lacks {sorted(missing)} of a parameter's state"
                )
            _set(model_param, {**tensors, **{k: state[k] for k in missing}})

        opt._set_main_param_and_optimizer_states = set_states
        opt._agentrl_step_fix = True


def _torch_adam_unshare_steps(optimizer: Any) -> None:
    """After megatron-core 0.19.2 loads a distributed optimizer's state for torch's Adam, every
    parameter's `step` is one shared tensor (distrib_optimizer.py:1027-1032 assigns the same
    object to each state; torch's `load_state_dict` keeps `step` tensors as they are). torch's
    multi-tensor Adam then adds 1 to it once per parameter at every step (`_foreach_add_`), and
    the bias correction runs on a step count thousands too high. Each state gets its own copy."""
    from megatron.core.optimizer import distrib_optimizer as mdo

    if mdo.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()


class CheckpointMixin:
    """`save` and `load` of `MegatronTrainer`. With LoRA a checkpoint holds the adapters (one file
    per rank) and their optimizer state, not the frozen model."""

    def save(self, root: str | Path, *, buffer_state: dict[str, Any] | None = None) -> Path:
        """`root/step-NNNNNNNN/`: the model as megatron's distributed checkpoint (`torch_dist`,
        resharding-capable), the optimizer state (megatron's optimizer: a distributed checkpoint
        too; the local path: one file per rank), `state.json`; then `root/latest`."""
        from megatron.core import dist_checkpointing

        root = Path(root)
        final = root / f"step-{self.step:08d}"
        # One temporary name for every rank: rank 0 picks it, the others receive it.
        names = [f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"]
        dist.broadcast_object_list(names, src=0)
        tmp = root / names[0]
        if dist.get_rank() == 0:
            (tmp / "model").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if self.lora is not None:
            # LoRA: the adapters alone, each rank its own (the frozen weights are the initial
            # ones, which the run's settings name)
            torch.save(self.lora.state_dict(), tmp / "model" / f"adapters-rank{dist.get_rank():05d}.pt")
        else:
            dist_checkpointing.save(self._sharded_state_dict(), str(tmp / "model"))
        if self.megatron_ddp:
            # megatron's optimizer (the distributed one's shards too) as a distributed checkpoint
            _torch_adam_checkpoint_fixes(self.optimizer)
            opt = self.optimizer.sharded_state_dict(self._sharded_state_dict(), metadata=_OPTIMIZER_FORMAT)
            if dist.get_rank() == 0:
                (tmp / "optimizer").mkdir()
            dist.barrier()
            dist_checkpointing.save(opt, str(tmp / "optimizer"))
        else:
            torch.save(self.optimizer.state_dict(), tmp / f"optimizer-rank{dist.get_rank():05d}.pt")
        dist.barrier()
        if dist.get_rank() == 0:
            state = {
                "step": self.step,
                "buffer_state": dict(buffer_state or {}),
                "config": self.config.to_dict(),
                "megatron": self.settings.to_dict(),
                "world_size": dist.get_world_size(),
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
            # Renamed into place only when complete (as agentrl.train.checkpoint does): a crash
            # mid-write never leaves a checkpoint that a resume would pick up.
            if final.exists():
                old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            latest_tmp = root / f".latest-{uuid.uuid4().hex[:8]}"
            latest_tmp.write_text(final.name)
            os.replace(latest_tmp, root / "latest")
        dist.barrier()
        return final

    def _load_model(self, state: dict[str, Any]) -> None:
        if len(self.chunks) == 1:
            self.model.load_state_dict(state, strict=False)
        else:
            for i, chunk in enumerate(self.chunks):
                chunk.load_state_dict(state[f"model{i}"], strict=False)

    def _sharded_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict (keys carry global layer numbers, so stages and virtual
        stages merge into one checkpoint); one entry per chunk with virtual stages."""
        if len(self.chunks) == 1:
            return self.model.sharded_state_dict()
        return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(self.chunks)}

    def load(self, path: str | Path) -> TrainState:
        """Restore model, optimizer and step from a checkpoint directory (or a root with `latest`)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        if (path / "latest").exists():
            resolved = latest_checkpoint(path)
            if resolved is None:
                raise CheckpointError(f"{path}/latest points to a missing checkpoint")
            path = resolved
        if not (path / "state.json").exists() or not (path / "model").is_dir():
            raise CheckpointError(f"{path} is not a complete megatron checkpoint (state.json, model/)")
        raw = json.loads((path / "state.json").read_text())
        saved = {k: v for k, v in (raw.get("megatron") or {}).items() if k != "init_checkpoint"}
        if saved != self.settings.layout_dict() or raw.get("world_size") != dist.get_world_size():
            raise CheckpointError(
                f"{path} was saved with {saved} on {raw.get('world_size')} ranks; this trainer runs "
                f"{self.settings.layout_dict()} on {dist.get_world_size()}: the optimizer state is per rank"
            )
        if self.lora is not None:
            adapters = path / "model" / f"adapters-rank{dist.get_rank():05d}.pt"
            if not adapters.is_file():
                raise CheckpointError(
                    f"{path} holds no LoRA adapters for this rank ({adapters.name}): saved without LoRA?"
                )
            self.lora.load_state_dict(torch.load(adapters, map_location=self.device, weights_only=True))
        elif any((path / "model").glob("adapters-rank*.pt")):
            raise CheckpointError(
                f"{path} holds LoRA adapters only: resume it with the same trainer.lora settings"
            )
        else:
            self._load_model(dist_checkpointing.load(self._sharded_state_dict(), str(path / "model")))
        if self.megatron_ddp:
            _torch_adam_checkpoint_fixes(self.optimizer)
            opt_sd = self.optimizer.sharded_state_dict(
                self._sharded_state_dict(), is_loading=True, metadata=_OPTIMIZER_FORMAT
            )
            self.optimizer.load_state_dict(dist_checkpointing.load(opt_sd, str(path / "optimizer")))
            _torch_adam_unshare_steps(self.optimizer)
        else:
            opt = path / f"optimizer-rank{dist.get_rank():05d}.pt"
            self.optimizer.load_state_dict(torch.load(opt, map_location=self.device, weights_only=True))
        self.step = int(raw["step"])
        return TrainState(
            step=self.step, buffer_state=raw.get("buffer_state", {}), config=raw.get("config", {})
        )
