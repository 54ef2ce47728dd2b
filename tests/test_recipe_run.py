"""The demo recipe for real, shrunk: `prepare` -> `train` -> `eval` over HTTP, on two bundled tasks.

Real podman sandboxes, the in-process engine, the torch trainer with several minibatches per
rollout step and a weight sync every step; then `eval --engine sglang` against `agentrl engine
serve` holding the trained model. Checks what `make demo` relies on: every output file, staleness
within the bound, the trainer's metrics beside the rollout's, and evals with no unscored episode.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

pytestmark = [pytest.mark.container, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["hello-file", "make-executable"]


@pytest.fixture(scope="module")
def recipe():
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: run `make setup` (CI runs it before the tests)")
    spec = importlib.util.spec_from_file_location("local_tbench2_run", ROOT / "recipes" / "local_tbench2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_tbench2_run"] = module
    spec.loader.exec_module(module)
    return module


def invoke(recipe, *args: str) -> str:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(recipe.app, list(args))
    assert result.exit_code == 0, f"{args[0]} failed:\n{result.output}\n{result.exception!r}"
    return result.output


def test_prepare_train_and_eval_over_http(recipe, tmp_path: Path) -> None:
    from tests.test_server_cli import _free_port, _wait_healthy

    tasks = tmp_path / "tasks"
    for name in TASKS:
        shutil.copytree(ROOT / "envs" / "tbench2" / "tasks" / name, tasks / name)
    out = tmp_path / "out"
    common = [
        "--set",
        f"out={out}",
        "--set",
        f"env.tasks={tasks}",
        "--set",
        'env.task_ids=["hello-file","make-executable"]',
    ]

    invoke(recipe, "prepare", *common, "--set", "prepare.sft_steps=4")
    assert (out / "sft" / "config.json").is_file()
    assert sorted(p.name.split("__")[0] for p in (out / "harvest").glob("*.jsonl")) == TASKS

    invoke(
        recipe,
        "train",
        *common,
        "--set", "steps=2",
        "--set", "rollout.batch_size=2",
        "--set", "rollout.n_samples_per_prompt=2",
        "--set", "rollout.max_in_flight=2",
        "--set", "trainer.num_minibatches=2",
        "--set", "rollout.dynamic_filter=false",  # a 4-step SFT model fails everything: nothing would pass it
        "--set", "eval.samples_per_row=1",
    )  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["samples"] == 2 and r["failures_by_cause"] == {}
        # Consumed at most max_staleness (1) versions behind, reported at consumption time.
        assert all(int(k) <= 1 for k in r["staleness_hist"]), r["staleness_hist"]
        assert r["stale_groups"] == 0 and r["stale_cancelled"] == 0
        assert r["rollout_episodes"] >= 2 and 0.0 <= r["rollout_pass_rate"] <= 1.0
        trainer = r["extra"]["trainer"]
        # One training sample per episode, more when the chat template did not extend an episode's
        # tokens and it was split into segments (depends on what the random-ish model wrote).
        assert trainer["num_samples"] >= 2 and trainer["step_seconds"] > 0
    # Two optimizer steps per rollout step, one weight version per rollout step.
    assert [r["extra"]["trainer"]["step"] for r in rows] == [2.0, 4.0]
    assert [r["weight_version"] for r in rows] == [0, 1]
    evals = json.loads((out / "evals.json").read_text())
    assert [e["label"] for e in evals] == ["before", "after"]
    assert all(e["episodes"] == 2 and e["unscored"] == 0 for e in evals)
    for name in ("reward.png", "final/config.json", "final/tokenizer.json"):
        assert (out / name).is_file(), name
    # The demo trains LoRA adapters; `final` is the plain model with them merged, which any loader
    # (and the recipe's own `eval`) takes.
    assert json.loads((out / "config.json").read_text())["trainer"]["lora"]["rank"] > 0
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert not any("lora" in name for name in final.state_dict())
    assert any((out / "checkpoints").iterdir())
    assert len(list((out / "records").glob("*.jsonl"))) >= 4
    assert json.loads((out / "config.json").read_text())["trainer"]["num_minibatches"] == 2

    # Resume (metrics and evals continue, nothing redone) is the runtime's, tested in
    # tests/test_runtime.py and, through the CLI, tests/test_train_cli_run.py.

    # eval over HTTP: the trained model behind the SGLang-compatible server.
    async def serve_and_eval() -> str:
        port = _free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentrl.cli", "engine", "serve",
            "--model", str(out / "final"), "--port", str(port),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            await _wait_healthy(url, proc)
            return await asyncio.to_thread(
                invoke,
                recipe,
                "eval",
                "--engine", "sglang",
                "--url", url,
                "--tokenizer", str(out / "final"),
                "--output", str(out / "http_eval.json"),
                *common,
                "--set", "eval.samples_per_row=2",
                "--set", "eval.ks=[1,2]",
            )  # fmt: skip
        finally:
            proc.terminate()
            await proc.wait()

    asyncio.run(serve_and_eval())
    summary = json.loads((out / "http_eval.json").read_text())
    assert summary["label"] == "sglang" and summary["episodes"] == 4 and summary["unscored"] == 0
    assert set(summary["per_task"]) == set(TASKS)
    assert 0.0 <= summary["pass@1"] <= summary["pass@2"] <= 1.0


def test_eval_with_a_missing_model_or_bad_engine_says_what_to_do(recipe, tmp_path: Path) -> None:
    result = CliRunner().invoke(recipe.app, ["eval", "--set", f"out={tmp_path}"])
    assert result.exit_code != 0 and "run `prepare` first" in result.output
    result = CliRunner().invoke(recipe.app, ["eval", "--engine", "vllm", "--set", f"out={tmp_path}"])
    assert result.exit_code != 0 and "unknown engine 'vllm'" in result.output, result.output
    result = CliRunner().invoke(recipe.app, ["eval", "--engine", "sglang", "--set", f"out={tmp_path}"])
    assert result.exit_code != 0 and "sglang engine needs one or more worker URLs" in result.output
