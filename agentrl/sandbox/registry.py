"""Sandbox backends by name: `make_provider("podman" | "docker" | "daytona" | "fake", **options)`."""

from __future__ import annotations

from typing import Any

from agentrl.errors import AgentRLError
from agentrl.sandbox.base import SandboxProvider

BACKENDS = ("podman", "docker", "daytona", "fake")


def make_provider(backend: str, **options: Any) -> SandboxProvider:
    if backend in ("podman", "docker"):
        from agentrl.sandbox.podman import PodmanProvider

        return PodmanProvider(cli=options.pop("cli", backend), **options)
    if backend == "fake":
        from agentrl.sandbox.fake import FakeSandboxProvider

        return FakeSandboxProvider(**options)
    if backend == "daytona":
        try:
            from agentrl.sandbox.daytona import DaytonaProvider
        except ImportError as exc:
            raise AgentRLError(
                f"the daytona backend needs the daytona SDK ({exc}): pip install 'agentrl[daytona]'"
            ) from None
        return DaytonaProvider(**options)
    raise AgentRLError(f"unknown sandbox backend {backend!r}: choose one of {', '.join(BACKENDS)}")
