"""`TerminalEnvironment`: task directories -> rows; rows -> episodes in sandboxes (`agentrl.episode.run`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import Engine, SamplingParams
from agentrl.episode.run import EpisodeConfig, SandboxEpisodeRunner
from agentrl.rollout.environment import EnvContext, EnvironmentPluginError, Split
from agentrl.sandbox.base import SandboxProvider
from agentrl.tasks.dataset import task_row
from agentrl.tasks.task import Task, discover_tasks

log = logging.getLogger("agentrl.envs.tbench2")

BUNDLED_TASKS = Path(__file__).resolve().parent / "tasks"


class TerminalConfig(BaseModel):
    """Settings of the terminal environment (every one printed by `--dry-run`)."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["tbench2"] = "tbench2"
    tasks: str = Field(
        str(BUNDLED_TASKS), description="Directory of Harbor task directories (training rows)."
    )
    eval_tasks: str | None = Field(None, description="Task directory for evaluations (default: `tasks`).")
    max_solution_chars: int | None = Field(
        None,
        description="Keep only tasks whose reference solution is at most this many characters of "
        "commands (the tiny demo model cannot learn long scripts); None keeps every valid task.",
    )
    task_ids: list[str] | None = Field(
        None,
        description="Keep only the tasks with these ids (in `tasks` and `eval_tasks`); an id that "
        "matches no valid task is an error. None keeps every task.",
    )
    backend: Literal["podman", "docker", "daytona", "fake"] = "podman"
    private_verification: bool = Field(
        False,
        description="Daytona: run each episode's tests in a sandbox made from a snapshot of the "
        "agent's, where nothing the agent started runs (a snapshot and a create per episode; a "
        "service the agent left running is not there either). podman's verification is private "
        "already.",
    )
    action_format: str = "terminus-json"
    system_prompt: str | None = None
    agent: AgentConfig = Field(default_factory=AgentConfig)
    max_agent_timeout_s: float | None = Field(
        None, description="Cap on each task's [agent].timeout_sec (None: the task's own limit)."
    )
    create_timeout_s: float | None = Field(
        None, description="Sandbox start limit (None: the task's build timeout)."
    )
    record: bool = Field(True, description="Write every episode as a JSONL record under <out>/records.")


def solution_chars(task: Task) -> int | None:
    """Characters of the reference solution's commands (comments and `set -` lines excluded)."""
    if task.solve_script is None:
        return None
    body = [
        ln
        for ln in task.solve_script.read_text(encoding="utf-8").splitlines()
        if ln.strip() and not ln.lstrip().startswith(("#", "set -"))
    ]
    return len("\n".join(body))


def valid_tasks(root: str | Path) -> list[Task]:
    """Every task under `root` that lints clean; the others are logged and skipped."""
    from agentrl.sandbox.lint import lint_tasks

    chosen = []
    for result in lint_tasks(discover_tasks(Path(root))):
        if result.errors:
            log.warning("skipping %s: %s", result.task.task_id, "; ".join(map(str, result.errors)))
        else:
            chosen.append(result.task)
    if not chosen:
        raise EnvironmentPluginError(f"no valid task under {root}: `agentrl tasks lint {root}` says why")
    return chosen


def select_tasks(
    root: str | Path, max_solution_chars: int | None, task_ids: list[str] | None = None
) -> list[Task]:
    tasks = valid_tasks(root)
    if task_ids is not None:
        known = {t.task_id for t in tasks}
        if missing := sorted(set(task_ids) - known):
            raise EnvironmentPluginError(
                f"env.task_ids names {', '.join(missing)}, which {root} has no valid task for "
                f"(it has {', '.join(sorted(known))}); set env.task_ids=null to keep every task"
            )
        tasks = [t for t in tasks if t.task_id in set(task_ids)]
    if max_solution_chars is None:
        return tasks
    chosen = [t for t in tasks if (n := solution_chars(t)) is not None and n <= max_solution_chars]
    if not chosen:
        raise EnvironmentPluginError(
            f"no task in {root} has a reference solution of <= {max_solution_chars} characters: "
            "raise env.max_solution_chars or set it to null"
        )
    return chosen


class TerminalEnvironment:
    """Rows from task directories; a runner runs each row in a fresh sandbox of the chosen backend."""

    def __init__(self, config: TerminalConfig, context: EnvContext) -> None:
        self.config = config
        self.context = context
        self.tasks = select_tasks(config.tasks, config.max_solution_chars, config.task_ids)
        self._eval_tasks: list[Task] | None = None
        self._provider: SandboxProvider | None = None

    @property
    def eval_tasks(self) -> list[Task]:
        if self._eval_tasks is None:
            root = self.config.eval_tasks
            self._eval_tasks = (
                self.tasks
                if root is None
                else select_tasks(root, self.config.max_solution_chars, self.config.task_ids)
            )
        return self._eval_tasks

    def rows(self, split: Split) -> list[dict[str, Any]]:
        return [task_row(t) for t in (self.tasks if split == "train" else self.eval_tasks)]

    @property
    def provider(self) -> SandboxProvider:
        if self._provider is None:
            from agentrl.sandbox.registry import make_provider

            options = {"private_verification": True} if self.config.private_verification else {}
            if options and self.config.backend != "daytona":
                raise EnvironmentPluginError(
                    f"env.private_verification is a Daytona option; the {self.config.backend} "
                    "backend's verification is private already or not at all: unset it"
                )
            self._provider = make_provider(self.config.backend, **options)
        return self._provider

    def episode_config(self) -> EpisodeConfig:
        c = self.context
        return EpisodeConfig(
            action_format=self.config.action_format,
            agent=self.config.agent,
            sampling=SamplingParams(
                temperature=c.temperature,
                top_p=c.top_p,
                top_k=c.top_k,
                max_new_tokens=self.config.agent.max_new_tokens,
            ),
            system_prompt=self.config.system_prompt,
            create_timeout_s=self.config.create_timeout_s,
            max_agent_timeout_s=self.config.max_agent_timeout_s,
        )

    def runner(self, engine: Engine, *, run_id: str, record_dir: Path | None = None) -> SandboxEpisodeRunner:
        tok = self.context.tokenizer
        return SandboxEpisodeRunner(
            provider=self.provider,
            engine=engine,
            renderer=ChatRenderer.for_format(tok, self.config.action_format) if tok is not None else None,
            config=self.episode_config(),
            run_id=run_id,
            record_dir=record_dir if self.config.record else None,
        )

    async def aclose(self) -> None:
        if self._provider is not None:
            provider, self._provider = self._provider, None
            await provider.aclose()


class _Plugin:
    name = "tbench2"
    Config = TerminalConfig

    def build(self, config: TerminalConfig, context: EnvContext) -> TerminalEnvironment:
        return TerminalEnvironment(config, context)


plugin = _Plugin()
