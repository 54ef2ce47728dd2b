"""The adversarial suite through the Daytona backend, on the fake Daytona running its sandboxes in
real podman containers: the attacks that apply to Daytona's one-wrapper-per-command exec (there is
no persistent shell to forge frames on, and Daytona sets its own limits), each ending as reward 0
or a policy failure, the run going on, and nothing left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest
from daytona import CreateSandboxFromSnapshotParams

from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import EpisodeResult, run_episode
from agentrl.episode.sample import Status
from agentrl.sandbox.daytona import DaytonaProvider
from agentrl.tasks.task import load_task
from tests.chat_tokenizer import byte_tokenizer
from tests.fake_daytona import FAKE_LABEL, FakeDaytonaServer, PodmanRuntime
from tests.test_adversarial_podman import FAIL, GUARDED, HONEST, episode_config, fenced, script

CLI = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(shutil.which(CLI) is None, reason=f"{CLI} is not installed"),
]

ATTACKS = [
    (
        "background loop rewrites the reward while the tests run",
        [
            "(while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; sleep 0.02; done)"
            " >/dev/null 2>&1 &",
            "setsid bash -c 'while :; do echo 1 > /logs/verifier/reward.txt; sleep 0.02; done'"
            " >/dev/null 2>&1 </dev/null &",
        ],
        FAIL,
    ),
    # The reward and the list of changed files travel through Daytona's file API, never through
    # the sandbox's `cat` or `tar`.
    (
        "replaced /usr/bin/cat and tar",
        ["printf '#!/bin/sh\\necho 1\\n' | tee /usr/bin/cat > /usr/bin/tar"],
        ("tampered", "system_files"),
    ),
    (
        "pytest.py in the working directory",
        ["printf 'import sys\\nsys.exit(0)\\n' > /app/pytest.py"],
        ("tampered", "system_files"),
    ),
    (
        "conftest.py planted in /tests",
        ["mkdir -p /tests && printf 'import os\\nos._exit(0)\\n' > /tests/conftest.py"],
        FAIL,
    ),
    # The verifier's kill and its tamper scan run the sandbox's own tools: replacing them to spare a
    # reward writer is caught by the core files' digests, read through the file API.
    (
        "kill and scan subverted (readlink, find replaced) to spare a reward writer",
        [
            "(while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; sleep 0.02; done)"
            " >/dev/null 2>&1 &",
            "printf '#!/bin/sh\\necho same\\n' > /usr/bin/readlink; printf '#!/bin/sh\\nexit 0\\n' > /usr/bin/find",
        ],
        ("tampered", "system_files"),
    ),
    (
        "a shell shadowing /usr/bin/sh earlier on PATH",
        ["printf '#!/bin/bash\\nexit 0\\n' > /usr/local/bin/sh && chmod +x /usr/local/bin/sh"],
        ("tampered", "system_files"),
    ),
    # Its wrapper's stdout is the toolbox's reply: writing megabytes there is cut off on the host.
    (
        "megabytes written into the wrapper's reply",
        [
            "w=$(cut -d' ' -f4 /proc/$PPID/stat); head -c 3000000 /dev/zero | tr '\\0' a > /proc/$w/fd/1",
        ],
        ("tampered", "shell_protocol"),
    ),
    ("/tests/test.sh made a directory", ["mkdir -p /tests/test.sh"], FAIL),
    ("/logs made a file", ["rm -rf /logs && echo x > /logs"], FAIL),
    ("/tmp cleaned", ["rm -rf /tmp/* /tmp/.[!.]*", "echo still works"], FAIL),
    ("its own shell killed", ["kill -9 $$"], FAIL),
    ("every process killed", ["kill -9 -1"], {FAIL, ("tampered", "shell_protocol")}),
]


@pytest.fixture
def server():  # type: ignore[no-untyped-def]
    runtime = PodmanRuntime(CLI)
    srv = FakeDaytonaServer(runtime)
    yield srv
    out = subprocess.run(
        [CLI, "ps", "-a", "--filter", f"label={FAKE_LABEL}={runtime.server_tag}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if out:
        subprocess.run([CLI, "rm", "-f", "-t", "0", *out], capture_output=True, check=False)
    assert out == [], f"sandboxes left behind: {out}"


async def episode(provider: DaytonaProvider, commands: list[str]) -> EpisodeResult:
    tok = byte_tokenizer()
    engine = ScriptedEngine([*(fenced(c) for c in commands), "TASK_COMPLETE"], tok)
    return await run_episode(
        load_task(GUARDED),
        provider=provider,
        engine=engine,
        renderer=ChatRenderer(tok),
        config=episode_config(),
        run_id=f"adv-{uuid.uuid4().hex[:8]}",
    )


@pytest.mark.parametrize("private", [False, True], ids=["in-place", "private"])
@pytest.mark.parametrize(("name", "commands", "expected"), ATTACKS, ids=[a[0] for a in ATTACKS])
async def test_attack_through_daytona_scores_zero_and_the_run_goes_on(
    server: FakeDaytonaServer, name: str, commands: list[str], expected: object, private: bool
) -> None:
    provider = DaytonaProvider(
        client_factory=server.client, backoff_initial_s=0.01, keepalive_s=0, private_verification=private
    )
    try:
        result = await episode(provider, commands)
        assert result.verify is not None
        outcome, cause = result.verify.outcome, result.verify.cause
        assert (outcome, cause) in (expected if isinstance(expected, set) else {expected}), (
            result.verify.error
        )
        assert result.episode.reward == 0.0
        if outcome == "tampered":
            assert result.episode.status is Status.FAILED_POLICY
        again = await episode(provider, HONEST)
        assert again.episode.reward == 1.0
    finally:
        await provider.aclose()
    assert provider.live_sandboxes() == 0
    assert server.snapshots == {}  # every verification's snapshot deleted with its copy


# A server the agent leaves listening on a TCP port is kept through the kill (a task may ask for a
# service). This one waits for the tests to write their reward and then replaces it. In the sandbox
# itself nothing stops it; in a copy made from a snapshot it does not exist.
WRITER = """import os, socket, time
s = socket.socket(); s.bind(("127.0.0.1", 8079)); s.listen()
r = "/logs/verifier/reward.txt"
while True:
    try:
        if os.path.exists("/tests/test.sh") and open(r).read().strip() != "1":
            open(r, "w").write("1")
    except OSError:
        pass
    time.sleep(0.005)
"""
LISTENING_WRITER = [
    script("/root/writer.py", *WRITER.splitlines()),
    "setsid python3 /root/writer.py >/dev/null 2>&1 < /dev/null &",
    "sleep 1",
]


async def test_a_listening_reward_writer_wins_in_place_and_loses_to_a_private_verification(
    server: FakeDaytonaServer,
) -> None:
    outcomes = {}
    for private in (False, True):
        provider = DaytonaProvider(
            client_factory=server.client, backoff_initial_s=0.01, keepalive_s=0, private_verification=private
        )
        try:
            result = await episode(provider, LISTENING_WRITER)
            assert result.verify is not None
            outcomes[private] = (result.verify.outcome, result.episode.reward)
            if private:
                assert (await episode(provider, HONEST)).episode.reward == 1.0
        finally:
            await provider.aclose()
        assert provider.live_sandboxes() == 0
    assert outcomes == {False: ("pass", 1.0), True: ("fail", 0.0)}  # the in-place gap: docs/failures.md
    # One snapshot per private verification (the attack's and the honest run's), each deleted.
    assert len(server.snapshots_deleted) == 2 and server.snapshots == {}
    copies = [p for p in server.create_params if isinstance(p, CreateSandboxFromSnapshotParams)]
    assert [p.snapshot for p in copies] == server.snapshots_deleted
    assert all(p.network_block_all for p in copies)  # the verifier phase's network: none here


async def test_a_process_that_survives_the_kill_is_seen_from_outside(
    server: FakeDaytonaServer, monkeypatch
) -> None:
    """The survivor check lists /proc through the file API: had the kill been subverted in a way
    the core digests miss, a process of the agent's still running is `tampered`."""
    from agentrl.sandbox.base import SandboxPolicyError
    from agentrl.sandbox.daytona import sandbox as daytona

    provider = DaytonaProvider(client_factory=server.client, backoff_initial_s=0.01, keepalive_s=0)
    try:
        sb = await provider.create(load_task(GUARDED), run_id="survivor")
        try:
            await sb.exec("setsid sleep 300 >/dev/null 2>&1 < /dev/null &", timeout=10)
            await sb.stop_processes()  # the real kill: nothing survives
            await sb.exec("setsid tail -f /dev/null >/dev/null 2>&1 < /dev/null &", timeout=10)
            monkeypatch.setattr(daytona, "STOP_PROCESSES", "true")  # a kill that did nothing
            with pytest.raises(SandboxPolicyError, match=r"survived the verifier's kill: \d+ \(tail") as info:
                await sb.stop_processes()
            assert info.value.cause == "system_files"
        finally:
            await sb.close()
    finally:
        await provider.aclose()


async def test_a_listening_server_survives_the_kill_and_nothing_else(server: FakeDaytonaServer) -> None:
    """As on podman: a service the task asks for keeps answering the tests; everything else dies."""
    provider = DaytonaProvider(client_factory=server.client, backoff_initial_s=0.01, keepalive_s=0)
    try:
        sb = await provider.create(load_task(GUARDED), run_id="listener")
        try:
            await sb.exec(
                "setsid python3 -m http.server 8077 --bind 127.0.0.1 >/dev/null 2>&1 < /dev/null & "
                "setsid tail -f /dev/null >/dev/null 2>&1 < /dev/null &",  # not `sleep`: the fake's PID 1
                timeout=10,
            )
            await sb.exec("sleep 1", timeout=10)
            await sb.stop_processes()
            probe = await sb.exec(
                "python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8077/\").status)';"
                " ps -eo stat=,comm= | grep -v '^Z' | grep -w tail || echo no-tail",
                timeout=20,
            )
            assert probe.stdout.split() == ["200", "no-tail"], probe
        finally:
            await sb.close()
    finally:
        await provider.aclose()
