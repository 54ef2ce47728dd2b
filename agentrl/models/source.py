"""Where model weights come from: a local directory, or a Hugging Face hub name."""

from __future__ import annotations

import os
from pathlib import Path

from agentrl.errors import AgentRLError


class ModelSourceError(AgentRLError):
    """A model or tokenizer that cannot be loaded from where the configuration says."""


def check_model_source(source: str | os.PathLike[str], what: str = "model") -> str:
    """`source` as a string, after refusing a local path that does not exist or is no model
    directory. A path (absolute, relative with a separator, or `~`) never falls through to the hub,
    where it would fail with a misleading "repo id" error; a bare name (`org/name`) is a hub id."""
    text = os.fspath(source)
    looks_local = text.startswith(("/", ".", "~")) or (os.sep in text and Path(text).expanduser().exists())
    if not looks_local:
        return text
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"{what} directory {text} does not exist: give a Hugging Face model directory "
            "(config.json, weights and tokenizer files) or a hub name like Qwen/Qwen3-0.6B"
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelSourceError(
            f"{what} directory {text} has no config.json: it is not a Hugging Face model directory"
        )
    return str(path)
