"""Hugging Face safetensors checkpoints, one tensor at a time.

GLM-5.2 is ~1.5 TB in bf16 over dozens of shards: no process may load it whole, and no rank needs
more than its own pipeline stage, tensor-parallel slice and experts.

- `HFCheckpoint(path)`: a read-only `Mapping[str, Tensor]` over a model directory (the
  `model.safetensors.index.json` weight map, or the directory's safetensors files). Shards are
  opened lazily with `safetensors.safe_open` (only their headers are parsed); a tensor is read on
  access, cast to the dtype asked for; `read_chunk` reads one TP slice of a tensor without reading
  the rest. `names_read` / `bytes_read` record what this process has read.
- `HFCheckpointWriter(out_dir)`: the export direction: (name, tensor) pairs streamed into shards of
  at most `max_shard_bytes` and the index, as `save_pretrained` lays them out.

A missing or corrupt shard, or a tensor the index names that its shard lacks, is a
`HFCheckpointError` that names the file.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from agentrl.errors import AgentRLError

INDEX = "model.safetensors.index.json"
_REDOWNLOAD = "download it again (huggingface_hub.snapshot_download, or copy it from the source)"


class HFCheckpointError(AgentRLError):
    """A Hugging Face checkpoint directory that cannot be read as its index says."""


class HFCheckpoint(Mapping[str, torch.Tensor]):
    """Read-only view of a safetensors checkpoint directory: keys are the tensor names of its files
    (for MoE layers one tensor per expert, `...mlp.experts.{e}.gate_proj.weight`, not transformers'
    stacked in-memory names). Looking a name up reads that one tensor (a copy, not a view of the
    file), cast to `dtype` when it is floating point; `in`, `len` and iteration read nothing.
    At most `max_open` shard files are held open (mapped) at a time."""

    def __init__(self, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, max_open: int = 4):
        self.path = Path(path)
        self.dtype = dtype
        self.max_open = max(1, max_open)
        self.weight_map = _weight_map(self.path)
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._checked: set[str] = set()
        self.names_read: set[str] = set()
        self.bytes_read = 0

    # -- Mapping ---------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> torch.Tensor:
        handle = self._handle(name)
        return self._cast(name, self._guard(name, lambda: handle.get_tensor(name)))

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def __iter__(self) -> Iterator[str]:
        return iter(self.weight_map)

    def __len__(self) -> int:
        return len(self.weight_map)

    # -- partial reads and metadata --------------------------------------------------------------

    def read_chunk(self, name: str, dim: int, index: int, parts: int) -> torch.Tensor:
        """`self[name].chunk(parts, dim)[index]`, reading only that chunk from the file."""
        handle = self._handle(name)
        sl = handle.get_slice(name)
        size = sl.get_shape()[dim]
        step = -(-size // parts)  # torch.chunk's chunk size
        lo, hi = min(index * step, size), min((index + 1) * step, size)
        key = tuple(slice(None) for _ in range(dim)) + (slice(lo, hi),)
        return self._cast(name, self._guard(name, lambda: sl[key]))

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the shard's header (nothing read)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def close(self) -> None:
        while self._open:
            _, handle = self._open.popitem()
            handle.__exit__(None, None, None)

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------

    def _handle(self, name: str) -> Any:
        if name not in self.weight_map:
            raise KeyError(name)
        file = self.weight_map[name]
        if file in self._open:
            self._open.move_to_end(file)
            return self._open[file]
        from safetensors import safe_open

        path = self.path / file
        if not path.is_file():
            raise HFCheckpointError(f"{path}: shard missing ({INDEX} places {name} there); {_REDOWNLOAD}")
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises SafetensorError for a truncated / corrupt header
            raise HFCheckpointError(
                f"{path}: not a readable safetensors file ({exc}); {_REDOWNLOAD}"
            ) from exc
        if file not in self._checked:
            have = set(handle.keys())
            absent = sorted(n for n, f in self.weight_map.items() if f == file and n not in have)
            if absent:
                handle.__exit__(None, None, None)
                raise HFCheckpointError(
                    f"{path} lacks {len(absent)} tensor(s) that {INDEX} places there, e.g. "
                    f"{', '.join(absent[:3])}; the shard and the index do not belong together: {_REDOWNLOAD}"
                )
            self._checked.add(file)
        self._open[file] = handle
        while len(self._open) > self.max_open:
            _, old = self._open.popitem(last=False)
            old.__exit__(None, None, None)
        return handle

    def _guard(self, name: str, read: Any) -> torch.Tensor:
        try:
            return read()
        except Exception as exc:
            raise HFCheckpointError(
                f"{self.path / self.weight_map[name]}: cannot read {name} ({exc}); {_REDOWNLOAD}"
            ) from exc

    def _cast(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.names_read.add(name)
        self.bytes_read += t.numel() * t.element_size()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t


def _weight_map(path: Path) -> dict[str, str]:
    if not path.is_dir():
        raise HFCheckpointError(f"{path} is not a directory: give a Hugging Face model directory")
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise HFCheckpointError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFCheckpointError(f"{index}: weight_map is empty or not an object")
        return {str(k): str(v) for k, v in weight_map.items()}
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{path}: no {INDEX} and no *.safetensors files")
    from safetensors import safe_open

    out: dict[str, str] = {}
    for file in files:  # no index: read each file's header (a few KB) for its names
        try:
            with safe_open(str(path / file), framework="pt") as h:
                names = list(h.keys())
        except Exception as exc:
            raise HFCheckpointError(
                f"{path / file}: not a readable safetensors file ({exc}); {_REDOWNLOAD}"
            ) from exc
        for n in names:
            if n in out:
                raise HFCheckpointError(f"{path}: {n} is in both {out[n]} and {file}; write an {INDEX}")
            out[n] = file
    return out


class HFCheckpointWriter:
    """Streams (name, tensor) pairs into `out_dir` as safetensors shards of at most
    `max_shard_bytes` each (a larger tensor gets a shard of its own) plus `model.safetensors.index.json`;
    holds at most one shard's tensors in memory. Shards get their final names
    (`model-00001-of-00003.safetensors`) in `close`, when their count is known; an error inside
    `with` removes what was written."""

    def __init__(
        self, out_dir: str | os.PathLike[str], *, max_shard_bytes: int = 5 * 2**30, prefix: str = "model"
    ) -> None:
        if max_shard_bytes <= 0:
            raise ValueError("max_shard_bytes must be positive")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.prefix = prefix
        self._tag = uuid.uuid4().hex[:8]
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._seen: set[str] = set()
        self.total_bytes = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("HFCheckpointWriter is closed")
        if name in self._seen:
            raise HFCheckpointError(f"{name} written twice to {self.out_dir}")
        self._seen.add(name)
        # A private contiguous CPU copy: views (one expert of a stacked tensor) share storage, which
        # safetensors refuses, and the caller may reuse its buffer.
        t = tensor.detach().to("cpu").contiguous().clone()
        size = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += size
        self.total_bytes += size

    def add_all(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            self.add(name, tensor)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f".{self.prefix}-{self._tag}-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> dict[str, Any]:
        """Write the last shard, name the shards, write the index; returns the index."""
        if self._closed:
            raise RuntimeError("HFCheckpointWriter is closed")
        if self._pending:
            self._flush()
        self._closed = True
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(self._shards):
            final = f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return index

    def abort(self) -> None:
        """Remove the shards written so far."""
        self._closed = True
        for tmp, _ in self._shards:
            tmp.unlink(missing_ok=True)
        self._pending = {}

    def __enter__(self) -> HFCheckpointWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()
