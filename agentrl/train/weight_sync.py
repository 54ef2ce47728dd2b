"""Weight sync = a weight source x a transport.

The source is the trainer's `export_weights(dtype)`: an iterator of buckets, each a list of
`(hf_name, tensor)`. A transport moves those buckets into every engine and makes each serve them as
weight version `version`: `await transport.push(buckets, version=v)`.

Transports never pause or resume engines: the one pause/resume wrapper is the rollout manager's
(`RolloutManager.update_weights(sync_fn, mode)`: pause -> flush after an abort pause -> sync_fn ->
check versions -> resume). Only the last call of a push carries the new version; earlier ones
(several buckets) carry the engine's current version, so a push that fails half-way leaves the
engines on the version they had, and the manager's version check fails loudly instead of a
half-loaded model passing as the new version.

  InProcessTransport   `LocalEngine.load_state_dict` in this process (no copy: the engine copies
                       from the trainer's tensors)
  DiskTransport        a safetensors directory per version, written atomically (temporary dir +
                       rename), then `DiskWeights(dir)` on every engine (SGLang
                       `/update_weights_from_disk`)
  TensorTransport      per bucket, `TensorWeights` with one payload per TP rank of the servers,
                       each a serialized list of `(name, tensor)` pairs (SGLang
                       `/update_weights_from_tensor`; agentrl's safe encoding, `agentrl.engine.tensors`)
  AdapterTransport     LoRA adapters alone: a PEFT adapter directory per version, loaded by name
                       on every engine (`LoraAdapter`: SGLang `/load_lora_adapter`)
  DistributedTransport a process group joined once (the trainer is rank 0, each server TP rank one
                       more: SGLang `/init_weights_update_group`), then per bucket the HTTP
                       `DistributedWeights` call on every engine concurrently with the trainer's
                       `broadcast(src=0)` of each tensor, in order (NCCL on GPUs, gloo on CPU)
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import logging
import shutil
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from agentrl.engine.base import DiskWeights, DistributedWeights, Engine, LoraAdapter, TensorWeights
from agentrl.engine.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from agentrl.engine.tensors import serialize_named_tensors
from agentrl.engine.weight_group import WeightGroup, rendezvous_store
from agentrl.errors import InfraError
from agentrl.train.checkpoint import atomic_dir

Bucket = list[tuple[str, torch.Tensor]]

log = logging.getLogger("agentrl.train.weight_sync")

# Files of a Hugging Face model directory that a server reading weights from disk may need besides
# the weights (SGLang's loader reads the config of `model_path`).
_MODEL_FILES = ("config.json", "generation_config.json")


class WeightSyncError(InfraError):
    """Weights could not be delivered to every engine."""

    cause = "weight_sync"


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last one (one item of look-ahead)."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


class Transport(abc.ABC):
    """Moves weight buckets into `engines`. `timeout` bounds each engine call."""

    def __init__(self, engines: Sequence[Engine], *, timeout: float = 600.0) -> None:
        if not engines:
            raise ValueError("weight sync needs at least one engine")
        self.engines = list(engines)
        self.timeout = timeout

    async def _each(self, what: str, fn: Callable[[Engine], Awaitable[Any]]) -> None:
        """fn(engine) on every engine concurrently, each under the timeout; raises
        `WeightSyncError` naming the engines that failed."""

        async def one(engine: Engine) -> None:
            try:
                async with asyncio.timeout(self.timeout):
                    await fn(engine)
            except TimeoutError as exc:
                raise WeightSyncError(f"{what} on {engine!r} timed out after {self.timeout:.0f}s") from exc

        results = await asyncio.gather(*(one(e) for e in self.engines), return_exceptions=True)
        failures = [
            (e, r) for e, r in zip(self.engines, results, strict=True) if isinstance(r, BaseException)
        ]
        for _, r in failures:
            if not isinstance(r, Exception):  # cancellation and the like pass through
                raise r
        if failures:
            first = failures[0][1]
            if isinstance(first, WeightSyncError) and len(failures) == 1:
                raise first
            raise WeightSyncError(
                f"{what} failed on {len(failures)} of {len(self.engines)} engine(s): "
                + "; ".join(f"{e!r}: {r}" for e, r in failures)
            ) from first

    @abc.abstractmethod
    async def push(self, buckets: Iterable[Bucket], *, version: int) -> None:
        """Deliver every bucket to every engine; afterwards each serves weight version `version`."""

    async def aclose(self) -> None:  # noqa: B027
        """Release what the transport holds (a process group)."""


class InProcessTransport(Transport):
    """Engines in this process (`LocalEngine.load_state_dict`): one load of all buckets."""

    async def push(self, buckets: Iterable[Bucket], *, version: int) -> None:
        state = {name: t for bucket in buckets for name, t in bucket}
        await self._each(
            "load_state_dict",
            lambda e: e.load_state_dict(state, weight_version=version),  # type: ignore[attr-defined]
        )


def write_version(
    directory: Path, version: int, fill: Callable[[Path], None], *, keep: int, what: str
) -> Path:
    """`directory/v<version>` written atomically by `fill`, then all but the `keep` newest versions
    removed; returns the version's directory (`WeightSyncError` when it cannot be written)."""
    final = directory / f"v{version:08d}"
    try:
        atomic_dir(final, fill)
    except OSError as exc:
        raise WeightSyncError(f"could not write {what} for version {version} under {final}: {exc}") from exc
    old = sorted(p for p in directory.glob("v*") if p.is_dir() and p != final)
    for stale in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


class DiskTransport(Transport):
    """A safetensors model directory per version under `directory` (`v00000007/`): one shard per
    bucket plus `model.safetensors.index.json`, and the config files of `model_files_from` (the
    initial model directory) when given. The directory appears only complete; the `keep` newest
    versions stay on disk. Then every engine loads it (`DiskWeights`)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        directory: str | Path,
        *,
        keep: int = 2,
        model_files_from: str | Path | None = None,
        load_format: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(engines, timeout=timeout)
        self.directory = Path(directory)
        self.keep = max(1, keep)
        self.model_files_from = Path(model_files_from) if model_files_from else None
        self.load_format = load_format

    def write(self, buckets: Iterable[Bucket], version: int) -> Path:
        """The atomic write alone; returns the version's directory."""

        def fill(tmp: Path) -> None:
            tmp.mkdir(parents=True, exist_ok=True)
            index: dict[str, str] = {}
            for i, bucket in enumerate(buckets):
                shard = f"model-{i + 1:05d}.safetensors"
                tensors = _dedup({name: t.detach().contiguous().cpu() for name, t in bucket})
                save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
                index.update(dict.fromkeys(tensors, shard))
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": index}, indent=1)
            )
            if self.model_files_from is not None:
                for name in _MODEL_FILES:
                    if (self.model_files_from / name).exists():
                        shutil.copyfile(self.model_files_from / name, tmp / name)

        return write_version(self.directory, version, fill, keep=self.keep, what="weights")

    async def push(self, buckets: Iterable[Bucket], *, version: int) -> None:
        path = await asyncio.to_thread(self.write, buckets, version)
        update = DiskWeights(str(path), load_format=self.load_format)
        await self._each(
            "update_weights(DiskWeights)", lambda e: e.update_weights(update, weight_version=version)
        )


class AdapterTransport(Transport):
    """LoRA adapters alone (`sync.transport=lora_adapter`): the trainer's adapter tensors (its
    `export_adapter`, PEFT's names) written as a PEFT adapter directory per version under
    `directory` (`v00000007/`: `adapter_model.safetensors` + `adapter_config.json`), atomically,
    the `keep` newest kept; then every engine loads it by name (`LoraAdapter`: SGLang's
    `/load_lora_adapter` and `/update_weight_version`) and names it in its requests. The engines'
    base weights never move, so a push costs the adapters' bytes, not the model's."""

    exports = "adapter"

    def __init__(
        self,
        engines: Sequence[Engine],
        directory: str | Path,
        adapter_config: dict[str, Any],
        *,
        keep: int = 2,
        prefix: str = "agentrl-policy",
        timeout: float = 600.0,
    ) -> None:
        super().__init__(engines, timeout=timeout)
        self.directory = Path(directory)
        self.config = dict(adapter_config)
        self.keep = max(2, keep)  # the engines may still serve the previous version's adapter
        self.prefix = prefix

    def write(self, buckets: Iterable[Bucket], version: int) -> Path:
        def fill(tmp: Path) -> None:
            tmp.mkdir(parents=True, exist_ok=True)
            tensors = {name: t.detach().contiguous().cpu() for bucket in buckets for name, t in bucket}
            save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(self.config, indent=1, sort_keys=True))

        return write_version(self.directory, version, fill, keep=self.keep, what="the adapter")

    async def push(self, buckets: Iterable[Bucket], *, version: int) -> None:
        path = await asyncio.to_thread(self.write, buckets, version)
        update = LoraAdapter(f"{self.prefix}-v{version}", str(path))
        await self._each(
            "update_weights(LoraAdapter)", lambda e: e.update_weights(update, weight_version=version)
        )


def _dedup(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage (tied embeddings): give each name its own copy."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        ptr = v.data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


async def _tp_size(engine: Engine) -> int:
    """The TP size of an engine's servers (they must agree); 1 for an in-process engine."""
    sizes_of = getattr(engine, "server_tp_sizes", None)
    if sizes_of is None:
        return 1
    sizes = await sizes_of()
    if len(set(sizes.values())) != 1:
        raise WeightSyncError(
            f"servers of {engine!r} have different TP sizes {sizes}: give tp_size per fleet"
        )
    return int(next(iter(sizes.values())))


class TensorTransport(Transport):
    """Each bucket as one `TensorWeights` call: `serialized_named_tensors` holds one payload per TP
    rank of the servers (SGLang's `tp_worker.py` picks its rank's entry), each the bucket's full
    list of `(name, tensor)` pairs. `tp_size` None asks each engine's servers (`/server_info`).

    `serialize` turns a bucket into one entry; the default is the encoding agentrl's engine server
    accepts (`agentrl.engine.tensors`). A real SGLang worker expects its `MultiprocessingSerializer`
    payload (CUDA IPC handles, so only for engines colocated with the trainer): pass that serializer
    and its `load_format` there."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        tp_size: int | None = None,
        serialize: Callable[[Bucket], str] | None = None,
        load_format: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(engines, timeout=timeout)
        if tp_size is not None and tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        if serialize is None:
            serialize = serialize_named_tensors
        self.serialize: Callable[[Bucket], str] = serialize
        self.load_format = load_format

    async def push(self, buckets: Iterable[Bucket], *, version: int) -> None:
        sizes = [self.tp_size or await _tp_size(e) for e in self.engines]
        start = {id(e): e.weight_version for e in self.engines}
        for bucket, last in _with_last(buckets):
            entry = await asyncio.to_thread(self.serialize, bucket)

            def call(e: Engine, entry: str = entry, last: bool = last) -> Awaitable[None]:
                update = TensorWeights([entry] * sizes[self.engines.index(e)], load_format=self.load_format)
                return e.update_weights(update, weight_version=version if last else start[id(e)])

            await self._each("update_weights(TensorWeights)", call)


class DistributedTransport(Transport):
    """Broadcast buckets from the trainer (rank 0) to every server through a process group.

    A push first makes sure the group holds exactly the servers that serve now: each engine's live
    servers and their weight versions are read, and the group is (re)formed when there is none yet,
    when a member is gone or a new server answers, or when a member reports a version other than
    the fleet's (a server restarted between two checks: a new process, not in the group). Forming:
    each live server gets a `rank_offset` (1, then one more per TP rank before it), the trainer joins
    as rank 0 on its rendezvous store (kept across groups, so the port stays its own) while the
    servers join through `/init_weights_update_group`. Each group has its own name (`group_name`,
    then `group_name-2`, ...): SGLang refuses a name it already holds, so the previous group and any
    stale one under the new name are destroyed on the servers first. Each bucket then is one
    `DistributedWeights` call per engine, concurrent with the trainer's broadcast of each tensor in
    order, and a restarted server gets the whole model in that push. Tensors travel from `device`
    ("cpu" for gloo; a CUDA device for NCCL). A push that fails leaves no group: the next forms one."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        master_address: str = "127.0.0.1",
        master_port: int,
        backend: str = "nccl",
        group_name: str = "weight_update_group",
        device: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(engines, timeout=timeout)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.base_group_name = group_name
        self.group_name = group_name
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        self._group: Any = None
        self._store: Any = None
        self._formed = 0  # groups formed so far
        self._members: list[set[str]] = []  # per engine: the servers in the group
        # The group each server last joined: a server that was out of a re-formed group (set
        # aside for an eval) still holds its old one when it comes back.
        self._held: dict[str, str] = {}

    async def _live(self) -> list[dict[str, int]]:
        """Per engine, {server URL: weight version} of the servers that answer now."""
        for e in self.engines:
            if not hasattr(e, "init_weights_update_group"):
                raise WeightSyncError(f"{e!r} cannot join a weight-update group: serve it over HTTP")
        return [await e.weight_versions() for e in self.engines]

    def _stale(self, live: list[dict[str, int]]) -> str | None:
        """Why the group must be formed again, or None when it holds exactly the live servers."""
        if self._group is None:
            return "no group yet"
        for e, now, members in zip(self.engines, live, self._members, strict=True):
            if set(now) != members:
                gone, new = sorted(members - set(now)), sorted(set(now) - members)
                return f"servers changed (gone: {gone or 'none'}, new: {new or 'none'})"
            restarted = sorted(u for u, v in now.items() if v != e.weight_version)
            if restarted:
                return f"{restarted} report another version than {e.weight_version} (restarted)"
        return None

    async def _form(self, live: list[dict[str, int]]) -> None:

        previous = self.group_name if self._formed else None
        self._drop_group()
        self._formed += 1
        name = self.base_group_name if self._formed == 1 else f"{self.base_group_name}-{self._formed}"
        offsets: list[dict[str, int]] = []
        rank = 1
        for e, now in zip(self.engines, live, strict=True):
            sizes = await e.server_tp_sizes()  # type: ignore[attr-defined]
            mine = {}
            for url in sorted(now):
                if url in sizes:
                    mine[url] = rank
                    rank += sizes[url]
            offsets.append(mine)
        world_size = rank
        # The group being replaced, a stale one under the new name, and any older group a
        # returning server still holds.
        held = {self._held[u] for now in live for u in now if u in self._held}
        olds = sorted(held | {name} | ({previous} if previous else set()))
        for e in self.engines:
            for old in olds:
                await e.destroy_weights_update_group(old)  # type: ignore[attr-defined]

        def join() -> Any:
            if self._store is None:  # the first group: the servers connect while it waits for them
                self._store = rendezvous_store(
                    self.master_address, self.master_port, rank=0, world_size=world_size,
                    timeout_s=self.timeout,
                )  # fmt: skip
            return WeightGroup(
                master_address=self.master_address,
                master_port=self.master_port,
                rank=0,
                world_size=world_size,
                group_name=name,
                backend=self.backend,
                timeout_s=self.timeout,
                store=self._store,
            )

        async def servers_join() -> None:
            await asyncio.gather(
                *(
                    e.init_weights_update_group(  # type: ignore[attr-defined]
                        master_address=self.master_address,
                        master_port=self.master_port,
                        world_size=world_size,
                        rank_offsets=off,
                        group_name=name,
                        backend=self.backend,
                        timeout_s=self.timeout,
                    )
                    for e, off in zip(self.engines, offsets, strict=True)
                )
            )

        # The rendezvous needs every rank at once: the trainer's join and the servers' together.
        group, _ = await asyncio.gather(asyncio.to_thread(join), servers_join())
        self._group = group
        self.group_name = name
        self._members = [set(off) for off in offsets]
        self._held.update({u: name for off in offsets for u in off})

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.destroy()
            self._group = None
        self._members = []

    async def push(self, buckets: Iterable[Bucket], *, version: int) -> None:
        try:
            live = await self._live()
            why = self._stale(live)
            if why is not None:
                if self._group is not None:
                    log.warning("weight-update group %s formed again: %s", self.group_name, why)
                await self._form(live)
        except WeightSyncError:
            self._drop_group()
            raise
        except Exception as exc:
            self._drop_group()
            raise WeightSyncError(f"could not set up the weight-update group: {exc}") from exc
        try:
            await self._broadcast(buckets, version)
        except BaseException:
            self._drop_group()  # a rank may be half-way through a tensor: never reuse the group
            raise

    async def _broadcast(self, buckets: Iterable[Bucket], version: int) -> None:
        start = {id(e): e.weight_version for e in self.engines}
        # Each engine's update goes to the servers in the group only (`DistributedWeights.members`).
        members = {id(e): tuple(sorted(m)) for e, m in zip(self.engines, self._members, strict=True)}
        for bucket, last in _with_last(buckets):
            tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
            update = DistributedWeights(
                names=[n for n, _ in bucket],
                dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
                shapes=[list(t.shape) for t in tensors],
                group_name=self.group_name,
            )

            def send(tensors: list[torch.Tensor] = tensors) -> None:
                for t in tensors:
                    self._group.broadcast(t, src=0)

            def call(e: Engine, update: DistributedWeights = update, last: bool = last) -> Awaitable[None]:
                mine = dataclasses.replace(update, members=members[id(e)])
                return e.update_weights(mine, weight_version=version if last else start[id(e)])

            await asyncio.gather(
                asyncio.to_thread(send), self._each("update_weights(DistributedWeights)", call)
            )

    async def aclose(self) -> None:
        self._drop_group()
        self._store = None
