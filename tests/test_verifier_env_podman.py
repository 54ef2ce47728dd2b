"""A separate verifier environment on real podman: the agent's artifacts, and nothing else of its
container, reach a fresh container built from the verifier's own image (tests bundled in it);
collect hooks run first; what the agent leaves running or plants elsewhere cannot touch it; an
artifact too large to copy is the agent's failure, found from the tar headers."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import pytest

from agentrl.agent.actions import get_format
from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import EpisodeConfig, replay_episode, run_episode
from agentrl.sandbox.podman import PodmanProvider
from agentrl.tasks.task import load_task
from tests.chat_tokenizer import byte_tokenizer
from tests.host_listener import host_listener
from tests.test_daytona_contract import make_provider, server  # noqa: F401 - the fake Daytona's fixture

pytestmark = [pytest.mark.container, pytest.mark.slow]

TASK = Path(__file__).resolve().parents[1] / "envs" / "tbench2" / "tasks" / "sales-total-artifact"
FMT = get_format("terminus-json")
SOLVE = "mkdir -p /app/out && echo 7967 > /app/out/total.txt && echo 37 > /app/out/count.txt"


def _script(*cmds: str) -> list[str]:
    return [
        FMT.render([c + "\n" for c in cmds], task_complete=False, analysis="a", plan="p"),
        FMT.render([], task_complete=True, analysis="done", plan="finish"),
    ]


async def _episode(task_dir: Path, tmp_path: Path, *cmds: str, provider=None):  # type: ignore[no-untyped-def]
    tok = byte_tokenizer()
    provider = provider or PodmanProvider()
    try:
        result = await run_episode(
            load_task(task_dir),
            provider=provider,
            engine=ScriptedEngine(_script(*cmds), tok),
            renderer=ChatRenderer(tok),
            config=EpisodeConfig(
                agent=AgentConfig(
                    max_turns=3, max_new_tokens=4096, max_total_tokens=32768, terminal="commands"
                ),
                sampling=SamplingParams(max_new_tokens=4096),
            ),
            run_id="sepverify",
            record_dir=tmp_path,
        )
    finally:
        await provider.aclose()
    assert provider.live_sandboxes() == 0  # the verifier's container is gone too
    return result


def _probe_task(tmp_path: Path) -> Path:
    """The bundled task with tests that also check what the verifier's environment holds."""
    d = tmp_path / "sales-probe"
    shutil.copytree(TASK, d)
    (d / "tests" / "test_outputs.py").write_text(
        (d / "tests" / "test_outputs.py").read_text()
        + """

import os


def test_only_the_artifacts_came_over():
    assert not Path("/app/sales.csv").exists()  # the agent's image is not the verifier's
    assert not Path("/app/planted.txt").exists()  # nor anything the agent wrote outside them
    assert Path("/logs/artifacts/listing.txt").read_text().count("total.txt") == 1  # the hook ran first


def test_no_process_of_the_agent_is_here():
    names = [open(f"/proc/{p}/cmdline", "rb").read() for p in os.listdir("/proc") if p.isdigit()]
    assert not any(b"planted" in n for n in names)
"""
    )
    return d


@pytest.mark.parametrize("backend", ["podman", "daytona-fake"])
async def test_only_artifacts_reach_a_verifier_built_from_its_own_image(
    tmp_path: Path, backend: str, request
) -> None:
    task = _probe_task(tmp_path)
    provider = make_provider(request.getfixturevalue("server")) if backend == "daytona-fake" else None
    leftover = "nohup sh -c 'while true; do echo 1 > /logs/verifier/reward.txt; sleep 0.2; done # planted' >/dev/null 2>&1 &"
    result = await _episode(task, tmp_path, SOLVE, "echo x > /app/planted.txt", leftover, provider=provider)
    assert result.verify.outcome == "pass", result.verify.log_tail
    assert "4 passed" in result.verify.log_tail


async def test_wrong_artifacts_fail_whatever_the_agent_left_running(tmp_path: Path) -> None:
    forge = (
        "nohup sh -c 'while true; do mkdir -p /logs/verifier /tests; echo 1 > /logs/verifier/reward.txt;"
        ' printf "#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n" > /tests/test.sh; sleep 0.1; done\' >/dev/null 2>&1 &'
    )
    result = await _episode(TASK, tmp_path, "mkdir -p /app/out && echo 1 > /app/out/total.txt", forge)
    assert result.verify.outcome == "fail" and result.verify.reward == 0.0


async def test_a_sparse_artifact_over_the_limit_is_the_agents_failure_found_fast(tmp_path: Path) -> None:
    start = time.monotonic()
    result = await _episode(TASK, tmp_path, SOLVE, "truncate -s 300G /app/out/huge")
    assert result.verify.outcome == "tampered" and result.verify.cause == "artifact_too_large"
    assert result.episode.reward == 0.0 and "more than 256 MiB" in (result.verify.error or "")
    assert time.monotonic() - start < 120  # nothing of the 300 GB is read


async def test_a_separate_verification_replays(tmp_path: Path) -> None:
    result = await _episode(TASK, tmp_path, SOLVE)
    assert result.verify.reward == 1.0 and result.record_path is not None
    provider = PodmanProvider()
    try:
        report = await replay_episode(result.record_path, provider=provider, run_id="sepreplay")
    finally:
        await provider.aclose()
    assert report.reward_matches and report.replayed_reward == 1.0


def _phase_task(tmp_path: Path, port: int, steps: bool = False) -> Path:
    """Agent phase without network, verifier phase public (Harbor's per-phase `network_mode`): the
    tests reach a listener on the host's bridge address only if the switch happened."""
    d = tmp_path / "phases"
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text(
        "#!/bin/bash\n"
        f"if timeout 5 bash -c 'echo verifier > /dev/tcp/10.88.0.1/{port}' && grep -q blocked /app/agent.txt; then\n"
        "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n"
    )
    (d / "instruction.md").write_text("Try the network from /app.\n")
    (d / "task.toml").write_text(
        '[environment]\nnetwork_mode = "no-network"\n[verifier]\nnetwork_mode = "public"\ntimeout_sec = 60\n'
    )
    return d


@pytest.mark.parametrize("backend", ["podman", "daytona-fake"])
async def test_the_verifier_phase_gets_its_own_network_policy(tmp_path: Path, backend: str, request) -> None:
    listening = contextlib.ExitStack()
    port, seen = listening.enter_context(host_listener())
    try:
        probe = f"(timeout 5 bash -c 'echo agent > /dev/tcp/10.88.0.1/{port}' && echo open || echo blocked) > /app/agent.txt"
        provider = make_provider(request.getfixturevalue("server")) if backend == "daytona-fake" else None
        result = await _episode(_phase_task(tmp_path, port), tmp_path, probe, provider=provider)
    finally:
        listening.close()
    assert result.verify.reward == 1.0, result.verify.log_tail
    assert seen == [b"verifier\n"]  # the agent's attempt never arrived


def _other_host_address() -> str | None:
    """An address of this host other than podman's bridge (reached through the bridge too)."""
    import subprocess

    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] != "lo" and not parts[3].startswith("10.88."):
            return parts[3].split("/")[0]
    return None


@pytest.mark.parametrize(
    ("phase", "backend"), [("agent", "podman"), ("verifier", "podman"), ("verifier", "daytona-fake")]
)  # Daytona's agent phase is its create parameters (tests/test_daytona.py)
async def test_an_allowlist_reaches_its_addresses_and_nothing_else(
    tmp_path: Path, phase: str, backend: str, request
) -> None:
    """Harbor's `allowlist`: the phase reaches the allowed address (the bridge's), and not another
    address of the same host; the other phase, closed, reaches neither. On podman by the backend's
    own rules; on Daytona through its network limits (`network_allow_list`), which the fake
    enforces by address."""
    other = _other_host_address()
    if other is None:
        pytest.skip("this host has no address besides loopback and podman's bridge")
    listening = contextlib.ExitStack()
    port, seen = listening.enter_context(host_listener())

    def probe(who: str) -> str:
        return " ; ".join(
            f"(timeout 5 bash -c 'echo {who}-{addr} > /dev/tcp/{addr}/{port}' && echo {addr} open || echo {addr} blocked)"
            for addr in ("10.88.0.1", other)
        )

    d = tmp_path / "allow"
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text(
        f"#!/bin/bash\n{{ {probe('verifier')} ; }} > /logs/verifier/seen.txt\necho 1 > /logs/verifier/reward.txt\n"
    )
    (d / "instruction.md").write_text("Try the network.\n")
    allow = 'network_mode = "allowlist"\nallowed_hosts = ["10.88.0.1"]\n'
    (d / "task.toml").write_text(
        f'[environment]\n{allow}[verifier]\nnetwork_mode = "no-network"\n'
        if phase == "agent"
        else f'[environment]\nnetwork_mode = "no-network"\n[verifier]\n{allow}'
    )
    try:
        provider = make_provider(request.getfixturevalue("server")) if backend == "daytona-fake" else None
        result = await _episode(d, tmp_path, f"{{ {probe('agent')} ; }} > /app/agent.txt", provider=provider)
    finally:
        listening.close()
    assert result.verify.reward == 1.0, result.verify.log_tail
    assert sorted(seen) == [f"{phase}-10.88.0.1\n".encode()]


async def test_a_wildcard_allowlist_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from agentrl.errors import InputError

    d = tmp_path / "wild"
    shutil.copytree(TASK, d)
    toml = (d / "task.toml").read_text()
    (d / "task.toml").write_text(
        toml.replace("[agent]\n", '[agent]\nnetwork_mode = "allowlist"\nallowed_hosts = ["*.pypi.org"]\n')
    )
    provider = PodmanProvider()
    with pytest.raises(InputError, match="wildcard"):
        await provider.create(load_task(d), run_id="wild")
    assert provider.live_sandboxes() == 0


@pytest.mark.parametrize("command", ["test -f /tests/test.sh", "test -f /app/sales.csv"])
async def test_the_verifier_environments_own_healthcheck_runs_before_the_artifacts(
    tmp_path: Path, command: str
) -> None:
    """`[verifier.environment.healthcheck]` runs in the verifier's environment (its image has the
    tests, not the agent's files), before anything of the agent's is in it: a failing one is the
    environment's failure, never a reward."""
    from agentrl.episode.healthcheck import HealthcheckError

    d = tmp_path / "hc"
    shutil.copytree(TASK, d)
    toml = (d / "task.toml").read_text()
    (d / "task.toml").write_text(
        toml.replace(
            "[[verifier.collect]]",
            f'[verifier.environment.healthcheck]\ncommand = "{command}"\nretries = 1\ninterval_sec = 0.1\n\n[[verifier.collect]]',
        )
    )
    if command.endswith("test.sh"):
        assert (await _episode(d, tmp_path, SOLVE)).verify.reward == 1.0
        return
    with pytest.raises(HealthcheckError, match=r"sales\.csv"):
        await _episode(d, tmp_path, SOLVE)


@pytest.mark.parametrize("name", ["two-step-notes", "sales-total-artifact"])
async def test_the_oracle_contract_holds_on_the_daytona_fake(name: str, request) -> None:
    """Where Daytona supports the feature (multi-step, a separate verifier), the
    oracle sweep's contract holds on the Daytona fake as on podman: the reference solution scores
    1 and no solution 0, with nothing left running."""
    from agentrl.episode.oracle import oracle_one

    provider = make_provider(request.getfixturevalue("server"))
    task = load_task(TASK.parent / name)
    try:
        solved = await oracle_one(provider, task, run_id="oracle-daytona")
        unsolved = await oracle_one(provider, task, run_id="oracle-daytona", solution=False)
    finally:
        await provider.aclose()
    assert (solved.reward, solved.cause) == (1.0, None), solved.detail
    assert (unsolved.reward, unsolved.cause) == (0.0, None), unsolved.detail
    assert provider.live_sandboxes() == 0


async def test_a_steps_own_agent_network_applies_to_that_step_only(tmp_path: Path) -> None:
    """`[steps.agent] network_mode` (Harbor: the step's override wins over the task's): the first
    step's agent has no network, the second's may reach one address; the host hears only the
    second."""
    listening = contextlib.ExitStack()
    port, seen = listening.enter_context(host_listener())
    d = tmp_path / "steps-net"
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    for name in ("closed", "open"):
        (d / "steps" / name).mkdir(parents=True)
        (d / "steps" / name / "instruction.md").write_text(f"Step {name}: try the network.\n")
    (d / "task.toml").write_text(
        '[environment]\nnetwork_mode = "no-network"\n\n[[steps]]\nname = "closed"\n\n[[steps]]\nname = "open"\n'
        '[steps.agent]\nnetwork_mode = "allowlist"\nallowed_hosts = ["10.88.0.1"]\n'
    )
    probe = [
        f"(timeout 5 bash -c 'echo {who} > /dev/tcp/10.88.0.1/{port}' && echo open || echo blocked)"
        for who in ("first", "second")
    ]
    replies = [*_script(probe[0]), *_script(probe[1])]
    tok = byte_tokenizer()
    provider = PodmanProvider()
    try:
        result = await run_episode(
            load_task(d),
            provider=provider,
            engine=ScriptedEngine(replies, tok),
            renderer=ChatRenderer(tok),
            config=EpisodeConfig(
                agent=AgentConfig(
                    max_turns=3, max_new_tokens=4096, max_total_tokens=32768, terminal="commands"
                ),
                sampling=SamplingParams(max_new_tokens=4096),
            ),
            run_id="steps-net",
        )
    finally:
        await provider.aclose()
        listening.close()
    assert result.verify.reward == 1.0, result.verify.log_tail
    outputs = [o.stdout.strip() for t in result.run.turns for o in t.outputs]
    assert outputs == ["blocked", "open"] and seen == [b"second\n"]


async def test_a_steps_own_verifier_image_bundles_its_tests_and_gets_only_its_artifacts(
    tmp_path: Path,
) -> None:
    """Harbor's per-step resolution run for real: the second step of two-step-notes verified in a
    separate environment built from `steps/append/tests/Dockerfile` (its bundled tests), which gets
    only that step's artifacts; the first step is verified in the shared sandbox as before. The
    reference solution scores 1, no solution 0; the step's verifier never sees the agent's other
    files."""
    from agentrl.episode.oracle import oracle_one

    d = tmp_path / "two-step-notes"
    shutil.copytree(TASK.parent / "two-step-notes", d)
    tests = d / "steps" / "append" / "tests"
    (tests / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\n"
        "RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pytest"
        " && rm -rf /var/lib/apt/lists/*\n"
        "WORKDIR /app\nCOPY test.sh test_outputs.py /tests/\n"
    )
    with (tests / "test_outputs.py").open("a") as fh:
        fh.write("\n\ndef test_only_the_artifacts_came_over():\n"
                 "    assert not Path('/app/secret.txt').exists()\n")  # fmt: skip
    toml = (d / "task.toml").read_text()
    marker = '[[steps]]\nname = "append"\n'
    assert marker in toml and toml.endswith("[steps.verifier]\ntimeout_sec = 120.0\n")  # the last step's
    toml = toml.replace(marker, marker + 'artifacts = ["/app/notes.txt", "/app/inbox"]\n')
    (d / "task.toml").write_text(toml + 'environment_mode = "separate"\n')
    solve = d / "steps" / "write" / "solution" / "solve.sh"
    solve.write_text(solve.read_text() + "\necho planted > /app/secret.txt\n")
    task = load_task(d)
    assert [s.verifier_mode for s in task.steps] == ["shared", "separate"]
    provider = PodmanProvider()
    try:
        solved = await oracle_one(provider, task, run_id="step-verifier")
        unsolved = await oracle_one(provider, task, run_id="step-verifier", solution=False)
    finally:
        await provider.aclose()
    assert (solved.reward, solved.cause) == (1.0, None), solved.detail
    assert (unsolved.reward, unsolved.cause) == (0.0, None), unsolved.detail
    assert provider.live_sandboxes() == 0
