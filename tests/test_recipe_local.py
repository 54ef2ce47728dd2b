"""The demo recipe's commands that need no sandboxes: the resolved configuration and `probe`."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "recipes"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe():
    return _load("local_tbench2")


@pytest.fixture(scope="module")
def probe(recipe):
    return _load("local_tbench2_probe")


def test_dry_run_prints_every_resolved_value_and_applies_dotted_overrides(recipe):
    result = CliRunner().invoke(
        recipe.app,
        [
            "train",
            "--dry-run",
            "--set",
            "trainer.lr=1e-4",
            "--set",
            "steps=3",
            "--set",
            "env.agent.max_turns=5",
        ],
    )
    assert result.exit_code == 0, result.output
    cfg = json.loads(result.output)
    assert cfg["trainer"]["lr"] == 1e-4 and cfg["steps"] == 3 and cfg["env"]["agent"]["max_turns"] == 5
    assert cfg["trainer"]["loss"]["aggregation"] == "token_mean" and cfg["sampling"]["temperature"] == 0.7
    # The trainer's log-probs follow the sampling temperature: one setting, shown resolved.
    assert cfg["trainer"]["temperature"] == 0.7
    # What used to hide in code is printed: episode cap, micro-batch token cap, batch wait, harvest.
    assert (
        cfg["rollout"]["episode_timeout_s"] == 300.0 and cfg["trainer"]["max_tokens_per_micro_batch"] == 8192
    )
    assert cfg["batch_timeout_s"] == 900.0 and cfg["prepare"]["harvest_max_new_tokens"] == 1024
    assert cfg["env"]["max_agent_timeout_s"] == 120.0 and cfg["env"]["agent"]["wall_clock_s"] is None
    assert cfg["engine"]["model"].endswith("runs/local_tbench2/sft")


def test_a_config_file_and_overrides_stack(recipe, tmp_path):
    (tmp_path / "run.toml").write_text("steps = 7\n[trainer]\nlr = 2e-5\n[rollout]\nmax_in_flight = 3\n")
    result = CliRunner().invoke(
        recipe.app, ["train", "--dry-run", "--config", str(tmp_path / "run.toml"), "--set", "steps=9"]
    )
    assert result.exit_code == 0, result.output
    cfg = json.loads(result.output)
    assert cfg["steps"] == 9 and cfg["trainer"]["lr"] == 2e-5 and cfg["rollout"]["max_in_flight"] == 3


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("local_tbench2", []),
        (
            "local_dapo_math",
            [
                "env.train_file=runs/local_dapo_math/train.jsonl",
                "env.eval_file=runs/local_dapo_math/eval.jsonl",
            ],
        ),
    ],
)
def test_the_recipe_is_its_config_file_plus_a_warm_start(name, extra):
    """`agentrl train run recipes/configs/<name>.yaml` resolves exactly the run the script does
    (the script only adds `prepare` and the paths it writes)."""
    from agentrl.cli import app

    script = CliRunner().invoke(_load(name).app, ["train", "--dry-run"])
    assert script.exit_code == 0, script.output
    sets = [f"engine.model=runs/{name}/sft", *extra]
    args = ["train", "run", str(ROOT / "recipes" / "configs" / f"{name}.yaml"), "--dry-run"]
    cli = CliRunner().invoke(app, args + [a for s in sets for a in ("--set", s)])
    assert cli.exit_code == 0, cli.output
    from_script, from_cli = json.loads(script.output), json.loads(cli.stdout)
    assert from_script.pop("prepare")
    from_script["engine"]["model"] = from_cli["engine"]["model"]  # absolute in the script
    assert from_script == from_cli


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learning_rate=1", "learning_rate: Extra inputs are not permitted"),
        ("trainer.bogus=1", "trainer.bogus: Unexpected keyword argument"),
        ("trainer.lr=-1", "lr must be > 0"),
        ("trainer.temperature=1.0", "differs from sampling.temperature"),
        ("env.name=nope", "unknown environment 'nope'"),
        ("env.agent.max_turnz=3", "max_turnz"),
        ("rollout.batch_size=5", "multiple of n_samples_per_prompt"),
        ("trainer", "write section.field=value"),
    ],
)
def test_bad_settings_are_rejected_with_the_setting_named(recipe, override, message):
    result = CliRunner().invoke(recipe.app, ["train", "--dry-run", "--set", override])
    assert result.exit_code != 0
    assert message in " ".join(result.output.split()), result.output


def test_probe_without_prepare_says_what_to_run(probe, tmp_path):
    result = CliRunner().invoke(probe.app, ["--set", f"out={tmp_path}"])
    assert result.exit_code != 0
    assert "run `prepare` first" in result.output


@pytest.mark.slow
def test_probe_trains_on_harvest_records_with_the_proxy_reward(probe, tmp_path):
    """A harvest record whose reference command the model has just been taught: the probe's
    proxy reward sees successes, and the trainer takes real (non-zero) gradient steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.episode.sample import Sample
    from agentrl.models.tiny import tiny_model_dir
    from agentrl.train.sft import SFTConfig, run_sft

    base = tiny_model_dir(seed=0)
    tok = AutoTokenizer.from_pretrained(str(base))
    messages = [
        {"role": "system", "content": "Reply with one bash block."},
        {"role": "user", "content": "Say hi."},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    reply = "```bash\necho hi\n```<|endoftext|>"
    reply_ids = tok.encode(reply, add_special_tokens=False)
    sample = Sample(
        prompt_id="0",
        tokens=prompt + reply_ids,
        prompt_length=len(prompt),
        loss_mask=[1] * len(reply_ids),
        rollout_logprobs=[0.0] * len(reply_ids),
        reward=1.0,
        task_id="say-hi",
    )
    harvest = tmp_path / "harvest"
    harvest.mkdir()
    rows = [
        {"type": "header", "task_id": "say-hi"},
        {"type": "turn", "index": 0, "model_text": reply},
        {"type": "result", "reward": 1.0, "samples": [sample.to_dict()]},
    ]
    (harvest / "say-hi.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A partly trained model: some samples right, some wrong, so groups have signal.
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(0)
    run_sft(model, [sample], SFTConfig(steps=30, lr=1e-3, batch_size=1, seed=0), log=lambda *_: None)
    model.save_pretrained(tmp_path / "sft")
    shutil.copytree(
        base, tmp_path / "sft", dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors")
    )

    result = CliRunner().invoke(
        probe.app,
        [
            "--set", f"out={tmp_path}",
            "--set", "steps=2",
            "--set", "rollout.batch_size=8",
            "--set", "rollout.n_samples_per_prompt=8",
            "--set", "sampling.temperature=1.0",
            "--eval-every", "2",
            "--eval-samples", "8",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "proxy pass@1" in result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("step ") and "reward" in ln]
    assert len(lines) == 2
    start = float(result.output.split("proxy pass@1 ")[1].split()[0])
    assert start > 0.0, result.output  # the proxy recognises the taught command
