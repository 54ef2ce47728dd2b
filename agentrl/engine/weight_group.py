"""The process group of `init_weights_update_group` / `update_weights_from_distributed`.

As SGLang's `model_executor/model_runner.py` (`init_weights_update_group`, which calls
`init_custom_process_group` with `init_method=tcp://master_address:master_port`): the trainer is
rank 0 and hosts the rendezvous store; a server joins as rank `rank_offset + tp_rank` of a world of
`world_size`; then, for every `update_weights_from_distributed` call, each named tensor is received
in order by `broadcast(src=0)` into an empty tensor of the announced dtype and shape.

The group is a standalone `ProcessGroupGloo` / `ProcessGroupNCCL` over a prefixed `TCPStore`, not
torch.distributed's global default group, so a trainer that already has its own default group (or
a test that runs rank 0 and a server in one process) can hold it too. Every call blocks; run it in
a thread from async code.
"""

from __future__ import annotations

import datetime
from typing import Any

from agentrl.engine.base import EngineBadRequest


class WeightGroup:
    """One member (rank) of a weight-update group."""

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> None:
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise EngineBadRequest(
                f"weight update group backend {backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)"
            )
        if not 0 <= rank < world_size:
            raise EngineBadRequest(f"rank {rank} is outside a world of size {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        # Rank 0 (the trainer) serves the rendezvous store, as torch's tcp:// init method does.
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        self._store: Any = store
        prefixed = dist.PrefixStore(group_name, store)
        # Constructing the group is the rendezvous: it returns once every rank has joined.
        if backend == "gloo":
            self._pg: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)

    def broadcast(self, tensor: Any, src: int = 0) -> None:
        """In place: rank `src` sends `tensor`, every other rank receives into it."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        self._pg = None
        self._store = None
