"""The Engine seam. Data plane: `generate`. Control plane: pause, resume, flush_cache,
update_weights, health. Backends: sglang.py (HTTP), local.py (transformers), openai.py (eval).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import InfraError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
        }
        if self.stop:
            d["stop"] = list(self.stop)
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        return d


@dataclass(frozen=True)
class Generation:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class EngineError(InfraError):
    """The engine could not serve a request (unavailable, timeout, 5xx)."""

    cause = "engine"


class EngineAborted(EngineError):
    """Generation was aborted (e.g. for a weight update); the caller may retry the turn."""

    cause = "engine_abort"


class EngineBadRequest(EngineError):
    """The request itself is invalid (empty or too long input, bad sampling parameters, unknown
    weight names): retrying it unchanged will fail again. SGLang answers these with HTTP 400."""

    cause = "engine_bad_request"


class Engine(abc.ABC):
    @abc.abstractmethod
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation: ...

    async def pause(self, *, mode: str = "in_place") -> None:  # noqa: B027
        """Stop admitting generation; `mode` "abort" aborts in-flight requests."""

    async def resume(self) -> None:  # noqa: B027
        """Admit generation again."""

    async def flush_cache(self) -> None:  # noqa: B027
        """Drop the prefix cache (after a weight change)."""

    async def update_weights(self, **kwargs: Any) -> None:
        raise EngineError(f"{type(self).__name__} does not support weight updates", cause="engine_control")

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:  # noqa: B027
        """Release connections."""
