"""The engine API key read from a file (a cluster run's `engine.key` on shared storage): one key on one
line, private to its owner. The key itself is never logged."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from agentrl.errors import AgentRLError

log = logging.getLogger(__name__)


class EngineKeyError(AgentRLError):
    """The engine key file is missing, empty or unreadable, or a program cannot take the key."""


def read_key(path: str | os.PathLike[str]) -> str:
    """The key in `path` (one line), or an EngineKeyError that says what to do."""
    p = Path(path).expanduser()
    try:
        key = p.read_text().strip()
    except OSError as exc:
        raise EngineKeyError(
            f"cannot read the engine key file {p} ({exc.strerror}): the driver creates it on the shared "
            f"storage before it starts the engines; every node must see the same path"
        ) from None
    if not key or any(c.isspace() for c in key):
        raise EngineKeyError(f"the engine key file {p} must hold one key on one line (no spaces)")
    if ":" in key:  # smg reads --control-plane-api-keys as id:name:role:key
        raise EngineKeyError(f"the engine key in {p} must not contain ':' (smg splits its keys on it)")
    if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("engine key file %s is readable by others: chmod 600 it", p)
    return key
