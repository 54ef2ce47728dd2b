"""A simulated episode runner with fault injection, for the rollout tests and benchmark.

Time is the event loop's clock: real time on a normal loop (latencies are short), so the
manager's timeouts, cancellation and slot accounting run exactly as in production; or simulated
time under `run_virtual_time`, where the loop jumps to the next timer whenever nothing is ready
(CPU work takes no simulated time: a scheduling study immune to a busy machine). The pieces
mirror the production seams:

- `SimEngine`: data plane (`generate`, latency per token, bursts of 503s) and control plane
  (`pause(mode)` / `resume()` / `weight_version`), with "in_place" (pause waits for in-flight
  turns to finish on the old weights) and "abort" (in-flight turns raise EngineAborted).
- `SimSandboxProvider`: opens and closes `SimSandbox`es and counts the live ones (leak checks);
  create failures, transport errors mid-episode and hangs are injected here.
- `SimulatedRunner`: the agent loop: lognormal (sigma 1) number of turns, a generate and an exec
  per turn, then the verifier (latency, injected timeouts). Infra failures raise the same
  InfraError subclasses the real episode runner raises; an aborted turn is retried on the new
  weights and every turn's weight version is kept in the Sample.
"""

from __future__ import annotations

import asyncio
import math
import random
import selectors
import zlib
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentrl.engine.base import EngineAborted, EngineError
from agentrl.episode.sample import Episode, Sample, Status
from agentrl.errors import InfraError

T = TypeVar("T")


def clock() -> float:
    """The running event loop's clock (simulated seconds under `run_virtual_time`)."""
    return asyncio.get_running_loop().time()


class _JumpingSelector(selectors.DefaultSelector):
    """Polls real file descriptors without blocking; where the loop would block until its next
    timer, it moves the loop's clock there instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0 if timeout is not None else None)
        if not events and timeout is not None and timeout > 0:
            self._loop.advance(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a simulated clock: sleeps and timeouts complete as soon as nothing else
    can run, with `time()` moved forward by exactly their length."""

    def __init__(self) -> None:
        self._virtual_now = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds


def run_virtual_time(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a VirtualTimeLoop."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)


@dataclass
class SimFaults:
    create_failure: float = 0.0  # per sandbox create
    transport_error: float = 0.0  # per episode, at a random turn
    engine_burst_rate: float = 0.0  # per generate call: a burst of 503s starts
    engine_burst_s: float = 0.0  # how long every generate call answers 503 once a burst starts
    verifier_timeout: float = 0.0  # per episode
    hang: float = 0.0  # per episode: one exec never returns (only the episode cap ends it)
    policy_failure: float = 0.0  # per episode: the agent gives up (a real outcome, reward 0)


@dataclass
class SimWorkload:
    """Latencies in seconds. Turns per episode ~ lognormal(log(median_turns), turns_sigma)."""

    engine_per_token_s: float = 0.0001
    tokens_per_turn: int = 32  # mean; each turn draws uniformly from +-`jitter` of it
    jitter: float = 0.5
    obs_tokens_per_turn: int = 16
    prompt_tokens: int = 16
    sandbox_create_s: float = 0.002
    sandbox_exec_s: float = 0.002
    verifier_s: float = 0.002
    median_turns: float = 3.0
    turns_sigma: float = 1.0
    max_turns: int = 30  # longer episodes are truncated (and still verified)
    engine_retries: int = 2  # a 503 is retried this many times inside the episode
    engine_retry_backoff_s: float = 0.005

    def turn_s(self) -> float:
        return self.engine_per_token_s * self.tokens_per_turn + self.sandbox_exec_s

    def mean_episode_s(self) -> float:
        """Expected nominal duration (no faults), from the capped lognormal turn count."""
        mu, sigma = math.log(self.median_turns), self.turns_sigma
        # E[min(ceil(X), cap)] by summing P(ceil(X) >= k) = P(X > k - 1).
        mean_turns = sum(
            1.0 if k == 1 else 0.5 * math.erfc((math.log(k - 1) - mu) / (sigma * math.sqrt(2)))
            for k in range(1, self.max_turns + 1)
        )
        return self.sandbox_create_s + mean_turns * self.turn_s() + self.verifier_s


class SimEngine:
    """Simulated inference engine: latency per token, 503 bursts, pause / resume, versions."""

    def __init__(self, workload: SimWorkload, faults: SimFaults | None = None, *, seed: int = 0) -> None:
        self.workload = workload
        self.faults = faults or SimFaults()
        self.rng = random.Random(seed)
        self.weight_version = 0
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight: set[asyncio.Future[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._burst_until = 0.0
        self.calls = 0
        self.rejected_503 = 0
        self.aborted = 0
        self.pauses: list[str] = []
        self.flushes = 0

    async def generate(self, n_tokens: int) -> int:
        """Generate `n_tokens`; returns the weight version they were generated with."""
        await self._open.wait()
        self.calls += 1
        now = asyncio.get_running_loop().time()
        if now < self._burst_until or (
            self.faults.engine_burst_rate and self.rng.random() < self.faults.engine_burst_rate
        ):
            if now >= self._burst_until:
                self._burst_until = now + self.faults.engine_burst_s
            self.rejected_503 += 1
            raise EngineError("engine answered 503 Service Unavailable", cause="engine_unavailable")
        version = self.weight_version
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(n_tokens * self.workload.engine_per_token_s, _resolve, fut)
        self._in_flight.add(fut)
        self._idle.clear()
        try:
            await fut
        finally:
            handle.cancel()
            self._in_flight.discard(fut)
            if not self._in_flight:
                self._idle.set()
        return version

    async def pause(self, mode: str = "abort") -> None:
        self.pauses.append(mode)
        self._open.clear()
        if mode == "abort":
            for fut in list(self._in_flight):
                if not fut.done():
                    self.aborted += 1
                    fut.set_exception(EngineAborted("generation aborted for a weight update"))
        await self._idle.wait()

    async def resume(self) -> None:
        self._open.set()

    async def flush_cache(self) -> None:
        if not self._idle.is_set():
            raise EngineError("flush_cache while requests run (SGLang refuses it)", cause="engine_control")
        self.flushes += 1

    async def set_weights(self, version: int) -> None:
        if not self._idle.is_set() or self._open.is_set():
            raise EngineError(
                "weights changed while generating: pause the engine first", cause="engine_control"
            )
        self.weight_version = version


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class SimSandbox:
    def __init__(self, provider: SimSandboxProvider, sandbox_id: str) -> None:
        self.provider = provider
        self.sandbox_id = sandbox_id

    async def exec(self, seconds: float, *, hang: bool = False, transport_error: bool = False) -> None:
        if hang:
            await asyncio.Event().wait()  # never set: a stuck transport; the episode cap ends it
        await asyncio.sleep(seconds)
        if transport_error:
            raise InfraError(f"connection to {self.sandbox_id} reset during exec", cause="sandbox_transport")

    async def close(self) -> None:
        self.provider._live.discard(self.sandbox_id)
        self.provider.closed += 1


class SimSandboxProvider:
    """Opens SimSandboxes; `live_sandboxes()` counts those not closed."""

    def __init__(self, workload: SimWorkload, faults: SimFaults | None = None, *, seed: int = 0) -> None:
        self.workload = workload
        self.faults = faults or SimFaults()
        self.rng = random.Random(seed)
        self._live: set[str] = set()
        self.created = 0
        self.closed = 0
        self.create_failures = 0

    async def create(self, run_id: str) -> SimSandbox:
        await asyncio.sleep(self.workload.sandbox_create_s)
        if self.faults.create_failure and self.rng.random() < self.faults.create_failure:
            self.create_failures += 1
            raise InfraError(f"sandbox for {run_id} failed to start (injected)", cause="sandbox_create")
        self.created += 1
        sandbox = SimSandbox(self, f"sim-{self.created}")
        self._live.add(sandbox.sandbox_id)
        return sandbox

    def live_sandboxes(self) -> int:
        return len(self._live)


@dataclass
class SimulatedRunner:
    """An `EpisodeRunner` over SimEngine + SimSandboxProvider.

    A row's `metadata.p_pass` (default 0.5) is the chance an episode earns reward 1.0. Randomness
    is a pure function of (seed, group, sample, attempt), so runs are reproducible.
    """

    engine: SimEngine
    provider: SimSandboxProvider
    workload: SimWorkload
    faults: SimFaults = field(default_factory=SimFaults)
    seed: int = 0
    runs: int = 0
    turns: int = 0
    raised: dict[str, int] = field(default_factory=dict)
    eval_runs: int = 0

    async def run(
        self,
        row: dict[str, Any],
        *,
        group_id: str,
        sample_index: int,
        attempt: int = 0,
        eval: bool = False,
        seed: int | None = None,
    ) -> Episode:
        self.runs += 1
        self.eval_runs += eval
        try:
            return await self._run(row, group_id, sample_index, attempt, eval)
        except InfraError as exc:
            self.raised[exc.cause] = self.raised.get(exc.cause, 0) + 1
            raise

    async def _run(
        self, row: dict[str, Any], group_id: str, sample_index: int, attempt: int, eval: bool
    ) -> Episode:
        w, f = self.workload, self.faults
        rng = random.Random(zlib.crc32(f"{self.seed}|{group_id}|{sample_index}|{attempt}".encode()))
        n_turns = max(1, math.ceil(rng.lognormvariate(math.log(w.median_turns), w.turns_sigma)))
        truncated = n_turns > w.max_turns
        n_turns = min(n_turns, w.max_turns)
        transport_turn = rng.randrange(n_turns) if rng.random() < f.transport_error else -1
        hang_turn = rng.randrange(n_turns) if rng.random() < f.hang else -1
        verifier_timeout = rng.random() < f.verifier_timeout
        policy_fail_turn = rng.randrange(n_turns) if rng.random() < f.policy_failure else -1
        p_pass = float((row.get("metadata") or {}).get("p_pass", 0.5))
        passed = rng.random() < p_pass
        span = round(w.tokens_per_turn * w.jitter)
        turn_tokens = [
            rng.randint(w.tokens_per_turn - span, w.tokens_per_turn + span) or 1 for _ in range(n_turns)
        ]
        timings = {"engine_s": 0.0, "sandbox_s": 0.0, "verifier_s": 0.0}
        versions: list[int] = []
        t0 = clock()
        sandbox = await self.provider.create(f"{group_id}/{sample_index}/{attempt}")
        timings["sandbox_s"] += clock() - t0
        try:
            for turn in range(n_turns):
                t = clock()
                versions.append(await self._generate(turn_tokens[turn]))
                timings["engine_s"] += clock() - t
                self.turns += 1
                if turn == policy_fail_turn:
                    n_turns = turn + 1
                    break
                t = clock()
                await sandbox.exec(
                    w.sandbox_exec_s, hang=turn == hang_turn, transport_error=turn == transport_turn
                )
                timings["sandbox_s"] += clock() - t
            t = clock()
            await asyncio.sleep(w.verifier_s)
            timings["verifier_s"] += clock() - t
            if verifier_timeout:
                raise InfraError(f"verifier of {group_id} timed out (injected)", cause="verifier_timeout")
        finally:
            await sandbox.close()
        if policy_fail_turn >= 0:
            status, reward, end = Status.FAILED_POLICY, 0.0, "gave_up"
        elif truncated:
            status, reward, end = Status.TRUNCATED, 1.0 if passed else 0.0, "max_turns"
        else:
            status, reward, end = Status.COMPLETED, 1.0 if passed else 0.0, "done"
        mask = [m for k in turn_tokens[:n_turns] for m in [1] * k + [0] * w.obs_tokens_per_turn]
        # What the episode would take on an idle machine: the benchmark's Little's-law ideal.
        timings["nominal_s"] = (
            w.sandbox_create_s
            + w.verifier_s
            + n_turns * w.sandbox_exec_s
            + sum(turn_tokens[:n_turns]) * w.engine_per_token_s
        )
        segment = Sample(
            prompt_id=group_id,
            tokens=[1] * (w.prompt_tokens + len(mask)),
            prompt_length=w.prompt_tokens,
            loss_mask=mask,
            rollout_logprobs=[-0.5 if m else 0.0 for m in mask],
            reward=reward,
            status=status,
            end_reason=end,
            sample_index=sample_index,
            weight_versions=versions,
            timings=timings,
        )
        return Episode(
            segments=[segment],
            reward=reward,
            status=status,
            turn_versions=versions,
            end_reason=end,
            prompt_id=group_id,
            sample_index=sample_index,
            timings=timings,
            metadata={"eval": eval, "turns": n_turns},
        )

    async def _generate(self, n_tokens: int) -> int:
        """One turn's generation the way the agent loop does it: a 503 is retried a few times
        with backoff, then raised; an abort (weight update) is retried on the new weights."""
        failures = 0
        while True:
            try:
                return await self.engine.generate(n_tokens)
            except EngineAborted:
                continue
            except EngineError:
                failures += 1
                if failures > self.workload.engine_retries:
                    raise
                await asyncio.sleep(self.workload.engine_retry_backoff_s * failures)
