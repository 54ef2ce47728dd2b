"""The runtime: the training loop as library code and the typed run configuration.

cfg = resolve(RunConfig, defaults=..., config_file=..., overrides=["trainer.lr=3e-5"])
parts = build_parts(cfg)          # environment, engine, trainer, weight transport
result = asyncio.run(train(cfg, parts))
"""

from agentrl.runtime.config import ConfigError, RunConfig, apply_overrides, resolve
from agentrl.runtime.loop import (
    RunParts,
    RunResult,
    WeightTransport,
    close_parts,
    run_eval,
    sync_weights,
    train,
)

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
