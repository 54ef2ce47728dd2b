"""LoRA adapters in an engine, as SGLang serves them (`--enable-lora`, `/load_lora_adapter`,
`/unload_lora_adapter`, a request's `lora_path` naming a loaded adapter), for `LocalEngine` and
`agentrl engine serve`.

An adapter is a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`, what
`peft`'s `save_pretrained` writes and SGLang loads). `LoraPool` keeps each loaded adapter as its
per-module updates (alpha / r) B A and serves one adapter per batch: before a batch it folds that
adapter's updates into the projection weights (the base weights kept aside), which computes what
SGLang's unmerged LoRA kernels compute, up to float rounding. A request without an adapter runs on
the base weights. The error texts of the refusals are SGLang's where it has them
(`managers/tokenizer_manager.py`, `lora/lora_manager.py`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch (the `local` extra) loads with the first adapter: a plain install imports this
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class AdapterFileError(ValueError):
    """A directory that is not a PEFT LoRA adapter, or one this model cannot take."""


def read_adapter(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT LoRA adapter directory, or `AdapterFileError`
    saying what is missing."""
    from safetensors.torch import load_file

    d = Path(directory)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (d / name).is_file():
            raise AdapterFileError(f"{d} is not a LoRA adapter directory: no {name}")
    config = json.loads((d / ADAPTER_CONFIG).read_text())
    if str(config.get("peft_type", "")).upper() not in ("LORA", "PEFTTYPE.LORA"):
        raise AdapterFileError(f"{d}: peft_type {config.get('peft_type')!r}; only LoRA adapters load")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in config:
            raise AdapterFileError(f"{d}/{ADAPTER_CONFIG} has no {key!r}")
    return config, load_file(str(d / ADAPTER_WEIGHTS))


def adapter_updates(
    model: Any, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *, max_rank: int | None = None
) -> dict[str, torch.Tensor]:
    """module name -> its weight update scale B A, checked against `model` (every target a Linear
    module of matching shape)."""
    import torch

    r = int(config["r"])
    if max_rank is not None and r > max_rank:
        raise AdapterFileError(f"LoRA rank {r} exceeds the server's --max-lora-rank {max_rank}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterFileError("per-module ranks (rank_pattern / alpha_pattern) are not supported here")
    if config.get("use_dora"):
        raise AdapterFileError("DoRA adapters are not supported")
    alpha = float(config["lora_alpha"])
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if not key.startswith(_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterFileError(f"unexpected tensor {key!r} in the adapter (LoRA A / B weights only)")
        module, _, kind = key[len(_PREFIX) :].rpartition(".lora_")
        pairs.setdefault(module, {})[kind.split(".")[0]] = t
    updates: dict[str, torch.Tensor] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterFileError(f"{module}: the adapter has lora_{'A' if 'A' in ab else 'B'} only")
        try:
            target = model.get_submodule(module)
        except AttributeError:
            raise AdapterFileError(f"the adapter targets {module}, which this model does not have") from None
        weight = getattr(target, "weight", None)
        if not isinstance(target, torch.nn.Linear) or weight is None:
            raise AdapterFileError(f"the adapter targets {module}, which is not a Linear layer here")
        a, b = ab["A"].float(), ab["B"].float()
        if a.shape[0] != r or b.shape[1] != r or (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise AdapterFileError(
                f"{module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not make a rank-{r} update of "
                f"its {tuple(weight.shape)} weight"
            )
        updates[module] = (scale * b @ a).to(weight.device)
    if not updates:
        raise AdapterFileError("the adapter holds no LoRA weights")
    return updates


class LoraPool:
    """Adapters loaded by name into one model; `activate(name)` makes the model compute with that
    adapter (None: the base weights). Call from the thread that runs the model."""

    def __init__(self, model: Any, *, max_rank: int | None = None, max_loaded: int | None = None) -> None:
        self.model = model
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.paths: dict[str, str] = {}
        self.active: str | None = None
        self._base: dict[str, torch.Tensor] = {}  # module -> base weight, while an adapter is folded in

    def load(self, name: str, path: str) -> None:
        if not name:
            raise AdapterFileError("lora_name must not be empty")
        if name in self.adapters:
            raise AdapterFileError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise AdapterFileError(
                f"cannot load LoRA adapter {name}: {len(self.adapters)} adapters are loaded, the "
                f"server's --max-loaded-loras is {self.max_loaded}; unload one first"
            )
        config, tensors = read_adapter(path)
        self.adapters[name] = adapter_updates(self.model, config, tensors, max_rank=self.max_rank)
        self.paths[name] = str(path)

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterFileError(f"LoRA adapter {name} is not loaded")
        if self.active == name:
            self.activate(None)
        del self.adapters[name]
        del self.paths[name]

    def check(self, name: str | None) -> None:
        """Refuse a request naming an adapter that is not loaded."""
        if name is not None and name not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise AdapterFileError(f"LoRA adapter '{name}' is not loaded (loaded: {loaded})")

    def activate(self, name: str | None) -> None:
        import torch

        if name == self.active:
            return
        with torch.no_grad():
            for module, base in self._base.items():  # back to the base weights
                self.model.get_submodule(module).weight.copy_(base)
            self._base.clear()
            self.active = None
            if name is None:
                return
            for module, update in self.adapters[name].items():
                weight = self.model.get_submodule(module).weight
                self._base[module] = weight.detach().clone()
                weight.add_(update.to(weight.dtype))
        self.active = name

    def without_adapter(self) -> str | None:
        """Fold the active adapter out (before a base-weight load); returns it for `activate`."""
        name = self.active
        self.activate(None)
        return name
