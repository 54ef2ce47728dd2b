"""The Engine seam. Data plane: `generate`. Control plane: `weight_version`, `pause(mode)`,
`resume`, `flush_cache`, `abort`, typed `update_weights`, `weight_versions`, `health`, `aclose`.

Backends: sglang.py (HTTP client for one SGLang server or a fleet behind a router), local.py
(transformers, in-process), fake.py (tests), openai.py (API models, evaluation only).

Weight updates are typed: `DiskWeights`, `TensorWeights` and `DistributedWeights` are the bodies of
SGLang's `/update_weights_from_disk`, `/update_weights_from_tensor` and
`/update_weights_from_distributed`. Cache flushing is a separate call on purpose: SGLang 0.5.16
asserts that a flush requested by an update succeeded, and a flush fails while any request is
running or queued, which is the state after an `in_place` pause, so the server dies
(`scheduler_components/weight_updater.py`, `Scheduler.flush_cache`). `update_weights` therefore
never flushes unless asked, and the rollout manager flushes only after an `abort` pause.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

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
    """One `/generate` answer. `weight_version` is the version the server reported for the turn.
    `version_mismatch` is set by a fleet client when that version is neither the fleet's version
    when the request was sent nor when the answer came back: the turn was served (or replayed
    after a worker died) by a server on other weights. Never train on such a turn silently."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    version_mismatch: bool = False
    # R3: the experts each token of input + output (all but the last output token) was routed to,
    # [len(input) + len(output) - 1][num_layers][top_k] (-1 on dense layers), when asked for.
    routed_experts: list[list[list[int]]] | None = None


PauseMode = Literal["abort", "in_place", "retract"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "in_place", "retract")


@dataclass(frozen=True)
class DiskWeights:
    """`/update_weights_from_disk`: a model directory every server can read."""

    model_path: str
    load_format: str | None = None


@dataclass(frozen=True)
class TensorWeights:
    """`/update_weights_from_tensor`: `serialized_named_tensors` has one entry per TP rank of the
    server (SGLang's `tp_worker.py` indexes it by `tp_rank`), each a serialized list of
    `(name, tensor)` pairs (`agentrl.engine.tensors.serialize_named_tensors`)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None


@dataclass(frozen=True)
class DistributedWeights:
    """`/update_weights_from_distributed`: the server receives each named tensor, in order, by a
    `broadcast(src=0)` in the group set up by `init_weights_update_group` (the trainer is rank 0)."""

    names: list[str]
    dtypes: list[str]  # torch dtype names without the "torch." prefix, e.g. "bfloat16"
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    # The servers (URLs) that joined `group_name`: only they are sent the update (SGLang asserts
    # the group exists, outside its try block: a server that is not a member would die). Empty:
    # every live server.
    members: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("DistributedWeights: names, dtypes and shapes must have the same length")


@dataclass(frozen=True)
class LoraAdapter:
    """`/load_lora_adapter` + `/update_weight_version`: the servers (started with `--enable-lora`)
    load a PEFT LoRA adapter directory every one of them can read as `name`, and the client's
    requests name it from then on (`lora_path`); the base weights do not move. Adapters older than
    the one before are unloaded (a request paused in place may still run on the previous one)."""

    name: str
    path: str


WeightUpdate = DiskWeights | TensorWeights | DistributedWeights | LoraAdapter


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


class EngineVersionMismatch(EngineError):
    """After a weight update a server reports another weight version than the one requested."""

    cause = "engine_version_mismatch"


class Engine(abc.ABC):
    """An inference engine. `generate` is the data plane; the rest is the control plane that the
    rollout manager drives around weight updates (pause -> [flush] -> update -> check -> resume).
    Control methods an engine does not support raise `EngineError` (cause "engine_control")."""

    _weight_version: int = 0

    @abc.abstractmethod
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation: ...

    @property
    def weight_version(self) -> int:
        """The weight version this engine serves (an HTTP client: the one last confirmed by its
        servers)."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        self._weight_version = int(value)

    def _unsupported(self, what: str) -> EngineError:
        return EngineError(f"{type(self).__name__} does not support {what}", cause="engine_control")

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating. New requests wait (they do not fail) until `resume`. "abort": in-flight
        requests end now with finish_reason "abort" (returns once none is in flight); "in_place":
        they stop where they are and continue after `resume`, on whatever weights are loaded then;
        "retract": as in_place, but the server drops their KV cache and recomputes it."""
        raise self._unsupported("pause")

    async def resume(self) -> None:
        """Admit and continue generation again."""
        raise self._unsupported("resume")

    async def flush_cache(self) -> None:
        """Drop the prefix cache (after a weight change). Fails while requests run or wait, so
        only after an "abort" pause."""
        raise self._unsupported("flush_cache")

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort the request with exactly this id (SGLang 0.5.16 ignores anything but an exact live
        rid), or every request with `abort_all`."""
        raise self._unsupported("abort")

    async def update_weights(
        self, update: WeightUpdate, *, weight_version: int, flush_cache: bool = False
    ) -> None:
        """Load new weights and serve them as `weight_version`. `flush_cache=True` is only safe
        when nothing is running or queued (see the module docstring)."""
        raise self._unsupported("weight updates")

    async def weight_versions(self) -> dict[str, int]:
        """The version each server (or this engine) reports, by server URL or engine name."""
        return {type(self).__name__: self.weight_version}

    async def health(self) -> bool:
        return True

    def can_set_aside(self, n: int) -> bool:
        """Whether `set_aside(n)` can take n servers out and leave at least one serving."""
        return False

    async def set_aside(self, n: int) -> Engine:
        """Take `n` servers out of this engine for a task at the current weight version (an eval
        that must not stop training): they leave routing and every later control call (pause,
        weight updates) until `rejoin`. Returns an engine over those servers alone."""
        raise self._unsupported("setting servers aside")

    async def rejoin(self, aside: Engine) -> None:
        """Give back servers `set_aside` took: they return at the next `pause` (so a weight push,
        which always runs between pause and resume, reaches them whole) and are routed to again
        once an update has put them on this engine's version."""
        raise self._unsupported("setting servers aside")

    async def aclose(self) -> None:  # noqa: B027
        """Release connections."""


@dataclass
class Continued:
    """A response generated to its end across aborted pieces (partial rollouts): the tokens and
    log-probs of every piece, each piece's weight version, the final finish reason, and how many
    pieces a fleet answered under an unexpected weight version."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    version_mismatches: int = 0
    routed_experts: list[list[list[int]]] | None = None  # the last piece's: it covers all before it


async def generate_to_end(
    engine: Engine,
    context_ids: list[int],
    sampling: SamplingParams,
    *,
    session_id: str | None,
    timeout_s: float,
    deadline: float | None = None,
) -> Continued:
    """Generate one response to its end. A piece aborted for a weight update keeps its tokens and
    the response continues from them on the new weights, each piece with its weight version.

    Each piece waits at most `timeout_s`; past it the engine has failed (`EngineError`, cause
    "engine_timeout": an infrastructure failure, never a scored outcome). `deadline` (a
    `time.monotonic()` value) is the caller's own wall clock: when it ends first, `TimeoutError` is
    raised, which the caller scores as its own time limit."""
    ids: list[int] = []
    logps: list[float] = []
    versions: list[int] = []
    mismatches = 0
    finish = "abort"
    routes = None
    while finish == "abort":
        left = sampling.max_new_tokens - len(ids)
        if left <= 0:
            finish = "length"
            break
        wait, by_deadline = timeout_s, False
        if deadline is not None and deadline - time.monotonic() < wait:
            wait, by_deadline = deadline - time.monotonic(), True
        if wait <= 0:
            raise TimeoutError("the wall-clock deadline passed")
        try:
            gen = await asyncio.wait_for(
                engine.generate(
                    context_ids + ids, replace(sampling, max_new_tokens=left), session_id=session_id
                ),
                wait,
            )
        except EngineAborted:
            continue
        except TimeoutError:
            if by_deadline:
                raise
            raise EngineError(f"no generation within {timeout_s:g}s", cause="engine_timeout") from None
        ids += gen.output_ids
        logps += gen.logprobs
        versions.append(gen.weight_version)
        mismatches += int(gen.version_mismatch)
        finish = gen.finish_reason
        routes = gen.routed_experts
    return Continued(ids, logps, versions, finish, mismatches, routes)
