"""Provenance on real podman with real pytest, on the bundled tasks that keep it honest: work the
task asks for in system paths scores 1 (the reference solution's footprint, computed on demand),
services left running answer the tests, tests bring their own plugins, and code the agent slips
into the test run by any other path is `tampered`."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from agentrl.episode.oracle import oracle_one
from agentrl.episode.verify import footprint_path
from agentrl.sandbox.podman import PodmanProvider
from agentrl.tasks.task import load_task
from tests.test_adversarial_podman import CODE, episode, pytestmark, script  # noqa: F401

TASKS = Path(__file__).resolve().parents[1] / "envs" / "tbench2" / "tasks"
PLUGIN = [
    "d=/usr/lib/python3/dist-packages && mkdir -p $d/evil-1.0.dist-info && "
    + script("$d/evil-1.0.dist-info/METADATA", "Metadata-Version: 2.1", "Name: evil", "Version: 1.0")
    + " && "
    + script("$d/evil-1.0.dist-info/entry_points.txt", "[pytest11]", "evil = evil_plugin")
    + " && "
    + script("$d/evil_plugin.py", "import os", "os._exit(0)")
]


@pytest.fixture
def run_id() -> str:
    return f"prov-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def provider():  # type: ignore[no-untyped-def]
    return PodmanProvider(shell_grace_s=3)


@pytest.fixture(autouse=True)
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))


async def test_a_package_installed_into_system_paths_as_asked_scores_one(provider, run_id: str) -> None:  # type: ignore[no-untyped-def]
    task = load_task(TASKS / "install-deb")
    assert not footprint_path(task).exists()
    try:
        result = await episode(provider, ["dpkg -i /opt/pkgs/greet_1.0_all.deb"], run_id, task=task)
    finally:
        await provider.aclose()
    assert result.verify is not None and result.verify.outcome == "pass", result.verify.error
    # The footprint was computed once, on demand, from the task's own solution.
    assert json.loads(footprint_path(task).read_text())["trusted"] == ["/usr/bin/greet"]


async def test_a_program_the_solution_does_not_install_is_still_tampering(provider, run_id: str) -> None:  # type: ignore[no-untyped-def]
    task = load_task(TASKS / "install-deb")
    commands = [
        script("/usr/bin/greet", "#!/bin/sh", 'echo "Hello, $1!"') + " && chmod +x /usr/bin/greet",
        *PLUGIN,
    ]
    try:
        result = await episode(provider, commands, run_id, task=task)
    finally:
        await provider.aclose()
    assert result.verify is not None
    assert (result.verify.outcome, result.verify.cause) == CODE, result.verify.error
    assert "evil_plugin.py" in (result.verify.error or "") and result.episode.reward == 0.0


async def test_a_replaced_system_tool_the_task_asks_for_scores_one(provider, run_id: str) -> None:  # type: ignore[no-untyped-def]
    task = load_task(TASKS / "replace-tool")
    commands = [
        script(
            "/usr/local/bin/checksum",
            "#!/bin/sh",
            '[ -f "$1" ] || exit 1',
            "sha256sum \"$1\" | cut -d' ' -f1",
        )
        + " && chmod 755 /usr/local/bin/checksum"
    ]
    try:
        result = await episode(provider, commands, run_id, task=task)
    finally:
        await provider.aclose()
    assert result.verify is not None and result.verify.outcome == "pass", result.verify.error


async def test_tests_that_install_their_own_plugin_score_one_and_a_planted_plugin_does_not(
    provider,
    run_id: str,  # type: ignore[no-untyped-def]
) -> None:
    task = load_task(TASKS / "pytest-plugin-sum")
    solve = "python3 -c \"print(sum(int(l) for l in open('/app/numbers.txt') if l.strip()))\" > /app/sum.txt"
    try:
        honest = await episode(provider, [solve], run_id, task=task)
        planted = await episode(provider, PLUGIN, run_id, task=task)
    finally:
        await provider.aclose()
    assert honest.verify is not None and honest.verify.outcome == "pass", honest.verify.log_tail
    assert planted.verify is not None and (planted.verify.outcome, planted.verify.cause) == CODE


async def test_a_service_left_running_answers_the_tests(provider, run_id: str) -> None:  # type: ignore[no-untyped-def]
    """The solution starts a server and ends; the tests, in their own container, reach it."""
    try:
        result = await oracle_one(provider, load_task(TASKS / "port-service"), run_id=run_id)
    finally:
        await provider.aclose()
    assert result.ok and result.reward == 1.0, result.detail


@pytest.mark.parametrize(
    "commands",
    [
        [script("/pytest.ini", "[pytest]", "addopts = --collect-only")],  # passes without running a test
        [script("/pytest.ini", "[pytest]"), script("/conftest.py", "import os", "os._exit(0)")],
        [
            "f=$(python3 -c 'import _pytest.main as m; print(m.__file__)') && echo 'import os; os._exit(0)' >> $f"
        ],
    ],
    ids=["root pytest.ini", "root conftest.py", "pytest's own code"],
)
async def test_the_real_harness_steered_by_the_agent_is_tampering(
    provider, run_id: str, commands: list[str]
) -> None:  # type: ignore[no-untyped-def]
    task = load_task(TASKS / "hello-file")
    try:
        result = await episode(provider, commands, run_id, task=task)
    finally:
        await provider.aclose()
    assert result.verify is not None
    assert (result.verify.outcome, result.verify.cause) == CODE, result.verify.error
    assert result.episode.reward == 0.0
