"""A trainer over several ranks (torchrun): rank 0 drives the run, the others follow.

`agentrl train run` under torchrun (the cluster recipes start one per training node) runs this:
every rank builds the trainer (megatron's process groups span them all), and only rank 0 builds
the rest (environment, engines, weight transport) and runs the training loop. Its trainer is a
`DriverTrainer`: before each call that is a collective on the trainer's ranks (`train_step`,
`export_weights`, `save`, `load`) it sends that call to the other ranks, which run the same call
in `follow` (the rollout batch travels with `train_step`; `export_weights` is iterated to the end
on every rank while rank 0's transport pushes it). The calls travel by broadcast over a gloo group
of their own, whose timeout is long enough for rank 0 to wait for a batch of episodes. A rank that
dies or fails takes the others down with it (torchrun stops the job when one process exits with
an error; a failed rank 0 sends nothing more), and a resumed run starts them all again.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentrl.errors import AgentRLError
from agentrl.runtime.config import RunConfig

log = logging.getLogger("agentrl.runtime.ranks")

IDLE_TIMEOUT = datetime.timedelta(hours=24)  # the longest a follower waits for rank 0's next call


class RankError(AgentRLError):
    """A run that cannot be spread over these ranks."""


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


class RankCalls:
    """The driver's calls to the other ranks, broadcast from rank 0 over a gloo group. Every rank
    must create it at the same point (it is a collective)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, call: tuple[Any, ...]) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([call], src=0, group=self.group)

    def receive(self) -> tuple[Any, ...]:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return tuple(box[0])


class DriverTrainer:
    """Rank 0's trainer as the training loop sees it: each collective call goes to every rank."""

    def __init__(self, trainer: Any, calls: RankCalls) -> None:
        self.trainer = trainer
        self.calls = calls

    @property
    def step(self) -> int:
        return int(self.trainer.step)

    @step.setter
    def step(self, value: int) -> None:
        self.trainer.step = value

    def train_step(self, samples: Any) -> dict[str, float]:
        samples = list(samples)
        self.calls.send(("train_step", samples))
        return dict(self.trainer.train_step(samples))

    def export_weights(
        self, dtype: torch.dtype | None = None, *, bucket_bytes: int = 512 * 2**20
    ) -> Iterator[Any]:
        self.calls.send(("export_weights", dtype, bucket_bytes))
        yield from self.trainer.export_weights(dtype, bucket_bytes=bucket_bytes)

    def export_adapter(self, dtype: torch.dtype | None = None) -> Iterator[Any]:
        self.calls.send(("export_adapter", dtype))
        yield from self.trainer.export_adapter(dtype)

    def save(self, root: str | Path, *, buffer_state: dict[str, Any] | None = None) -> Path:
        self.calls.send(("save", str(root)))
        return Path(self.trainer.save(root, buffer_state=buffer_state))

    def load(self, path: str | Path) -> Any:
        self.calls.send(("load", str(path)))
        return self.trainer.load(path)

    def __getattr__(self, name: str) -> Any:  # anything else (logprobs, model, config): rank 0's own
        return getattr(self.trainer, name)


@dataclass
class Followed:
    """What a follower did (for logs and tests)."""

    calls: dict[str, int] = field(default_factory=dict)
    step: int = 0


def follow(trainer: Any, calls: RankCalls) -> Followed:
    """Run rank 0's calls on this rank's part of the trainer until it says stop."""
    done = Followed()
    while True:
        name, *args = calls.receive()
        done.calls[name] = done.calls.get(name, 0) + 1
        if name == "stop":
            done.step = int(trainer.step)
            return done
        if name == "train_step":
            trainer.train_step(args[0])
        elif name == "export_weights":
            for _ in trainer.export_weights(args[0], bucket_bytes=args[1]):
                pass  # the gathers inside are collectives; rank 0 pushes the buckets
        elif name == "export_adapter":
            for _ in trainer.export_adapter(args[0]):
                pass
        elif name == "save":
            trainer.save(args[0])
        elif name == "load":
            trainer.load(args[0])
        else:
            raise RankError(f"rank 0 sent a call this rank does not know: {name!r}")


def run_ranks(cfg: RunConfig, *, reporter: Callable[[str], None] | None = None) -> Any:
    """The run on this rank: rank 0 returns the `RunResult`, the others what they `follow`ed."""
    import torch.distributed as dist

    from agentrl.runtime import close_parts, train
    from agentrl.runtime.build import build_parts, build_trainer

    if cfg.trainer.backend != "megatron":
        raise RankError(
            f"{world_size()} ranks: trainer.backend={cfg.trainer.backend} trains in one process; "
            "run it without torchrun, or use trainer.backend=megatron"
        )
    rank = int(os.environ.get("RANK", "0"))
    built = build_trainer(cfg, engine_policy=rank == 0)  # megatron joins every rank here
    if not dist.is_initialized():
        raise RankError("the trainer did not join a process group: start the ranks with torchrun")
    calls = RankCalls()
    if dist.get_rank() != 0:
        done = follow(built[0], calls)
        log.info("rank %d: followed %s to step %d", dist.get_rank(), done.calls, done.step)
        return done
    parts = build_parts(cfg, built)
    parts.trainer = DriverTrainer(parts.trainer, calls)

    async def go() -> Any:
        try:
            return await train(cfg, parts, reporter=reporter)
        finally:
            await close_parts(parts)

    result = asyncio.run(go())
    # Only after a run that ended well: a failed rank 0 exits instead (the others may be inside a
    # collective it left; torchrun stops them when it goes).
    calls.send(("stop",))
    return result
