"""`trainer.megatron.init_checkpoint`: the Megatron trainer starts from the `torch_dist` checkpoint
that `prepare` converted (the HF directory of `engine.model` gives config and tokenizer only).

The error paths run here in the main environment; the load itself (slow) converts a tiny
checkpoint with `prepare`'s own converter at TP1 PP1 and loads it at TP2 and at PP2 x VPP2 in the
Megatron environment (`tests/megatron_venv`, two gloo ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.runtime.config import RunConfig, resolve
from agentrl.train.checkpoint import CheckpointError
from agentrl.train.megatron.checkpointing import InitCheckpointError, init_checkpoint_dir
from agentrl.train.megatron.settings import MegatronSettings


def test_init_checkpoint_is_a_run_setting_and_not_part_of_the_resume_layout() -> None:
    cfg = resolve(RunConfig, overrides=["trainer.backend=megatron", "trainer.megatron.init_checkpoint=/l/m"])
    assert cfg.trainer.megatron.init_checkpoint == "/l/m"
    assert cfg.dump()["trainer"]["megatron"]["init_checkpoint"] == "/l/m"  # --dry-run shows it
    # A run checkpoint resumes whatever the initial weights were (a run checkpoint wins).
    assert cfg.trainer.megatron.layout_dict() == MegatronSettings().layout_dict()
    with pytest.raises(ValueError, match="init_checkpoint is empty"):
        MegatronSettings(init_checkpoint=" ")


def test_a_missing_init_checkpoint_says_to_run_prepare_before_any_model_is_built(tmp_path: Path) -> None:
    """Through `build_parts`, as `agentrl train run` on a training node reaches it."""
    from agentrl.models.tiny import tiny_model_dir
    from agentrl.runtime.build import build_parts

    missing = tmp_path / "local" / "megatron" / "GLM-5.2"
    cfg = resolve(
        RunConfig,
        overrides=[
            f"out={tmp_path / 'run'}",
            f"engine.model={tiny_model_dir()}",
            "trainer.backend=megatron",
            f"trainer.megatron.init_checkpoint={missing}",
        ],
    )
    with pytest.raises(InitCheckpointError, match="does not exist: run the recipe's `prepare`") as info:
        build_parts(cfg)
    assert "prepare-cp" in str(info.value) and str(missing) in str(info.value)
    assert isinstance(info.value, CheckpointError)


def test_an_unfinished_conversion_or_copy_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "GLM-5.2" / "model"
    model.mkdir(parents=True)
    (model / "__0_0.distcp").write_bytes(b"\0" * 16)
    (model / ".metadata").write_bytes(b"\0")
    # megatron writes metadata.json last, once every shard is saved: without it the save did not end.
    with pytest.raises(
        InitCheckpointError, match=r"not a complete torch_dist checkpoint \(no metadata.json\)"
    ):
        init_checkpoint_dir(tmp_path / "GLM-5.2")
    (model / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert init_checkpoint_dir(tmp_path / "GLM-5.2") == model  # the directory prepare writes
    assert init_checkpoint_dir(model) == model  # or model/ itself
    (model / "__0_0.distcp").unlink()
    with pytest.raises(InitCheckpointError, match=r"no \*\.distcp shards"):
        init_checkpoint_dir(model)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["dsa", "glm4"])
def test_a_checkpoint_converted_at_tp1_starts_trainers_at_tp2_and_pp2_vpp2_exactly(
    tmp_path: Path, model: str
) -> None:
    """`prepare`'s conversion (one rank), then in one two-rank launch: trainers built from it at
    TP2 and at PP2 x VPP2 export exactly the HF checkpoint's tensors (names, dtypes, values); a
    run checkpoint (every weight moved) wins over the init checkpoint on resume; a 4-layer model
    refuses the 8-layer checkpoint. For `glm_moe_dsa` and `glm4_moe` (GLM-4.5: the fused QKV and
    its biases split by query group over TP)."""
    from agentrl.cluster.planner import Layout
    from agentrl.cluster.prepare import convert_to_megatron
    from tests.megatron_venv import python, run_case
    from tests.megatron_venv.cases import _shape, tiny_hf

    python()  # skips without a Python >= 3.12
    hf_dir = tmp_path / "hf"
    (tiny_hf(**_shape(8)) if model == "dsa" else tiny_hf(model="glm4", num_hidden_layers=8)).save_pretrained(
        hf_dir
    )
    out = tmp_path / "megatron"
    report = convert_to_megatron(hf_dir, out, Layout(1, 1, 1, 1))
    assert report["max_abs_diff"] == 0 and report["ranks"] == 1

    r = run_case("init_checkpoint", tmp_path, "--hf", str(hf_dir), "--init", str(out), nproc=2)
    for name in ("tp2", "pp2-vpp2"):
        x = r[name]
        assert x["missing"] == [] and x["extra"] == [] and x["tensors"] == report["hf_tensors"]
        assert x["dtypes_equal"] and x["max_abs_diff"] == 0.0, (name, x)
    assert (r["tp2"]["tp"], r["tp2"]["pp"]) == (2, 1)
    assert r["pp2-vpp2"]["stage_layers"] == [[[1, 2], [5, 6]], [[3, 4], [7, 8]]]
    # Every tensor of the run checkpoint differs from the init checkpoint's; the resumed trainer has them.
    assert r["resume"]["step"] == 1 and r["resume"]["trained_vs_init_min_abs_diff"] > 0.2
    assert r["resume"]["resumed_vs_trained_max_abs_diff"] == 0.0
    error = r["fewer_layers_error"]
    assert error is not None and "is not this model's checkpoint" in error
    assert "decoder.layers.4." in error and "run the recipe's `prepare`" in error
