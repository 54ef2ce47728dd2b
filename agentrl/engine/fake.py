"""In-memory engines implementing the `Engine` protocol, for tests and scripted runs.

- `ScriptedEngine` answers each turn of a session with the next scripted text, tokenized with a
  real tokenizer and closed with its eos token: it drives bundled-task solutions through the real
  agent loop, and gives tests exact, known outputs.
- `FakeEngine` produces seeded pseudo-random tokens and injects faults (bursts of unavailability,
  random failures, aborts, per-token latency) for rollout tests.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.engine.base import (
    PAUSE_MODES,
    DiskWeights,
    DistributedWeights,
    Engine,
    EngineBadRequest,
    EngineError,
    Generation,
    PauseMode,
    SamplingParams,
    TensorWeights,
    WeightUpdate,
)

Script = Sequence[str] | Callable[[str | None, int, list[int]], str]


class _PauseGate:
    """Shared pause/abort behaviour: requests wait while paused; "abort" ends in-flight ones."""

    def __init__(self) -> None:
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._generation = 0  # bumped by every abort-mode pause
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def enter(self) -> int:
        await self._resumed.wait()
        self._in_flight += 1
        self._idle.clear()
        return self._generation

    def leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def aborted(self, ticket: int) -> bool:
        return ticket != self._generation

    async def wait_running(self) -> None:
        await self._resumed.wait()

    @property
    def busy(self) -> bool:
        return self._in_flight > 0

    def abort_all(self) -> None:
        self._generation += 1

    async def pause(self, mode: str, timeout: float) -> None:
        if mode not in PAUSE_MODES:
            raise EngineBadRequest(f"pause mode {mode!r}: use 'abort', 'retract' or 'in_place'")
        self._resumed.clear()
        if mode == "abort":
            self._generation += 1
            async with asyncio.timeout(timeout):
                await self._idle.wait()

    def resume(self) -> None:
        self._resumed.set()


class _FakeControl(Engine):
    """The control plane both fakes share, as strict as SGLang where it matters: a cache flush (on
    its own or requested by an update) fails while a request is in flight (0.5.16
    `Scheduler.flush_cache`), and updates are typed. `updates` records every update applied."""

    _gate: _PauseGate
    updates: list[WeightUpdate]

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._gate.pause(mode, timeout=60.0)

    async def resume(self) -> None:
        self._gate.resume()

    async def flush_cache(self) -> None:
        if self._gate.busy:
            raise EngineError(
                f"{type(self).__name__}: flush_cache refused while requests are in flight (SGLang "
                "0.5.16 Scheduler.flush_cache); pause with mode='abort' first",
                cause="engine_flush_busy",
            )

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        # Fake requests carry no rid, so only abort_all has an effect (an unknown rid is ignored,
        # as SGLang ignores it).
        if abort_all:
            self._gate.abort_all()

    async def update_weights(
        self, update: WeightUpdate, *, weight_version: int, flush_cache: bool = False
    ) -> None:
        if not isinstance(update, DiskWeights | TensorWeights | DistributedWeights):
            raise EngineBadRequest(
                f"update_weights takes DiskWeights, TensorWeights or DistributedWeights, not {update!r}"
            )
        if flush_cache:
            await self.flush_cache()
        self.updates.append(update)
        self.weight_version = int(weight_version)


class ScriptedEngine(_FakeControl):
    """Answers turn k of a session with `script[k]` (or `script(session_id, k, input_ids)`).

    Output ids are `tokenizer.encode(text)` plus the eos id (finish "stop"), cut to
    `max_new_tokens` (finish "length"); every log-prob is `logprob`. `calls` records
    `(session_id, input_ids)` of each request. Running past the script raises `EngineError`.
    """

    def __init__(
        self,
        script: Script,
        tokenizer: Any,
        *,
        logprob: float = -0.5,
        weight_version: int = 0,
        eos_id: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.logprob = logprob
        self.weight_version = weight_version
        eos = eos_id if eos_id is not None else getattr(tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise ValueError("ScriptedEngine needs an eos id: pass eos_id= or a tokenizer with eos_token_id")
        self.eos_id = eos
        self.calls: list[tuple[str | None, list[int]]] = []
        self._turns: dict[str | None, int] = {}
        self._gate = _PauseGate()
        self.updates = []

    def _text(self, session_id: str | None, input_ids: list[int]) -> str:
        turn = self._turns.get(session_id, 0)
        self._turns[session_id] = turn + 1
        if callable(self.script):
            return self.script(session_id, turn, input_ids)
        if turn >= len(self.script):
            raise EngineError(
                f"ScriptedEngine: session {session_id!r} asked for turn {turn + 1} but the script has "
                f"{len(self.script)} turns",
                cause="script_exhausted",
            )
        return self.script[turn]

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        if not input_ids:
            raise EngineBadRequest("input_ids cannot be empty.")
        await self._gate.enter()
        try:
            self.calls.append((session_id, list(input_ids)))
            text = self._text(session_id, list(input_ids))
            ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos_id]
            finish = "stop"
            if len(ids) > sampling.max_new_tokens:
                ids, finish = ids[: sampling.max_new_tokens], "length"
            return Generation(ids, [self.logprob] * len(ids), finish, self.weight_version, text=text)
        finally:
            self._gate.leave()


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


class FakeEngine(_FakeControl):
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
        self._gate = _PauseGate()
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
