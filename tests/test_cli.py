"""The `agentrl` command itself: its help lists every group without importing torch or a backend,
and a group whose extra is missing says which one to install."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from agentrl import cli


def test_help_lists_every_group_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from agentrl.cli import app\n"
        "result = CliRunner().invoke(app, ['--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(result.output)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'daytona', 'numpy') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    for name in (*cli._GROUPS, "sft", "dashboard"):
        assert name in out


def test_a_group_with_a_missing_extra_says_what_to_install(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(
        cli._GROUPS, "megatron", ("agentrl_missing_module_xyz", "A missing group.", "megatron")
    )
    result = CliRunner().invoke(cli.app, ["megatron", "--help"])
    assert result.exit_code == 2
    assert (
        "needs 'agentrl_missing_module_xyz'" in result.output
        and "pip install -e '.[megatron]'" in result.output
    )


def test_a_group_runs_after_it_is_resolved() -> None:
    result = CliRunner().invoke(cli.app, ["tasks", "--help"])
    assert result.exit_code == 0 and "lint" in result.output
