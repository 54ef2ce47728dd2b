"""Multi-step tasks, run as Harbor 0.25 runs them (`harbor/trial/multi_step.py`): one sandbox for
every step, in order; before each step its `workdir/` is uploaded into the working directory and
its `setup.sh` and its healthcheck run; the agent gets the step's instruction in a fresh conversation; the step's
tests verify; a step whose rewards miss its `min_reward` stops the rest. The task's reward is the
per-key mean over the verified steps (`multi_step_reward_strategy = "mean"`, Harbor's default) or
the last verified step's ("final").

One deliberate difference, in the reward's favour of trust: when a step's setup fails after an
earlier step's agent has run, the agent could have caused it, so the step counts as verified with
reward 0 (Harbor records an exception and leaves the step out of the mean, which a policy could use
to drop a step it would fail). A first step's failing setup is the task's own defect.
"""

from __future__ import annotations

import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentrl.agent.loop import AgentRun
from agentrl.episode.healthcheck import HealthcheckError, run_healthcheck
from agentrl.episode.verify import PASS_THRESHOLD, VerifyResult
from agentrl.errors import InfraError
from agentrl.sandbox.base import Sandbox, printable, tail
from agentrl.tasks.config import StepConfig
from agentrl.tasks.task import Task, TaskStep

SETUP_TIMEOUT_S = 600.0
# What the verification of one step leaves behind that the next step's agent must not read; run in
# a clean shell (with `cwd`), never in the agent's session, whose aliases and state the agent set.
CLEAR_VERIFIER = "rm -rf /tests /logs/verifier && mkdir -p /logs/verifier && chmod 777 /logs/verifier"


class StepSetupError(InfraError):
    """A multi-step task's first step could not be set up: the task's own defect."""

    cause = "step_setup"


@dataclass
class StepOutcome:
    name: str
    run: AgentRun | None
    verify: VerifyResult


# One phase acted on and verified (the agent's run, the oracle's solution, a replay's turns), or None
# where nothing more of the task was reached.
ActPhase = Callable[[int, Task], Awaitable[StepOutcome | None]]
Record = Callable[[str, dict[str, Any]], None]


async def run_phases(
    sandbox: Sandbox,
    task: Task,
    act: ActPhase,
    *,
    later_setup_scores_zero: bool = True,
    record: Record | None = None,
) -> VerifyResult:
    """The one loop over a task's phases (the task itself, or its steps in order), shared by
    episodes, the oracle and replay: set a step up, `act` on it, stop at a failure or an unmet
    gate, clear the verifier's files before the next step; the task's verification at the end.

    A step whose setup fails raises `StepSetupError` when it is the first (the task's defect) or
    when `later_setup_scores_zero` is off (the oracle, where no agent ran); otherwise the agent
    could have caused it, and the step scores 0 (`step_setup`)."""
    phases: list[Task] = list(task.steps) or [task]
    outcomes: list[StepOutcome] = []
    for k, phase in enumerate(phases):
        if isinstance(phase, TaskStep) and k and _agent_policy(phase) != _agent_policy(phases[k - 1]):
            # a step's own agent-phase network (`[steps.agent] network_mode`), from outside
            await sandbox.set_network(*_agent_policy(phase))
        if isinstance(phase, TaskStep):
            problem = await prepare_step(sandbox, phase)
            if record is not None:
                record("step", {"index": k, "name": phase.step_name, "setup_error": problem})
            if problem and (k == 0 or not later_setup_scores_zero):
                raise StepSetupError(f"{task.task_id}: {problem}")
            if problem:
                failed = VerifyResult("fail", 0.0, {"reward": 0.0}, cause="step_setup", error=problem)
                outcomes.append(StepOutcome(phase.step_name, None, failed))
                break
        outcome = await act(k, phase)
        if outcome is None:
            break
        outcomes.append(outcome)
        v = outcome.verify
        if record is not None and isinstance(phase, TaskStep):
            record(
                "step_result",
                {
                    "index": k,
                    "rewards": v.rewards if not v.infra_failure else None,
                    "outcome": v.outcome,
                    "cause": v.cause,
                    "agent_s": outcome.run.timings.get("agent_s") if outcome.run else None,
                    "verifier_s": v.duration_s,
                    "log_tail": v.log_tail,
                },
            )
        if not isinstance(phase, TaskStep) or v.policy_failure or v.infra_failure:
            break
        if not gate_met(phase.step, v.rewards) or k == len(phases) - 1:
            break
        await sandbox.exec(CLEAR_VERIFIER, timeout=60, cwd="/")  # the next agent sees no tests
    return combine(outcomes, task.config.reward_strategy) if task.steps else outcomes[-1].verify


def _agent_policy(phase: Task) -> tuple[str, tuple[str, ...]]:
    return phase.config.phase_network("agent"), phase.config.phase_hosts("agent")


async def prepare_step(sandbox: Sandbox, step: TaskStep) -> str | None:
    """Upload the step's workdir into the working directory and run its setup.sh there, as the
    step's agent user, then the step's healthcheck; what went wrong, or None."""
    problem = await _setup(sandbox, step)
    if problem is None and step.step.healthcheck is not None:
        try:
            await run_healthcheck(sandbox, step, check=step.step.healthcheck)
        except HealthcheckError as exc:
            problem = f"the healthcheck of step {step.step_name!r} failed: {exc}"
    return problem


async def _setup(sandbox: Sandbox, step: TaskStep) -> str | None:
    if not step.workdir.is_dir():
        return None
    # A clean shell (an `env` given), as Harbor's fresh exec: the image's working directory, not
    # wherever the last agent's session `cd`-ed to.
    where = await sandbox.exec("pwd", timeout=30, env={})
    pwd = where.stdout.strip() or "/"
    await sandbox.upload(step.workdir, pwd)
    if not (step.workdir / "setup.sh").is_file():
        return None
    run = await sandbox.exec(
        f"bash {shlex.quote(pwd.rstrip('/') + '/setup.sh')}",
        timeout=SETUP_TIMEOUT_S,
        cwd=pwd,  # a clean shell too, never the agent's session
        user=step.config.agent.user,
    )
    if run.timed_out:
        return f"setup.sh of step {step.step_name!r} ran past {SETUP_TIMEOUT_S:.0f}s"
    if run.exit_code != 0:
        return f"setup.sh of step {step.step_name!r} exited {run.exit_code}: {printable(tail(run.stderr or run.stdout, 300))}"
    return None


def gate_met(step: StepConfig, rewards: dict[str, float]) -> bool:
    """Whether the step's rewards reach its `min_reward` (a float gates "reward"; a table every key
    it names, a missing key counting as -inf)."""
    if step.min_reward is None:
        return True
    gates = step.min_reward if isinstance(step.min_reward, dict) else {"reward": step.min_reward}
    return all(rewards.get(key, float("-inf")) >= value for key, value in gates.items())


def combine(outcomes: list[StepOutcome], strategy: str) -> VerifyResult:
    """The task's verification from its steps': a policy failure in any step is the task's (reward
    0, its cause); otherwise the strategy over the verified steps' rewards."""
    for o in outcomes:
        if o.verify.policy_failure or o.verify.infra_failure:
            return o.verify
    verified = [o.verify for o in outcomes]
    last = verified[-1]
    if strategy == "final":
        rewards = dict(last.rewards)
    else:  # "mean": per key, a key a step did not write counting 0
        keys = list(dict.fromkeys(k for v in verified for k in v.rewards))
        rewards = {k: sum(v.rewards.get(k, 0.0) for v in verified) / len(verified) for k in keys}
    reward = rewards.get("reward", next(iter(rewards.values()), 0.0))
    return VerifyResult(
        "pass" if reward >= PASS_THRESHOLD else "fail",
        reward,
        rewards,
        sum(v.duration_s for v in verified),
        last.log_tail,
        cause=last.cause,
    )


def merge_runs(runs: list[AgentRun]) -> AgentRun:
    """One episode's agent run from its steps' (their segments in order: one sample set, one
    advantage)."""
    last = runs[-1]
    timings: dict[str, float] = {}
    for r in runs:
        for k, v in r.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    return AgentRun(
        segments=[s for r in runs for s in r.segments],
        turns=[t for r in runs for t in r.turns],
        end_reason=last.end_reason,
        malformed_turns=sum(r.malformed_turns for r in runs),
        infra_error=last.infra_error,
        policy_error=last.policy_error,
        timings=timings,
        version_mismatches=sum(r.version_mismatches for r in runs),
        mode=last.mode,
        initial_state=runs[0].initial_state,
        summaries=[s for r in runs for s in r.summaries],
    )
