"""Daytona credentials: read from the environment or a key file, never logged, never shipped by value.

Resolution order: `DAYTONA_API_KEY`; else the file named by `DAYTONA_API_KEY_FILE`; else
`~/.config/daytona/api_key` if it exists. `DAYTONA_API_URL` and `DAYTONA_TARGET` are optional.
The key only ever reaches the Daytona SDK's client configuration: the credentials object's repr
redacts it, sandboxes never get it in their environment, and `ray_runtime_env_for_daytona()` hands
Ray workers the key file's path, so the value never sits in a job's runtime-env payload.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.errors import AgentRLError

if TYPE_CHECKING:
    from daytona import DaytonaConfig

log = logging.getLogger(__name__)

ENV_KEY = "DAYTONA_API_KEY"
ENV_KEY_FILE = "DAYTONA_API_KEY_FILE"
ENV_URL = "DAYTONA_API_URL"
ENV_TARGET = "DAYTONA_TARGET"
DEFAULT_KEY_FILE = Path("~/.config/daytona/api_key")


class DaytonaCredentialsError(AgentRLError):
    """No usable Daytona API key, or a key that cannot travel the way it was asked to."""


def _read_key_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise DaytonaCredentialsError(
            f"cannot read the Daytona API key file {path} ({exc.strerror}): "
            f"create it with the key on one line (chmod 600), or set {ENV_KEY}"
        ) from None
    if not text:
        raise DaytonaCredentialsError(f"the Daytona API key file {path} is empty: put the key on one line")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("Daytona API key file %s is readable by others: chmod 600 it", path)
    return text


@dataclass(frozen=True, repr=False)
class DaytonaCredentials:
    """A resolved Daytona API key plus where to send it. `repr`/`str` never show the key."""

    api_key: str
    api_url: str | None = None
    target: str | None = None
    key_file: Path | None = None  # set when the key came from a file: the only thing that travels

    def __repr__(self) -> str:
        source = f"file {self.key_file}" if self.key_file else f"${ENV_KEY}"
        return (
            f"DaytonaCredentials(api_key=<redacted from {source}>, api_url={self.api_url!r}, "
            f"target={self.target!r})"
        )

    __str__ = __repr__

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DaytonaCredentials:
        env = os.environ if environ is None else environ
        url = env.get(ENV_URL) or None
        target = env.get(ENV_TARGET) or None
        if env.get(ENV_KEY):
            return cls(api_key=env[ENV_KEY].strip(), api_url=url, target=target)
        if env.get(ENV_KEY_FILE):
            path = Path(env[ENV_KEY_FILE]).expanduser()
            return cls(api_key=_read_key_file(path), api_url=url, target=target, key_file=path)
        default = DEFAULT_KEY_FILE.expanduser()
        if default.is_file():
            return cls(api_key=_read_key_file(default), api_url=url, target=target, key_file=default)
        raise DaytonaCredentialsError(
            f"no Daytona API key: set {ENV_KEY}, or write the key to {DEFAULT_KEY_FILE} (chmod 600) "
            f"or to a file named by {ENV_KEY_FILE}; create keys at https://app.daytona.io/dashboard/keys"
        )

    def sdk_config(self) -> DaytonaConfig:
        """The SDK client configuration; the one place the key value is handed on."""
        from daytona import DaytonaConfig

        return DaytonaConfig(api_key=self.api_key, api_url=self.api_url, target=self.target)


def ray_runtime_env_for_daytona(
    credentials: DaytonaCredentials | None = None, *, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A Ray `runtime_env` that lets workers build their own `DaytonaCredentials`: the key file's
    path (which must be readable on every worker, e.g. a shared filesystem), URL and target, never
    the key's value. A key that exists only in `DAYTONA_API_KEY` is refused with what to do."""
    creds = credentials or DaytonaCredentials.from_env(environ)
    if creds.key_file is None:
        raise DaytonaCredentialsError(
            f"the Daytona key comes from ${ENV_KEY}, and Ray workers must not receive it by value: "
            f"write it to a file readable on every worker (chmod 600), set {ENV_KEY_FILE} to that "
            f"path and unset {ENV_KEY}"
        )
    env_vars = {ENV_KEY_FILE: str(creds.key_file.resolve())}
    if creds.api_url:
        env_vars[ENV_URL] = creds.api_url
    if creds.target:
        env_vars[ENV_TARGET] = creds.target
    return {"env_vars": env_vars}
