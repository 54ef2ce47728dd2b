"""The adversarial suite on real podman sandboxes: every known forgery, breakage and resource attack,
sent by a scripted model through the real agent loop, episode runner and verifier.

Each attack must end as reward 0 (an ordinary failed episode) or a policy failure with its cause,
never an infrastructure failure (which would be a re-roll) and never an exception out of the
episode; the run survives (an honest episode afterwards still scores 1) and nothing is left
running. The tasks are in `tests/fixtures/adversarial/` (see its README).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import EpisodeConfig, EpisodeResult, run_episode
from agentrl.episode.sample import Status
from agentrl.episode.verify import verify
from agentrl.errors import TaskFormatError
from agentrl.sandbox.podman import LABEL_RUN, PodmanProvider, run_cli
from agentrl.tasks.task import MAX_INSTRUCTION_BYTES, load_task
from tests.chat_tokenizer import byte_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "adversarial"
GUARDED = FIXTURES / "guarded-hello"
CLI = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(shutil.which(CLI) is None, reason=f"{CLI} is not installed"),
]

HONEST = ["echo hello > /app/out.txt"]
FAIL = ("fail", None)  # verified as usual: the attack gained nothing

# (name, the model's commands, (verifier outcome, failure cause)). Every one scores 0.
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
    (
        "replaced /usr/bin/cat",
        ["printf '#!/bin/sh\\necho 1\\n' > /usr/bin/cat"],
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
    (
        "sitecustomize.py on the system Python's path",
        [
            "d=$(python3 -c 'import site; print(site.getsitepackages()[0])'); mkdir -p $d;"
            " printf 'import os\\nos._exit(0)\\n' > $d/sitecustomize.py"
        ],
        ("tampered", "system_files"),
    ),
    (
        "a python3 earlier on PATH",
        ["printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/python3; chmod +x /usr/local/bin/python3"],
        ("tampered", "system_files"),
    ),
    ("/tests/test.sh made a directory", ["mkdir -p /tests/test.sh"], FAIL),
    ("/logs made a file", ["rm -rf /logs && echo x > /logs"], FAIL),
    ("/tmp cleaned", ["rm -rf /tmp/* /tmp/.[!.]*", "echo still works"], FAIL),
    # `$$` is the agent's own session shell: killing or stopping it loses nothing but the session
    # since the last command (the next one starts a new one from the last snapshot). `$PPID` is
    # the framing shell that talks to the host.
    ("session shell killed", ["kill -9 $$", "echo still works"], FAIL),
    ("shell killed", ["kill -9 $PPID"], ("tampered", "shell_killed")),
    ("every process killed", ["kill -9 -1"], ("tampered", "shell_killed")),
    ("shell stopped", ["kill -STOP $PPID"], ("tampered", "shell_unresponsive")),
    (
        "garbage on the shell's stdout",
        ["printf 'garbage\\n' > /proc/$PPID/fd/1"],
        ("tampered", "shell_protocol"),
    ),
    (
        "forged frame header",
        [
            "printf '__AGENTRL_%s 0 0 0 0 0 0 0 0\\n' $(od -An -tx1 -N16 /dev/urandom | tr -d ' \\n') > /proc/$PPID/fd/1; sleep 0.3"
        ],
        ("tampered", "shell_protocol"),
    ),
    (
        "40 MB without a newline on the shell's stdout",
        ["head -c 40000000 /dev/zero | tr '\\0' a > /proc/$PPID/fd/1"],
        ("tampered", "shell_protocol"),
    ),
    # The bomb outlives its command; when its noise needs a fork to report and none is free, the
    # shell stops answering (a policy failure); otherwise the episode is verified (and fails).
    ("fork bomb", ["bomb() { bomb | bomb & }; bomb; sleep 3"], {FAIL, ("tampered", "shell_unresponsive")}),
]


def episode_config() -> EpisodeConfig:
    return EpisodeConfig(
        action_format="fenced-bash",
        agent=AgentConfig(max_turns=8, command_timeout_s=10),
        sampling=SamplingParams(max_new_tokens=512),
    )


def fenced(cmd: str) -> str:
    return f"```bash\n{cmd}\n```"


async def episode(provider: PodmanProvider, commands: list[str], run_id: str, task=None) -> EpisodeResult:  # type: ignore[no-untyped-def]
    tok = byte_tokenizer()
    engine = ScriptedEngine([*(fenced(c) for c in commands), "TASK_COMPLETE"], tok)
    return await run_episode(
        task or load_task(GUARDED),
        provider=provider,
        engine=engine,
        renderer=ChatRenderer(tok),
        config=episode_config(),
        run_id=run_id,
    )


def containers(run_id: str) -> list[str]:
    out = subprocess.run(
        [CLI, "ps", "-a", "--filter", f"label={LABEL_RUN}={run_id}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


@pytest.fixture
def run_id() -> str:
    return f"adv-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def provider(run_id: str):  # type: ignore[no-untyped-def]
    p = PodmanProvider(cli=CLI, shell_grace_s=3)
    yield p
    await p.aclose()
    assert p.live_sandboxes() == 0
    assert containers(run_id) == []  # nothing left running


async def test_the_honest_episode_scores_one(provider: PodmanProvider, run_id: str) -> None:
    """The control: the same task and loop score 1 when the work is done, so reward 0 below is the
    attack failing, not the suite."""
    result = await episode(provider, HONEST, run_id)
    assert result.episode.reward == 1.0 and result.episode.status is Status.COMPLETED


@pytest.mark.parametrize(("name", "commands", "expected"), ATTACKS, ids=[a[0] for a in ATTACKS])
async def test_attack_scores_zero_and_the_run_goes_on(
    provider: PodmanProvider, run_id: str, name: str, commands: list[str], expected: object
) -> None:
    result = await episode(provider, commands, run_id)
    assert result.verify is not None
    outcome, cause = result.verify.outcome, result.verify.cause
    assert (outcome, cause) in (expected if isinstance(expected, set) else {expected}), result.verify.error
    assert result.episode.reward == 0.0
    if outcome == "tampered":
        assert result.episode.status is Status.FAILED_POLICY and result.episode.failure_cause == cause
    # The run survives: the same provider still scores honest work.
    again = await episode(provider, HONEST, run_id)
    assert again.episode.reward == 1.0


async def test_fork_bomb_orphans_are_reaped_and_defaults_apply(provider: PodmanProvider, run_id: str) -> None:
    task = load_task(FIXTURES / "small-disk")  # silent about cpus and memory
    async with await provider.create(task, run_id=run_id) as sb:
        info = (
            await run_cli(
                CLI,
                "inspect",
                "--format",
                "{{.HostConfig.Memory}} {{.HostConfig.NanoCpus}} {{.HostConfig.PidsLimit}}",
                sb.sandbox_id,
            )
        )[1]
        assert info.split() == [str(2048 * 2**20), str(10**9), "1024"]
        res = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 3", timeout=2)
        assert res.timed_out
        zombies = "grep -l '^State:[[:space:]]*Z' /proc/[0-9]*/status 2>/dev/null | wc -l"
        for _ in range(40):
            count = await sb.exec(zombies, timeout=30)
            if count.stdout.strip() == "0":
                break
            await asyncio.sleep(0.25)
        assert count.stdout.strip() == "0"  # PID 1 reaps what the bomb left behind
        assert (await sb.exec("echo alive")).stdout == "alive\n"


async def test_storage_limit_is_enforced_as_a_policy_failure(provider: PodmanProvider, run_id: str) -> None:
    task = load_task(FIXTURES / "small-disk")  # storage_mb = 100
    result = await episode(
        provider, ["head -c 300000000 /dev/zero > /app/fill; sleep 5", "echo more"], run_id, task=task
    )
    assert result.episode.reward == 0.0 and result.episode.status is Status.FAILED_POLICY
    assert result.episode.failure_cause == "storage_exceeded"


async def test_host_proxy_variables_never_reach_the_sandbox(
    provider: PodmanProvider, run_id: str, monkeypatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://user:secret@proxy.invalid:3128")
    monkeypatch.setenv("https_proxy", "http://user:secret@proxy.invalid:3128")
    async with await provider.create(load_task(GUARDED), run_id=run_id) as sb:
        res = await sb.exec("env; cat /proc/1/environ | tr '\\0' '\\n'")
    assert "secret" not in res.stdout and "proxy" not in res.stdout.lower()


async def test_reward_out_of_range_is_a_verifier_error_with_the_value(
    provider: PodmanProvider, run_id: str, tmp_path: Path
) -> None:
    task_dir = tmp_path / "seven"
    shutil.copytree(GUARDED, task_dir)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho 7 > /logs/verifier/reward.txt\n")
    task = load_task(task_dir)
    async with await provider.create(task, run_id=run_id) as sb:
        res = await verify(sb, task)
    assert (
        res.outcome == "verifier-error" and res.cause == "reward_out_of_range" and "7.0" in (res.error or "")
    )


async def test_oversized_instruction_is_refused_with_a_task_error(
    provider: PodmanProvider, run_id: str, tmp_path: Path
) -> None:
    task_dir = tmp_path / "huge"
    shutil.copytree(GUARDED, task_dir)
    (task_dir / "instruction.md").write_text("x" * (MAX_INSTRUCTION_BYTES + 1))
    task = load_task(task_dir)
    assert any("over the" in w for w in task.validate())  # lint warns
    with pytest.raises(TaskFormatError, match="cap"):
        await episode(provider, HONEST, run_id, task=task)
    assert provider.live_sandboxes() == 0


async def test_a_listening_service_survives_verification_other_processes_do_not(
    provider: PodmanProvider, run_id: str
) -> None:
    """Tasks may ask for a service the tests talk to; everything else the agent left is killed."""
    async with await provider.create(load_task(GUARDED), run_id=run_id) as sb:
        await sb.exec(
            "python3 -m http.server 8011 --bind 127.0.0.1 >/dev/null 2>&1 & "
            "(while :; do sleep 0.05; done) >/dev/null 2>&1 & "
            "setsid bash -c 'while :; do sleep 0.05; done' >/dev/null 2>&1 </dev/null & sleep 1"
        )
        await sb.stop_processes()
        ps = await sb.exec("ps -eo pid,args")
        assert "http.server 8011" in ps.stdout
        assert "while" not in ps.stdout and "sleep 0.05" not in ps.stdout
        probe = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8011/').status)\""
        assert (await sb.exec(probe, timeout=30)).stdout == "200\n"
