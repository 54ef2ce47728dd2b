"""Sandbox backends by name: `make_provider("podman" | "docker" | "daytona" | "fake", **options)`."""

from __future__ import annotations

import asyncio
import functools
import importlib
from typing import Any

from agentrl.errors import AgentRLError
from agentrl.sandbox import images
from agentrl.sandbox.base import SandboxProvider
from agentrl.sandbox.podman import PodmanProvider
from agentrl.tasks.task import Task

BACKENDS = ("podman", "docker", "daytona", "fake")


def make_provider(backend: str, **options: Any) -> SandboxProvider:
    if backend in ("podman", "docker"):
        return _lazy_bases_provider()(cli=options.pop("cli", backend), **options)
    if backend == "fake":
        # The in-memory double is reached by name only (tests and the CPU loop pick it with
        # `--backend fake`); product code never imports the testing wing.
        return importlib.import_module("agentrl.testing.sandbox").FakeSandboxProvider(**options)
    if backend == "daytona":
        try:
            from agentrl.sandbox.daytona import DaytonaProvider
        except ImportError as exc:
            raise AgentRLError(
                f"the daytona backend needs the daytona SDK ({exc}): pip install 'agentrl[daytona]'"
            ) from None
        return DaytonaProvider(**options)
    raise AgentRLError(f"unknown sandbox backend {backend!r}: choose one of {', '.join(BACKENDS)}")


@functools.cache
def _lazy_bases_provider() -> type[SandboxProvider]:
    """PodmanProvider that first builds the stand-in families a task's `FROM`s need (a language
    family is built only when a task asks for it; `agentrl sandbox build-bases` builds the root)."""

    class LazyBasesPodmanProvider(PodmanProvider):
        async def image_for(self, task: Task) -> str:
            image = task.config.environment.docker_image
            if task.dockerfile is not None and not (
                image and await asyncio.to_thread(images.image_exists, self.cli, image)
            ):
                text = task.dockerfile.read_text(encoding="utf-8", errors="replace")
                await asyncio.to_thread(images.ensure_standins, text, cli=self.cli)
            return await super().image_for(task)

    return LazyBasesPodmanProvider
