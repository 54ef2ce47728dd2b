"""The process group of `init_weights_update_group` / `update_weights_from_distributed`.

As SGLang's `model_executor/model_runner.py` (`init_weights_update_group`, which calls
`init_custom_process_group(backend, init_method="tcp://master_address:master_port", world_size,
rank, group_name)` from `sglang/srt/utils`): the trainer is rank 0 and hosts the rendezvous store
(torch's tcp:// rendezvous: a `TCPStore` whose master is rank 0); a server joins as rank
`rank_offset + tp_rank` of a world of `world_size`; then, for every
`update_weights_from_distributed` call, each named tensor is received in order by
`broadcast(src=0)` into an empty tensor of the announced dtype and shape.

The store keys must be exactly SGLang's or the ranks never meet: `init_custom_process_group` wraps
the store in `PrefixStore(group_name)` and hands it to torch's `_new_process_group_helper`, which
adds `PrefixStore(f"{group_name}/")` and, per device, `PrefixStore(f"{device}/")` ("cuda/" for
NCCL, "cpu/" for gloo), then builds the backend and sets its sequence number (gloo: rank 0 writes
it to the store and every other rank waits for it). `WeightGroup` builds the same layout without
registering the group in torch's global registry, so one process can hold several members (the
stand-in server's TP ranks) and a group can be formed again under another name (the same name
twice is refused, as torch refuses it in SGLang). `tests/test_weight_group_layout.py` checks it
against a member made SGLang's way, through torch's own helper.

The group is a standalone process group, not torch.distributed's default one, so a trainer that
already has its own default group can hold it too. Every call blocks; run it in a thread from
async code.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

from agentrl.engine.base import EngineBadRequest


def rendezvous_store(
    master_address: str, master_port: int, *, rank: int, world_size: int, timeout_s: float
) -> Any:
    """The store of torch's tcp:// rendezvous (`_create_c10d_store`): rank 0 serves it (and waits
    until the other `world_size - 1` ranks have connected), every other rank connects to it."""
    import torch.distributed as dist

    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        multi_tenant=True,
    )


class WeightGroup:
    """One member (rank) of a weight-update group. `store`: an existing rendezvous store to form
    the group on (the trainer keeps its master store across groups); default: a new one."""

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
        store: Any = None,
    ) -> None:
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise EngineBadRequest(
                f"weight update group backend {backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)"
            )
        if not 0 <= rank < world_size:
            raise EngineBadRequest(f"rank {rank} is outside a world of size {world_size}")
        if not group_name:
            raise EngineBadRequest(
                "the weight update group needs a name (SGLang: 'Group name cannot be empty')"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        if store is None:
            store = rendezvous_store(
                master_address, master_port, rank=rank, world_size=world_size, timeout_s=timeout_s
            )
        self._store: Any = store
        device = "cuda" if backend == "nccl" else "cpu"
        keys = dist.PrefixStore(
            f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
        )
        # Constructing the group is the rendezvous: it returns once every rank has joined.
        if backend == "gloo":
            self._pg: Any = dist.ProcessGroupGloo(keys, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(keys, rank, world_size, options)
        self._pg._set_sequence_number_for_group()

    def broadcast(self, tensor: Any, src: int = 0) -> None:
        """In place: rank `src` sends `tensor`, every other rank receives into it."""
        import torch.distributed as dist

        if self._pg is None:
            raise EngineBadRequest(f"weight update group {self.group_name!r} was destroyed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        """Release the group's connections (NCCL: abort its communicators). The store stays with
        whoever passed it in."""
        pg, self._pg = self._pg, None
        if pg is not None and self.backend == "nccl":
            with contextlib.suppress(Exception):  # already broken by a dead peer: nothing to release
                pg.shutdown()
        self._store = None
