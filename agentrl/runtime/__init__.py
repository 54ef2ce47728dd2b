"""The runtime: the training loop as library code and the typed run configuration.

cfg = resolve(RunConfig, defaults=..., config_file=..., overrides=["trainer.lr=3e-5"])
parts = build_parts(cfg)          # environment, engine, trainer, weight transport
result = asyncio.run(train(cfg, parts))
"""

from __future__ import annotations

import importlib
from typing import Any

from agentrl.runtime.config import ConfigError, RunConfig, apply_overrides, resolve

# The loop loads on first use: it needs torch (the `local` extra), the configuration does not
# (`agentrl train run --dry-run` resolves and prints a run's settings without it).
_LOOP = ("RunParts", "RunResult", "WeightTransport", "close_parts", "run_eval", "sync_weights", "train")


def __getattr__(name: str) -> Any:
    if name in _LOOP:
        return getattr(importlib.import_module("agentrl.runtime.loop"), name)
    raise AttributeError(f"module 'agentrl.runtime' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "RunConfig",
    "RunParts",
    "RunResult",
    "WeightTransport",
    "apply_overrides",
    "close_parts",
    "resolve",
    "run_eval",
    "sync_weights",
    "train",
]
