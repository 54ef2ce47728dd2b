"""Settings from files and `--set` overrides: the one override syntax of every entry point.

`a.b.c=value` sets a nested key; the value is JSON when it parses as JSON (`3e-5`, `true`, `null`,
`[1,8]`), else a plain string. Files are TOML, JSON or YAML. Validation belongs to the typed
config the result feeds (`agentrl.runtime.config.RunConfig`, `agentrl.train.config.TrainConfig`).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from agentrl.errors import AgentRLError


class ConfigError(AgentRLError):
    """A run configuration cannot be read, parsed or validated."""


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """`a.b.c=value` items applied to a nested dict (in place, and returned)."""
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: write section.field=value (e.g. trainer.lr=3e-5)")
        parts = key.strip().split(".")
        target = data
        for part in parts[:-1]:
            nxt = target.get(part)
            if nxt is None:
                nxt = target[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {key}: {part!r} is a value, not a section")
            target = nxt
        target[parts[-1]] = _parse_value(raw)
    return data


def load_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix == ".toml":
            return tomllib.loads(text)
        if p.suffix == ".json":
            return dict(json.loads(text))
        if p.suffix in (".yaml", ".yml"):
            import yaml

            return dict(yaml.safe_load(text) or {})
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{p}: cannot parse: {exc}") from exc
    except ImportError:
        raise ConfigError(f"{p}: YAML needs PyYAML (pip install pyyaml), or use .toml / .json") from None
    raise ConfigError(f"{p}: unknown config format {p.suffix!r}: use .toml, .json or .yaml")
