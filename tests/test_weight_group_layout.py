"""`WeightGroup` meets a member made SGLang's way.

The server side below is what SGLang's `init_weights_update_group` runs (`sglang/srt/utils`
`init_custom_process_group`: torch's tcp:// `rendezvous`, `PrefixStore(group_name, store)`, then
torch's `_new_process_group_helper` under that group name), in its own process as in a real server.
Our trainer side is `WeightGroup` as rank 0: if the store keys differed anywhere (the group prefix,
torch's own `group_name/` and `cpu/` prefixes, gloo's sequence number), the ranks would never meet
and the join would time out instead of the tensor arriving.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # processes that import torch and meet over TCP

SGLANG_MEMBER = textwrap.dedent(
    """
    import datetime, os, sys
    import torch
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    port, rank, world, group = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    timeout = datetime.timedelta(seconds=60)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group, store)
    pg, _ = _new_process_group_helper(world, rank, [], "gloo", store, group_name=group, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    for _ in range(2):  # two update calls, each one broadcast from rank 0
        t = torch.empty(3, 4, dtype=torch.bfloat16)
        torch.distributed.broadcast(t, src=0, group=pg)
        print(t.float().sum().item(), flush=True)
    torch.distributed.destroy_process_group(pg)
    # A server stays up after an update; this stand-in leaves without the interpreter's teardown,
    # where torch's store client thread could abort the exit ("terminate called without an active
    # exception", seen once in CI10) after everything above had succeeded.
    sys.stdout.flush()
    os._exit(0)
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_weight_group_rank0_broadcasts_to_members_joined_the_sglang_way() -> None:
    from agentrl.engine.weight_group import WeightGroup

    port = _port()
    members = [
        subprocess.Popen(
            [sys.executable, "-c", SGLANG_MEMBER, str(port), str(r), "3", "weight_update_group"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (1, 2)
    ]
    try:
        group = WeightGroup(
            master_address="127.0.0.1", master_port=port, rank=0, world_size=3, backend="gloo",
            timeout_s=60,
        )  # fmt: skip
        sent = []
        for k in (1, 2):
            t = torch.full((3, 4), float(k), dtype=torch.bfloat16)
            group.broadcast(t)
            sent.append(t.float().sum().item())
        outs = [m.communicate(timeout=60) for m in members]
    finally:
        for m in members:
            if m.poll() is None:
                m.kill()
    for m, (out, err) in zip(members, outs, strict=True):
        assert m.returncode == 0, err[-2000:]
        assert [float(x) for x in out.split()] == sent
    group.destroy()


def test_a_second_group_forms_on_the_trainers_store_under_a_new_name() -> None:
    """The trainer keeps its rendezvous store: a group formed again (a restarted server) meets on
    the same port under another name, while the old name stays refused by the member's torch."""
    from agentrl.engine.weight_group import WeightGroup, rendezvous_store

    port = _port()

    def member(group: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", SGLANG_MEMBER, str(port), "1", "2", group],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    first = member("weight_update_group")
    store = rendezvous_store("127.0.0.1", port, rank=0, world_size=2, timeout_s=60)
    try:
        results = []
        for name, proc in (("weight_update_group", first), ("weight_update_group-2", None)):
            proc = proc or member(name)
            group = WeightGroup(
                master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name=name,
                backend="gloo", timeout_s=60, store=store,
            )  # fmt: skip
            for k in (3, 4):
                group.broadcast(torch.full((3, 4), float(k), dtype=torch.bfloat16))
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err[-2000:]
            results.append([float(x) for x in out.split()])
            group.destroy()
        assert results == [[36.0, 48.0], [36.0, 48.0]]
    finally:
        if first.poll() is None:
            first.kill()
