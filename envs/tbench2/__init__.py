"""The terminal environment: Harbor / terminal-bench-2 tasks, one sandbox per episode, scored by the
task's own `tests/test.sh` (`agentrl.episode.run`). Bundled example tasks are under `tasks/`.

    env.name=tbench2  env.tasks=<dir of task dirs>  env.backend=podman|docker|daytona|fake
"""

from envs.tbench2 import data
from envs.tbench2.environment import TerminalConfig, TerminalEnvironment, plugin

# The cluster recipes' data hooks (prepare, run settings, local mode): `agentrl.cluster.recipe.env_data`.
plugin.data = data  # type: ignore[attr-defined]

__all__ = ["TerminalConfig", "TerminalEnvironment", "data", "plugin"]
