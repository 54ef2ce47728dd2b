"""Real podman containers: the shared contract plus what only a container backend has (images by
content hash, isolation flags, the persistent shell and its fallback, the warm pool, reaping)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agentrl.sandbox.base import ImageBuildError, SandboxTransportError, TerminalUnavailableError
from agentrl.sandbox.images import load_recipe
from agentrl.sandbox.podman import LABEL_RUN, PodmanProvider, PodmanSandbox, context_hash, reap, run_cli
from agentrl.tasks.task import load_task
from tests.sandbox_contract import SandboxContract
from tests.terminal_contract import ShellSessionContract, TerminalContract

FIXTURES = Path(__file__).parent / "fixtures" / "sandbox_tasks"
CLI = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(shutil.which(CLI) is None, reason=f"{CLI} is not installed"),
]


def containers(label: str) -> list[str]:
    out = subprocess.run(
        [CLI, "ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


def copy_task(tmp_path: Path, name: str = "write-hello") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


class TestPodmanContract(SandboxContract):
    @pytest.fixture
    def provider(self) -> PodmanProvider:
        return PodmanProvider(cli=CLI)

    @pytest.fixture
    def task(self):
        return load_task(FIXTURES / "write-hello")


class TestPodmanShellSession(ShellSessionContract):
    @pytest.fixture
    def provider(self) -> PodmanProvider:
        return PodmanProvider(cli=CLI)


class TestPodmanTerminal(TerminalContract):
    @pytest.fixture
    def provider(self) -> PodmanProvider:
        return PodmanProvider(cli=CLI)


@pytest.fixture
def task():
    return load_task(FIXTURES / "write-hello")


async def test_agent_phase_container(task) -> None:
    provider = PodmanProvider(cli=CLI)
    run_id = f"t-{uuid.uuid4().hex[:8]}"
    async with await provider.create(task, run_id=run_id) as sb:
        assert isinstance(sb, PodmanSandbox)
        info = json.loads((await run_cli(CLI, "inspect", sb.sandbox_id))[1])[0]
        labels = info["Config"]["Labels"]
        assert labels[LABEL_RUN] == run_id and labels["agentrl.task-id"] == "write-hello"
        assert int(labels["agentrl.created-at"]) <= time.time()
        assert info["HostConfig"]["NetworkMode"] == "none"
        assert info["HostConfig"]["PidsLimit"] == provider.pids_limit
        assert info["HostConfig"]["Memory"] == 256 * 1024 * 1024
        assert [(m["Destination"], m["RW"]) for m in info["Mounts"]] == [("/run/agentrl-init", False)]
        assert info["Config"]["Entrypoint"] in ("/run/agentrl-init", ["/run/agentrl-init"])
        res = await sb.exec("test -d /logs/verifier && test -d /logs/agent && pwd; ls /tests /solution")
        assert res.stdout.startswith("/app\n")  # the Dockerfile's WORKDIR
        assert "No such file" in res.stderr  # tests/ and solution/ are not inside yet
        assert (await sb.exec("cat /app/seed.txt")).stdout == "seed\n"
        assert containers(f"{LABEL_RUN}={run_id}") == [sb.sandbox_id]
    assert containers(f"{LABEL_RUN}={run_id}") == []


async def test_timeout_kills_the_whole_process_group(task) -> None:
    async with await PodmanProvider(cli=CLI).create(task, run_id="pgkill") as sb:
        res = await sb.exec("sleep 101 & sleep 102 & wait", timeout=1)
        assert res.timed_out
        left = await sb.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c 'sleep 10[12]'")
        assert left.stdout.strip() == "0"


async def test_session_shell_saves_what_a_function_or_alias_changed_before_a_timeout(task) -> None:
    """`go /tmp` reads as a plain command, but `go` is a function that changes directory: the
    session shell sees the function and saves, so a later timeout (which replaces the shell from
    the last snapshot) keeps it. The session shell is `$$`; killing it loses nothing saved."""
    async with await PodmanProvider(cli=CLI).create(task, run_id="fnsave") as sb:
        await sb.exec("go() { cd \"$1\"; export WENT=$1; }; alias stay='cd /srv'")
        await sb.exec("go /tmp")
        assert (await sb.exec("sleep 30", timeout=1)).timed_out
        assert (await sb.exec("pwd; printenv WENT")).stdout == "/tmp\n/tmp\n"
        await sb.exec("stay")
        assert (await sb.exec("kill -9 $$")).exit_code == 137
        assert (await sb.exec("pwd; type -t go")).stdout == "/srv\nfunction\n"


async def test_cancelled_command_is_killed_inside(task) -> None:
    provider = PodmanProvider(cli=CLI)
    async with await provider.create(task, run_id="cancelkill") as sb:
        t = asyncio.create_task(sb.exec("sleep 103"))
        await asyncio.sleep(0.5)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.gather(*provider._background)
        left = await sb.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c 'sleep 10[3]'")
        assert left.stdout.strip() == "0"


async def test_dead_shell_is_replaced_between_commands(task, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="agentrl.sandbox.podman")
    async with await PodmanProvider(cli=CLI).create(task, run_id="restart") as sb:
        assert isinstance(sb, PodmanSandbox)
        await sb.exec("true")
        assert sb._shell is not None
        first = sb._shell
        first.kill()
        await first.proc.wait()
        for i in range(3):
            res = await sb.exec(f"echo {i}; echo e >&2; exit 4", cwd="/tmp", env={"K": "v"})
            assert (res.stdout, res.stderr, res.exit_code) == (f"{i}\n", "e\n", 4)
        assert sb._shell is not None and sb._shell is not first and sb._shell.alive
    assert not [r for r in caplog.records if "persistent shell" in r.getMessage()]


async def test_shell_that_cannot_start_falls_back_to_exec_per_command(task, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="agentrl.sandbox.podman")
    async with await PodmanProvider(cli=CLI).create(task, run_id="fallback") as sb:
        assert isinstance(sb, PodmanSandbox)

        async def broken() -> None:
            raise SandboxTransportError("no shell today")

        assert sb._shell is not None
        sb._shell.kill()
        await sb._shell.proc.wait()
        sb._start_shell = broken  # type: ignore[method-assign]
        for i in range(3):
            res = await sb.exec(f"echo {i}; echo e >&2; exit 4", cwd="/tmp", env={"K": "v"})
            assert (res.stdout, res.stderr, res.exit_code) == (f"{i}\n", "e\n", 4)
        assert (await sb.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"
        assert (await sb.exec("sleep 30", timeout=1)).timed_out
        big = await sb.exec("head -c 50000000 /dev/zero | tr '\\0' a")  # bounded on the host too
        assert len(big.stdout) < 70_000 and "49934464 bytes omitted" in big.stdout
    warnings = [r for r in caplog.records if "persistent shell" in r.getMessage()]
    assert len(warnings) == 1


async def test_shell_dying_mid_command_is_a_transport_error_never_a_rerun(task) -> None:
    async with await PodmanProvider(cli=CLI).create(task, run_id="midcmd") as sb:
        assert isinstance(sb, PodmanSandbox)
        await sb.exec("true")
        assert sb._shell is not None
        shell = sb._shell

        async def kill_soon() -> None:
            await asyncio.sleep(0.5)
            shell.kill()

        killer = asyncio.create_task(kill_soon())
        with pytest.raises(SandboxTransportError, match="mid-command"):
            await sb.exec("echo ran >> /tmp/runs; sleep 5")
        await killer
        assert (await sb.exec("cat /tmp/runs")).stdout == "ran\n"  # exactly once
        assert (await sb.exec("echo via-exec")).stdout == "via-exec\n"


async def test_image_is_reused_and_built_once_under_concurrency(tmp_path: Path) -> None:
    path = copy_task(tmp_path)
    (path / "environment" / "seed.txt").write_text(f"unique {uuid.uuid4()}\n")  # a fresh image tag
    task = load_task(path)
    provider = PodmanProvider(cli=CLI)
    builds = 0
    real_build = provider._build

    async def counting_build(t, tag, dockerfile=None):  # type: ignore[no-untyped-def]
        nonlocal builds
        builds += 1
        await real_build(t, tag, dockerfile)

    provider._build = counting_build  # type: ignore[method-assign]
    try:
        tags = await asyncio.gather(*(provider.image_for(task) for _ in range(3)))
        assert len(set(tags)) == 1 and builds == 1
        # keyed by the context's content (and, where a FROM was served by the stand-in, the rewrite)
        assert tags[0].startswith("localhost/agentrl-task/write-hello:")
        if await provider._dockerfile_offline(task) is None:
            assert tags[0].endswith(":" + context_hash(path / "environment"))
        assert await provider.image_for(task) == tags[0]
        assert builds == 1
    finally:
        await run_cli(CLI, "rmi", "-f", tags[0])


def test_context_hash_follows_content(tmp_path: Path) -> None:
    a = copy_task(tmp_path)
    h = context_hash(a / "environment")
    assert context_hash(a / "environment") == h
    (a / "environment" / "seed.txt").write_text("changed\n")
    assert context_hash(a / "environment") != h


async def test_build_failure_is_typed_with_the_log_tail() -> None:
    task = load_task(FIXTURES / "build-fails")
    provider = PodmanProvider(cli=CLI)
    with pytest.raises(ImageBuildError) as err:
        await provider.create(task, run_id="buildfail")
    assert err.value.cause == "image_build"
    assert "building-step" in err.value.log_tail
    assert provider.live_sandboxes() == 0
    # a second sandbox of the task is told at once: the failing build is not run again
    builds = []
    real_build = provider._build

    async def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        builds.append(args)
        return await real_build(*args, **kwargs)

    provider._build = counting  # type: ignore[method-assign]
    with pytest.raises(ImageBuildError) as again:
        await provider.create(task, run_id="buildfail")
    assert builds == [] and str(again.value) == str(err.value)


async def test_a_failed_build_leaves_no_layers(tmp_path: Path) -> None:
    """The layers of the steps that built before the failing one are pruned (they would pile up
    with every failed build of every task); an image built on shared layers keeps them."""
    task_dir = tmp_path / "fails-late"
    shutil.copytree(FIXTURES / "build-fails", task_dir)
    marker = uuid.uuid4().hex
    (task_dir / "environment" / "Dockerfile").write_text(
        f"FROM debian:bookworm-slim\nRUN echo {marker} > /one\nRUN echo two > /two\nRUN exit 3\n"
    )

    def layers(build_id: str) -> list[str]:
        out = subprocess.run(
            [CLI, "images", "-a", "-q", "--filter", f"label=agentrl.build={build_id}"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return out.stdout.split()

    provider = PodmanProvider(cli=CLI)
    seen: list[tuple[str, int]] = []
    prune = provider._prune_build

    async def watched(build_id: str) -> None:
        seen.append((build_id, len(layers(build_id))))
        await prune(build_id)

    provider._prune_build = watched  # type: ignore[method-assign]
    with pytest.raises(ImageBuildError):
        await provider.create(load_task(task_dir), run_id="buildprune")
    ((build_id, left),) = seen
    assert left == 2 and layers(build_id) == []  # the two good steps' layers were there, and are gone


async def test_docker_image_is_used_directly(tmp_path: Path) -> None:
    path = tmp_path / "prebuilt"
    shutil.copytree(FIXTURES / "write-hello", path)
    shutil.rmtree(path / "environment")
    toml = (
        (path / "task.toml")
        .read_text()
        # the stand-in is a local image under its own name (real names are never re-tagged)
        .replace("[environment]\n", f'[environment]\ndocker_image = "{load_recipe().standin}"\n')
    )
    (path / "task.toml").write_text(toml)
    async with await PodmanProvider(cli=CLI).create(load_task(path), run_id="prebuilt") as sb:
        assert "bookworm" in (await sb.exec("cat /etc/os-release")).stdout


async def test_unavailable_docker_image_falls_back_to_the_dockerfile(tmp_path: Path) -> None:
    path = copy_task(tmp_path)
    toml = (
        (path / "task.toml")
        .read_text()
        .replace("[environment]\n", '[environment]\ndocker_image = "localhost/agentrl-no-such-image:none"\n')
    )
    (path / "task.toml").write_text(toml)
    async with await PodmanProvider(cli=CLI).create(load_task(path), run_id="fallback-build") as sb:
        assert (await sb.exec("cat /app/seed.txt")).stdout == "seed\n"  # built from the Dockerfile


async def test_warm_pool_hands_out_a_started_container(task) -> None:
    provider = PodmanProvider(cli=CLI, warm_pool=1)
    run_id = f"warm-{uuid.uuid4().hex[:8]}"
    try:
        provider.prefetch(task, run_id=run_id)
        assert await provider.wait_warm(task) == 1
        pooled = provider._pool[task.task_id][0]
        sb = await provider.create(task, run_id=run_id)
        assert sb is pooled
        assert (await sb.exec("echo warm")).stdout == "warm\n"
        await sb.close()
    finally:
        await provider.aclose()
    assert provider.live_sandboxes() == 0
    assert containers(f"{LABEL_RUN}={run_id}") == []


async def test_reap_by_run_id_and_age(task) -> None:
    run_id = f"reap-{uuid.uuid4().hex[:8]}"
    provider = PodmanProvider(cli=CLI)
    sb = await provider.create(task, run_id=run_id)
    assert await reap(cli=CLI, run_id=run_id, older_than_s=3600) == []
    assert await reap(cli=CLI, run_id=run_id) == [sb.sandbox_id]
    assert containers(f"{LABEL_RUN}={run_id}") == []
    await sb.close()  # already gone: still fine


def test_containers_are_removed_at_interpreter_exit() -> None:
    run_id = f"exit-{uuid.uuid4().hex[:8]}"
    script = (
        "import asyncio\n"
        "from agentrl.sandbox.podman import PodmanProvider\n"
        "from agentrl.tasks.task import load_task\n"
        "async def main():\n"
        f"    sb = await PodmanProvider(cli={CLI!r}).create(load_task({str(FIXTURES / 'write-hello')!r}), run_id={run_id!r})\n"
        "    print(sb.sandbox_id, flush=True)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("agentrl-")
    assert containers(f"{LABEL_RUN}={run_id}") == []


async def test_missing_cli_is_a_typed_error(task) -> None:
    from agentrl.sandbox.base import SandboxError

    with pytest.raises(SandboxError, match=r"setup_host\.sh"):
        await PodmanProvider(cli="agentrl-no-such-cli").create(task, run_id="nocli")


async def test_relative_task_paths_build_upload_and_download(tmp_path: Path, monkeypatch) -> None:
    """The CLI runs in a private directory (conmon's `oom` marker must not land in the user's cwd),
    so relative host paths are resolved first: a fresh build, an upload and a download."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(FIXTURES / "write-hello", tmp_path / "rel")
    (tmp_path / "rel" / "environment" / "fresh.txt").write_text(uuid.uuid4().hex)  # a new image hash
    (tmp_path / "payload.txt").write_text("payload\n")
    async with await PodmanProvider(cli=CLI).create(load_task(Path("rel")), run_id="relpath") as sb:
        await sb.upload(Path("payload.txt"), "/tmp/payload.txt")
        assert (await sb.exec("cat /tmp/payload.txt")).stdout == "payload\n"
        await sb.download("/tmp/payload.txt", Path("back.txt"))
    assert (tmp_path / "back.txt").read_text() == "payload\n"
    assert not (tmp_path / "oom").exists()


async def test_a_task_image_without_tmux_gets_it_from_a_layer_or_a_typed_error(
    tmp_path: Path, caplog
) -> None:
    path = copy_task(tmp_path)
    dockerfile = path / "environment" / "Dockerfile"
    base = dockerfile.read_text()
    (path / "environment" / "seed.txt").write_text(f"unique {uuid.uuid4()}\n")  # fresh image tags
    dockerfile.write_text(base + "RUN dpkg --purge tmux\n")
    provider = PodmanProvider(cli=CLI)
    async with await provider.create(load_task(path), run_id="tmux-layer") as sb:
        term = await sb.open_terminal()  # installed by the layer (the build has Debian's mirror)
        await term.send_keys("echo layered\n", duration=0.5)
        assert "\nlayered\n" in await term.capture()
    # The first build of a layer over an image that has tmux already: no "has no tmux" warning
    # (its build log echoes the check's RUN line, which holds the same words; issue 35).
    dockerfile.write_text(base + f"RUN echo {uuid.uuid4()} > /fresh\n")
    with caplog.at_level(logging.WARNING, logger="agentrl.sandbox.podman.provider"):
        async with await provider.create(load_task(path), run_id="tmux-layer") as sb:
            assert (await sb.exec("command -v tmux")).exit_code == 0
            await (await sb.open_terminal()).close()
    assert not [r for r in caplog.records if "tmux" in r.getMessage()], caplog.text
    dockerfile.write_text(base + "RUN dpkg --purge tmux && rm /usr/bin/apt-get\n")
    async with await provider.create(load_task(path), run_id="tmux-layer") as sb:
        with pytest.raises(TerminalUnavailableError, match=r"no tmux.*no package manager"):
            await sb.open_terminal()
        assert (await sb.exec("echo commands still work")).exit_code == 0
    async with await PodmanProvider(cli=CLI, terminal_tools=False).create(load_task(path), run_id="t") as sb:
        with pytest.raises(TerminalUnavailableError, match="terminal_tools=True"):
            await sb.open_terminal()
    await provider.aclose()
