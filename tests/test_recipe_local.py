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


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("local_tbench2", ROOT / "recipes" / "local_tbench2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_tbench2"] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_the_learning_setup_and_overrides(recipe):
    result = CliRunner().invoke(recipe.app, ["train", "--dry-run", "--set", "lr=1e-4", "--set", "steps=3"])
    assert result.exit_code == 0, result.output
    cfg = json.loads(result.output)
    assert cfg["lr"] == 1e-4 and cfg["steps"] == 3
    assert cfg["aggregation"] == "token_mean" and cfg["temperature"] == 0.7


def test_unknown_setting_is_rejected(recipe):
    result = CliRunner().invoke(recipe.app, ["train", "--dry-run", "--set", "learning_rate=1"])
    assert result.exit_code != 0
    assert "unknown setting 'learning_rate'" in result.output


def test_probe_without_prepare_says_what_to_run(recipe, tmp_path):
    result = CliRunner().invoke(recipe.app, ["probe", "--set", f"out={tmp_path}"])
    assert result.exit_code != 0
    assert "run `prepare` first" in result.output


@pytest.mark.slow
def test_probe_trains_on_harvest_records_with_the_proxy_reward(recipe, tmp_path):
    """A harvest record whose reference command the model has just been taught: the probe's
    proxy reward sees successes, and the trainer takes real (non-zero) gradient steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.models.tiny import tiny_model_dir
    from agentrl.sample import Sample
    from agentrl.sft import SFTConfig, run_sft

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
        recipe.app,
        [
            "probe",
            "--set", f"out={tmp_path}",
            "--set", "steps=2",
            "--set", "prompts_per_step=1",
            "--set", "samples_per_prompt=8",
            "--set", "temperature=1.0",
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
