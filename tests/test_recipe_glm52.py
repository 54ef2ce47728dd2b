"""`--dry-run` of the GLM-5.2 recipes: one snapshot per branch, hardware and flag combination
(tests/fixtures/glm52_dryrun/<case>.txt; regenerate with AGENTRL_UPDATE_SNAPSHOTS=1 and read the
diff), the reference layouts, and invalid combinations failing with their reason."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "tests" / "fixtures" / "glm52_dryrun"


def recipe_module(name: str):
    """Load a recipe script as Python runs it: its own directory (with `_glm52`) first on the path."""
    if str(ROOT / "recipes") not in sys.path:
        sys.path.insert(0, str(ROOT / "recipes"))
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODULES = {
    "tbench2": recipe_module("glm52_tbench2"),
    "dapo_math": recipe_module("glm52_dapo_math"),
    "dapo_math_lora": recipe_module("glm52_dapo_math_lora"),
}
APPS = {name: m.app for name, m in MODULES.items()}
SPECS = {name: m.spec for name, m in MODULES.items()}  # the RecipeSpec each launcher plans with

CASES = {
    # tbench2: separate training and rollout nodes
    "tbench2_16x4_gb300": ("tbench2", "--num-nodes 16"),
    "tbench2_16x8_h200": ("tbench2", "--num-nodes 16 --hardware H200"),
    "tbench2_16x8_b200_bf16": ("tbench2", "--num-nodes 16 --hardware B200 --no-fp8-rollout"),
    "tbench2_16x4_gb300_lowlatency_pd_mtp": (
        "tbench2",
        "--num-nodes 16 --sglang-config low-latency --enable-pd --enable-mtp",
    ),
    "tbench2_32x8_h200_no_deepep": ("tbench2", "--num-nodes 32 --hardware H200 --no-megatron-use-deepep"),
    # dapo_math: colocated, the Miles branches
    "dapo_math_1x8_h200_pruned": ("dapo_math", "--model-name GLM-5.2_5layer --num-nodes 1 --hardware H200"),
    "dapo_math_1x4_gb300_pruned": ("dapo_math", "--model-name GLM-5.2_5layer --num-nodes 1 --enable-pd"),
    "dapo_math_1x8_b200_pruned_fp8": (
        "dapo_math",
        "--model-name GLM-5.2_5layer --num-nodes 1 --hardware B200 --fp8-rollout",
    ),
    "dapo_math_16x4_gb300": ("dapo_math", "--num-nodes 16"),
    "dapo_math_16x4_gb300_balanced_fp8_mtp": (
        "dapo_math",
        "--num-nodes 16 --sglang-config balanced --fp8-rollout --enable-mtp",
    ),
    "dapo_math_16x8_h200": ("dapo_math", "--num-nodes 16 --hardware H200"),
    "dapo_math_16x8_h200_offload_nopd": (
        "dapo_math",
        "--num-nodes 16 --hardware H200 --enable-optimizer-offload --no-enable-pd",
    ),
    "dapo_math_32x8_h200": ("dapo_math", "--num-nodes 32 --hardware H200"),
    "dapo_math_16x8_b200_fp8_deepep": (
        "dapo_math",
        "--num-nodes 16 --hardware B200 --fp8-rollout --use-deepep",
    ),
    # LoRA: the same branches, the memory with LoRA and with every weight trained side by side
    "dapo_math_lora_16x4_gb300": ("dapo_math_lora", "--num-nodes 16"),
    "dapo_math_lora_4x8_h200": ("dapo_math_lora", "--num-nodes 4 --hardware H200"),
    "dapo_math_lora_1x8_h200_pruned": (
        "dapo_math_lora",
        "--model-name GLM-5.2_5layer --num-nodes 1 --hardware H200",
    ),
}


def dry_run(recipe: str, args: str):
    return CliRunner().invoke(APPS[recipe], ["train", *args.split(), "--dry-run"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_matches_its_snapshot(case: str) -> None:
    recipe, args = CASES[case]
    check_snapshot(dry_run(recipe, args), SNAPSHOTS / f"{case}.txt")


def check_snapshot(result: Any, path: Path) -> None:
    """A `--dry-run`'s output equals its snapshot (AGENTRL_UPDATE_SNAPSHOTS=1 rewrites it)."""
    assert result.exit_code == 0, result.output
    if os.environ.get("AGENTRL_UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result.stdout)
    assert result.stdout == path.read_text(), (
        f"{path.stem}: the plan changed (AGENTRL_UPDATE_SNAPSHOTS=1 to accept)"
    )


@pytest.mark.parametrize(
    "case", sorted(c for c in CASES if not CASES[c][0].endswith("_lora"))
)  # writes scripts
def test_each_process_loads_the_checkpoint_prepare_cp_put_on_its_node(case: str, tmp_path: Path) -> None:
    """The written plan's SGLang servers load `--model-path` and its trainer ranks
    `trainer.megatron.init_checkpoint` from node-local disk, each exactly what `prepare-cp` copies
    to that node (`node_needs`: training nodes the Megatron checkpoint, rollout nodes FP8 or HF,
    colocated nodes both); `engine.model` stays on shared storage (config and tokenizer)."""
    from agentrl.cluster.prepare import node_needs
    from agentrl.cluster.recipe import RecipeOptions, plan_recipe

    recipe, args = CASES[case]
    root = tmp_path / "shared"
    result = CliRunner().invoke(
        APPS[recipe], ["train", *args.split(), "--root", str(root), "--local-root", "/l", "--write-scripts"]
    )
    assert result.exit_code == 0, result.output
    written = json.loads((root / "runs" / recipe / "launch" / "plan.json").read_text())
    plan = plan_recipe(RecipeOptions(**written["options"]), SPECS[recipe])
    model = plan.options.model_name
    loads: dict[int, set[str]] = {}
    for p in written["processes"]:
        argv = p["argv"]
        if "sglang.launch_server" in argv:
            paths = [argv[argv.index("--model-path") + 1]]
        elif "torchrun" in argv:
            sets = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")
            paths = [sets["trainer.megatron.init_checkpoint"]]
            assert sets["engine.model"] == f"{root}/hf/{model}"
        else:
            continue
        for path in paths:
            m = re.fullmatch(rf"/l/(fp8|hf|megatron)/{re.escape(model)}", path)
            assert m, path
            loads.setdefault(p["node"], set()).add(m.group(1))
    assert loads == {node: set(kinds) for node, kinds in node_needs(plan).items()}


def test_the_16_node_tbench2_plan_is_the_reference_layout() -> None:
    out = dry_run("tbench2", "--num-nodes 16").stdout
    assert "## parallel layout (reference: tbench2 16 x GB300)" in out
    assert "TP2 PP4 CP4 EP8 ETP1 first/last 18/20 DP1" in out and "32 training GPUs" in out
    assert "stage starts [1, 19, 39, 59]" in out
    trains = re.findall(r"^node-(\d+): train: ", out, re.M)
    rollouts = re.findall(r"^node-(\d+): rollout: sglang-regular-\d+$", out, re.M)
    assert len(trains) == 8 and len(rollouts) == 8 and not set(trains) & set(rollouts)
    # Every server and the router start through the launcher that hands them the run's key.
    keyed = r"^  python -m agentrl\.cluster\.launch --key-file /shared/glm52/engine\.key -- "
    engines = re.findall(keyed + r"python -m sglang\.launch_server .*$", out, re.M)
    assert len(engines) == 8
    for cmd in engines:  # one 4-GPU dp-attention FP8 engine per inference node
        assert "--tp-size 4 --ep-size 4 --enable-dp-attention --dp-size 4" in cmd
        assert (
            "/fp8/GLM-5.2" in cmd and "--kv-cache-dtype fp8_e4m3" in cmd and "--attention-backend nsa" in cmd
        )
    router = re.search(keyed + r"smg launch .*$", out, re.M)
    assert (
        router and "--policy consistent_hashing" in router.group(0) and router.group(0).count("http://") == 8
    )
    assert "optimizer state (offloaded)                     0.0" in out
    # The reference run script's settings: TIS with no lower clip, 8 tasks x 8 samples per step,
    # 128 episodes in flight, 30 turns, in_place pauses, an eval of held-out tasks every 10 steps.
    assert "trainer.loss.eps_clip_high=0.28" in out and "trainer.loss.tis_clip_low=0.0" in out
    for setting in (
        "steps=100",
        "rollout.batch_size=64",
        "rollout.n_samples_per_prompt=8",
        "rollout.max_in_flight=128",
        "sampling.temperature=0.8",
        "env.agent.max_turns=30",
        "env.agent.max_total_tokens=65536",
        "env.agent.wall_clock_s=3600",
        "sync.pause_mode=in_place",
        "eval.every=10",
        "eval.samples_per_row=2",
        "env.eval_tasks=/shared/glm52/data/tbench2-eval",
    ):
        assert f"--set {setting} " in out, setting


def test_engine_auth_is_on_by_default_and_off_with_its_flag() -> None:
    on = dry_run("tbench2", "--num-nodes 16 --engine-key-file /keys/run.key").stdout
    assert "--set engine.api_key_file=/keys/run.key" in on and "engine key: /keys/run.key" in on
    assert on.count("agentrl.cluster.launch --key-file /keys/run.key --") == 9  # 8 servers + router
    off = dry_run("tbench2", "--num-nodes 16 --no-engine-auth").stdout
    assert "agentrl.cluster.launch" not in off and "engine.api_key_file" not in off
    assert len(re.findall(r"^  python -m sglang\.launch_server ", off, re.M)) == 8
    assert "--no-engine-auth: engines and router take any request" in off


def test_16_nodes_of_8_h200_reject_the_reference_and_find_a_layout() -> None:
    out = dry_run("dapo_math", "--num-nodes 16 --hardware H200").stdout
    assert "rejected reference >= 16 nodes of 8 GPUs" in out and "4 x 8 x 8 = 256 GPUs" in out
    assert "## parallel layout (search)" in out and "TP4 PP4 CP1 EP32 ETP1 first/last 18/20 DP8" in out


@pytest.mark.parametrize(
    ("recipe", "args", "reason"),
    [
        ("tbench2", "--num-nodes 16 --use-deepep", "GB300 needs --no-megatron-use-deepep"),
        (
            "dapo_math",
            "--model-name GLM-5.2_5layer --num-nodes 1 --hardware H200 --enable-mtp",
            "no MTP layer",
        ),
        ("tbench2", "--num-nodes 16 --sglang-config balanced --enable-pd", "incompatible with --enable-pd"),
        ("dapo_math", "--num-nodes 2 --hardware H200 --gpus-per-node 6 --sglang-config balanced", "% 4 != 0"),
        ("dapo_math", "--num-nodes 1 --hardware H200", "no parallel layout of GLM-5.2 fits 8 H200"),
        ("tbench2", "--num-nodes 8 --hardware H200", "151.5 GiB per GPU"),
        ("tbench2", "--num-nodes 16 --hardware A100", "choose one of H200, B200, GB300"),
    ],
)
def test_invalid_combinations_fail_with_the_reason(recipe: str, args: str, reason: str) -> None:
    result = dry_run(recipe, args)
    assert result.exit_code != 0
    assert reason in result.output


def test_train_without_dry_run_writes_the_plan_and_node_scripts(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        APPS["tbench2"], ["train", "--num-nodes", "16", "--root", str(tmp_path), "--write-scripts"]
    )
    assert result.exit_code == 0, result.output
    launch = tmp_path / "runs" / "tbench2" / "launch"
    scripts = sorted(launch.glob("node-*.sh"))
    assert len(scripts) == 16 and (launch / "plan.json").exists()
    assert "sglang.launch_server" in scripts[8].read_text() and "torchrun" in scripts[0].read_text()
    assert "DAYTONA_API_KEY_FILE=" in scripts[0].read_text()
    # The scripts' servers and router read the run's engine key: it exists, private, not in them.
    key = (tmp_path / "engine.key").read_text().strip()
    assert oct((tmp_path / "engine.key").stat().st_mode & 0o777) == "0o600"
    assert f"agentrl.cluster.launch --key-file {tmp_path}/engine.key --" in scripts[8].read_text()
    assert all(key not in p.read_text() for p in [*scripts, launch / "plan.json"])


def test_prepare_dry_run_lists_its_steps() -> None:
    result = CliRunner().invoke(APPS["dapo_math"], ["prepare", "--dry-run", "--root", "/x"])
    assert result.exit_code == 0
    assert "download zai-org/GLM-5.2 -> /x/hf/GLM-5.2" in result.stdout and "dapo-math-17k" in result.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_the_math_recipe_keeps_the_math_algorithm_and_no_terminal_settings() -> None:
    out = dry_run("dapo_math", "--num-nodes 16").stdout
    assert "--set trainer.loss.tis_clip_low=0.5 " in out and "--set trainer.loss.tis_clip=2.0 " in out
    assert "rollout.max_in_flight" not in out and "env.agent" not in out


def test_lora_fits_where_full_fine_tuning_does_not_and_its_training_launches_on_megatron(
    tmp_path: Path,
) -> None:
    full = dry_run("dapo_math", "--num-nodes 4 --hardware H200")
    assert full.exit_code != 0 and "no parallel layout of GLM-5.2 fits 32 H200" in full.output
    lora = dry_run("dapo_math_lora", "--num-nodes 4 --hardware H200")
    assert lora.exit_code == 0, lora.output
    out = lora.stdout
    assert "## LoRA rank 32" in out and "--set trainer.lora.rank=32" in out
    rows = {
        line[:42].strip(): line[42:].split()
        for line in out.splitlines()
        if line.startswith(("gradients", "optimizer state ", "total "))
    }
    lora_total, full_total = map(float, rows["total"])
    assert lora_total < 141 < full_total  # fits an H200 with LoRA, not without
    assert float(rows["gradients (fp32 main grads)"][0]) < 0.1 * float(rows["gradients (fp32 main grads)"][1])
    # The Megatron backend trains the adapters (tests/test_megatron.py): the LoRA recipe launches.
    launched = CliRunner().invoke(
        APPS["dapo_math_lora"], ["train", "--root", str(tmp_path), "--write-scripts"]
    )
    assert launched.exit_code == 0, launched.output
