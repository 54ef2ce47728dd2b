"""The fake backend: the shared contract, plus its fault injection."""

from __future__ import annotations

import pytest

from agentrl.sandbox.base import ExecResult, SandboxCreateError, SandboxTransportError, TerminalClosedError
from agentrl.sandbox.registry import make_provider
from agentrl.tasks.task import load_task
from agentrl.testing.sandbox import FakeSandboxProvider, Faults
from tests.sandbox_contract import SandboxContract
from tests.terminal_contract import TerminalContract

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


# -- the fake terminal --------------------------------------------------------------------------------
async def test_fake_terminal_echoes_typing_and_runs_lines_through_the_handlers() -> None:
    provider = FakeSandboxProvider().on(
        r"^make (\w+)$", lambda sb, cmd, m: f"built {m.group(1)} in {sb.cwd}\n"
    )
    async with await provider.create("t", run_id="r") as sb:
        term = await sb.open_terminal(width=40, height=8)
        await term.send_keys("cd /app")
        assert (await term.capture()).startswith("root@sandbox:/# cd /app\n")  # echoed, not run
        await term.send_keys(["Enter", "make all", "Enter", "echo $HOME", "Enter"])
        screen = await term.capture()
        assert screen.split("\n")[:5] == [
            "root@sandbox:/# cd /app",
            "root@sandbox:/app# make all",
            "built all in /app",
            "root@sandbox:/app# echo $HOME",
            "$HOME",
        ]
        assert (await sb.exec("pwd")).stdout == "/\n"  # the terminal's shell is its own


async def test_fake_terminal_foreground_sleep_ctrl_c_and_typeahead() -> None:
    async with await FakeSandboxProvider().create("t", run_id="r") as sb:
        term = await sb.open_terminal()
        await term.send_keys("sleep 5\n", duration=1.0)
        assert not await term.is_idle()
        await term.send_keys("echo later\n", duration=1.0)  # typed ahead: echoed, run afterwards
        assert "\nlater\n" not in await term.capture()
        await term.send_keys("", duration=3.0)
        assert await term.is_idle() and "\nlater\n" in await term.capture()
        await term.send_keys("sleep 100\n", duration=1.0)
        await term.send_keys("C-c")
        assert await term.is_idle()
        assert "sleep 100\n^C\nroot@sandbox:/# " in await term.capture()
        assert [d for _, d in term.sent] == [1.0, 1.0, 3.0, 1.0, 0.0]  # type: ignore[attr-defined]


async def test_fake_terminal_screen_is_the_last_rows_wrapped_at_the_width() -> None:
    provider = FakeSandboxProvider().on(r"^many$", "\n".join(f"line {i}" for i in range(30)) + "\n")
    async with await provider.create("t", run_id="r") as sb:
        term = await sb.open_terminal(width=10, height=4)
        await term.send_keys("many\n")
        assert await term.capture() == "line 28\nline 29\nroot@sandb\nox:/# \n"
        history = await term.capture(history=True)
        assert history.startswith("root@sandb\nox:/# many\nline 0\n")


async def test_fake_terminal_ends_with_ctrl_d_exit_and_stop_processes() -> None:
    async with await FakeSandboxProvider().create("t", run_id="r") as sb:
        for ending in ("C-d", "exit\n"):
            term = await sb.open_terminal()
            await term.send_keys(ending)
            assert not await term.is_alive()
            with pytest.raises(TerminalClosedError):
                await term.send_keys("echo late\n")
        term = await sb.open_terminal()
        await sb.stop_processes()
        assert not await term.is_alive()
        with pytest.raises(ValueError, match="width and height"):
            await sb.open_terminal(width=0)


def _interactive_grader(sb) -> float:  # type: ignore[no-untyped-def]
    """tests/fixtures/sandbox_tasks/interactive/tests/test.sh: `$(cat /app/out.txt)` is hello."""
    return 1.0 if sb.files.get("/app/out.txt", b"").rstrip(b"\n") == b"hello" else 0.0


class TestFakeTerminal(TerminalContract):
    keeps_listeners = False  # as on Daytona: `stop_processes` ends every process the fake models

    @pytest.fixture
    def provider(self) -> FakeSandboxProvider:
        return FakeSandboxProvider(grader=_interactive_grader)
