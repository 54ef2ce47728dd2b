"""The Daytona backend against the fake Daytona running its sandboxes in real podman containers:
the shared sandbox contract, plus what containers make observable (session-path exec, the image
Daytona would build, no secret inside, deletion at interpreter exit)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import Engine, Generation, SamplingParams
from agentrl.episode.run import EpisodeConfig, run_episode
from agentrl.sandbox.daytona import DaytonaProvider
from agentrl.tasks.task import load_task
from tests.chat_tokenizer import byte_tokenizer
from tests.fake_daytona import FAKE_LABEL, FakeDaytonaServer, PodmanRuntime
from tests.sandbox_contract import SandboxContract
from tests.terminal_contract import ShellSessionContract, TerminalContract

CLI = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")
TASK = "tests/fixtures/sandbox_tasks/write-hello"
REPO = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(shutil.which(CLI) is None, reason=f"{CLI} is not installed"),
]


def fake_containers(tag: str) -> list[str]:
    out = subprocess.run(
        [CLI, "ps", "-a", "--filter", f"label={FAKE_LABEL}={tag}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


@pytest.fixture
def server():
    runtime = PodmanRuntime(CLI)
    srv = FakeDaytonaServer(runtime)
    yield srv
    names = fake_containers(runtime.server_tag)
    if names:
        subprocess.run([CLI, "rm", "-f", "-t", "0", *names], capture_output=True, check=False)
    assert names == [], f"sandboxes left behind: {names}"


def make_provider(server: FakeDaytonaServer, **options) -> DaytonaProvider:
    return DaytonaProvider(client_factory=server.client, backoff_initial_s=0.01, keepalive_s=0, **options)


class TestDaytonaContract(SandboxContract):
    @pytest.fixture
    def provider(self, server: FakeDaytonaServer) -> DaytonaProvider:
        return make_provider(server)

    @pytest.fixture
    def task(self):
        return load_task(TASK)


class TestDaytonaShellSession(ShellSessionContract):
    @pytest.fixture
    def provider(self, server: FakeDaytonaServer) -> DaytonaProvider:
        return make_provider(server)


class TestDaytonaTerminal(TerminalContract):
    keeps_listeners = True  # as on podman: servers listening on a socket are kept for the tests

    @pytest.fixture
    def provider(self, server: FakeDaytonaServer) -> DaytonaProvider:
        return make_provider(server)


async def test_sandbox_is_built_from_the_task_dockerfile_with_logs_prepared(server) -> None:
    provider = make_provider(server)
    async with await provider.create(load_task(TASK), run_id="img") as sb:
        assert (await sb.exec("cat /app/seed.txt", timeout=30)).exit_code == 0
        assert (await sb.exec("pwd", timeout=30)).stdout == "/app\n"  # task workdir
        res = await sb.exec("stat -c %a /logs/verifier", timeout=30)
        assert res.stdout.strip() == "777"
    await provider.aclose()


async def test_long_commands_go_through_a_session_and_keep_streams_apart(server) -> None:
    provider = make_provider(server, exec_limit_s=1.0)
    async with await provider.create(load_task(TASK), run_id="sess") as sb:
        res = await sb.exec("sleep 1.5; echo late; echo oops >&2; exit 4", timeout=20)
        assert (res.stdout, res.stderr, res.exit_code) == ("late\n", "oops\n", 4)
        sdk = server.sandboxes[sb.sandbox_id]
        assert len(sdk.process.sessions) == 1  # the long command ran as a session command
        timed = await sb.exec("sleep 30", timeout=2)
        assert timed.timed_out and timed.exit_code is None and timed.duration_s < 15
    await provider.aclose()


async def test_a_cancelled_command_is_killed_inside_the_sandbox(server) -> None:
    provider = make_provider(server)
    async with await provider.create(load_task(TASK), run_id="kill") as sb:
        t = asyncio.create_task(sb.exec("sleep 77"))
        await asyncio.sleep(1.5)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.gather(*provider._background)
        ps = await sb.exec("ps -eo args 2>/dev/null || ls /proc", timeout=30)
        assert "sleep 77" not in ps.stdout
    await provider.aclose()


async def test_no_host_secret_reaches_the_sandbox_environment(server, monkeypatch) -> None:
    monkeypatch.setenv("DAYTONA_API_KEY", "dtn_secret_contract_key")
    provider = make_provider(server)
    async with await provider.create(load_task(TASK), run_id="sec") as sb:
        res = await sb.exec("env; cat /proc/1/environ | tr '\\0' '\\n'", timeout=30)
        assert res.exit_code == 0 and "dtn_secret_contract_key" not in res.stdout
    await provider.aclose()


KEY = "dtn_secret_episode_key_42"


async def test_oracle_run_leaves_the_key_out_of_logs_and_results(server, monkeypatch, caplog) -> None:
    from agentrl.episode.oracle import run_oracle

    monkeypatch.setenv("DAYTONA_API_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    (result,) = await run_oracle(make_provider(server), [load_task(TASK)], run_id="oracle")
    assert result.ok and result.reward == 1.0, result
    assert caplog.records and KEY not in caplog.text and KEY not in repr(result)


class ReplyEngine(Engine):
    """Answers each turn with the next scripted reply (token ids of its text, then EOS)."""

    def __init__(self, replies: list[str], tokenizer) -> None:
        self.replies, self.tok = list(replies), tokenizer

    async def generate(self, input_ids, sampling, *, session_id=None) -> Generation:
        ids = [*self.tok.encode(self.replies.pop(0), add_special_tokens=False), self.tok.eos_token_id]
        return Generation(ids, [-0.5] * len(ids), "stop", 0)


async def test_a_recorded_episode_leaves_the_key_out_of_its_record(server, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DAYTONA_API_KEY", KEY)
    tok = byte_tokenizer()
    engine = ReplyEngine(["```bash\nenv; echo hello > /app/out.txt\n```", "TASK_COMPLETE"], tok)
    provider = make_provider(server)
    config = EpisodeConfig(
        action_format="fenced-bash", agent=AgentConfig(), sampling=SamplingParams(max_new_tokens=64)
    )
    episode = await run_episode(
        load_task(TASK),
        provider=provider,
        engine=engine,
        renderer=ChatRenderer(tok),
        config=config,
        run_id="ep",
        record_dir=tmp_path,
    )
    await provider.aclose()
    (sample,) = episode.samples
    assert sample.reward == 1.0
    record = episode.record_path.read_text()
    assert "PATH=" in record  # the agent's `env` output is in the record...
    assert KEY not in record  # ...and the key is not


def test_sandboxes_left_open_are_deleted_at_interpreter_exit(server) -> None:
    tag = server.runtime.server_tag
    script = textwrap.dedent(
        f"""
        import asyncio
        from agentrl.sandbox.daytona import DaytonaProvider
        from agentrl.tasks.task import load_task
        from tests.fake_daytona import FakeDaytonaServer, PodmanRuntime

        server = FakeDaytonaServer(PodmanRuntime({CLI!r}, server_tag={tag!r}))

        async def main():
            provider = DaytonaProvider(client_factory=server.client, keepalive_s=0)
            sb = await provider.create(load_task({TASK!r}), run_id="exit")
            print("created", sb.sandbox_id, flush=True)

        asyncio.run(main())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "created" in proc.stdout
    assert fake_containers(tag) == []
