"""The terminal environment: Harbor / terminal-bench-2 tasks, one sandbox per episode, scored by the
task's own `tests/test.sh` (`agentrl.episode.run`). Bundled example tasks are under `tasks/`.

    env.name=tbench2  env.tasks=<dir of task dirs>  env.backend=podman|docker|daytona|fake
"""

from envs.tbench2.environment import TerminalConfig, TerminalEnvironment, plugin

__all__ = ["TerminalConfig", "TerminalEnvironment", "plugin"]
