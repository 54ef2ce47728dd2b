"""The fake backend: the shared contract, plus its fault injection."""

from __future__ import annotations

import pytest

from agentrl.sandbox.base import ExecResult, SandboxCreateError, SandboxTransportError
from agentrl.sandbox.fake import FakeSandboxProvider, Faults
from agentrl.sandbox.registry import make_provider
from agentrl.tasks import load_task
from tests.sandbox_contract import SandboxContract

TASK = "tests/fixtures/sandbox_tasks/write-hello"


class TestFakeContract(SandboxContract):
    @pytest.fixture
    def provider(self) -> FakeSandboxProvider:
        return FakeSandboxProvider()

    @pytest.fixture
    def task(self):
        return load_task(TASK)


async def test_scripted_handlers_take_precedence() -> None:
    provider = (
        FakeSandboxProvider()
        .on(r"^ls /app$", "out.txt\n")
        .on(r"^make (\w+)$", lambda sb, cmd, m: ExecResult("", f"no rule {m.group(1)}\n", 2))
    )
    async with await provider.create("t", run_id="r") as sb:
        assert (await sb.exec("ls /app")).stdout == "out.txt\n"
        res = await sb.exec("make all")
        assert (res.stderr, res.exit_code) == ("no rule all\n", 2)
        assert (await sb.exec("frobnicate")).exit_code == 127
    assert provider.live_sandboxes() == 0


def _fault_pattern(seed: int) -> list[str]:
    async def run() -> list[str]:
        provider = FakeSandboxProvider(faults=Faults(create_failure=0.3, transport_error=0.3), seed=seed)
        seen = []
        for _ in range(20):
            try:
                sb = await provider.create("t", run_id="r")
            except SandboxCreateError:
                seen.append("create")
                continue
            try:
                await sb.exec("true")
                seen.append("ok")
            except SandboxTransportError:
                seen.append("transport")
            finally:
                await sb.close()
        assert provider.live_sandboxes() == 0
        return seen

    import asyncio

    return asyncio.run(run())


def test_faults_are_seeded_and_happen() -> None:
    a, b, c = _fault_pattern(1), _fault_pattern(1), _fault_pattern(2)
    assert a == b
    assert a != c
    assert {"create", "transport", "ok"} <= set(a)


async def test_hang_returns_timed_out_at_the_callers_timeout() -> None:
    provider = FakeSandboxProvider(faults=Faults(hang=1.0))
    async with await provider.create("t", run_id="r") as sb:
        res = await sb.exec("true", timeout=0.05)
    assert res.timed_out and res.exit_code is None


def test_registry_names_backends() -> None:
    assert isinstance(make_provider("fake"), FakeSandboxProvider)
    from agentrl.errors import AgentRLError

    with pytest.raises(AgentRLError, match="unknown sandbox backend"):
        make_provider("lxc")
