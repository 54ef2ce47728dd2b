"""The one contract every sandbox backend passes (podman, docker, daytona, fake).

Use it by subclassing `SandboxContract` in a test module and overriding two fixtures:
`provider` (a fresh `SandboxProvider`) and `task` (a `Task` the provider can start). Commands are
kept to ones the fake backend interprets too, so the same assertions run everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from agentrl.sandbox.base import Sandbox, SandboxError, SandboxProvider


class SandboxContract:
    @pytest.fixture
    def provider(self) -> SandboxProvider:
        raise NotImplementedError("a contract test module must override the `provider` fixture")

    @pytest.fixture
    def task(self):
        raise NotImplementedError("a contract test module must override the `task` fixture")

    @pytest.fixture
    async def sandbox(self, provider: SandboxProvider, task):
        sb = await provider.create(task, run_id="contract")
        try:
            yield sb
        finally:
            await sb.close()
            await provider.aclose()
            assert provider.live_sandboxes() == 0

    async def test_stdout_stderr_exit_code(self, sandbox: Sandbox) -> None:
        res = await sandbox.exec("echo out; echo err >&2; exit 3")
        assert res.stdout == "out\n"
        assert res.stderr == "err\n"
        assert res.exit_code == 3
        assert not res.timed_out and not res.ok

    async def test_success_is_ok(self, sandbox: Sandbox) -> None:
        res = await sandbox.exec("true")
        assert res.ok and res.exit_code == 0

    async def test_timeout_leaves_sandbox_usable(self, sandbox: Sandbox) -> None:
        res = await sandbox.exec("sleep 30", timeout=1)
        assert res.timed_out and res.exit_code is None and not res.ok
        assert res.duration_s < 25  # returned at the timeout, not when the sleep ended
        again = await sandbox.exec("echo alive")
        assert again.stdout == "alive\n" and again.exit_code == 0

    async def test_output_is_bounded_with_a_marker(self, sandbox: Sandbox) -> None:
        res = await sandbox.exec("yes x | head -n 200000")  # 400 kB, over the 64 kB default limit
        assert res.exit_code == 0
        assert len(res.stdout) < 70_000
        assert "omitted" in res.stdout
        assert res.stdout.startswith("x\nx\n") and res.stdout.endswith("x\nx\n")

    async def test_cwd_and_env_per_command(self, sandbox: Sandbox) -> None:
        assert (await sandbox.exec("pwd", cwd="/tmp")).stdout.strip() == "/tmp"
        res = await sandbox.exec("printenv AGENTRL_CONTRACT", env={"AGENTRL_CONTRACT": "a b'c"})
        assert res.stdout == "a b'c\n"

    async def test_cd_and_export_persist_between_commands(self, sandbox: Sandbox) -> None:
        await sandbox.exec("cd /tmp")
        await sandbox.exec("export AGENTRL_SESSION='a b'")
        assert (await sandbox.exec("pwd")).stdout == "/tmp\n"
        assert (await sandbox.exec("printenv AGENTRL_SESSION")).stdout == "a b\n"

    async def test_explicit_cwd_env_or_user_run_clean_and_leave_the_session_alone(
        self, sandbox: Sandbox
    ) -> None:
        await sandbox.exec("cd /tmp; export AGENTRL_SESSION=1")
        assert (await sandbox.exec("pwd", cwd="/")).stdout == "/\n"
        assert (await sandbox.exec("printenv AGENTRL_SESSION", env={"OTHER": "1"})).exit_code != 0
        await sandbox.exec("cd /; export AGENTRL_SESSION=2", cwd="/")  # a clean command's own changes
        await sandbox.exec("printenv AGENTRL_ONCE", env={"AGENTRL_ONCE": "1"})
        assert (await sandbox.exec("pwd")).stdout == "/tmp\n"
        assert (await sandbox.exec("printenv AGENTRL_SESSION")).stdout == "1\n"
        assert (await sandbox.exec("printenv AGENTRL_ONCE")).exit_code != 0

    async def test_a_timed_out_command_leaves_the_session_as_it_was(self, sandbox: Sandbox) -> None:
        await sandbox.exec("cd /tmp")
        res = await sandbox.exec("cd /; export AGENTRL_LATE=1; sleep 30", timeout=1)
        assert res.timed_out
        assert (await sandbox.exec("pwd")).stdout == "/tmp\n"
        assert (await sandbox.exec("printenv AGENTRL_LATE")).exit_code != 0

    async def test_stop_processes_starts_a_new_session(self, sandbox: Sandbox) -> None:
        await sandbox.exec("cd /tmp; export AGENTRL_SESSION=1")
        await sandbox.stop_processes()
        assert (await sandbox.exec("pwd")).stdout != "/tmp\n"
        assert (await sandbox.exec("printenv AGENTRL_SESSION")).exit_code != 0

    async def test_user(self, sandbox: Sandbox) -> None:
        assert (await sandbox.exec("id -un")).stdout.strip() == "root"
        assert (await sandbox.exec("id -un", user="nobody")).stdout.strip() == "nobody"

    async def test_upload_download_file(self, sandbox: Sandbox, tmp_path: Path) -> None:
        src = tmp_path / "a.txt"
        src.write_text("hello file\n")
        await sandbox.upload(src, "/tmp/contract/a.txt")
        assert (await sandbox.exec("cat /tmp/contract/a.txt")).stdout == "hello file\n"
        await sandbox.download("/tmp/contract/a.txt", tmp_path / "back" / "a.txt")
        assert (tmp_path / "back" / "a.txt").read_text() == "hello file\n"

    async def test_upload_download_directory_contents(self, sandbox: Sandbox, tmp_path: Path) -> None:
        src = tmp_path / "tree"
        (src / "sub").mkdir(parents=True)
        (src / "top.txt").write_text("top\n")
        (src / "sub" / "deep.txt").write_text("deep\n")
        await sandbox.upload(src, "/tmp/tree-in")
        assert (await sandbox.exec("cat /tmp/tree-in/sub/deep.txt")).stdout == "deep\n"
        assert (await sandbox.exec("test -d /tmp/tree-in/sub")).exit_code == 0
        out = tmp_path / "out"
        await sandbox.download("/tmp/tree-in", out)
        assert (out / "top.txt").read_text() == "top\n"
        assert (out / "sub" / "deep.txt").read_text() == "deep\n"

    async def test_bounded_download_lands_under_a_new_directory(
        self, sandbox: Sandbox, tmp_path: Path
    ) -> None:
        """The artifacts' path: a file and a directory each copied to a host path whose parents do
        not exist yet; a missing source is `FileNotFoundError`."""
        src = tmp_path / "src"
        (src / "d").mkdir(parents=True)
        (src / "f.txt").write_text("f\n")
        (src / "d" / "g.txt").write_text("g\n")
        await sandbox.upload(src, "/tmp/art")
        await sandbox.download("/tmp/art/f.txt", tmp_path / "a" / "b" / "f.txt", limit_bytes=1 << 20)
        await sandbox.download("/tmp/art/d", tmp_path / "c" / "d", limit_bytes=1 << 20)
        assert (tmp_path / "a" / "b" / "f.txt").read_text() == "f\n"
        assert (tmp_path / "c" / "d" / "g.txt").read_text() == "g\n"
        with pytest.raises(FileNotFoundError):
            await sandbox.download("/tmp/art/none", tmp_path / "e" / "none", limit_bytes=1 << 20)

    async def test_close_is_idempotent_and_final(self, provider: SandboxProvider, task) -> None:
        sb = await provider.create(task, run_id="contract")
        assert provider.live_sandboxes() == 1
        await sb.close()
        await sb.close()
        assert provider.live_sandboxes() == 0
        with pytest.raises(SandboxError):
            await sb.exec("true")
        await provider.aclose()

    async def test_async_with_closes(self, provider: SandboxProvider, task) -> None:
        async with await provider.create(task, run_id="contract") as sb:
            assert (await sb.exec("echo in")).stdout == "in\n"
        assert provider.live_sandboxes() == 0
        await provider.aclose()

    async def test_cancellation_mid_exec_still_cleans_up(self, provider: SandboxProvider, task) -> None:
        started = asyncio.Event()

        async def episode() -> None:
            async with await provider.create(task, run_id="contract") as sb:
                started.set()
                await sb.exec("sleep 30")

        t = asyncio.create_task(episode())
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.sleep(0.3)
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t
        assert provider.live_sandboxes() == 0
        await provider.aclose()

    async def test_cancelled_exec_leaves_sandbox_usable(self, sandbox: Sandbox) -> None:
        t = asyncio.create_task(sandbox.exec("sleep 30"))
        await asyncio.sleep(0.5)
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t
        assert (await sandbox.exec("echo next", timeout=30)).stdout == "next\n"

    async def test_concurrent_sandboxes_are_isolated(self, provider: SandboxProvider, task) -> None:
        a, b = await asyncio.gather(
            provider.create(task, run_id="contract"), provider.create(task, run_id="contract")
        )
        async with a, b:
            assert a.sandbox_id != b.sandbox_id
            await a.exec("echo mine > /tmp/owner.txt")
            assert (await b.exec("cat /tmp/owner.txt")).exit_code != 0
        assert provider.live_sandboxes() == 0
        await provider.aclose()
