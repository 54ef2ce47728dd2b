"""Progress bars (`agentrl.progress`): on stderr, only on a terminal or when forced
(`AGENTRL_PROGRESS=1`), never in stdout, JSON output, job files or logs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.progress import progress_bar, progress_enabled
from agentrl.testing.sandbox import FakeSandboxProvider

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "envs" / "tbench2" / "tasks"


def _has_bar(text: str) -> bool:
    """A live display hides the cursor; a bar's row ends `3/8 0:00:12`."""
    return "\x1b[?25l" in text or re.search(r"\d+/(\d+|\?) \d+:\d\d:\d\d", _plain(text)) is not None


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_off_when_stderr_is_not_a_terminal_and_on_when_forced(monkeypatch, capsys):
    monkeypatch.delenv("AGENTRL_PROGRESS", raising=False)
    assert not progress_enabled()  # pytest captures stderr: not a terminal
    with progress_bar("work", total=2) as bar:
        bar.advance(note="one")
    assert capsys.readouterr().err == ""

    monkeypatch.setenv("AGENTRL_PROGRESS", "1")
    with progress_bar("work", total=2) as bar:
        bar.advance(note="one")
        with progress_bar("inner", total=3) as inner:  # a second row, not a second display
            inner.advance(3)
        bar.advance(note="[red]two[/red]")
        print("result line")
    out, err = capsys.readouterr()
    assert out == "result line\n"
    shown = _plain(err)
    assert "work" in shown and "2/2" in shown and "inner" in shown
    assert "[red]two[/red]" in shown  # task text is shown as it is, never as markup

    monkeypatch.setenv("AGENTRL_PROGRESS", "0")
    assert not progress_enabled()


def test_the_oracle_sweep_draws_its_bars_on_stderr_only(monkeypatch):
    from agentrl.cli import app

    monkeypatch.setenv("AGENTRL_PROGRESS", "1")
    result = CliRunner().invoke(
        app, ["tasks", "oracle", str(TASKS / "hello-file"), "--backend", "fake", "--no-solution"]
    )
    # the fake backend has no grader here: the verdict is beside the point, where things go is not
    assert "0/1 tasks gave the expected reward" in result.stdout
    assert "oracle" in _plain(result.stderr) and "1/1" in _plain(result.stderr)
    assert _has_bar(result.stderr) and not _has_bar(result.stdout)


async def test_eval_episodes_bar_stays_out_of_the_job_files_and_the_summary(tmp_path, monkeypatch, capsys):
    from agentrl.eval.harbor import run_harbor_eval
    from tests.test_eval_cli import SOLVE, ScriptedChat, _grader, _settings

    monkeypatch.setenv("AGENTRL_PROGRESS", "1")
    async with ScriptedChat({"hello.txt": [SOLVE], "directories": [SOLVE]}) as server:
        settings = _settings(tmp_path, server.url, n_attempts=2, max_turns=1)
        summary = await run_harbor_eval(settings, provider=FakeSandboxProvider(grader=_grader))
    out, err = capsys.readouterr()
    assert "episodes" in _plain(err) and "4/4" in _plain(err)
    assert _has_bar(err) and not _has_bar(out)
    assert not _has_bar(json.dumps(summary))
    for path in (tmp_path / "jobs").rglob("*"):
        if path.is_file() and path.suffix in (".json", ".log", ".jsonl", ".txt"):
            assert not _has_bar(path.read_text(errors="replace")), path


@pytest.mark.parametrize("value", ["0", "off"])
def test_forced_off_wins_over_a_terminal(monkeypatch, value):
    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Tty())
    monkeypatch.delenv("AGENTRL_PROGRESS", raising=False)
    assert progress_enabled()
    monkeypatch.setenv("AGENTRL_PROGRESS", value)
    assert not progress_enabled()
