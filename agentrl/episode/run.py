"""One terminal episode end to end: sandbox -> agent phase -> verifier -> `Episode`; record and replay.

Failures are classified. Policy outcomes (the model did badly, ran out of turns or tokens, wrote
garbage) are verified and keep their reward. Infrastructure failures (sandbox create or
transport, engine unavailable, verifier error or timeout) raise `InfraError` with a `cause`
after the record is written, so nothing is lost and nothing is scored 0 by accident.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from agentrl.agent.acting import TerminalActor
from agentrl.agent.actions import Command, get_format
from agentrl.agent.loop import TRUNCATING, AgentConfig, AgentRun, EndReason, run_agent, run_command
from agentrl.agent.tokens import ChatRenderer, Segment
from agentrl.engine.base import Engine, SamplingParams
from agentrl.episode.healthcheck import run_healthcheck
from agentrl.episode.oracle import ensure_footprint
from agentrl.episode.record import RECORD_VERSION, Recorder, read_record
from agentrl.episode.sample import Episode, Sample, Status
from agentrl.episode.steps import StepOutcome, merge_runs, run_phases
from agentrl.episode.verify import VerifyResult, verify_phase
from agentrl.errors import InfraError
from agentrl.sandbox.base import SandboxCreateError, SandboxPolicyError, SandboxProvider
from agentrl.tasks.task import Task, TaskStep, load_task


class VerifierInfraError(InfraError):
    cause = "verifier_error"


@dataclass
class EpisodeConfig:
    action_format: str = "terminus-json"
    agent: AgentConfig = field(default_factory=AgentConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    system_prompt: str | None = None
    create_timeout_s: float | None = None  # default: the task's build timeout
    max_agent_timeout_s: float | None = None  # cap on the task's [agent].timeout_sec


@dataclass
class EpisodeResult:
    episode: Episode
    run: AgentRun | None
    verify: VerifyResult | None
    record_path: Path | None = None

    @property
    def samples(self) -> list[Sample]:
        return self.episode.segments


def _status(end: EndReason) -> Status:
    if end in TRUNCATING:
        return Status.TRUNCATED
    if end is EndReason.NO_ACTION:
        return Status.FAILED_POLICY
    return Status.COMPLETED


def segment_samples(
    segments: list[Segment],
    *,
    reward: float,
    status: Status,
    end_reason: str,
    prompt_id: str,
    sample_index: int,
    task_id: str,
    timings: dict[str, float],
) -> list[Sample]:
    """The one place segments become training samples: one `Sample` per segment that generated
    anything, all under the episode's reward and status."""
    trained = [s for s in segments if any(s.loss_mask)]
    samples = []
    for k, seg in enumerate(trained):
        seg.check()
        samples.append(
            Sample(
                prompt_id=prompt_id,
                tokens=seg.prompt_ids + seg.response_ids,
                prompt_length=len(seg.prompt_ids),
                loss_mask=list(seg.loss_mask),
                rollout_logprobs=list(seg.logprobs),
                reward=reward,
                status=status,
                end_reason=end_reason,
                sample_index=sample_index,
                weight_versions=list(seg.weight_versions),
                timings=dict(timings),
                task_id=task_id,
                metadata={"segment": k, "n_segments": len(trained)},
                routed_experts=seg.routed_experts,
            )
        )
    return samples


def episode_from_run(
    run: AgentRun,
    *,
    reward: float,
    prompt_id: str,
    sample_index: int,
    task_id: str,
    timings: dict[str, float],
) -> Episode:
    """The agent's token segments (one per unbroken prefix) under one reward and one status."""
    status = _status(run.end_reason)
    segments = segment_samples(
        run.segments,
        reward=reward,
        status=status,
        end_reason=run.end_reason.value,
        prompt_id=prompt_id,
        sample_index=sample_index,
        task_id=task_id,
        timings=timings,
    )
    if not segments:
        # Nothing generated at all (e.g. zero turns): an outcome, but nothing to train on.
        status = Status.FAILED_POLICY
    return Episode(
        segments=segments,
        reward=reward,
        status=status,
        turn_versions=[v for t in run.turns for v in t.weight_versions],
        end_reason=run.end_reason.value,
        task_id=task_id,
        prompt_id=prompt_id,
        sample_index=sample_index,
        timings=dict(timings),
        metadata={
            "malformed_turns": run.malformed_turns,
            "turns": len(run.turns),
            "version_mismatches": run.version_mismatches,
        },
    )


async def run_episode(
    task: Task,
    *,
    provider: SandboxProvider,
    engine: Engine,
    renderer: ChatRenderer,
    config: EpisodeConfig,
    run_id: str,
    prompt_id: str | None = None,
    sample_index: int = 0,
    record_dir: Path | None = None,
    artifacts_dir: Path | None = None,
) -> EpisodeResult:
    """Run one episode. Raises `InfraError` (after recording) for infrastructure failures. With
    `artifacts_dir`, the task's artifacts are collected there after the agent phase, with
    Harbor's `manifest.json` (a step's under `<artifacts_dir>/../steps/<name>/artifacts`)."""
    prompt_id = prompt_id or task.task_id
    # A broken task (e.g. an instruction over the size cap) is refused before any sandbox starts.
    for phase in task.steps or [task]:
        _ = phase.instruction
    session_id = f"{run_id}:{prompt_id}:{sample_index}:{uuid.uuid4().hex[:8]}"
    fmt = get_format(config.action_format)
    recorder = None
    if record_dir is not None:
        recorder = Recorder(Path(record_dir) / f"{task.task_id}__{session_id.replace(':', '_')}.jsonl")
        recorder.write(
            "header",
            {
                "version": RECORD_VERSION,
                "task_id": task.task_id,
                "task_path": str(task.path.resolve()),
                "action_format": fmt.name,
                "terminal": config.agent.mode_for(fmt),
                "run_id": run_id,
                "session_id": session_id,
                "prompt_id": prompt_id,
                "sample_index": sample_index,
                "agent": asdict(config.agent),
                "sampling": asdict(config.sampling),
                "created_at": time.time(),
            },
        )
    timings: dict[str, float] = {}
    runs: list[AgentRun] = []  # one per phase reached
    vres: VerifyResult | None = None
    t_start = time.monotonic()
    try:
        create_timeout = config.create_timeout_s or task.config.environment.build_timeout_sec
        try:
            sandbox = await asyncio.wait_for(provider.create(task, run_id=run_id), create_timeout)
        except TimeoutError:
            raise SandboxCreateError(
                f"sandbox for {task.task_id} not ready after {create_timeout:.0f}s"
            ) from None
        timings["create_s"] = time.monotonic() - t_start
        async with sandbox:
            await run_healthcheck(sandbox, task)

            async def act(k: int, phase: Task) -> StepOutcome:
                run = await _agent_phase(phase, sandbox, engine, renderer, fmt, config, session_id)
                runs.append(run)
                timings.update({f: timings.get(f, 0.0) + v for f, v in run.timings.items()})
                if recorder is not None:
                    mark = {"step": k} if isinstance(phase, TaskStep) else {}
                    if run.initial_state is not None:  # each step's agent starts on its own screen
                        recorder.write("terminal", {"initial_state": run.initial_state, **mark})
                    for turn in run.turns:
                        for summary in run.summaries:  # where a summary replaced the history
                            if summary.before_turn == turn.index:
                                recorder.write("summary", {**summary.to_dict(), **mark})
                        recorder.write("turn", {**asdict(turn), "step": k})
                if run.infra_error is not None:
                    raise run.infra_error
                if run.policy_error is not None:
                    # The agent's command broke its own sandbox (docs/failures.md): nothing to verify.
                    step_v = VerifyResult(
                        "tampered",
                        0.0,
                        {"reward": 0.0},
                        error=str(run.policy_error),
                        cause=run.policy_error.cause,
                    )
                else:
                    t_v = time.monotonic()
                    where = artifacts_dir
                    if where is not None and isinstance(phase, TaskStep):
                        where = where.parent / "steps" / phase.step_name / "artifacts"
                    step_v = await verify_phase(
                        sandbox,
                        phase,
                        provider=provider,
                        run_id=run_id,
                        footprint=lambda: ensure_footprint(provider, phase, run_id=run_id),
                        artifacts_dir=where,
                    )
                    timings["verifier_s"] = timings.get("verifier_s", 0.0) + time.monotonic() - t_v
                return StepOutcome(getattr(phase, "step_name", task.task_id), run, step_v)

            vres = await run_phases(sandbox, task, act, record=recorder.write if recorder else None)
            run = merge_runs(runs) if len(runs) != 1 else runs[0]
        if vres.infra_failure and not vres.policy_failure:
            raise VerifierInfraError(
                f"verifier of {task.task_id}: {vres.outcome}: {vres.error or ''}",
                cause=vres.cause or "verifier_error",
                log_tail=vres.log_tail,
            )
        # A policy failure (tampering, a broken sandbox, tests the agent's work hangs or breaks)
        # scores 0 and says why; it is trained on like any other outcome, never retried.
        reward = 0.0 if vres.policy_failure else vres.reward
        assert reward is not None
        timings["total_s"] = time.monotonic() - t_start
        episode = episode_from_run(
            run,
            reward=reward,
            prompt_id=prompt_id,
            sample_index=sample_index,
            task_id=task.task_id,
            timings=timings,
        )
        if vres.policy_failure:
            episode.status, episode.failure_cause = Status.FAILED_POLICY, vres.cause
            for seg in episode.segments:
                seg.status, seg.failure_cause = Status.FAILED_POLICY, vres.cause
        if recorder is not None:
            recorder.write(
                "result",
                {
                    "status": episode.status.value,
                    "end_reason": run.end_reason.value,
                    "reward": reward,
                    "outcome": vres.outcome,
                    "failure_cause": vres.cause,
                    "rewards": vres.rewards,
                    "timings": timings,
                    "verifier_log_tail": vres.log_tail,
                    "samples": [s.to_dict() for s in episode.segments],
                },
            )
        return EpisodeResult(episode, run, vres, recorder.path if recorder else None)
    except InfraError as exc:
        if recorder is not None:
            recorder.write(
                "result",
                {
                    "status": Status.FAILED_INFRA.value,
                    "failure_cause": exc.cause,
                    "error": str(exc),
                    "end_reason": runs[-1].end_reason.value if runs else None,
                    "reward": None,
                    "timings": timings,
                },
            )
        raise
    finally:
        if recorder is not None:
            recorder.close()


async def _agent_phase(
    phase: Task,
    sandbox: Any,
    engine: Engine,
    renderer: ChatRenderer,
    fmt: Any,
    config: EpisodeConfig,
    session_id: str,
) -> AgentRun:
    """The agent on one task or step: its instruction, under its agent timeout (capped by the
    run's)."""
    agent_cfg = config.agent
    limit = phase.config.agent.timeout_sec
    if config.max_agent_timeout_s is not None:
        limit = min(limit or config.max_agent_timeout_s, config.max_agent_timeout_s)
    if limit is not None:
        agent_cfg = AgentConfig(**{**asdict(agent_cfg), "wall_clock_s": limit})
    return await run_agent(
        engine=engine,
        sandbox=sandbox,
        renderer=renderer,
        action_format=fmt,
        instruction=phase.instruction,
        config=agent_cfg,
        sampling=config.sampling,
        session_id=session_id,
        system_prompt=config.system_prompt,
    )


@dataclass
class TurnReplay:
    index: int
    matched: bool
    detail: str = ""


@dataclass
class ReplayReport:
    record: Path
    task_id: str
    recorded_reward: float | None
    replayed_reward: float | None
    turns: list[TurnReplay]

    @property
    def reward_matches(self) -> bool:
        return self.recorded_reward == self.replayed_reward

    @property
    def outputs_match(self) -> bool:
        return all(t.matched for t in self.turns)


# Output that legitimately changes between runs of the same commands: durations ("0.02s"),
# hex object ids (git commits, containers) and clock times. Replay reports them but still matches.
_VOLATILE = [
    (re.compile(r"\b[0-9a-f]{7,64}\b"), "<hex>"),
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms|sec|seconds)\b"), "<duration>"),
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"), "<time>"),
    (re.compile(r"\b\d{2}:\d{2}:\d{2}\b"), "<time>"),
]


def _stable(output: tuple[str, str, int | None]) -> tuple[str, str, int | None]:
    def norm(text: str) -> str:
        for pattern, repl in _VOLATILE:
            text = pattern.sub(repl, text)
        return text

    return norm(output[0]), norm(output[1]), output[2]


async def replay_episode(
    record: Path, *, provider: SandboxProvider, run_id: str, task_path: Path | None = None
) -> ReplayReport:
    """Re-run a record's actions in a fresh sandbox, re-verify, compare outputs and reward.
    A terminal-path record is replayed keystroke by keystroke with its durations, and the
    terminal text after each batch is compared with the recorded one."""
    rec = read_record(record)
    header, turns, result = rec.header, rec.turns, rec.result
    task = load_task(task_path or header["task_path"])
    timeout = float(header["agent"].get("command_timeout_s", 60.0))
    reports: list[TurnReplay] = []

    async def act(k: int, phase: Task) -> StepOutcome | None:
        step_turns = [t for t in turns if t.get("step", 0) == k]
        if k > 0 and not step_turns:
            return None  # the recorded run never reached this step (a min_reward gate)
        reports.extend(await _replay_turns(sandbox, step_turns, header, timeout))
        verified = await verify_phase(sandbox, phase, provider=provider, run_id=run_id)
        return StepOutcome(getattr(phase, "step_name", task.task_id), None, verified)

    async with await provider.create(task, run_id=run_id) as sandbox:
        vres = await run_phases(sandbox, task, act)
    return ReplayReport(
        record=record,
        task_id=task.task_id,
        recorded_reward=(result or {}).get("reward"),
        replayed_reward=vres.reward,
        turns=reports,
    )


async def _replay_turns(
    sandbox: Any, turns: list[dict[str, Any]], header: dict[str, Any], timeout: float
) -> list[TurnReplay]:
    """One agent phase's turns again: keystrokes into a fresh terminal, or commands."""
    reports: list[TurnReplay] = []
    terminal = None
    if header.get("terminal") == "tmux":
        terminal = TerminalActor(await sandbox.open_terminal())
        await terminal.initial_state()
    for turn in turns:
        action = turn["action"]
        if action.get("error"):
            reports.append(TurnReplay(turn["index"], True, "malformed turn: nothing to run"))
            continue
        if terminal is not None:
            reports.append(await _replay_keystrokes(terminal, turn))
            continue
        mismatches = []
        volatile = []
        for k, (cmd, rec) in enumerate(zip(action["commands"], turn["outputs"], strict=False)):
            what = f"command {k} ({cmd['keystrokes'].strip()[:40]!r})"
            try:
                out = await run_command(sandbox, Command(cmd["keystrokes"], cmd["duration"]), timeout)
            except SandboxPolicyError as exc:
                mismatches.append(f"{what} broke the sandbox ({exc.cause})")
                continue
            now = (out.stdout, out.stderr, out.exit_code)
            then = (rec["stdout"], rec["stderr"], rec["exit_code"])
            if now == then:
                continue
            if _stable(now) == _stable(then):
                volatile.append(f"{what}: only timings / hashes / dates differ")
            else:
                mismatches.append(f"{what} output differs")
        reports.append(TurnReplay(turn["index"], not mismatches, "; ".join(mismatches + volatile)))
    if terminal is not None:
        await terminal.close()
    return reports


async def _replay_keystrokes(terminal: TerminalActor, turn: dict[str, Any]) -> TurnReplay:
    commands = [Command(c["keystrokes"], c["duration"]) for c in turn["action"]["commands"]]
    try:
        batch = await terminal.act(commands, None)
    except SandboxPolicyError as exc:
        return TurnReplay(turn["index"], False, f"the keystrokes broke the sandbox ({exc.cause})")
    then = turn.get("terminal_output") or ""
    if batch.terminal_output == then:
        return TurnReplay(turn["index"], True)
    if _stable((batch.terminal_output, "", None)) == _stable((then, "", None)):
        return TurnReplay(turn["index"], True, "the screen differs only in timings / hashes / dates")
    return TurnReplay(
        turn["index"], False, "the screen differs: " + _first_difference(then, batch.terminal_output)
    )


def _first_difference(then: str, now: str) -> str:
    old, new = then.splitlines(), now.splitlines()
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            return f"line {i + 1}: recorded {a[:120]!r}, replayed {b[:120]!r}"
    return f"recorded {len(old)} lines, replayed {len(new)}"


class SandboxEpisodeRunner:
    """The terminal environment's runner: one task row -> one `Episode` (or an `InfraError`)."""

    def __init__(
        self,
        *,
        provider: SandboxProvider,
        engine: Engine,
        renderer: ChatRenderer | None,
        config: EpisodeConfig,
        run_id: str,
        record_dir: Path | None = None,
        eval_config: EpisodeConfig | None = None,
    ) -> None:
        self.provider = provider
        self.engine = engine
        self.renderer = renderer
        self.config = config
        self.eval_config = eval_config or config
        self.run_id = run_id
        self.record_dir = record_dir
        self._tasks: dict[str, Task] = {}

    def _task(self, row: dict[str, Any]) -> Task:
        path = row["metadata"]["task_path"]
        if path not in self._tasks:
            self._tasks[path] = load_task(path)
        return self._tasks[path]

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
        config = self.eval_config if eval else self.config
        if seed is not None:
            config = replace(config, sampling=replace(config.sampling, seed=seed))
        result = await run_episode(
            self._task(row),
            provider=self.provider,
            engine=self.engine,
            renderer=self.renderer,  # type: ignore[arg-type]
            config=config,
            run_id=self.run_id,
            prompt_id=group_id,
            sample_index=sample_index,
            record_dir=self.record_dir,
        )
        return result.episode
