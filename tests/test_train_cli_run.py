"""`agentrl train run` as a user runs it: a config file naming a model directory and a task
directory of their own (made here, not the demo's), two steps, then `--resume` to four with one
metrics file and the prompt order continued."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BUNDLED_TASKS

pytestmark = pytest.mark.slow


def agentrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=900
    )


def test_train_a_model_and_tasks_of_ones_own_then_resume(tmp_path: Path) -> None:
    from agentrl.models.tiny import tiny_model_dir

    model = tmp_path / "my-model"
    shutil.copytree(tiny_model_dir(), model)
    tasks = tmp_path / "my-tasks"
    for name in ("hello-file", "make-dirs"):
        shutil.copytree(BUNDLED_TASKS / name, tasks / f"mine-{name}")
    run = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        f"""
out = "{run}"
steps = 2
[env]
name = "tbench2"
tasks = "{tasks}"
backend = "fake"
action_format = "fenced-bash"
[env.agent]
max_turns = 1
max_new_tokens = 12
min_turn_tokens = 4
max_total_tokens = 2048
[engine]
model = "{model}"
[rollout]
batch_size = 2
n_samples_per_prompt = 2
max_in_flight = 2
max_staleness = 1
[trainer]
lr = 1e-3
num_minibatches = 1
[eval]
before = false
after = false
[checkpoint]
every = 1
"""
    )
    first = agentrl("train", "run", str(config))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "step 2/2:" in first.stdout
    step_line = next(line for line in first.stdout.splitlines() if line.startswith("step 2/2:"))
    assert "infra 0" in step_line and "dropped" not in step_line  # no dynamic filter in this run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    saved = json.loads((run / "config.json").read_text())
    assert saved["engine"]["model"] == str(model) and saved["env"]["tasks"] == str(tasks)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = AutoModelForCausalLM.from_pretrained(run / "final")  # the policy as a plain model
    assert final.config.vocab_size == AutoTokenizer.from_pretrained(run / "final").vocab_size

    again = agentrl("train", "run", "--resume", str(run), "--set", "steps=4")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {run / 'checkpoints'} at step 2" in again.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one metrics file, continued
    assert [r["extra"]["version"] for r in rows] == [1, 2, 3, 4]
    log = (run / "run.log").read_text()
    assert "step 4/4:" in log and "resumed from" in log  # the run's own log file, both sessions

    wrong = agentrl("train", "run", "--resume", str(tmp_path / "nowhere"))
    assert wrong.returncode == 2 and "no config.json there" in wrong.stderr


def test_records_are_bounded(tmp_path: Path) -> None:
    import os

    from agentrl.runtime.loop import prune_records

    for i in range(7):
        path = tmp_path / f"ep{i}.jsonl"
        path.write_text("{}")
        os.utime(path, (1000 + i, 1000 + i))
    (tmp_path / "notes.txt").write_text("kept")
    assert prune_records(tmp_path, 3) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ep4.jsonl", "ep5.jsonl", "ep6.jsonl", "notes.txt"]
    assert prune_records(tmp_path, 0) == 0
