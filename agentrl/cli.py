"""The `agentrl` command. Each area owns its sub-command group in its own `cli.py`."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Agentic RL on terminal tasks.")

# (module, attribute, name) of each sub-command group; imported lazily-at-start so that a missing
# optional extra only disables its own group.
_GROUPS = [
    ("agentrl.tasks.cli", "app", "tasks"),
    ("agentrl.sandbox.cli", "app", "sandbox"),
    ("agentrl.engine.cli", "app", "engine"),
    ("agentrl.episode_cli", "app", "episode"),
    ("agentrl.train.cli", "app", "train"),
]

for _module, _attr, _name in _GROUPS:
    try:
        _group = getattr(importlib.import_module(_module), _attr)
    except ModuleNotFoundError as _exc:
        if _exc.name and _exc.name.startswith("agentrl"):
            continue  # that area is not built in this install
        raise
    app.add_typer(_group, name=_name)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
