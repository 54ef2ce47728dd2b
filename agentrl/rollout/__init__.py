"""Rollout: the asynchronous producer of GRPO groups (manager), the buffer the trainer reads,
per-step metrics, and a fault-injecting simulated runner for tests and benchmarks."""

from agentrl.rollout.buffer import Buffer, BufferError, BufferTimeout, Group, RolloutFinished
from agentrl.rollout.manager import (
    ControlPlane,
    EpisodeRunner,
    RolloutConfig,
    RolloutError,
    RolloutManager,
)
from agentrl.rollout.metrics import MetricsTracker, StepMetrics, render
from agentrl.rollout.source import Prompt, PromptSource, PromptSourceError

__all__ = [
    "Buffer",
    "BufferError",
    "BufferTimeout",
    "ControlPlane",
    "EpisodeRunner",
    "Group",
    "MetricsTracker",
    "Prompt",
    "PromptSource",
    "PromptSourceError",
    "RolloutConfig",
    "RolloutError",
    "RolloutFinished",
    "RolloutManager",
    "StepMetrics",
    "render",
]
