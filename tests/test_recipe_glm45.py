"""The GLM-4.5 recipes (`recipes/glm45_*.py`): `--dry-run` of every branch (one snapshot each under
tests/fixtures/glm45_dryrun/, AGENTRL_UPDATE_SNAPSHOTS=1 to regenerate and read the diff), the
reference layouts and algorithms, the model's shape against its published sizes, the Blackwell-only
refusal, and `train` / `prepare` refusing what agentrl's Megatron backend cannot build yet. Also the
hub ids of every cluster recipe, pinned against shared/reference/glm52.md and glm45.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.test_recipe_glm52 import ROOT, check_snapshot, recipe_module

SNAPSHOTS = ROOT / "tests" / "fixtures" / "glm45_dryrun"
MODULES = {
    "glm45": recipe_module("glm45_dapo_math"),
    "glm45_gspo": recipe_module("glm45_dapo_math_gspo"),
    "glm45_air": recipe_module("glm45_air_dapo_math"),
}
APPS = {name: m.app for name, m in MODULES.items()}

CASES = {
    "glm45_8x8_b200": ("glm45", "--num-nodes 8"),
    "glm45_4x8_b200_debug": ("glm45", "--num-nodes 4"),
    "glm45_8x4_gb300": ("glm45", "--num-nodes 8 --hardware GB300 --no-megatron-use-deepep"),
    "glm45_gspo_8x8_h100": ("glm45_gspo", "--num-nodes 8"),
    "glm45_gspo_8x8_h200_no_mtp": ("glm45_gspo", "--num-nodes 8 --hardware H200 --no-enable-mtp"),
    "glm45_air_8x8_h100": ("glm45_air", "--num-nodes 8"),
}


def dry_run(recipe: str, args: str):
    return CliRunner().invoke(APPS[recipe], ["train", *args.split(), "--dry-run"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_matches_its_snapshot(case: str) -> None:
    recipe, args = CASES[case]
    check_snapshot(dry_run(recipe, args), SNAPSHOTS / f"{case}.txt")


def test_the_model_shapes_give_the_published_sizes() -> None:
    """355B total / 32B active and 106B / 12B (the published counts: without the MTP layer, active
    without the embeddings and the LM head)."""
    models = MODULES["glm45"].spec.models
    for name, total, active in (("GLM-4.5", 355e9, 32e9), ("GLM-4.5-Air", 106e9, 12e9)):
        m = models[name].spec()
        assert not m.dsa and not m.mla
        assert m.total_params(with_mtp=False) == pytest.approx(total, rel=0.01), name
        assert m.active_params() - 2 * m.embedding_params == pytest.approx(active, rel=0.02), name


def test_the_bash_launcher_plan_is_its_reference_layout_with_gspo() -> None:
    out = dry_run("glm45_gspo", "--num-nodes 8").stdout
    assert "## parallel layout (reference: bash launcher, 8 x 8)" in out
    assert "TP8 PP4 CP2 EP16 ETP1 DP1, max tokens per GPU 16384, 64 training GPUs" in out
    assert "stage sizes [23, 23, 23, 23]" in out
    for setting in ("trainer.loss.objective=gspo", "trainer.loss.eps_clip=0.0001",
                    "trainer.loss.eps_clip_high=0.0002", "trainer.loss.use_tis=true",
                    "trainer.megatron.optimizer_cpu_offload=true", "trainer.max_tokens_per_micro_batch=16384",
                    "trainer.megatron.moe_token_dispatcher_type=flex", "env.name=dapo_math"):  # fmt: skip
        assert f"--set {setting}" in out, setting
    engines = re.findall(r"python -m sglang\.launch_server .*$", out, re.M)
    assert len(engines) == 8  # two 32-GPU engines over four nodes each
    for cmd in engines:
        assert "--tp-size 32 --ep-size 32" in cmd and "--nnodes 4" in cmd
        assert "--enable-dp-attention --dp-size 4 --moe-dense-tp-size 1 --enable-dp-lm-head" in cmd
        assert "--mem-fraction-static 0.70" in cmd
        assert (
            "--speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 2 --enable-draft-weights-cpu-backup" in cmd
        )
        assert "--enable-memory-saver" in cmd  # colocated with the trainer


def test_the_python_launcher_plans_its_8_node_branch_and_checks_its_debug_branch() -> None:
    out = dry_run("glm45", "--num-nodes 8").stdout
    assert "## parallel layout (reference: Python launcher, 8 nodes)" in out
    assert "TP4 PP8 CP2 EP8" in out and "--set trainer.loss.objective=grpo" in out
    # The debug branch's layout cannot hold the full model's weights on 32 GPUs: the plan says so
    # with the arithmetic and searches one that fits.
    debug = dry_run("glm45", "--num-nodes 4").stdout
    assert "rejected reference Python launcher, <= 4 nodes (debug) (TP4 PP1 CP1 EP4 ETP1)" in debug
    assert "## parallel layout (search)" in debug


@pytest.mark.parametrize(
    ("recipe", "args", "reason"),
    [
        ("glm45", "--num-nodes 8 --hardware H100", "Blackwell-only and refuses H100"),
        ("glm45", "--num-nodes 8 --hardware H200", "choose one of B200, GB300"),
        ("glm45_gspo", "--num-nodes 8 --sglang-config balanced", "engines have their own shape"),
        ("glm45_gspo", "--num-nodes 8 --enable-pd", "engines have their own shape"),
        ("glm45_gspo", "--num-nodes 8 --hardware A100", "choose one of H100, H200, B200, GB300"),
    ],
)
def test_invalid_combinations_fail_with_the_reason(recipe: str, args: str, reason: str) -> None:
    result = dry_run(recipe, args)
    assert result.exit_code != 0
    assert reason in " ".join(result.output.split()), result.output


def test_train_and_convert_plan_glm4_moe_on_the_megatron_backend(tmp_path: Path) -> None:
    """The backend builds `glm4_moe` (tests/test_megatron.py: HF parity and the TP / CP / PP
    steps), so `train` writes its node scripts and `prepare` plans the conversion."""
    train = CliRunner().invoke(APPS["glm45_gspo"], ["train", "--root", str(tmp_path), "--write-scripts"])
    assert train.exit_code == 0, train.output
    assert (tmp_path / "runs" / "glm45_gspo" / "launch" / "plan.json").exists()
    convert = CliRunner().invoke(APPS["glm45_air"], ["prepare", "--dry-run", "--root", "/x"])
    assert convert.exit_code == 0, convert.output
    assert "convert HF -> Megatron torch_dist (TP2 PP1 CP1 EP32 ETP1" in convert.output
    staged = CliRunner().invoke(APPS["glm45_air"], ["prepare", "--no-convert", "--dry-run", "--root", "/x"])
    assert staged.exit_code == 0, staged.output
    assert "download zai-org/GLM-4.5-Air -> /x/hf/GLM-4.5-Air" in staged.stdout
    assert "dapo-math-17k" in staged.stdout and "aime-2024" in staged.stdout


def test_air_plans_apart_and_says_what_it_does_not_do_as_upstream() -> None:
    out = dry_run("glm45_air", "--num-nodes 8").stdout
    assert len(re.findall(r"^node-\d+: train: ", out, re.M)) == 4
    assert len(re.findall(r"^node-\d+: rollout: ", out, re.M)) == 4
    assert "--set sync.transport=distributed" in out and "agentrl has no P2P transport" in out


def test_hub_ids_are_the_reference_ones() -> None:
    """shared/reference/glm52.md: `zai-org/GLM-5.2`, the pruned model under `Pinaster` (not zai-org);
    glm45.md: `zai-org/GLM-4.5`, `zai-org/GLM-4.5-Air`. The math data: the DAPO recipe's own files
    (`BytedTsinghua-SIA/DAPO-Math-17k`, `BytedTsinghua-SIA/AIME-2024`); Miles stages the same sets
    from `zhuzilin/dapo-math-17k` and `zhuzilin/aime-2024`, re-published in its own row format."""
    glm52 = recipe_module("glm52_dapo_math").spec.models
    assert {k: m.hf_repo for k, m in glm52.items()} == {
        "GLM-5.2": "zai-org/GLM-5.2",
        "GLM-5.2_5layer": "Pinaster/GLM-5.2_5layer",
    }
    glm45 = MODULES["glm45"].spec.models
    assert {k: m.hf_repo for k, m in glm45.items()} == {
        "GLM-4.5": "zai-org/GLM-4.5",
        "GLM-4.5-Air": "zai-org/GLM-4.5-Air",
    }
    for entry in (*glm52.values(), *glm45.values()):  # what `prepare` validates the download against
        arch = {"glm_moe_dsa": ["GlmMoeDsaForCausalLM"], "glm4_moe": ["Glm4MoeForCausalLM"]}
        assert entry.config["architectures"] == arch[entry.config["model_type"]]
    from envs.dapo_math.hub import DATASETS

    assert DATASETS == {
        "dapo-math-17k": ("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet"),
        "aime-2024": ("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet"),
    }
