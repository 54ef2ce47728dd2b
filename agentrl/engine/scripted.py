"""`ScriptedEngine`: an in-memory `Engine` that answers each turn of a session with the next scripted
text, tokenized with a real tokenizer and closed with its eos token. It drives a task's reference
solution through the real agent loop (SFT warm-start trajectories, `agentrl episode run --engine
scripted`) and gives tests exact, known outputs. Its control plane (pause, resume, weight versions)
behaves as a server's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
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


class PauseGate:
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


class InMemoryControl(Engine):
    """The control plane both fakes share, as strict as SGLang where it matters: a cache flush (on
    its own or requested by an update) fails while a request is in flight (0.5.16
    `Scheduler.flush_cache`), and updates are typed. `updates` records every update applied."""

    _gate: PauseGate
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


class ScriptedEngine(InMemoryControl):
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
        self._gate = PauseGate()
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
