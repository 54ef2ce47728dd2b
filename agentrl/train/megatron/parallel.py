"""Process groups for the Megatron backend: gloo on CPU, NCCL on GPU."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from agentrl.train.megatron.model import cpu_shims
from agentrl.train.megatron.settings import MegatronSettings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def initialize(settings: MegatronSettings, *, seed: int = 0) -> None:
    """Join (or create) the default process group and megatron's model-parallel groups.

    Launched by torchrun (RANK / WORLD_SIZE / MASTER_ADDR set) every rank joins that world; a
    plain single process makes a world of one on loopback, which is how the runtime drives a
    one-rank trainer."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    world = dist.get_world_size()
    if world % settings.world_size:
        raise ValueError(f"world size {world} is not a multiple of tp x pp x cp = {settings.world_size}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=settings.tp,
        pipeline_model_parallel_size=settings.pp,
        virtual_pipeline_model_parallel_size=settings.vpp,
        context_parallel_size=settings.cp,
        expert_model_parallel_size=settings.ep,
        expert_tensor_parallel_size=settings.etp,
    )
    cpu_shims()
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def tp_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def all_reduce_flat(grads: list[torch.Tensor], group: Any, *, mean: bool = False) -> None:
    """Sum (or average) a list of gradients over `group` in one flat all-reduce."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # gloo has no AVG: sum, then divide
    if mean:
        flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def from_every_stage(
    mine: Callable[[], Iterator[tuple[str, torch.Tensor]]], pp_rank: int, pp_size: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """`mine()` of every pipeline stage in stage order (named tensors), broadcast from the stage
    that makes them, so every rank yields every tensor; every rank iterates it to the end together."""
    if pp_size == 1:
        yield from mine()
        return
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    for owner in range(pp_size):
        source = mine() if owner == pp_rank else iter(())
        while True:
            item = next(source, None) if owner == pp_rank else None
            head: list[Any] = [None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
            dist.broadcast_object_list(head, src=ranks[owner], group=group)
            if head[0] is None:
                break
            name, shape, dtype = head[0]
            t = item[1].contiguous() if item is not None else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=ranks[owner], group=group)
            yield name, t
