"""Hostile commands inside a sandbox: each is contained, the host is unaffected, results are right."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from agentrl.episode.verify import verify
from agentrl.sandbox.podman import PodmanProvider, run_cli
from agentrl.tasks.task import load_task

FIXTURES = Path(__file__).parent / "fixtures" / "sandbox_tasks"
CLI = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(shutil.which(CLI) is None, reason=f"{CLI} is not installed"),
]


def host_is_fine() -> None:
    assert subprocess.run(["true"], timeout=30).returncode == 0
    assert subprocess.run([CLI, "ps", "-q"], capture_output=True, timeout=60).returncode == 0


async def test_fork_bomb_hits_the_pids_limit() -> None:
    provider = PodmanProvider(cli=CLI, pids_limit=128)
    async with await provider.create(load_task(FIXTURES / "write-hello"), run_id="forkbomb") as sb:
        res = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 8", timeout=5)
        assert res.timed_out
        info = await run_cli(CLI, "inspect", "--format", "{{.HostConfig.PidsLimit}}", sb.sandbox_id)
        assert info[1].strip() == "128"
        # The bomb's process group was killed with the command: the sandbox works again.
        for _ in range(20):
            after = await sb.exec("echo alive", timeout=30)
            if after.exit_code == 0:
                break
            await asyncio.sleep(0.5)
        assert after.stdout == "alive\n"
    host_is_fine()


async def test_memory_hog_is_killed_by_the_memory_limit(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # podman's conmon drops an `oom` file into its working directory
    task = load_task(FIXTURES / "write-hello")  # memory_mb = 256
    async with await PodmanProvider(cli=CLI).create(task, run_id="memhog") as sb:
        # bash holds a command substitution in memory: 1 GiB asked, 256 MiB allowed, no swap.
        res = await sb.exec("s=$(head -c 1G /dev/zero | tr '\\0' a); echo ${#s}", timeout=120)
        assert not res.timed_out
        assert res.exit_code == 137  # SIGKILL from the OOM killer
        assert (await sb.exec("echo alive")).stdout == "alive\n"
    assert list(tmp_path.iterdir()) == []  # ...which must not land in the user's directory
    host_is_fine()


async def test_host_loopback_server_is_unreachable() -> None:
    connections = 0

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with await PodmanProvider(cli=CLI).create(
            load_task(FIXTURES / "write-hello"), run_id="net"
        ) as sb:
            res = await sb.exec(f"echo hi > /dev/tcp/127.0.0.1/{port}", timeout=20)
            assert res.exit_code != 0 and not res.timed_out
            interfaces = (await sb.exec("cat /proc/net/dev")).stdout
            assert "eth0" not in interfaces and "lo:" in interfaces
        # The same probe from the host reaches the server: the check above can fail.
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await asyncio.sleep(0.2)
    finally:
        server.close()
        await server.wait_closed()
    assert connections == 1


async def test_host_files_are_not_visible(tmp_path: Path) -> None:
    secret = tmp_path / f"secret-{uuid.uuid4().hex}.txt"
    secret.write_text("host secret\n")
    async with await PodmanProvider(cli=CLI).create(
        load_task(FIXTURES / "write-hello"), run_id="files"
    ) as sb:
        assert (await sb.exec(f"cat {secret}")).exit_code != 0
        assert (await sb.exec(f"test -e {Path.cwd()}")).exit_code != 0
        assert (await sb.exec("grep -c ' /work' /proc/mounts")).stdout.strip() == "0"
    assert secret.read_text() == "host secret\n"


@pytest.mark.parametrize("fixture,outcome", [("write-hello", "fail"), ("no-reward", "verifier-error")])
async def test_reward_planted_by_the_agent_never_counts(fixture: str, outcome: str) -> None:
    task = load_task(FIXTURES / fixture)
    async with await PodmanProvider(cli=CLI).create(task, run_id="plant") as sb:
        await sb.exec(
            "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt;"
            " echo '{\"reward\": 1}' > /logs/verifier/reward.json"
        )
        result = await verify(sb, task)
    assert result.outcome == outcome
    assert result.reward != 1.0
