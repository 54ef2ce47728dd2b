"""Weight sync: new trainer weights into the inference engines, one interface, three strategies.

`sync(model, version)` runs the same envelope around every strategy's transfer:
    pause every engine -> push the weights (tagged with the new weight version) -> resume every engine
The resume runs whatever happened before it (a failed pause, a failed or timed-out push,
cancellation), so a failed sync never leaves an engine paused; the failure is then raised as a
`WeightSyncError` (an infrastructure error, never a policy outcome). A caller that pauses engines
itself (the rollout manager around its own update) calls `push` alone.

Strategies and the engine calls they make (the `Engine` control plane):
  InProcessSync  engine.load_state_dict(state_dict, weight_version=v)          LocalEngine, same process
  DiskSync       engine.update_weights(model_path=dir, weight_version=v)     SGLang `/update_weights_from_disk`
                 (or LocalEngine); the safetensors directory is written to a temporary directory and
                 renamed into place before any engine reads it
  TensorSync     engine.update_weights(serialized_named_tensors=[...], weight_version=v)
                 SGLang `/update_weights_from_tensor`, in buckets of bounded size
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from agentrl.errors import InfraError
from agentrl.train.checkpoint import atomic_dir


class WeightSyncError(InfraError):
    """Weights could not be delivered to every engine (engines were resumed regardless)."""

    cause = "weight_sync"


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class WeightSync(abc.ABC):
    """Pushes a model's weights to `engines`, pausing them around the update.

    `pause_mode` is passed to `engine.pause(mode=...)` ("abort" makes in-flight generations return
    early with finish reason abort; the rollout side retries those turns). `timeout` bounds each
    engine call.
    """

    def __init__(self, engines: Sequence[Any], *, timeout: float = 600.0, pause_mode: str = "abort") -> None:
        if not engines:
            raise ValueError("weight sync needs at least one engine")
        self.engines = list(engines)
        self.timeout = timeout
        self.pause_mode = pause_mode
        self.version: int | None = None

    async def _each(self, what: str, fn: Any) -> list[BaseException]:
        """Run fn(engine) on every engine concurrently, each under the timeout; return the failures."""

        async def one(engine: Any) -> None:
            try:
                await asyncio.wait_for(_maybe_await(fn(engine)), self.timeout)
            except TimeoutError as exc:
                raise WeightSyncError(f"{what} on {engine!r} timed out after {self.timeout:.0f}s") from exc

        results = await asyncio.gather(*(one(e) for e in self.engines), return_exceptions=True)
        return [r for r in results if isinstance(r, BaseException)]

    async def sync(self, model: Any, version: int) -> None:
        """Deliver `model`'s weights to every engine as weight version `version`."""
        failures: list[BaseException] = []
        try:
            failures += await self._each("pause", lambda e: e.pause(mode=self.pause_mode))
            if not failures:
                await self.push(model, version)
        except Exception as exc:
            failures.append(exc)
        finally:
            # Shielded so that a cancelled sync still resumes the engines before the cancellation lands.
            resume_failures = await asyncio.shield(self._each("resume", lambda e: e.resume()))
        failures += resume_failures
        if failures:
            first = failures[0]
            raise WeightSyncError(
                f"{type(self).__name__} to version {version} failed on {len(failures)} call(s); "
                f"engines were resumed{' except where resume failed' if resume_failures else ''}: {first}",
            ) from first
        self.version = version

    @abc.abstractmethod
    async def push(self, model: Any, version: int) -> None:
        """Transfer the weights to every (paused) engine; raise on any failure."""


def _named_tensors(model: Any, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in model.state_dict().items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield name, t


class InProcessSync(WeightSync):
    """Copy the state dict into engines that live in this process (`LocalEngine.load_state_dict`)."""

    def __init__(self, engines: Sequence[Any], *, dtype: torch.dtype | None = None, **kw: Any) -> None:
        super().__init__(engines, **kw)
        self.dtype = dtype

    async def push(self, model: Any, version: int) -> None:
        # No copy: the engine copies into its own parameters, and sync() returns only after it has.
        state = dict(_named_tensors(model, self.dtype))
        failures = await self._each(
            "load_state_dict", lambda e: e.load_state_dict(state, weight_version=version)
        )
        if failures:
            raise failures[0]


class DiskSync(WeightSync):
    """Write a safetensors model directory per version under `directory`, then have engines load it.

    The directory appears only complete (temporary dir + rename); `keep` newest versions stay on disk.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        directory: str | Path,
        *,
        dtype: torch.dtype | None = None,
        keep: int = 2,
        **kw: Any,
    ) -> None:
        super().__init__(engines, **kw)
        self.directory = Path(directory)
        self.dtype = dtype
        self.keep = max(1, keep)
        self._pending: tuple[int, Path] | None = None

    def write(self, model: Any, version: int) -> Path:
        """The atomic write alone (usable before pausing engines: writing can take a while)."""
        final = self.directory / f"v{version:08d}"

        def fill(tmp: Path) -> None:
            tensors = {k: v.contiguous() for k, v in _named_tensors(model, self.dtype)}
            tmp.mkdir(parents=True, exist_ok=True)
            save_file(_dedup(tensors), str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config = getattr(model, "config", None)
            if config is not None and hasattr(config, "to_json_file"):
                config.to_json_file(str(tmp / "config.json"))

        atomic_dir(final, fill)
        old = sorted(p for p in self.directory.glob("v*") if p.is_dir() and p != final)
        for stale in old[: max(0, len(old) - (self.keep - 1))]:
            shutil.rmtree(stale, ignore_errors=True)
        return final

    async def sync(self, model: Any, version: int) -> None:
        # Write before pausing: engines keep generating while the (slow) write happens.
        await self._write(model, version)
        await super().sync(model, version)

    async def _write(self, model: Any, version: int) -> Path:
        if self._pending is None or self._pending[0] != version:
            try:
                self._pending = (version, await asyncio.to_thread(self.write, model, version))
            except OSError as exc:
                raise WeightSyncError(
                    f"could not write weights for version {version} under {self.directory}: {exc}"
                ) from exc
        return self._pending[1]

    async def push(self, model: Any, version: int) -> None:
        path = str(await self._write(model, version))
        failures = await self._each(
            "update_weights(model_path)",
            lambda e: e.update_weights(model_path=path, weight_version=version),
        )
        if failures:
            raise failures[0]


def _dedup(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage (tied embeddings): give each name its own copy."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        ptr = v.data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


class TensorSync(WeightSync):
    """Send the tensors themselves in buckets of at most `bucket_bytes` (one tensor larger than
    that goes alone), each bucket one `update_weights(serialized_named_tensors=...)` call.

    `serialize` turns a bucket into one `serialized_named_tensors` entry. The default is the format
    agentrl's engine server accepts (base64 safetensors, `agentrl.engine.tensors`); a real SGLang
    worker expects its own `MultiprocessingSerializer` payload (CUDA IPC handles, so only for
    engines colocated with the trainer): pass that serializer and its `load_format` there.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        dtype: torch.dtype | None = None,
        bucket_bytes: int = 512 * 2**20,
        serialize: Callable[[dict[str, torch.Tensor]], str] | None = None,
        load_format: str | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(engines, **kw)
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        if serialize is None:
            from agentrl.engine.tensors import serialize_named_tensors

            serialize = serialize_named_tensors
        self.serialize: Callable[[dict[str, torch.Tensor]], str] = serialize
        self.load_format = load_format

    def buckets(self, model: Any) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in _named_tensors(model, self.dtype):
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += nbytes
        if bucket:
            yield bucket

    async def push(self, model: Any, version: int) -> None:
        extra = {"load_format": self.load_format} if self.load_format is not None else {}
        for bucket in self.buckets(model):
            payload = await asyncio.to_thread(self.serialize, dict(bucket))
            failures = await self._each(
                "update_weights(serialized_named_tensors)",
                lambda e, p=payload: e.update_weights(
                    serialized_named_tensors=[p], weight_version=version, **extra
                ),
            )
            if failures:
                raise failures[0]
