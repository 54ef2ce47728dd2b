"""`FakeEngine`: seeded pseudo-random tokens with injected faults (bursts of unavailability, random
failures, aborts, per-token latency), for rollout tests and benchmarks."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from agentrl.engine.base import (
    EngineBadRequest,
    EngineError,
    Generation,
    SamplingParams,
)
from agentrl.engine.scripted import InMemoryControl, PauseGate


@dataclass(frozen=True)
class Faults:
    """What `FakeEngine` does wrong, deterministically from its seed.

    error_burst: the first N requests fail with `EngineError` (an engine answering 503).
    error_rate: after the burst, each request fails with this probability.
    abort_rate: a request ends with finish_reason "abort" after half of its tokens.
    latency_per_token_s: sleep per generated token (pause "abort" cuts it short).
    """

    error_burst: int = 0
    error_rate: float = 0.0
    abort_rate: float = 0.0
    latency_per_token_s: float = 0.0


class FakeEngine(InMemoryControl):
    """Seeded pseudo-random tokens in `[first_token, vocab_size)`, eos with probability `eos_rate`
    per token, log-probs in (-5, 0); faults as `Faults` says. Counts requests and failures."""

    def __init__(
        self,
        *,
        vocab_size: int = 1000,
        eos_id: int = 0,
        first_token: int = 10,
        eos_rate: float = 0.05,
        faults: Faults | None = None,
        seed: int = 0,
        weight_version: int = 0,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.first_token = first_token
        self.eos_rate = eos_rate
        self.faults = faults or Faults()
        self.weight_version = weight_version
        self._rng = random.Random(seed)
        self.requests = 0
        self.failures = 0
        self.aborts = 0
        self.tokens = 0  # generated, over all requests
        self._gate = PauseGate()
        self.updates = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        if not input_ids:
            raise EngineBadRequest("input_ids cannot be empty.")
        ticket = await self._gate.enter()
        try:
            self.requests += 1
            f = self.faults
            if self.requests <= f.error_burst or self._rng.random() < f.error_rate:
                self.failures += 1
                raise EngineError("fake engine: HTTP 503 Service Unavailable", cause="engine_unavailable")
            rng = random.Random(self._rng.random() if sampling.seed is None else sampling.seed)
            abort_at = sampling.max_new_tokens // 2 if self._rng.random() < f.abort_rate else None
            stops = {self.eos_id, *sampling.stop_token_ids}
            version = self.weight_version
            ids: list[int] = []
            logps: list[float] = []
            finish = "length"
            for i in range(sampling.max_new_tokens):
                if f.latency_per_token_s:
                    await asyncio.sleep(f.latency_per_token_s)
                if self._gate.aborted(ticket) or i == abort_at:
                    finish = "abort"
                    self.aborts += 1
                    break
                tok = (
                    self.eos_id
                    if rng.random() < self.eos_rate
                    else rng.randrange(self.first_token, self.vocab_size)
                )
                ids.append(tok)
                self.tokens += 1
                logps.append(-5.0 * rng.random())
                if tok in stops:
                    finish = "stop"
                    break
            return Generation(ids, logps, finish, version)
        finally:
            self._gate.leave()
