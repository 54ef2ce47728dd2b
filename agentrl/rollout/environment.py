"""The `Environment` plugin seam: what turns prompt rows into episodes and rewards.

An environment plugin is a package (the bundled ones live under `envs/<name>/`) that exposes a
`plugin` object with a `name`, a pydantic `Config` class (its settings, printed by `--dry-run` like
every other setting) and `build(config, context) -> Environment`. Plugins are found by name in
the `agentrl.environments` entry-point group of any installed package (the bundled ones are declared
in pyproject.toml). The rollout manager, the trainer and the runtime import no environment: terminal
tasks and single-turn math are two plugins of this one interface.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from agentrl.engine.base import Engine
from agentrl.errors import AgentRLError
from agentrl.rollout.manager import EpisodeRunner

Split = Literal["train", "eval"]

# The environment a run gets when its settings name none (the terminal tasks, the product's purpose).
DEFAULT_ENV = "tbench2"


class EnvironmentPluginError(AgentRLError):
    """An environment plugin cannot be found, configured or built."""


@dataclass(frozen=True)
class EnvContext:
    """What the runtime hands a plugin when building it."""

    tokenizer: Any  # a Hugging Face tokenizer, or None for engines that take text
    seed: int
    out_dir: Path
    temperature: float
    top_p: float = 1.0
    top_k: int = -1


class Environment(Protocol):
    """A built environment: its rows and a runner per engine."""

    def rows(self, split: Split) -> list[dict[str, Any]]:
        """Prompt rows for training or evaluation (the JSONL row shape, `agentrl.tasks.rows`)."""
        ...

    def runner(self, engine: Engine, *, run_id: str, record_dir: Path | None = None) -> EpisodeRunner:
        """An episode runner over `engine` (row -> Episode, eval settings when asked)."""
        ...

    async def aclose(self) -> None:
        """Release what the environment holds (sandbox providers, pools)."""
        ...


class EnvironmentPlugin(Protocol):
    name: str
    Config: type[BaseModel]

    def build(self, config: Any, context: EnvContext) -> Environment: ...


def available() -> dict[str, str]:
    """Environment name -> "module:attribute" of its plugin: every installed package's entry in the
    `agentrl.environments` entry-point group (the bundled ones are declared in pyproject.toml)."""
    return {ep.name: ep.value for ep in entry_points(group="agentrl.environments")}


def get_plugin(name: str) -> EnvironmentPlugin:
    known = available()
    if name not in known:
        raise EnvironmentPluginError(
            f"unknown environment {name!r}: choose one of {', '.join(sorted(known))}, or install a "
            "package that registers it in the 'agentrl.environments' entry-point group (or reinstall agentrl: pip install -e .)"
        )
    module, _, attr = known[name].partition(":")
    try:
        plugin = getattr(importlib.import_module(module), attr or "plugin")
    except (ImportError, AttributeError) as exc:
        raise EnvironmentPluginError(f"environment {name!r} ({known[name]}) cannot be loaded: {exc}") from exc
    return plugin


def resolve_config(settings: dict[str, Any]) -> BaseModel:
    """`{"name": ..., **options}` -> the plugin's validated Config (defaults filled in)."""
    data = dict(settings)
    name = data.get("name")
    if not name:
        raise EnvironmentPluginError("the env settings need a name (e.g. env.name=tbench2)")
    return get_plugin(str(name)).Config.model_validate(data)
