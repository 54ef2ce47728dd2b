"""Oracle trajectories for an SFT warm start: each task's reference solution driven through the real
agent loop and sandboxes by a scripted engine, kept when it scores 1."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.agent.actions import get_format
from agentrl.agent.solution import scripted_solution_texts
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import run_episode
from agentrl.errors import AgentRLError
from envs.tbench2.environment import TerminalEnvironment


class HarvestError(AgentRLError):
    """A reference solution did not pass through the agent loop."""


async def harvest_solutions(
    env: TerminalEnvironment,
    tokenizer: Any,
    record_dir: Path,
    *,
    max_new_tokens: int,
    max_total_tokens: int,
    report: Callable[[str], None] = print,
) -> Path:
    """Write one episode record per training task under `record_dir` (emptied first)."""
    shutil.rmtree(record_dir, ignore_errors=True)
    renderer = ChatRenderer.for_format(tokenizer, env.config.action_format)
    config = env.episode_config()
    # A script can be longer than the policy's own turns: give the scripted replies room.
    config = dataclasses.replace(
        config,
        agent=dataclasses.replace(
            config.agent, max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens
        ),
    )
    for task in env.tasks:
        terminal = config.agent.mode_for(get_format(env.config.action_format)) == "tmux"
        engine = ScriptedEngine(
            scripted_solution_texts(task, env.config.action_format, terminal=terminal), tokenizer
        )
        result = await run_episode(
            task,
            provider=env.provider,
            engine=engine,
            renderer=renderer,
            config=config,
            run_id="harvest",
            record_dir=record_dir,
        )
        reward = result.verify.reward if result.verify else None
        report(f"harvest {task.task_id}: reward {reward}")
        if reward != 1.0:
            raise HarvestError(
                f"the reference solution of {task.task_id} did not pass through the agent loop"
            )
    return record_dir
