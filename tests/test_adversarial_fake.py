"""Adversarial checks that need no container: output escaped for the operator's terminal, the
tamper rules, the instruction cap in lint, and a sandbox the agent broke classified as policy."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.agent.tokens import ChatRenderer
from agentrl.cli.episode import _safe
from agentrl.cli.tasks import app as tasks_app
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import run_episode
from agentrl.episode.sample import Status
from agentrl.sandbox.base import ExecResult, SandboxPolicyError, printable, tampered
from agentrl.sandbox.lint import lint_task
from agentrl.sandbox.podman.sandbox import _DiffScan
from agentrl.tasks.task import MAX_INSTRUCTION_BYTES, load_task
from agentrl.testing.sandbox import FakeSandbox, FakeSandboxProvider
from tests.chat_tokenizer import byte_tokenizer
from tests.test_adversarial_podman import GUARDED, episode_config, fenced

HOSTILE_OUTPUT = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\x9b31m\u202eevil\r\n"


def test_printable_shows_escape_sequences_and_keeps_text() -> None:
    out = printable(HOSTILE_OUTPUT + "tab\tok\nnext line")
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e]", out)
    assert "\\x1b]0;pwned\\x07" in out and "\\u202e" in out and "\\r" in out
    assert out.endswith("tab\tok\nnext line")
    assert _safe("[red]not markup[/red]") == "\\[red]not markup\\[/red]"


def test_tasks_oracle_escapes_sandbox_output(monkeypatch, tmp_path: Path) -> None:
    task_dir = tmp_path / "noisy"
    shutil.copytree(GUARDED, task_dir)

    def noisy(sb: FakeSandbox, cmd: str, m) -> ExecResult:  # type: ignore[no-untyped-def]
        sb.files["/logs/verifier/test-stdout.txt"] = HOSTILE_OUTPUT.encode()
        sb.files["/logs/verifier/reward.txt"] = b"0\n"
        return ExecResult("", "", 0)

    def fake_provider(backend: str, **options):  # type: ignore[no-untyped-def]
        return (
            FakeSandboxProvider()
            .on(r"^tail -c \d+ /logs/verifier/test-stdout\.txt$", HOSTILE_OUTPUT)
            .on(r"^/tests/test\.sh", noisy)
            .on(r"^chmod \+x /solution/solve\.sh", ExecResult("", HOSTILE_OUTPUT, 1))
        )

    monkeypatch.setattr("agentrl.cli.tasks.make_provider", fake_provider)
    result = CliRunner().invoke(tasks_app, ["oracle", str(task_dir), "--backend", "fake"])
    assert result.exit_code == 1  # reward 0 where 1 was expected: reported, with the output
    assert "pwned" in result.output
    assert "\x1b" not in result.output and "\x07" not in result.output and "\u202e" not in result.output


def test_lint_warns_about_an_oversized_instruction(tmp_path: Path) -> None:
    task_dir = tmp_path / "huge"
    shutil.copytree(GUARDED, task_dir)
    (task_dir / "instruction.md").write_text("x" * (MAX_INSTRUCTION_BYTES + 1))
    result = lint_task(load_task(task_dir))
    assert result.ok and any("over the" in w and "refuse" in w for w in result.warnings)


@pytest.mark.parametrize(
    ("changed", "deleted", "added", "flagged"),
    [
        (["/usr", "/usr/bin", "/usr/bin/cat"], [], [], ["/usr/bin/cat"]),
        (["/usr", "/usr/bin"], ["/usr/bin/yes"], [], ["/usr/bin/yes"]),
        ([], [], ["/usr/local/bin/python3", "/usr/local/bin/mytool"], ["/usr/local/bin/python3"]),
        ([], [], ["/etc/ld.so.preload", "/etc/motd"], ["/etc/ld.so.preload"]),
        ([], [], ["/conftest.py", "/app/conftest.py", "/app/pytest.py"], ["/app/pytest.py", "/conftest.py"]),
        ([], [], ["/app/src/pkg/__init__.py", "/app/pytest/__init__.py"], ["/app/pytest/__init__.py"]),
        ([], [], ["/usr/lib/python3/dist-packages/x.pth"], ["/usr/lib/python3/dist-packages/x.pth"]),
        (["/usr/lib/python3.11/json/__pycache__/decoder.cpython-311.pyc"], [], [], []),
        (["/etc", "/etc/hosts", "/app", "/root/.bashrc"], ["/tmp/x"], ["/app/out.txt"], []),
    ],
)
def test_tamper_rules(changed, deleted, added, flagged) -> None:  # type: ignore[no-untyped-def]
    assert tampered(changed, deleted, added) == flagged
    # The same rules over `podman diff` lines streamed in either order (directories are not
    # listed before their entries); a directory only seen before its entries is asked of the layer.
    lines = [f"C {p}" for p in changed] + [f"D {p}" for p in deleted] + [f"A {p}" for p in added]
    dirs = {p.rsplit("/", 1)[0] for p in [*changed, *deleted, *added]}
    for order in (lines, lines[::-1]):
        scan = _DiffScan()
        for line in order:
            scan.feed(line)
        assert scan.result(lambda p: p in dirs) == flagged


def test_a_huge_diff_is_scanned_in_bounded_memory() -> None:
    scan = _DiffScan(cap=100)
    for i in range(50_000):
        scan.feed(f"A /usr/local/lib/python3.11/site-packages/evil{i}.pth")
        scan.feed(f"A /app/data/file{i}")  # ordinary additions are never held
    found = scan.result()
    assert len(scan.candidates) == 100 and len(found) == 101 and found[-1] == "... and up to 49900 more"


async def test_a_sandbox_the_command_broke_is_a_policy_failure_not_infra() -> None:
    def break_it(sb: FakeSandbox, cmd: str, m) -> ExecResult:  # type: ignore[no-untyped-def]
        raise SandboxPolicyError("the shell was killed during the command", cause="shell_killed")

    provider = FakeSandboxProvider(grader=lambda sb: 1.0).on(r"^kill -9 \$\$$", break_it)
    tok = byte_tokenizer()
    result = await run_episode(
        load_task(GUARDED),
        provider=provider,
        engine=ScriptedEngine([fenced("kill -9 $$"), "TASK_COMPLETE"], tok),
        renderer=ChatRenderer(tok),
        config=episode_config(),
        run_id="fake-adv",
    )
    assert result.episode.reward == 0.0 and result.episode.status is Status.FAILED_POLICY
    assert result.episode.failure_cause == "shell_killed"
    assert result.run is not None and result.run.end_reason.value == "sandbox_broken"
    assert all(s.status is Status.FAILED_POLICY for s in result.episode.segments)
    assert not any(c.cmd.startswith("/tests/test.sh") for c in provider.sandboxes[0].calls)  # not verified
    assert provider.live_sandboxes() == 0
