"""What container backends (podman, the Daytona fake) promise beyond `SandboxContract`: the agent's
shell session in full (functions, aliases, options, background jobs, a verifier it cannot reach)
and the terminal (`Sandbox.open_terminal`: tmux driven as Harbor's Terminus-2 drives it).

Use them like `SandboxContract`: subclass in a backend's test module and override `provider`;
`task` defaults to the `interactive` fixture (vi in its image; tests/test.sh rewards "hello" in
/app/out.txt). Servers bind to 127.0.0.1 inside the sandbox and are queried from inside it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from agentrl.episode.verify import verify
from agentrl.sandbox.base import Sandbox, SandboxProvider, TerminalClosedError, TerminalSession
from agentrl.tasks.task import load_task

INTERACTIVE = Path(__file__).parent / "fixtures" / "sandbox_tasks" / "interactive"
PROBE = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=5).status)\""


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 15.0) -> bool:
    """Poll `check` until it holds or `timeout` passes (programs start at their own pace)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.2)
    return await check()


async def live_processes(sandbox: Sandbox) -> str:
    """`ps` of the sandbox without zombies (Daytona's PID 1 may not reap) and with states."""
    ps = (await sandbox.exec("ps -eo stat,args")).stdout
    return "\n".join(line for line in ps.splitlines() if not line.startswith("Z"))


async def screen_shows(term: TerminalSession, text: str, timeout: float = 15.0) -> str:
    screen = ""

    async def check() -> bool:
        nonlocal screen
        screen = await term.capture()
        return text in screen

    assert await until(check, timeout), f"{text!r} never appeared on the screen:\n{screen}"
    return screen


class _Backend:
    @pytest.fixture
    def provider(self) -> SandboxProvider:
        raise NotImplementedError("a contract test module must override the `provider` fixture")

    @pytest.fixture
    def task(self):
        return load_task(INTERACTIVE)

    @pytest.fixture
    async def sandbox(self, provider: SandboxProvider, task):
        sb = await provider.create(task, run_id="terminal-contract")
        try:
            yield sb
        finally:
            await sb.close()
            await provider.aclose()
            assert provider.live_sandboxes() == 0


class ShellSessionContract(_Backend):
    async def test_functions_aliases_options_and_unexported_variables_persist(self, sandbox: Sandbox) -> None:
        await sandbox.exec(
            "greet() { echo \"hi $1\"; }; alias ll='echo aliased'; LOCAL_ONLY='x y'; arr=(a 'b c'); "
            "set -o pipefail; shopt -s extglob; umask 027"
        )
        res = await sandbox.exec(
            'greet you; ll; echo "$LOCAL_ONLY ${arr[1]}"; printenv LOCAL_ONLY; '
            "set -o | grep -c 'pipefail.*on'; shopt -q extglob && echo extglob; umask"
        )
        assert res.stdout == "hi you\naliased\nx y b c\n1\nextglob\n0027\n", res
        await sandbox.exec("unset -f greet; unalias ll; unset LOCAL_ONLY HOME; set +o pipefail")
        res = await sandbox.exec('type greet; type ll; echo "[$LOCAL_ONLY][$HOME]"; set -o | grep pipefail')
        assert "[][]" in res.stdout and "pipefail" in res.stdout and "off" in res.stdout
        assert "not found" in res.stderr

    async def test_exported_functions_and_variables_reach_child_processes(self, sandbox: Sandbox) -> None:
        await sandbox.exec("f() { echo from-f; }; export -f f; export CHILD_SEES=yes")
        res = await sandbox.exec("bash -c 'f; echo $CHILD_SEES'")
        assert res.stdout == "from-f\nyes\n"

    async def test_exit_and_errexit_keep_what_the_command_changed(self, sandbox: Sandbox) -> None:
        res = await sandbox.exec("cd /tmp; export AFTER_EXIT=1; exit 3")
        assert res.exit_code == 3
        assert (await sandbox.exec("pwd; printenv AFTER_EXIT")).stdout == "/tmp\n1\n"
        assert (await sandbox.exec("set -e; cd /; false; echo unreachable")).stdout == ""
        res = await sandbox.exec("false; echo errexit-persists")
        assert res.exit_code == 1 and res.stdout == ""  # `set -e` is session state too
        await sandbox.exec("set +e")
        assert (await sandbox.exec("false; pwd")).stdout == "/\n"

    async def test_set_x_traces_the_commands_only(self, sandbox: Sandbox) -> None:
        await sandbox.exec("set -x")
        res = await sandbox.exec("echo traced")
        assert res.stdout == "traced\n"
        assert "echo traced" in res.stderr and "__ar" not in res.stderr and "trap" not in res.stderr

    async def test_background_jobs_outlive_their_command_and_later_timeouts(self, sandbox: Sandbox) -> None:
        await sandbox.exec("sleep 600 & echo $! > /tmp/bg.pid")
        assert (await sandbox.exec("sleep 30", timeout=1)).timed_out
        res = await sandbox.exec("kill -0 $(cat /tmp/bg.pid) && echo running")
        assert res.stdout == "running\n"

    async def test_the_verifier_never_sees_the_agents_session(self, sandbox: Sandbox) -> None:
        """Aliases, functions, PATH and BASH_ENV the agent left would make tests/test.sh's `cat`
        print "hello" on an unsolved task; the verifier runs from a clean state."""
        await sandbox.exec(
            "mkdir -p /tmp/evil && printf '#!/bin/sh\\necho hello\\n' > /tmp/evil/cat && chmod +x /tmp/evil/cat; "
            "echo 'cat() { echo hello; }; python3() { echo 1; }' > /tmp/evil.sh; "
            "cat() { echo hello; }; python3() { echo 1; }; export -f cat python3; alias cat='echo hello;:'; "
            "export BASH_ENV=/tmp/evil.sh PATH=/tmp/evil:$PATH"
        )
        assert (await sandbox.exec("cat /app/out.txt")).stdout == "hello\n"  # the session is hijacked
        assert (await sandbox.exec("bash -c 'cat /app/out.txt'")).stdout == "hello\n"
        result = await verify(sandbox, load_task(INTERACTIVE))
        assert result.outcome == "fail" and result.reward == 0.0, result


class TerminalContract(_Backend):
    keeps_listeners = True  # whether `stop_processes` spares servers listening on a socket

    async def test_a_foreground_server_keeps_serving_while_later_commands_query_it(
        self, sandbox: Sandbox
    ) -> None:
        term = await sandbox.open_terminal()
        await term.send_keys("python3 -m http.server 8000 --bind 127.0.0.1\n", duration=1.0)
        await screen_shows(term, "Serving HTTP")
        assert not await term.is_idle()
        res = await sandbox.exec(PROBE.format(port=8000), timeout=30)
        assert res.stdout == "200\n", res
        await screen_shows(term, '"GET / HTTP/1.1" 200')  # the server's own log, on its screen
        await term.send_keys("C-c", duration=0.5)
        assert await until(term.is_idle)
        assert (await sandbox.exec(PROBE.format(port=8000), timeout=30)).exit_code != 0
        await term.close()

    async def test_ctrl_c_stops_a_running_program(self, sandbox: Sandbox) -> None:
        term = await sandbox.open_terminal(width=80, height=24)
        assert await until(term.is_idle)
        await term.send_keys("sleep 1000\n", duration=0.3)
        assert not await term.is_idle()
        await term.send_keys("C-c")
        assert await until(term.is_idle)
        assert "^C" in await term.capture()
        assert "sleep 1000" not in await live_processes(sandbox)

    async def test_a_python_repl_computes(self, sandbox: Sandbox) -> None:
        term = await sandbox.open_terminal()
        await term.send_keys("python3\n", duration=0.5)
        await screen_shows(term, ">>>")
        await term.send_keys(["x = 6 * 7", "Enter", "print(x + 0)", "Enter"], duration=0.2)
        screen = await screen_shows(term, "\n42\n")
        assert screen.count(">>>") >= 3
        await term.send_keys("exit()\n")
        assert await until(term.is_idle)

    async def test_vi_edits_a_file(self, sandbox: Sandbox) -> None:
        term = await sandbox.open_terminal()
        await term.send_keys("vi /app/out.txt\n", duration=1.0)
        await screen_shows(term, "~")  # vi's empty-buffer lines
        await term.send_keys("i", duration=0.2)
        await term.send_keys("hello", duration=0.2)
        await term.send_keys("Escape", duration=0.2)
        await term.send_keys(":wq\n", duration=0.5)
        assert await until(term.is_idle)
        assert (await sandbox.exec("cat /app/out.txt")).stdout == "hello\n"
        assert (await verify(sandbox, load_task(INTERACTIVE))).reward == 1.0  # no tampering flagged

    async def test_keys_lists_key_names_and_long_pastes(self, sandbox: Sandbox) -> None:
        term = await sandbox.open_terminal()
        await term.send_keys(["echo", "Space", "spaced", "Enter"])
        await screen_shows(term, "\nspaced\n")
        long = "x" * 20_000  # over tmux's command limit: goes through a paste buffer
        await term.send_keys(f"echo {long} | wc -c\n")
        await screen_shows(term, "\n20001\n")
        await term.send_keys(["ech again", "C-a", "Right", "Right", "Right", "o", "C-e", "!", "Enter"])
        await screen_shows(term, "\nagain!\n")

    async def test_screens_are_bounded_and_history_holds_what_scrolled_away(self, sandbox: Sandbox) -> None:
        term = await sandbox.open_terminal(width=100, height=20)
        await term.send_keys("seq 1 1500\n")
        screen = await screen_shows(term, "\n1500\n")
        assert len(screen.split("\n")) == 21 and "\n5\n" not in screen  # 20 rows, each ends a line
        history = await term.capture(history=True)
        assert "\n5\n" in history and "\n1500\n" in history
        await term.send_keys("yes $(printf '%090d' 7) | head -n 3000\n")  # ~270 kB of scrollback
        await screen_shows(term, "0" * 89 + "7\n")
        assert await until(term.is_idle)
        big = await term.capture(history=True)
        assert len(big) <= 32 * 1024 and big.startswith("0" * 89 + "7\n")  # whole lines, the last ones
        assert big.rstrip().endswith("#")  # the prompt after the output

    async def test_exit_ends_the_session(self, sandbox: Sandbox) -> None:
        term = await sandbox.open_terminal()
        assert await term.is_alive()
        await term.send_keys("exit\n")
        assert await until(lambda: _not(term.is_alive()))
        with pytest.raises(TerminalClosedError):
            await term.send_keys("echo late\n")

    async def test_stop_processes_ends_the_terminal_and_everything_in_it(self, sandbox: Sandbox) -> None:
        term = await sandbox.open_terminal()
        await term.send_keys("sleep 777 &\n", duration=0.3)
        await term.send_keys("tmux set-hook -g session-closed 'run-shell \"sleep 778\"'\n", duration=0.3)
        await term.send_keys("python3 -m http.server 8001 --bind 127.0.0.1\n", duration=1.0)
        await screen_shows(term, "Serving HTTP")
        await sandbox.stop_processes()
        assert not await term.is_alive()
        with pytest.raises(TerminalClosedError):
            await term.capture()
        await asyncio.sleep(1.0)
        ps = await live_processes(sandbox)
        assert "sleep 77" not in ps, ps  # nothing else runs, nor does a tmux hook ever fire
        # A listening server is a service the tests may talk to: podman keeps it (and its terminal
        # stopped, or SIGHUP would end it); Daytona kills every process.
        if self.keeps_listeners:
            probe = await sandbox.exec(PROBE.format(port=8001), timeout=30)
            assert probe.stdout == "200\n", (probe, ps)
            assert all(
                line.startswith("T") for line in ps.splitlines() if "tmux" in line or "bash --login" in line
            ), ps
        else:
            assert "http.server" not in ps and "tmux" not in ps, ps

    async def test_stop_processes_ends_a_terminal_without_a_server(self, sandbox: Sandbox) -> None:
        term = await sandbox.open_terminal()
        await term.send_keys("tmux set-hook -g session-closed 'run-shell \"sleep 779\"'\n", duration=0.3)
        await term.send_keys("sleep 780\n", duration=0.3)
        await sandbox.stop_processes()
        await asyncio.sleep(1.0)
        ps = await live_processes(sandbox)
        assert "tmux" not in ps and "sleep 7" not in ps, ps


async def _not(check: Awaitable[bool]) -> bool:
    return not await check
