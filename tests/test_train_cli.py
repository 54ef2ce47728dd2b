"""`agentrl train replay`: train-only runs from dumped samples, resumable."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.episode.sample import Status
from tests.test_train_models import make_samples, tiny_base  # noqa: F401


def test_replay_trains_on_dumped_samples_and_resumes_where_it_stopped(tiny_base, tmp_path: Path):  # noqa: F811
    from agentrl.models.tiny import tiny_model_dir

    samples = make_samples(tiny_base, groups=2, per_group=2, rewards=[1.0, 0.0, 0.0, 1.0])
    samples[0].status, samples[0].reward = Status.FAILED_INFRA, None
    dump = tmp_path / "samples.jsonl"
    dump.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in samples))
    out = tmp_path / "ckpt"
    args = ["train", "replay", str(dump), "--model", str(tiny_model_dir()), "--output", str(out)]
    args += ["--groups-per-step", "1", "--set", "lr=1e-4", "--device", "cpu"]
    runner = CliRunner()
    first = runner.invoke(app, [*args, "--steps", "2"])
    assert first.exit_code == 0, first.output
    lines = [json.loads(x) for x in first.stdout.splitlines() if x.startswith("{")]
    assert [m["step"] for m in lines] == [1.0, 2.0]
    assert lines[0]["num_samples"] == 1 and lines[1]["num_samples"] == 2  # the infra failure is dropped
    second = runner.invoke(app, [*args, "--steps", "1"])
    assert second.exit_code == 0, second.output
    assert [json.loads(x)["step"] for x in second.stdout.splitlines() if x.startswith("{")] == [3.0]
    state = json.loads((out / "step-00000003" / "state.json").read_text())
    assert state["buffer_state"] == {"position": 3} and state["config"]["lr"] == 1e-4


def test_replay_dry_run_prints_the_resolved_config_and_rejects_unknown_settings():
    runner = CliRunner()
    ok = runner.invoke(app, ["train", "replay", "x", "--dry-run", "--set", "loss.eps_clip_high=0.3"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["loss"]["eps_clip_high"] == 0.3
    bad = runner.invoke(app, ["train", "replay", "x", "--dry-run", "--set", "loss.bogus=1"])
    assert bad.exit_code != 0 and "loss.bogus: Unexpected keyword argument" in bad.output
    worse = runner.invoke(app, ["train", "replay", "x", "--dry-run", "--set", "lr=-1"])
    assert worse.exit_code != 0 and "lr must be > 0" in worse.output


def test_train_run_resolves_any_config_and_names_what_is_wrong(tmp_path):
    (tmp_path / "run.toml").write_text('[engine]\nmodel = "/m"\n[env]\nbackend = "fake"\n')
    runner = CliRunner()
    ok = runner.invoke(
        app, ["train", "run", "--config", str(tmp_path / "run.toml"), "--dry-run", "--set", "steps=3"]
    )
    assert ok.exit_code == 0, ok.output
    cfg = json.loads(ok.stdout)
    assert cfg["steps"] == 3 and cfg["engine"]["model"] == "/m" and cfg["env"]["name"] == "tbench2"
    assert cfg["env"]["backend"] == "fake" and cfg["env"]["agent"]["max_turns"] == 20
    bad = runner.invoke(app, ["train", "run", "--set", "env.name=nope"])
    assert bad.exit_code == 2 and "unknown environment 'nope'" in bad.output
    missing = runner.invoke(app, ["train", "run", "--set", "env.backend=fake"])
    assert missing.exit_code == 2 and "engine.model is not set" in missing.output
