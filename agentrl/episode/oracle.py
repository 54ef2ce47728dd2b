"""The oracle sweep: does each task's reference solution pass its own verifier?

Per task: build (or reuse) the image, start a sandbox, upload solution/ to /solution and run
solve.sh with `[solution.env]` under the agent timeout (or nothing, with `solution=False`), then
`agentrl.episode.verify.verify`. With solutions every reward must be 1; without, every reward must be 0
(a task that passes untouched verifies nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrl.episode.healthcheck import run_healthcheck
from agentrl.episode.steps import StepOutcome, StepSetupError, run_phases
from agentrl.episode.verify import footprint_path, load_footprint, save_footprint, verify_phase
from agentrl.errors import AgentRLError, InfraError
from agentrl.sandbox.base import SandboxProvider, tail
from agentrl.tasks.config import resolve_env_templates
from agentrl.tasks.task import Task, TaskStep, scripts_with_lf

DEFAULT_SOLVE_TIMEOUT = 600.0
log = logging.getLogger(__name__)


@dataclass
class OracleResult:
    task_id: str
    expected: float
    reward: float | None
    seconds: float
    cause: str | None = None  # None when the reward is the expected one
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.cause is None


async def oracle_one(
    provider: SandboxProvider, task: Task, *, run_id: str, solution: bool = True, raise_infra: bool = False
) -> OracleResult:
    """Run one task's oracle check; infrastructure and format failures become a failure cause
    (with `raise_infra`, an infrastructure failure is raised instead)."""
    expected = 1.0 if solution else 0.0
    start = time.monotonic()
    cause: str | None = None
    detail = ""
    # Checked before anything is built: a task without a verifier or a solution fails in no time.
    try:
        task.validate()
    except AgentRLError as exc:
        return OracleResult(task.task_id, expected, None, 0.0, "task_format", str(exc))
    phases = task.steps or [task]
    if solution and any(phase.solve_script is None for phase in phases):
        return OracleResult(task.task_id, expected, None, 0.0, "no_solution", "solution/solve.sh is missing")
    try:
        async with await provider.create(task, run_id=run_id) as sandbox:
            await run_healthcheck(sandbox, task)

            async def act(k: int, phase: Task) -> StepOutcome:
                nonlocal cause, detail
                if solution:
                    detail = await _solve(sandbox, phase) or detail
                    if detail.startswith("solve.sh ran past"):
                        cause = "solution_timeout"
                step_v = await verify_phase(
                    sandbox, phase, provider=provider, run_id=run_id, reference=solution
                )
                if solution and step_v.outcome == "pass" and step_v.agent_code is not None:
                    save_footprint(phase, step_v.agent_code)
                return StepOutcome(getattr(phase, "step_name", task.task_id), None, step_v)

            # No agent ran: a step's failing setup is the task's defect, whichever step it is.
            result = await run_phases(sandbox, task, act, later_setup_scores_zero=False)
    except StepSetupError as exc:
        return OracleResult(task.task_id, expected, None, time.monotonic() - start, "step_setup", str(exc))
    except InfraError as exc:
        if raise_infra:
            raise
        return OracleResult(
            task.task_id, expected, None, time.monotonic() - start, exc.cause, tail(str(exc), 2000)
        )
    except AgentRLError as exc:
        return OracleResult(task.task_id, expected, None, time.monotonic() - start, "task_format", str(exc))
    seconds = time.monotonic() - start
    if result.infra_failure:
        cause = "verifier_timeout" if result.outcome == "timeout" else "verifier_error"
        detail = f"{result.error}\n{tail(result.log_tail, 1500)}".strip()
    elif cause is None and result.reward != expected:
        cause = "wrong_reward"
        detail = (detail + "\n" + tail(result.log_tail, 1500)).strip()
    return OracleResult(task.task_id, expected, result.reward, seconds, cause, detail)


async def _solve(sandbox: Any, task: Task) -> str:
    """Upload the task's (or step's) solution to /solution and run solve.sh; what went wrong, or ""."""
    env = resolve_env_templates(task.config.solution.env, str(task.path / "task.toml"))
    with scripts_with_lf(task.solution_dir) as solution_dir:
        await sandbox.exec("rm -rf /solution", timeout=60)
        await sandbox.upload(solution_dir, "/solution")
    timeout = task.config.agent.timeout_sec or DEFAULT_SOLVE_TIMEOUT
    run = await sandbox.exec(
        "chmod +x /solution/solve.sh && /solution/solve.sh",
        timeout=timeout,
        env=env or None,
        user=task.config.agent.user,
    )
    if run.timed_out:
        return f"solve.sh ran past {timeout:.0f}s"
    if run.exit_code != 0:
        return f"solve.sh exited {run.exit_code}: {tail(run.stderr or run.stdout, 300)}"
    return ""


_FOOTPRINTS: dict[str, asyncio.Future[frozenset[str]]] = {}


async def ensure_footprint(provider: SandboxProvider, task: Task, *, run_id: str) -> frozenset[str]:
    """The agent-made code the task's reference solution makes its verifier use (what it installs
    or replaces as the task asks), computed once per task content by an oracle run in a sandbox of
    its own and cached (`save_footprint`); episodes of one task running at once share the run. A
    solution that fails its own verifier leaves an empty footprint (and says so in the log); an
    infrastructure failure on the way is raised (the episode is retried, nothing is cached)."""
    key = str(footprint_path(task))
    if key not in _FOOTPRINTS:
        future = _FOOTPRINTS[key] = asyncio.get_running_loop().create_future()
        try:
            if not footprint_path(task).is_file():
                # A step's solution builds on the steps before it: the whole task's oracle runs.
                whole = task.parent if isinstance(task, TaskStep) and task.parent is not None else task
                result = await oracle_one(provider, whole, run_id=f"{run_id}-footprint", raise_infra=True)
                if not result.ok:
                    log.warning(
                        "the reference solution of %s failed (%s): nothing it installs is trusted",
                        task.task_id,
                        result.cause,
                    )
                    save_footprint(task, [])
            future.set_result(load_footprint(task))
        except BaseException as exc:
            _FOOTPRINTS.pop(key, None)
            future.set_exception(exc)
            future.exception()  # retrieved: waiters see it through their own await
            raise
    return await asyncio.shield(_FOOTPRINTS[key])


async def build_images(
    provider: SandboxProvider,
    tasks: list[Task],
    *,
    concurrency: int = 2,
    on_built: Callable[[Task, BaseException | None], None] | None = None,
) -> dict[str, BaseException]:
    """Build (or find) the image of every task ahead of its sandboxes, so a long build shows as
    such (`on_built` is called per task: progress) rather than as a slow first episode. Only
    providers that build locally (`image_for`, and `terminal_image` for the tmux layer) do
    anything. Tasks that fail `validate()` are skipped: nothing is built for them. A failure is
    returned per task id, not raised: the task's episode meets it again and reports its cause."""
    image_for = getattr(provider, "image_for", None)
    terminal_image = getattr(provider, "terminal_image", None)
    failed: dict[str, BaseException] = {}
    if image_for is None:
        return failed
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(task: Task) -> None:
        error: BaseException | None = None
        try:
            task.validate()
        except AgentRLError:
            return
        async with gate:
            try:
                image = await image_for(task)
                if terminal_image is not None:
                    await terminal_image(image, task.config.environment.build_timeout_sec)
            except AgentRLError as exc:
                error = failed[task.task_id] = exc
        if on_built is not None:
            on_built(task, error)

    await asyncio.gather(*(one(t) for t in tasks))
    return failed


async def run_oracle(
    provider: SandboxProvider,
    tasks: list[Task],
    *,
    run_id: str,
    solution: bool = True,
    concurrency: int = 2,
    on_done: Callable[[OracleResult], None] | None = None,
) -> list[OracleResult]:
    """Check every task, `concurrency` at a time; results in the order of `tasks`. `on_done` is
    called as each task finishes (progress)."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(task: Task) -> OracleResult:
        async with gate:
            result = await oracle_one(provider, task, run_id=run_id, solution=solution)
        if on_done is not None:
            on_done(result)
        return result

    try:
        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        await provider.aclose()
