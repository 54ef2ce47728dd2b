"""Harbor / terminal-bench-2 tasks: the model, loading, linting and training rows."""

from agentrl.tasks.config import (
    AgentConfig,
    EnvironmentConfig,
    Metadata,
    SolutionConfig,
    TaskConfig,
    VerifierConfig,
    parse_task_config,
    resolve_env_templates,
)
from agentrl.tasks.task import Task, discover_tasks, load_task

__all__ = [
    "AgentConfig",
    "EnvironmentConfig",
    "Metadata",
    "SolutionConfig",
    "Task",
    "TaskConfig",
    "VerifierConfig",
    "discover_tasks",
    "load_task",
    "parse_task_config",
    "resolve_env_templates",
]
