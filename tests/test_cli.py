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


def _agentrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_a_users_mistake_is_one_line_not_a_traceback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "nope.jsonl"
    result = _agentrl("episode", "replay", str(missing))
    assert result.returncode == 2
    assert f"error: {missing}: no such episode record" in result.stderr and "Traceback" not in result.stderr
    debug = _agentrl("episode", "replay", str(missing), "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_missing_model_directory_is_named_not_sent_to_the_hub(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from agentrl.models.source import ModelSourceError, check_model_source

    with pytest.raises(ModelSourceError, match="does not exist"):
        check_model_source(str(tmp_path / "missing-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match=r"no config\.json"):
        check_model_source(str(tmp_path / "empty"))
    assert check_model_source("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub name passes through
    result = _agentrl(
        "train",
        "run",
        "--set",
        f"engine.model={tmp_path / 'missing-model'}",
        "--set",
        f"out={tmp_path / 'run'}",
    )
    assert result.returncode == 2 and "does not exist" in (result.stdout + result.stderr)
    assert "Traceback" not in result.stderr and "Repo id" not in result.stderr


def test_set_values_are_validated_and_sections_keep_their_defaults() -> None:
    bad = _agentrl("train", "run", "--set", "rollout.dynamic_filter=maybe", "--dry-run")
    assert bad.returncode == 2 and "rollout.dynamic_filter" in bad.stdout + bad.stderr
    good = _agentrl("train", "run", "--set", "rollout.dynamic_filter=yes", "--dry-run")
    assert (
        good.returncode == 0 and '"dynamic_filter": true' in good.stdout and '"batch_size": 16' in good.stdout
    )


def test_log_level_is_checked() -> None:
    result = _agentrl("--log-level", "loud", "tasks", "--help")
    assert result.returncode == 2 and "--log-level" in result.stderr
    assert _agentrl("--log-level", "debug", "tasks", "--help").returncode == 0
