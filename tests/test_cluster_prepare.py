"""`prepare` / `prepare-cp` of the GLM-5.2 recipes on a tiny glm_moe_dsa checkpoint made here
(no network: the source is a local directory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cluster.prepare import CheckpointError, copy_to_local, quantize_fp8, validate_checkpoint

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def tiny_checkpoint(path: Path, layers: int = 5) -> Path:
    """GLM-5.2's layer pattern (3 dense, DSA index freq 4, offset 3) at toy width."""
    torch.manual_seed(0)
    cfg = transformers.GlmMoeDsaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=layers, first_k_dense_replace=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=4, index_head_dim=16,
        index_n_heads=8, index_topk_freq=4, index_skip_topk_offset=3, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 8000000.0},
    )  # fmt: skip
    transformers.GlmMoeDsaForCausalLM(cfg).float().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("hf") / "GLM-5.2_5layer")


def test_validation_accepts_the_native_checkpoint(ckpt: Path) -> None:
    assert validate_checkpoint(ckpt, num_layers=5)["model_type"] == "glm_moe_dsa"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "deepseek_v3"}, "model_type is 'deepseek_v3'"),
        ({"architectures": ["GlmForCausalLM"]}, "expected ['GlmMoeDsaForCausalLM']"),
        ({"num_hidden_layers": 78}, "num_hidden_layers is 78, this model has 5"),
        ({"auto_map": {"AutoModel": "x.Y"}}, "auto_map"),
    ],
)
def test_validation_names_what_is_wrong(ckpt: Path, tmp_path: Path, change: dict, message: str) -> None:
    bad = copy_to_local(ckpt, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_checkpoint(bad, num_layers=5)


def test_fp8_copy_quantises_decoder_projections_with_block_scales(ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    n = quantize_fp8(ckpt, tmp_path / "fp8")
    state = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert n > 0 and n == sum(k.endswith("weight_scale_inv") for k in state)
    assert state["model.layers.4.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert state["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings stay unquantised


def test_prepare_cp_copies_whole_or_not_at_all(ckpt: Path, tmp_path: Path) -> None:
    dest = copy_to_local(ckpt, tmp_path / "local" / "m")
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(CheckpointError, match="run `prepare` first"):
        copy_to_local(tmp_path / "missing", tmp_path / "local" / "x")
    assert not list((tmp_path / "local").glob(".*"))  # no half-written copies left


@pytest.mark.slow
def test_prepare_converts_to_megatron_and_prepare_cp_copies_it(ckpt: Path, tmp_path: Path) -> None:
    """The recipe's own commands: validate, convert through the Megatron backend (its Python 3.12
    environment, EP2 on two ranks, each reading only its experts), FP8 copy; then prepare-cp to a
    node-local directory."""
    from tests.megatron_venv import python

    python()  # skips without a Python >= 3.12
    from tests.test_recipe_glm52 import APPS

    root, local = tmp_path / "shared", tmp_path / "local"
    args = ["--model-name", "GLM-5.2_5layer", "--model-source", str(ckpt), "--root", str(root), "--ep", "2"]
    result = CliRunner().invoke(APPS["tbench2"], ["prepare", *args])
    assert result.exit_code == 0, result.output
    assert "round trip max |diff| 0" in result.output and "on 2 ranks" in result.output
    meta = json.loads((root / "megatron" / "GLM-5.2_5layer" / "convert.json").read_text())
    assert meta["megatron"]["ep"] == 2 and meta["hf_tensors"] > 0
    # Each EP rank read only its own experts (4 experts: 0-1 and 2-3) from the checkpoint.
    assert [r["read"]["experts"] for r in meta["per_rank"]] == [[0, 1], [2, 3]]
    assert (root / "fp8" / "GLM-5.2_5layer" / "config.json").exists()
    result = CliRunner().invoke(
        APPS["tbench2"],
        ["prepare-cp", "--model-name", "GLM-5.2_5layer", "--root", str(root), "--local-root", str(local)],
    )
    assert result.exit_code == 0, result.output
    assert (local / "megatron" / "GLM-5.2_5layer" / "model" / "metadata.json").exists()
