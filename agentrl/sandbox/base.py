"""The Sandbox seam: one started container-like environment per episode.

Every backend (podman, daytona, fake) implements `Sandbox` and `SandboxProvider` and passes the
same contract suite in `tests/sandbox_contract.py`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from agentrl.errors import InfraError

if TYPE_CHECKING:
    from agentrl.tasks import Task

DEFAULT_OUTPUT_LIMIT = 64 * 1024


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxError(InfraError):
    """The sandbox failed as infrastructure (create, transport, dead container)."""

    cause = "sandbox"


class SandboxCreateError(SandboxError):
    cause = "sandbox_create"


class ImageBuildError(SandboxCreateError):
    cause = "image_build"


class SandboxTransportError(SandboxError):
    cause = "sandbox_transport"


def bound_output(text: str, limit: int = DEFAULT_OUTPUT_LIMIT) -> str:
    """Keep the head and the tail of `text` within `limit` characters, with a marker in between
    saying how much was cut."""
    if len(text) <= limit:
        return text
    half = limit // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters omitted ...]\n{text[-half:]}"


@dataclass
class SandboxSpec:
    """What a provider needs to start a sandbox, resolved from a task plus run options."""

    task_id: str
    run_id: str
    image: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    network: bool = False
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


class Sandbox(abc.ABC):
    """A started sandbox. Use as `async with`; `close()` is idempotent."""

    sandbox_id: str

    @abc.abstractmethod
    async def exec(
        self,
        cmd: str,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run `cmd` with bash. A timeout kills the command and returns `timed_out=True`; the
        sandbox stays usable. Transport failures raise `SandboxTransportError`."""

    @abc.abstractmethod
    async def upload(self, src: Path, dst: str) -> None:
        """Copy a host file or directory to `dst` inside the sandbox (directories: contents)."""

    @abc.abstractmethod
    async def download(self, src: str, dst: Path) -> None:
        """Copy a sandbox file or directory to `dst` on the host."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop and remove the sandbox. Idempotent, safe under cancellation."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class SandboxProvider(abc.ABC):
    """Turns a task into a started sandbox (building or reusing its image)."""

    @abc.abstractmethod
    async def create(self, task: Task, *, run_id: str) -> Sandbox:
        """Start a sandbox for `task` in the agent phase: no tests/, no solution/ inside."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release provider-wide resources (warm pools, clients)."""

    def live_sandboxes(self) -> int:
        """How many sandboxes this provider created and has not closed (leak checks)."""
        return 0
