"""The verifier: Harbor's reward parsing, and `verify` end to end on the fake backend."""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import pytest

from agentrl.episode.oracle import ensure_footprint
from agentrl.episode.verify import VERIFIER_PYTHON_ENV, footprint_path, parse_reward, verify
from agentrl.errors import TaskFormatError
from agentrl.sandbox.base import ExecResult, SandboxCreateError
from agentrl.tasks.task import load_task
from agentrl.testing.sandbox import FakeSandbox, FakeSandboxProvider, Faults

FIXTURES = Path(__file__).parent / "fixtures" / "sandbox_tasks"


@pytest.mark.parametrize(
    "json_text,txt_text,rewards",
    [
        (None, "1", {"reward": 1.0}),
        (None, " 0.25\n\n", {"reward": 0.25}),
        (None, "0", {"reward": 0.0}),
        ('{"reward": 0.5, "style": 1}', "0", {"reward": 0.5, "style": 1.0}),  # json wins
        ('{"accuracy": 0.75}', None, {"accuracy": 0.75}),
        ("{}", "1", {}),
    ],
)
def test_parse_reward_accepts(json_text, txt_text, rewards) -> None:
    assert parse_reward(json_text, txt_text) == (rewards, None)


@pytest.mark.parametrize(
    "json_text,txt_text,why",
    [
        (None, None, "neither"),
        (None, "", "empty"),
        (None, "   \n", "not a number"),
        (None, "yes", "not a number"),
        (None, "nan", "not finite"),
        (None, "inf", "not finite"),
        ("", "1", "empty"),
        ("{bad", "1", "not valid JSON"),
        ("0.5", None, "object"),
        ('{"reward": "1"}', None, "not a finite number"),
        ('{"reward": NaN}', None, "not a finite number"),
        ('{"reward": 1e309}', None, "not a finite number"),
        ('{"reward": {"nested": 1}}', None, "not a finite number"),
        ('{"reward": true}', None, "not a finite number"),
        (None, "7", "outside [0, 1]"),
        (None, "-1", "outside [0, 1]"),
        ('{"reward": 0.5, "style": 2}', None, "'style' = 2.0 is outside"),
    ],
)
def test_parse_reward_rejects(json_text, txt_text, why) -> None:
    rewards, error = parse_reward(json_text, txt_text)
    assert rewards is None
    assert error is not None and why in error


def grader_from_output(sb: FakeSandbox) -> float:
    return 1.0 if sb.files.get("/app/out.txt") == b"hello\n" else 0.0


@pytest.fixture
def task():
    return load_task(FIXTURES / "write-hello")


async def test_pass_and_fail(task) -> None:
    provider = FakeSandboxProvider(grader=grader_from_output)
    async with await provider.create(task, run_id="v") as sb:
        first = await verify(sb, task)
        assert (first.outcome, first.reward) == ("fail", 0.0)
        await sb.exec("echo hello > /app/out.txt")
        second = await verify(sb, task)
        assert (second.outcome, second.reward, second.rewards) == ("pass", 1.0, {"reward": 1.0})
        assert not second.infra_failure
        # tests arrive only at verification time, with the task's [verifier.env]
        assert sb.files["/tests/test.sh"] == task.test_script.read_bytes()
        run = next(c for c in reversed(sb.calls) if c.cmd.startswith("/tests/test.sh"))
        assert run.env == {**VERIFIER_PYTHON_ENV, "EXPECTED": "hello"}
        assert run.timeout == task.config.verifier.timeout_sec


async def test_partial_reward_is_a_fail_with_its_value(task) -> None:
    provider = FakeSandboxProvider(grader=lambda sb: 0.5)
    async with await provider.create(task, run_id="v") as sb:
        res = await verify(sb, task)
    assert (res.outcome, res.reward) == ("fail", 0.5)


async def test_planted_reward_is_cleared_before_the_tests_run(task) -> None:
    provider = FakeSandboxProvider(grader=lambda sb: None)  # test.sh writes no reward
    async with await provider.create(task, run_id="v") as sb:
        sb.files["/logs/verifier/reward.txt"] = b"1\n"
        sb.files["/logs/verifier/reward.json"] = b'{"reward": 1}'
        res = await verify(sb, task)
    assert res.outcome == "verifier-error" and res.reward is None and res.infra_failure
    assert "neither" in (res.error or "")


async def test_verifier_timeout_is_an_infra_failure(task) -> None:
    provider = FakeSandboxProvider().on(r"^/tests/test\.sh", lambda sb, c, m: ExecResult("", "", None, True))
    async with await provider.create(task, run_id="v") as sb:
        res = await verify(sb, task, timeout=0.1)
    assert res.outcome == "timeout" and res.infra_failure and res.reward is None
    # ...that an agent's artefacts could have caused: after an agent phase, a policy failure.
    assert res.policy_failure and res.cause == "verifier_timeout"


async def test_reward_json_takes_precedence(task) -> None:
    def both(sb: FakeSandbox, cmd: str, m) -> ExecResult:
        sb.files["/logs/verifier/reward.json"] = b'{"reward": 0.25, "lint": 1}'
        sb.files["/logs/verifier/reward.txt"] = b"1"
        return ExecResult("", "", 0)

    provider = FakeSandboxProvider().on(r"^/tests/test\.sh", both)
    async with await provider.create(task, run_id="v") as sb:
        res = await verify(sb, task)
    assert res.rewards == {"reward": 0.25, "lint": 1.0} and res.reward == 0.25
    assert math.isclose(res.reward, 0.25)


async def test_transport_errors_propagate_not_scored(task) -> None:
    from agentrl.sandbox.base import SandboxTransportError

    provider = FakeSandboxProvider(faults=Faults(transport_error=1.0))
    async with await provider.create(task, run_id="v") as sb:
        with pytest.raises(SandboxTransportError):
            await verify(sb, task)


@pytest.mark.parametrize("fixture,message", [("no-test-sh", "missing")])
async def test_bad_test_script_is_a_typed_error(fixture: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, path)
    bad = load_task(path)
    provider = FakeSandboxProvider()
    async with await provider.create(bad, run_id="v") as sb:
        with pytest.raises(TaskFormatError, match=message):
            await verify(sb, bad)


async def test_a_test_script_without_its_executable_bit_is_made_executable_inside(tmp_path: Path) -> None:
    path = tmp_path / "test-not-executable"
    shutil.copytree(FIXTURES / "test-not-executable", path)
    task = load_task(path)
    provider = FakeSandboxProvider()
    async with await provider.create(task, run_id="v") as sb:
        await verify(sb, task)
        assert "chmod +x /tests/test.sh" in sb.commands  # as Harbor does, inside the sandbox


def test_a_task_option_may_allow_other_reward_ranges() -> None:
    assert parse_reward(None, "7", reward_range=None) == ({"reward": 7.0}, None)
    assert parse_reward(None, "7", reward_range=(0, 10)) == ({"reward": 7.0}, None)


async def test_reward_out_of_range_is_a_verifier_error_showing_the_value(task) -> None:
    provider = FakeSandboxProvider(grader=lambda sb: 7.0)
    async with await provider.create(task, run_id="v") as sb:
        res = await verify(sb, task)
    assert res.outcome == "verifier-error" and res.reward is None and res.infra_failure
    assert (
        res.cause == "reward_out_of_range" and res.policy_failure
    )  # after an agent phase: its code may have written it
    assert "7.0" in (res.error or "")


async def test_a_background_loop_rewriting_the_reward_is_stopped_first(task) -> None:
    def forge(sb: FakeSandbox) -> None:
        sb.files["/logs/verifier/reward.txt"] = b"1\n"

    provider = FakeSandboxProvider(grader=grader_from_output)
    async with await provider.create(task, run_id="v") as sb:
        sb.background.append(forge)  # the agent left it running
        await sb.exec("true")
        assert sb.files["/logs/verifier/reward.txt"] == b"1\n"
        res = await verify(sb, task)
    assert (res.outcome, res.reward) == ("fail", 0.0)
    assert sb.background == []


async def test_tests_and_logs_are_recreated_whatever_the_agent_made_of_them(task) -> None:
    provider = FakeSandboxProvider(grader=grader_from_output)
    async with await provider.create(task, run_id="v") as sb:
        sb.files["/tests/conftest.py"] = b"import os; os.system('echo 1 > /logs/verifier/reward.txt')\n"
        sb.files["/logs/verifier/reward.json"] = b'{"reward": 1}'
        res = await verify(sb, task)
        assert "/tests/conftest.py" not in sb.files
    assert (res.outcome, res.reward) == ("fail", 0.0)


async def test_a_changed_system_file_is_tampering_scored_zero(task) -> None:
    provider = FakeSandboxProvider(
        grader=lambda sb: 1.0, image_files={"/usr/bin/cat": b"ELF cat", "/usr/bin/python3": b"ELF py"}
    )
    async with await provider.create(task, run_id="v") as sb:
        sb.files["/usr/bin/cat"] = b"#!/bin/sh\necho 1\n"
        sb.files["/usr/local/bin/python3"] = b"#!/bin/sh\n"  # shadows the real one on PATH
        sb.files["/app/notes.txt"] = b"ordinary work is fine\n"
        res = await verify(sb, task)
        assert not any(c.cmd.startswith("/tests/test.sh") for c in sb.calls)  # tests never ran
    assert (res.outcome, res.reward, res.cause) == ("tampered", 0.0, "system_files")
    assert res.policy_failure and not res.infra_failure
    assert "/usr/bin/cat" in (res.error or "") and "/usr/local/bin/python3" in (res.error or "")
    assert "/app/notes.txt" not in (res.error or "")


async def test_an_oversized_reward_file_is_never_read_whole(task) -> None:
    def big(sb: FakeSandbox, cmd: str, m) -> ExecResult:
        sb.files["/logs/verifier/reward.txt"] = b"1" + b" " * (1 << 20)
        return ExecResult("", "", 0)

    provider = FakeSandboxProvider().on(r"^/tests/test\.sh", big)
    async with await provider.create(task, run_id="v") as sb:
        res = await verify(sb, task)
    assert res.outcome == "verifier-error" and "too large" in (res.error or "")


async def test_a_task_may_declare_its_reward_range(task, tmp_path: Path) -> None:
    path = tmp_path / "ten"
    shutil.copytree(FIXTURES / "write-hello", path)
    toml = (path / "task.toml").read_text().replace("[verifier]\n", "[verifier]\nreward_range = [0, 10]\n")
    (path / "task.toml").write_text(toml)
    wide = load_task(path)
    assert wide.config.verifier.reward_range == (0.0, 10.0)
    async with await FakeSandboxProvider(grader=lambda sb: 7.0).create(wide, run_id="v") as sb:
        res = await verify(sb, wide)
    assert res.reward == 7.0 and res.outcome == "pass"  # pass is still reward >= 1
    (path / "task.toml").write_text(toml.replace("[0, 10]", "[10, 0]"))
    with pytest.raises(TaskFormatError, match="reward_range"):
        _ = load_task(path).config


async def test_a_footprint_is_computed_once_for_episodes_running_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    task = load_task(FIXTURES / "write-hello")
    provider = FakeSandboxProvider(grader=lambda sb: 1.0)
    results = await asyncio.gather(*(ensure_footprint(provider, task, run_id="f") for _ in range(3)))
    assert results == [frozenset()] * 3 and provider.created == 1


async def test_an_infrastructure_failure_while_computing_a_footprint_is_raised_and_not_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    task = load_task(FIXTURES / "reward-json")
    broken = FakeSandboxProvider(grader=lambda sb: 1.0, faults=Faults(create_failure=1.0))
    with pytest.raises(SandboxCreateError):
        await ensure_footprint(broken, task, run_id="f")
    assert not footprint_path(task).exists()
    working = FakeSandboxProvider(grader=lambda sb: 1.0)
    assert await ensure_footprint(working, task, run_id="f") == frozenset() and working.created == 1
