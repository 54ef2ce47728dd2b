"""Weight sync = a weight source (buckets of `(hf_name, tensor)`, as `trainer.export_weights`
yields them) x a transport. Every transport makes every engine serve exactly the trainer's weights
under the new version; none pauses or resumes (the rollout manager does).

Engines are the project's real ones: `LocalEngine` in this process, and the SGLang-compatible
`EngineServer` reached over loopback HTTP by the `SGLangEngine` fleet client.
"""

from __future__ import annotations

import asyncio
import copy
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from agentrl.engine.base import SamplingParams  # noqa: E402
from agentrl.engine.local import LocalEngine  # noqa: E402
from agentrl.engine.server import EngineServer  # noqa: E402
from agentrl.engine.sglang import SGLangEngine  # noqa: E402
from agentrl.models.tiny import load_tiny  # noqa: E402
from agentrl.train.weight_sync import (  # noqa: E402
    DiskTransport,
    DistributedTransport,
    InProcessTransport,
    TensorTransport,
    WeightSyncError,
)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def buckets(model: Any, bucket_bytes: int = 2**20) -> Iterator[list[tuple[str, Any]]]:
    """The trainer's `export_weights` in miniature: state_dict pairs in buckets of bounded size."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in model.state_dict().items():
        t = t.detach()
        if bucket and size + t.numel() * t.element_size() > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def trained(model: Any, seed: int = 0) -> Any:
    """Stand-in for the trainer's new weights: every parameter moved."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return out.eval()


def assert_same_weights(engine_model: Any, source: Any) -> None:
    mine = engine_model.state_dict()
    for name, t in source.state_dict().items():
        assert torch.equal(mine[name], t), name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_in_process_transport_loads_all_buckets_and_sets_the_version(tiny) -> None:
    model, tok = tiny
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(2)]
    new = trained(model)
    try:
        await InProcessTransport(engines).push(buckets(new, 64 * 1024), version=1)
        for e in engines:
            assert e.weight_version == 1 and not e.paused
            assert_same_weights(e.model, new)
    finally:
        for e in engines:
            await e.aclose()


async def test_disk_transport_writes_atomically_keeps_recent_versions_and_every_engine_loads_it(
    tiny, tmp_path: Path
) -> None:
    model, tok = tiny
    local = LocalEngine(copy.deepcopy(model), tok)
    served = LocalEngine(copy.deepcopy(model), tok)
    model_dir = tmp_path / "initial"
    model_dir.mkdir()
    model.config.to_json_file(str(model_dir / "config.json"))
    async with EngineServer(served, port=0) as server:
        client = SGLangEngine(server.url, retries=2)
        try:
            transport = DiskTransport(
                [local, client], tmp_path / "weights", keep=2, model_files_from=model_dir
            )
            for version in (1, 2, 3):
                new = trained(model, seed=version)
                await transport.push(buckets(new, 256 * 1024), version=version)
            assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000002", "v00000003"]
            latest = tmp_path / "weights" / "v00000003"
            assert (latest / "config.json").exists() and (latest / "model.safetensors.index.json").exists()
            assert len(list(latest.glob("model-*.safetensors"))) > 1  # one shard per bucket
            assert local.weight_version == 3 and client.weight_version == 3
            assert await client.weight_versions() == {server.url: 3}
            for e in (local, served):
                assert_same_weights(e.model, new)
        finally:
            await client.aclose()
    await local.aclose()
    await served.aclose()


async def test_tensor_transport_sends_one_payload_per_tp_rank_of_each_fleet(tiny) -> None:
    model, tok = tiny
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(2)]
    new = trained(model)
    async with (
        EngineServer(engines[0], port=0, tp_size=1) as tp1,
        EngineServer(engines[1], port=0, tp_size=2) as tp2,
    ):
        clients = [SGLangEngine(tp1.url, retries=2), SGLangEngine(tp2.url, retries=2)]
        try:
            # tp_size None: each fleet's servers say theirs (/server_info); a TP 2 server refuses
            # a single payload by dying, so this would fail if the transport sent one.
            await TensorTransport(clients).push(buckets(new, 128 * 1024), version=5)
            for e in engines:
                assert_same_weights(e.model, new)
            assert [c.weight_version for c in clients] == [5, 5]
            assert tp1.dead is None and tp2.dead is None
            prompt = tok.encode("count the lines")
            gen = await clients[1].generate(prompt, SamplingParams(max_new_tokens=4, seed=1))
            assert gen.weight_version == 5
        finally:
            for c in clients:
                await c.aclose()
    for e in engines:
        await e.aclose()


async def test_a_push_that_fails_half_way_leaves_the_version_where_it_was(tiny) -> None:
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(engine, port=0) as server:
        client = SGLangEngine(server.url, retries=2)
        try:
            good = list(buckets(trained(model), 128 * 1024))
            bad = [("no.such.weight", torch.zeros(2))]
            with pytest.raises(WeightSyncError, match="unknown parameter names"):
                await TensorTransport([client]).push([good[0], bad, *good[1:]], version=1)
            # Only the last call carries the new version: nothing claims version 1.
            assert client.weight_version == 0 and engine.weight_version == 0
        finally:
            await client.aclose()
    await engine.aclose()


async def test_distributed_transport_broadcasts_over_gloo_to_every_server_rank(tiny) -> None:
    # SGLang model_runner weight updater: the trainer is rank 0, each server TP rank joins as
    # rank_offset + tp_rank, and every tensor arrives by broadcast(src=0) in order.
    model, tok = tiny
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(2)]
    async with (
        EngineServer(engines[0], port=0, tp_size=1) as a,
        EngineServer(engines[1], port=0, tp_size=2) as b,
    ):
        fleet = SGLangEngine([a.url, b.url], retries=2)
        transport = DistributedTransport([fleet], master_port=free_port(), backend="gloo", timeout=120)
        try:
            for version in (1, 2):  # the group is set up once, on the first push
                new = trained(model, seed=version)
                new.to(torch.bfloat16)  # dtypes travel as announced
                await transport.push(buckets(new, 256 * 1024), version=version)
                for e in engines:
                    mine = e.model.state_dict()
                    for name, t in new.state_dict().items():
                        assert torch.equal(mine[name], t.to(mine[name].dtype)), name
            assert await fleet.weight_versions() == {a.url: 2, b.url: 2}
            assert len(a._groups["weight_update_group"]) == 1 and len(b._groups["weight_update_group"]) == 2
            assert {m.rank for m in b._groups["weight_update_group"]} | {
                m.rank for m in a._groups["weight_update_group"]
            } == {1, 2, 3}
        finally:
            await transport.aclose()
            await fleet.aclose()
    for e in engines:
        await e.aclose()


class _HangingEngine(LocalEngine):
    async def update_weights(self, update: Any, *, weight_version: int, flush_cache: bool = False) -> None:
        await asyncio.Event().wait()


async def test_a_hanging_engine_times_out_as_a_weight_sync_error_naming_it(tiny, tmp_path: Path) -> None:
    model, tok = tiny
    good = LocalEngine(copy.deepcopy(model), tok)
    hang = _HangingEngine(copy.deepcopy(model), tok)
    try:
        with pytest.raises(WeightSyncError, match="timed out"):
            await DiskTransport([good, hang], tmp_path, timeout=0.5).push(buckets(model), version=1)
        assert good.weight_version == 1 and hang.weight_version == 0
    finally:
        await good.aclose()
        await hang.aclose()


async def test_the_distributed_group_is_formed_again_when_a_server_restarts_or_goes(tiny) -> None:
    """A server restarted on its address (a new process with its launch weights, not a member of
    the group) or gone: the next push forms the group again from the servers that answer, under
    a new name (SGLang refuses a name it holds), destroys the old one on the survivors, and the
    restarted server gets the whole model and the version."""
    model, tok = tiny
    port_b = free_port()
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(3)]
    async with EngineServer(engines[0], port=0) as a:
        fleet = SGLangEngine([a.url, f"http://127.0.0.1:{port_b}"], retries=1)
        transport = DistributedTransport([fleet], master_port=free_port(), backend="gloo", timeout=120)

        def same(engine: LocalEngine, new: Any) -> bool:
            mine = engine.model.state_dict()
            return all(torch.equal(mine[n], t.to(mine[n].dtype)) for n, t in new.state_dict().items())

        try:
            async with EngineServer(engines[1], port=port_b) as b:
                await transport.push(buckets(trained(model, seed=1), 256 * 1024), version=1)
                assert transport.group_name == "weight_update_group" and "weight_update_group" in b._groups
                await transport.push(buckets(trained(model, seed=2), 256 * 1024), version=2)
                assert transport.group_name == "weight_update_group"  # same servers: same group
            # b restarts: a fresh process on the same address, launch weights, version 0, no group.
            async with EngineServer(engines[2], port=port_b) as b2:
                assert await fleet.weight_versions() == {a.url: 2, b2.url: 0}
                new = trained(model, seed=3)
                await transport.push(buckets(new, 256 * 1024), version=3)
                assert transport.group_name == "weight_update_group-2"
                assert list(a._groups) == ["weight_update_group-2"] == list(b2._groups)
                assert same(engines[0], new) and same(engines[2], new)
                assert await fleet.weight_versions() == {a.url: 3, b2.url: 3}
            # b is gone for good: the group shrinks to a alone and the push goes on.
            new = trained(model, seed=4)
            await transport.push(buckets(new, 256 * 1024), version=4)
            assert transport.group_name == "weight_update_group-3" and list(a._groups) == [
                "weight_update_group-3"
            ]
            assert same(engines[0], new) and list(fleet.dead_workers) == [f"http://127.0.0.1:{port_b}"]
        finally:
            await transport.aclose()
            await fleet.aclose()
    for e in engines:
        await e.aclose()


async def test_a_server_that_comes_up_after_the_group_formed_is_not_sent_its_update(tiny) -> None:
    """The race between a push's membership check and its broadcast: a server that starts in
    between is not in the group; sending it `/update_weights_from_distributed` would kill it
    (SGLang asserts the group exists, outside its try block). It gets nothing this push and
    joins the group formed again on the next."""
    model, tok = tiny
    port_b = free_port()
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(2)]
    async with EngineServer(engines[0], port=0) as a:
        fleet = SGLangEngine([a.url, f"http://127.0.0.1:{port_b}"], retries=1)
        transport = DistributedTransport([fleet], master_port=free_port(), backend="gloo", timeout=120)
        form = transport._form
        late: list[EngineServer] = []

        async def form_then_b_starts(live: Any) -> None:
            await form(live)
            if not late:  # b comes up after the group holds only a
                late.append(await EngineServer(engines[1], port=port_b).__aenter__())

        transport._form = form_then_b_starts  # type: ignore[method-assign]
        try:
            new = trained(model, seed=5)
            await transport.push(buckets(new, 256 * 1024), version=1)
            b = late[0]
            assert b.dead is None and not b._groups  # untouched: alive, no group, launch weights
            # The loop pauses the fleet around each update: a pause reaches every configured
            # server (one counted dead too, once), and one that answers rejoins the control plane.
            await fleet.pause("abort")
            await fleet.resume()
            assert await fleet.weight_versions() == {a.url: 1, b.url: 0}
            new = trained(model, seed=6)
            await transport.push(buckets(new, 256 * 1024), version=2)
            assert transport.group_name == "weight_update_group-2" and list(b._groups) == [
                "weight_update_group-2"
            ]
            assert await fleet.weight_versions() == {a.url: 2, b.url: 2}
            assert_same_weights(engines[1].model, new)
        finally:
            await transport.aclose()
            await fleet.aclose()
            for srv in late:
                await srv.__aexit__(None, None, None)
    for e in engines:
        await e.aclose()


async def test_a_resumed_fleet_takes_the_newest_version_and_a_fresh_one_refuses_to_disagree(tiny) -> None:
    from agentrl.engine.base import EngineVersionMismatch

    model, tok = tiny
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(2)]
    await engines[0].load_state_dict(model.state_dict(), weight_version=5)  # b restarted: still 0
    async with EngineServer(engines[0], port=0) as a, EngineServer(engines[1], port=0) as b:
        fleet = SGLangEngine([a.url, b.url], retries=1)
        try:
            with pytest.raises(EngineVersionMismatch, match="disagree"):
                await fleet.refresh_weight_version()
            assert await fleet.refresh_weight_version(allow_laggards=True) == 5
        finally:
            await fleet.aclose()
    for e in engines:
        await e.aclose()


async def test_a_server_set_aside_leaves_the_group_and_comes_back_without_its_old_one(tiny) -> None:
    """A server set aside for an eval is left out of the group formed at the next push (it keeps
    its weights and version); given back, the push after the next pause forms the group with it
    again, destroys the group it still held and gives it the whole model."""
    model, tok = tiny
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(2)]
    async with EngineServer(engines[0], port=0) as a, EngineServer(engines[1], port=0) as b:
        fleet = SGLangEngine([a.url, b.url], retries=2)
        transport = DistributedTransport([fleet], master_port=free_port(), backend="gloo", timeout=120)

        async def push(version: int) -> Any:
            new = trained(model, seed=version)
            await fleet.pause("in_place")
            await transport.push(buckets(new, 256 * 1024), version=version)
            await fleet.resume()
            return new

        try:
            await push(1)
            assert list(a._groups) == ["weight_update_group"] == list(b._groups)
            aside = await fleet.set_aside(1)
            await push(2)
            assert transport.group_name == "weight_update_group-2" and list(a._groups) == [
                transport.group_name
            ]
            assert list(b._groups) == ["weight_update_group"] and engines[1].weight_version == 1
            await fleet.rejoin(aside)
            new = await push(3)
            assert transport.group_name == "weight_update_group-3"
            assert list(a._groups) == [transport.group_name] == list(b._groups)
            mine = engines[1].model.state_dict()
            assert all(torch.equal(mine[n], t.to(mine[n].dtype)) for n, t in new.state_dict().items())
            assert await fleet.weight_versions() == {a.url: 3, b.url: 3}
        finally:
            await transport.aclose()
            await fleet.aclose()
    for e in engines:
        await e.aclose()
