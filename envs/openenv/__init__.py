"""Train on a remote OpenEnv environment server: the upstream `tbench2_env` schema (terminal tasks,
e.g. `agentrl env serve tbench2`) or any environment whose actions carry text.

    env.name=openenv  env.url=http://127.0.0.1:8000  env.protocol=tbench2|text
"""

from envs.openenv.environment import OpenEnvConfig, OpenEnvEnvironment, RemoteTextRunner, plugin

__all__ = ["OpenEnvConfig", "OpenEnvEnvironment", "RemoteTextRunner", "plugin"]
