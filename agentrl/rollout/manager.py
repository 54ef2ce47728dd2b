"""RolloutManager: a fully asynchronous producer of GRPO groups with staleness-bounded admission.

Shape: one producer task owns a TaskGroup; each running sample is one child task that calls
`EpisodeRunner.run` (one episode; for terminal tasks a fresh sandbox per attempt, owned and closed
by the runner) under a wall-clock cap. The manager knows nothing of what an episode is made of: the
environment's runner turns a prompt row into an `Episode`. A finished sample frees its slot at once and wakes the producer, which admits
the next sample: the next index of the open group, else the first of a new prompt. A failed
attempt is retried inside its own task, so it keeps its slot.

Admission (AReaL's rule). Let B = batch_size, s = max_staleness, k = weight updates since start
(`control.weight_version` - its value at start), C = samples consumed by the trainer, R = samples
running, D = samples done and not consumed (in the buffer or in unfinished groups). A sample
starts only while C + R + D + 1 <= (s + k + 1) * B. Since the trainer takes B samples per
version, at most (s + 1) batches' worth of samples exist beyond what the trainer has taken, so
with in-order completion every sample is trained at most s versions after it started.

Completion is not in order (episode lengths are heavy-tailed): a long episode can be overtaken
by later ones, which the count rule alone cannot bound. Two guards make the bound strict. After
each weight update, a group that can no longer be trained within the bound (its oldest start or
turn version is more than s behind the new version) is cancelled at once: its running episodes
are cancelled (their runners close their sandboxes), its prompt is re-queued, and it is counted
(`stale_cancelled`), so no compute goes on after it is known to be wasted. And the buffer checks
again at consumption (`stale_groups`). The admission rule keeps both rare.

Failures. `run` returns an Episode for completed, truncated and policy-failed episodes (real
outcomes with their reward) and raises `InfraError` for infrastructure failures; those are
counted by `cause` and retried in a fresh attempt, up to `max_attempts` per sample. Any other
exception out of a runner (a bug, or something an episode provoked) is caught per episode, logged
with its traceback, counted under the cause `internal_error` and retried the same way: one episode
never stops the run. A sample that exhausts its budget is logged at ERROR, counted
(`samples_exhausted`) and stored in its group as a FAILED_INFRA episode without a reward; the group
is still emitted, flagged `complete=False`, and the trainer skips that episode. No group is dropped
for a failed sample, and no infrastructure failure becomes a reward.

Weight updates: `update_weights(sync_fn, mode)` is the one pause/resume wrapper of a weight sync. It
closes admission, pauses the engines, flushes their caches after an "abort" pause (never after
"in_place" or "retract": requests are still queued then, and a real SGLang 0.5.16 scheduler dies on
a flush that fails during a weight update), runs `sync_fn`, checks that the version moved by exactly
one, and always resumes the engines and admission. Modes:
- "abort": in-flight generations return early (finish reason abort) and the agent loop re-sends
  that turn on the new weights; every turn records the version it was generated with.
- "in_place": in-flight generations are held and continue after the load with the NEW weights on
  the old KV cache (SGLang behaves so); the response reports the new version, which is the one the
  turn records, so the staleness bound and the importance weights (TIS) see the newer version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import ConfigDict

from agentrl.episode.sample import Episode, Status
from agentrl.errors import AgentRLError, InfraError, InputError
from agentrl.rollout.buffer import Buffer, Group
from agentrl.rollout.source import Prompt, PromptSource

log = logging.getLogger("agentrl.rollout")

PauseMode = Literal["in_place", "abort", "retract"]
BAD_INPUT = "bad_input"  # the cause of a row that cannot be run (`InputError`): never retried


class RolloutError(AgentRLError):
    """The rollout manager was misconfigured or used out of order."""


class EpisodeRunner(Protocol):
    """One prompt row -> one `Episode`; raises InfraError (with `.cause`) on infrastructure failure.
    The runner owns whatever it creates (a sandbox) and closes it, also when cancelled. `seed` fixes
    the sampling seed (evaluations); `eval` selects the runner's eval settings."""

    async def run(
        self,
        row: dict[str, Any],
        *,
        group_id: str,
        sample_index: int,
        attempt: int = 0,
        eval: bool = False,
        seed: int | None = None,
    ) -> Episode: ...


class ControlPlane(Protocol):
    """The engines' control plane as the manager needs it (`agentrl.engine.base.Engine` has it)."""

    @property
    def weight_version(self) -> int: ...

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def flush_cache(self) -> None: ...


@dataclass
class RolloutConfig:
    # Unknown keys in a run configuration are errors, not silently dropped settings.
    __pydantic_config__ = ConfigDict(extra="forbid")

    batch_size: int  # samples per trainer step; a multiple of n_samples_per_prompt
    n_samples_per_prompt: int = 8
    max_in_flight: int = 64
    max_staleness: int | None = 1  # None: no bound (pure throughput runs)
    max_attempts: int = 3  # per sample, counting the first
    retry_backoff_s: float = 0.5  # doubled per attempt
    episode_timeout_s: float = 1800.0
    control_timeout_s: float = 300.0  # engine pause / resume
    sync_timeout_s: float = 1800.0  # one weight sync
    shutdown_timeout_s: float = 60.0  # for runners to close their sandboxes after cancel
    dynamic_filter: bool = False  # drop groups whose rewards are all equal (DAPO)
    # With the filter on: this many dropped groups in a row means the policy gets no signal at all
    # (every task always or never solved); the trainer's get_batch then fails instead of waiting.
    max_filtered_in_a_row: int = 64
    # With the filter on: after it drops a group that every sample solved, pass over that prompt's
    # next this many appearances in the prompt order (it would likely be dropped again, its
    # episodes spent for nothing). Groups that none solved are not skipped: those tasks still have
    # to be learned. 0: every appearance is rolled out (plain DAPO dynamic sampling). Without the
    # filter nothing is dropped, so nothing is skipped.
    skip_solved: int = 0
    pass_threshold: float = 1.0  # reward at or above which an episode counts as passed

    def __post_init__(self) -> None:
        n = self.n_samples_per_prompt
        if n < 1 or self.batch_size < 1 or self.batch_size % n:
            raise RolloutError(
                f"batch_size {self.batch_size} must be a positive multiple of n_samples_per_prompt {n}: "
                "groups are never split across batches"
            )
        if self.max_in_flight < 1 or self.max_attempts < 1:
            raise RolloutError("max_in_flight and max_attempts must be >= 1")
        if self.skip_solved < 0:
            raise RolloutError(f"skip_solved must be >= 0 (appearances to pass over), got {self.skip_solved}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise RolloutError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")


@dataclass
class Counters:
    """Cumulative; StepMetrics reports the change per step."""

    started: int = 0
    finished: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    samples_exhausted: int = 0
    episode_timeouts: int = 0
    groups_emitted: int = 0
    groups_incomplete: int = 0
    groups_filtered: int = 0
    stale_groups: int = 0
    stale_cancelled: int = 0  # groups cancelled in flight as certain to exceed max_staleness
    internal_errors: int = 0  # untyped exceptions out of a runner, caught per episode
    policy_failures: Counter[str] = field(default_factory=Counter)  # scored 0, by failure cause
    # Generations answered under another weight version than expected (a replay on a server that
    # missed an update): their turns record the version they really had, and are counted here.
    version_mismatches: int = 0
    infra_scored: int = 0  # must stay 0: an infra failure that reached a group with a reward
    # Every scored training episode of a finished group, whether the dynamic filter kept it or not:
    # the policy's pass rate as the rollouts see it (the kept groups alone are biased towards 0.5).
    samples_scored: int = 0
    samples_passed: int = 0
    prompts_skipped: int = 0  # appearances passed over after an all-solved group (skip_solved)

    def snapshot(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["failures"] = dict(self.failures)
        d["policy_failures"] = dict(self.policy_failures)
        return d


class RolloutManager:
    """Usage::

        async with RolloutManager(runner, control, source, config) as mgr:
            for step in range(steps):
                groups = await mgr.get_batch(timeout=600)
                ...train...
                await mgr.update_weights(sync_fn)

    Leaving the block (also by Ctrl-C or an error) cancels every running episode and waits up to
    `shutdown_timeout_s` for the runners to close their sandboxes.
    """

    def __init__(
        self,
        runner: EpisodeRunner,
        control: ControlPlane,
        source: PromptSource | Sequence[dict[str, Any]],
        config: RolloutConfig,
        *,
        seed: int = 0,
    ) -> None:
        self.runner = runner
        self.control = control
        self.source = source if isinstance(source, PromptSource) else PromptSource(list(source), seed=seed)
        self.config = config
        self.counters = Counters()
        self.buffer = Buffer(on_consumed=self.source.mark_consumed, on_stale=self._on_stale)
        self._open: Group | None = None
        self._open_next = 0
        self._unfinished: dict[str, Group] = {}
        self._running = 0
        self._tasks: dict[int, set[asyncio.Task[Any]]] = {}  # id(group) -> its sample tasks
        self._attempt_versions: dict[tuple[int, int], int] = {}  # (id(group), idx) -> start version
        self._done_unbuffered = 0
        self._pauses = 0
        self._admit_open = asyncio.Event()
        self._admit_open.set()
        self._wake = asyncio.Event()
        self._producer: asyncio.Task[None] | None = None
        self._base_version = control.weight_version
        self._filtered_in_a_row = 0
        self.started_at = 0.0  # the event loop's clock, set on entry

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutManager:
        if self._producer is not None:
            raise RolloutError("this RolloutManager is already running")
        self._base_version = self.control.weight_version
        self.started_at = asyncio.get_running_loop().time()
        self._producer = asyncio.create_task(self._produce(), name="rollout-producer")
        self._producer.add_done_callback(self._producer_done)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Cancel every running episode and wait for the runners to clean up."""
        task, self._producer = self._producer, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            async with asyncio.timeout(self.config.shutdown_timeout_s):
                await asyncio.gather(task, return_exceptions=True)
        except TimeoutError:
            log.error(
                "rollout runners did not finish cleaning up within %.0fs of cancel",
                self.config.shutdown_timeout_s,
            )

    def _producer_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("rollout producer failed: %r", exc)
            self.buffer.fail(exc)

    # -- admission ---------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.control.weight_version - self._base_version

    @property
    def running(self) -> int:
        return self._running

    @property
    def unfinished_groups(self) -> int:
        """Groups with a sample still running or waiting for a retry."""
        return len(self._unfinished)

    @property
    def outstanding(self) -> int:
        """C + R + D of the admission rule, in samples."""
        return self.buffer.consumed_samples + self._running + self._done_unbuffered + self.buffer.n_samples

    def admission_limit(self) -> int | None:
        s = self.config.max_staleness
        return None if s is None else (s + self.step + 1) * self.config.batch_size

    def _can_admit(self) -> bool:
        if self._pauses or self._running >= self.config.max_in_flight:
            return False
        limit = self.admission_limit()
        return limit is None or self.outstanding + 1 <= limit

    def _next_job(self) -> tuple[Group, int, int] | None:
        if self._open is None or self._open_next >= self._open.n:
            prompt = self.source.next()
            self.counters.prompts_skipped = self.source.skipped
            if prompt is None:
                return None
            self._open = self._new_group(prompt)
            self._open_next = 0
        idx = self._open_next
        self._open_next += 1
        return self._open, idx, 0

    def _new_group(self, prompt: Prompt) -> Group:
        group = Group(prompt.uid, prompt.prompt_id, prompt.row, self.config.n_samples_per_prompt)
        self._unfinished[group.uid] = group
        return group

    def _idle_and_exhausted(self) -> bool:
        return self._running == 0 and not self._unfinished and self.source.exhausted()

    async def _produce(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                while self._can_admit():
                    job = self._next_job()
                    if job is None:
                        break
                    self._running += 1
                    self.counters.started += 1
                    group, idx, attempt = job
                    tg.create_task(self._run_sample(group, idx, attempt), name=f"episode-{group.uid}-{idx}")
                if self._idle_and_exhausted():
                    self.buffer.finish()
                self._wake.clear()
                await self._wake.wait()

    def _kick(self) -> None:
        self._wake.set()

    # -- one sample --------------------------------------------------------------------------

    async def _attempt(self, group: Group, idx: int, attempt: int) -> Episode | str:
        """One fresh episode; the Episode, or the failure cause."""
        version = self.control.weight_version
        cap = asyncio.timeout(self.config.episode_timeout_s)
        try:
            async with cap:
                episode = await self.runner.run(
                    group.row, group_id=group.uid, sample_index=idx, attempt=attempt
                )
        except InfraError as exc:
            log.warning("infra failure (%s) in %s/%d attempt %d: %s", exc.cause, group.uid, idx, attempt, exc)
            return exc.cause
        except InputError as exc:
            log.error("episode %s/%d: the row cannot be run, fix the data: %s", group.uid, idx, exc)
            return BAD_INPUT
        except TimeoutError:
            if not cap.expired():
                # A bare TimeoutError from inside the runner: some await of its own gave up.
                log.warning(
                    "episode %s/%d attempt %d: untyped timeout inside the runner", group.uid, idx, attempt
                )
                return "runner_timeout"
            self.counters.episode_timeouts += 1
            log.warning(
                "episode %s/%d attempt %d hit the %.0fs cap",
                group.uid,
                idx,
                attempt,
                self.config.episode_timeout_s,
            )
            return "episode_timeout"
        except Exception:
            # One episode must never stop the run: whatever escaped the runner is recorded here.
            self.counters.internal_errors += 1
            log.exception("episode %s/%d attempt %d raised an untyped error", group.uid, idx, attempt)
            return "internal_error"
        if not isinstance(episode, Episode):
            self.counters.internal_errors += 1
            log.error("runner returned %r instead of an Episode", type(episode).__name__)
            return "internal_error"
        if episode.status is Status.FAILED_INFRA:
            return episode.failure_cause or "infra"
        self.counters.version_mismatches += int(episode.metadata.get("version_mismatches", 0))
        if episode.status is Status.FAILED_POLICY and episode.failure_cause:
            self.counters.policy_failures[episode.failure_cause] += 1
        episode.prompt_id = group.uid
        episode.sample_index = idx
        episode.start_version = version
        episode.attempt = attempt
        return episode

    def _exhausted(self, group: Group, idx: int, causes: list[str]) -> Episode:
        self.counters.samples_exhausted += 1
        log.error(
            "sample %s/%d failed %d attempts (%s): its group is emitted incomplete",
            group.uid,
            idx,
            len(causes),
            ", ".join(causes),
        )
        return Episode.infra_failure(prompt_id=group.uid, sample_index=idx, cause=causes[-1], causes=causes)

    async def _run_sample(self, group: Group, idx: int, attempt: int) -> None:
        causes: list[str] = []
        task = asyncio.current_task()
        assert task is not None
        own = self._tasks.setdefault(id(group), set())
        own.add(task)
        key = (id(group), idx)
        try:
            while True:
                # A start happens only while admission is open: a task admitted just before a
                # pause (weight update, eval) starts after it, and so does a retry.
                await self._admit_open.wait()
                self._attempt_versions[key] = self.control.weight_version
                try:
                    result = await self._attempt(group, idx, attempt)
                finally:
                    self._attempt_versions.pop(key, None)
                if isinstance(result, Episode):
                    break
                causes.append(result)
                self.counters.failures[result] += 1
                attempt += 1
                # A broken row fails the same way every time: no retry.
                if attempt >= self.config.max_attempts or result == BAD_INPUT:
                    result = self._exhausted(group, idx, causes)
                    break
                # The slot stays ours while backing off.
                await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
        finally:
            self._running -= 1
            own.discard(task)
            if not own:
                self._tasks.pop(id(group), None)
            self._kick()
        if group.discarded:
            return
        self.counters.finished += 1
        self._fill(group, idx, result)

    def _fill(self, group: Group, idx: int, episode: Episode) -> None:
        group.episodes[idx] = episode
        if not group.done:
            self._done_unbuffered += 1
            return
        self._done_unbuffered -= group.n - 1
        self._unfinished.pop(group.uid, None)
        if any(
            e is not None and e.status is Status.FAILED_INFRA and e.reward is not None for e in group.episodes
        ):
            self.counters.infra_scored += 1
        if not group.complete:
            self.counters.groups_incomplete += 1
        scored = [float(e.reward) for e in group.trainable_episodes if e.reward is not None]
        self.counters.samples_scored += len(scored)
        self.counters.samples_passed += sum(r >= self.config.pass_threshold for r in scored)
        rewards = {e.reward for e in group.trainable_episodes}
        if self.config.dynamic_filter and group.complete and len(rewards) == 1:
            self.counters.groups_filtered += 1
            self._filtered_in_a_row += 1
            self.buffer.record_consumed(group.uid)
            if self.config.skip_solved and min(rewards) >= self.config.pass_threshold:
                self.source.skip_next(group.uid, self.config.skip_solved)
            if self._filtered_in_a_row == self.config.max_filtered_in_a_row:
                self.buffer.fail(
                    RolloutError(
                        f"the dynamic filter dropped {self._filtered_in_a_row} groups in a row (every "
                        f"group's rewards were equal, last {rewards}): the policy gets no learning signal. "
                        "Use easier tasks or a warmer start, more samples per prompt, or turn the filter off"
                    )
                )
        else:
            self._filtered_in_a_row = 0
            self.counters.groups_emitted += 1
            self.buffer.put(group)
        self._kick()

    def _cancel_doomed(self) -> None:
        """Cancel the unfinished groups that can no longer be trained within max_staleness."""
        s = self.config.max_staleness
        if s is None:
            return
        floor = self.control.weight_version - s
        running_oldest: dict[int, int] = {}
        for (gid, _), v in self._attempt_versions.items():
            running_oldest[gid] = min(v, running_oldest.get(gid, v))
        for uid, group in list(self._unfinished.items()):
            oldest = [x.oldest_version() for x in group.episodes if x is not None]
            versions = [v for v in oldest if v is not None]
            if id(group) in running_oldest:
                versions.append(running_oldest[id(group)])
            if not versions or min(versions) >= floor:
                continue
            group.discarded = True
            del self._unfinished[uid]
            self._done_unbuffered -= group.filled
            if self._open is group:
                self._open = None
            for task in self._tasks.get(id(group), ()):
                task.cancel()
            self.counters.stale_cancelled += 1
            log.info(
                "group %s cannot be trained within max_staleness %d: cancelled, prompt re-queued", uid, s
            )
            self.source.requeue(uid)
        self._kick()

    def _on_stale(self, group: Group) -> None:
        self.counters.stale_groups += 1
        log.info("group %s exceeded max_staleness before training: prompt re-queued", group.uid)
        self.source.requeue(group.uid)
        self.buffer.reopen()
        self._kick()

    # -- trainer side ------------------------------------------------------------------------

    async def get_batch(self, *, timeout: float, batch_size: int | None = None) -> list[Group]:
        """The next batch (whole groups; `batch_size` samples, default the configured one), none
        of it more than `max_staleness` versions behind the current weights."""
        groups = await self.buffer.get_batch(
            batch_size or self.config.batch_size,
            timeout=timeout,
            current_version=self.control.weight_version,
            max_staleness=self.config.max_staleness,
        )
        self._kick()
        return groups

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Close admission for the duration (running episodes continue)."""
        self._pauses += 1
        self._admit_open.clear()
        try:
            yield
        finally:
            self._pauses -= 1
            if not self._pauses:
                self._admit_open.set()
            self._kick()

    async def update_weights(self, sync_fn: Callable[[], Awaitable[None]], mode: PauseMode = "abort") -> None:
        """Pause admission and engines, flush after an abort pause, run `sync_fn`, check the
        version, then always resume both (see the module docstring for the modes).

        `sync_fn` must advance the engines' weight version by exactly one: the staleness bound
        counts versions, so a version that jumps by the optimizer steps of a rollout step would
        cancel in-flight work as stale, and one that stands still would never bound it.
        """
        if mode not in ("in_place", "abort", "retract"):
            raise RolloutError(f"pause mode must be 'in_place', 'abort' or 'retract', got {mode!r}")
        cfg = self.config
        async with self.paused():
            try:
                async with asyncio.timeout(cfg.control_timeout_s):
                    await self.control.pause(mode)
                    if mode == "abort":
                        # No request is left, so the cache can and must be dropped before new
                        # weights land. Never after in_place or retract: the requests still sit in
                        # the scheduler's queues and SGLang 0.5.16 refuses (is_fully_idle) a flush.
                        await self.control.flush_cache()
                before = self.control.weight_version
                async with asyncio.timeout(cfg.sync_timeout_s):
                    await sync_fn()
                after = self.control.weight_version
                if after != before + 1:
                    raise RolloutError(
                        f"a weight update moved the engines' version from {before} to {after}; it "
                        "must add exactly 1 (the staleness bound counts versions): push a counter of "
                        "weight updates, not the optimizer's step count"
                    )
            finally:
                try:
                    async with asyncio.timeout(cfg.control_timeout_s):
                        await self.control.resume()
                finally:
                    self._cancel_doomed()

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the source position and the prompts to redo (in flight or buffered
        now, never trained). Counters are kept for continuity of the metrics."""
        return {"source": self.source.state_dict(), "counters": self.counters.snapshot()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._producer is not None:
            raise RolloutError("load the state before entering the manager")
        self.source.load_state_dict(state["source"])
        counters = dict(state.get("counters", {}))
        failures: Counter[str] = Counter(counters.pop("failures", {}))
        policy: Counter[str] = Counter(counters.pop("policy_failures", {}))
        self.counters = Counters(**counters, failures=failures, policy_failures=policy)
