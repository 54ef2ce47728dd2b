"""`prepare` / `prepare-cp` of the GLM-5.2 recipes on a tiny glm_moe_dsa checkpoint made here
(no network: the source is a local directory): validation, FP8, how many nodes the conversion
spreads over and why, what each node copies, and (slow) the conversion on one host and across two
simulated nodes through Ray, which must give the same checkpoint."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cluster.planner import Layout
from agentrl.cluster.prepare import (
    ConvertPlacementError,
    ModelCheckpointError,
    copy_set_to_local,
    copy_to_local,
    node_needs,
    place_conversion,
    quantize_fp8,
    rank_shard_params,
    validate_checkpoint,
)
from agentrl.cluster.recipe import ClusterPlan, plan_recipe
from tests.test_recipe_glm52 import SPECS

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
    with pytest.raises(ModelCheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
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
    with pytest.raises(ModelCheckpointError, match="run `prepare` first"):
        copy_to_local(tmp_path / "missing", tmp_path / "local" / "x")
    assert not list((tmp_path / "local").glob(".*"))  # no half-written copies left


def _tbench2(**kw: object) -> ClusterPlan:
    return plan_recipe(SPECS["tbench2"].options(**kw), SPECS["tbench2"])


def test_a_conversion_rank_of_one_holds_the_whole_model_and_ranks_split_it() -> None:
    model = SPECS["tbench2"].models["GLM-5.2"].spec()
    assert rank_shard_params(model, Layout(1, 1, 1, 1)) == [model.total_params(with_mtp=False)]
    # TP2 PP4 EP8, 18/20: every stage's rank holds its layers' TP half, experts / 8, the rest whole.
    per_stage = rank_shard_params(model, Layout(2, 4, 1, 8, 1, 18, 20))
    assert len(per_stage) == 4 and per_stage[1] == per_stage[2]  # two middle stages of 20 MoE layers
    assert max(per_stage) == per_stage[3] < model.total_params(with_mtp=False) / 16


def test_glm52_conversion_spreads_over_the_fewest_training_nodes_that_hold_it() -> None:
    plan = _tbench2()  # 16 x 4 GB300: TP2 PP4 EP8 on 8 training nodes, 32 conversion ranks
    model, layout = plan.model, plan.layout
    # GPUs bound it first: one rank per GPU, 4 per node -> 8 nodes.
    p = place_conversion(model, layout, train_nodes=plan.train_nodes, host_memory_gib=960, gpus_per_node=4)
    assert (p.ranks, p.nodes, p.nproc_per_node) == (32, tuple(range(8)), 4)
    assert [n for n, _ in p.candidates] == [1, 2, 4]
    # Without a GPU bound, host memory decides: 8 ranks of ~116 GiB exceed 80 % of 960 GiB; fit 2 TiB.
    p = place_conversion(model, layout, train_nodes=plan.train_nodes, host_memory_gib=960, gpus_per_node=None)
    assert len(p.nodes) == 8 and "8 ranks x 116.25 GiB = 930.0 GiB > 768 GiB" in p.candidates[-1][1]
    p = place_conversion(
        model, layout, train_nodes=plan.train_nodes, host_memory_gib=2048, gpus_per_node=None
    )
    assert (len(p.nodes), p.nproc_per_node) == (4, 8)
    text = "\n".join(p.explain(layout, 2))
    assert "PP4 x lcm(TP2, EP8 x ETP1) = 32" in text and "26.90e9 parameters x 2 bytes = 50.11 GiB" in text


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"train_nodes": [0, 1]}, "4 nodes: the plan has 2 training nodes"),
        ({"nodes": 3}, "32 ranks do not divide over 3 nodes"),
        ({"nodes": 16}, "the plan has 8 training nodes"),
        ({"nodes": 2, "host_memory_gib": 4096}, "16 ranks per node > 4 GPUs"),
    ],
)
def test_a_conversion_that_fits_no_nodes_is_refused_with_the_arithmetic(kw: dict, message: str) -> None:
    plan = _tbench2()
    args: dict = {"train_nodes": plan.train_nodes, "host_memory_gib": 960, "gpus_per_node": 4, **kw}
    with pytest.raises(ConvertPlacementError, match=re.escape(message)):
        place_conversion(plan.model, plan.layout, **args)


def test_prepare_dry_run_shows_each_nodes_torchrun() -> None:
    from tests.test_recipe_glm52 import APPS

    result = CliRunner().invoke(APPS["tbench2"], ["prepare", "--dry-run", "--root", "/s"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert (
        "32 ranks on 8 nodes" in out
        and "nodes: 8 x 4 ranks, 4 x 116.25 = 465.0 GiB <= 768 GiB per node" in out
    )
    lines = [ln.strip() for ln in out.splitlines() if "torch.distributed.run" in ln]
    assert len(lines) == 8
    for r, line in enumerate(lines):
        assert line.startswith(f"[node-{r:02d}] node rank {r}: ")
        for flag in (f"--node-rank={r}", "--nnodes=8", "--nproc-per-node=4", "--master-addr=node-00"):
            assert flag in line.split()
        assert "-m agentrl.cluster.convert_job --hf /s/hf/GLM-5.2 --out /s/megatron/GLM-5.2" in line
    assert (
        "prepare: download the dataset harborframework/terminal-bench-2.0 -> /s/data/tbench2, 20 held out "
        "(seed 0) -> /s/data/tbench2-eval" in out
    )
    own = CliRunner().invoke(
        APPS["tbench2"],
        ["prepare", "--dry-run", "--root", "/s", "--tasks-source", "/tb2", "--eval-tasks", "9"],
    )
    assert "prepare: tasks from /tb2 -> /s/data/tbench2, 9 held out (seed 0)" in own.stdout
    refused = CliRunner().invoke(
        APPS["tbench2"], ["prepare", "--dry-run", "--single-host", "--host-memory-gib", "64"]
    )
    assert refused.exit_code == 2 and "fit no placement on this host" in refused.output


def test_prepare_cp_gives_each_node_what_its_role_loads() -> None:
    from tests.test_recipe_glm52 import APPS

    assert node_needs(_tbench2()) == {
        **{n: ["megatron"] for n in range(8)},
        **{n: ["fp8"] for n in range(8, 16)},
    }
    math = plan_recipe(SPECS["dapo_math"].options(num_nodes=16, hardware="H200"), SPECS["dapo_math"])
    assert node_needs(math) == {n: ["megatron", "hf"] for n in range(16)}  # colocated, BF16 rollout
    args = [
        "prepare-cp",
        "--dry-run",
        "--num-nodes",
        "4",
        "--hardware",
        "H200",
        "--model-name",
        "GLM-5.2_5layer",
    ]
    result = CliRunner().invoke(APPS["tbench2"], [*args, "--local", "--root", "/s", "--local-root", "/l"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "prepare-cp: [node-00] train: /s/megatron/GLM-5.2_5layer -> /l/node-00/megatron/GLM-5.2_5layer",
        "prepare-cp: [node-01] train: /s/megatron/GLM-5.2_5layer -> /l/node-01/megatron/GLM-5.2_5layer",
        "prepare-cp: [node-02] rollout: /s/fp8/GLM-5.2_5layer -> /l/node-02/fp8/GLM-5.2_5layer",
        "prepare-cp: [node-03] rollout: /s/fp8/GLM-5.2_5layer -> /l/node-03/fp8/GLM-5.2_5layer",
    ]


def test_a_nodes_copy_set_lands_whole_or_not_at_all(ckpt: Path, tmp_path: Path) -> None:
    broken = tmp_path / "shared" / "fp8"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").symlink_to(tmp_path / "gone")  # unreadable mid-copy
    local = tmp_path / "local"
    pairs = [(ckpt, local / "hf" / "m"), (broken, local / "fp8" / "m")]
    with pytest.raises(shutil.Error):
        copy_set_to_local(pairs)
    assert not (local / "hf" / "m").exists() and not list(local.rglob(".*"))  # nothing half-made
    copied = copy_set_to_local(pairs[:1])
    assert copied[0]["files"] == len(list(ckpt.iterdir())) and copied[0]["bytes"] > 0
    with pytest.raises(ModelCheckpointError, match="run `prepare` first"):
        copy_set_to_local([(tmp_path / "missing", local / "x")])


def _same_checkpoint(a: Path, b: Path) -> None:
    """Two torch_dist directories hold the same checkpoint: every shard file byte for byte, and
    the same metadata except where it was saved (path and save id)."""
    import pickle

    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and "__1_0.distcp" in names
    for name in names:
        if name != ".metadata":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (pickle.loads((d / ".metadata").read_bytes()) for d in (a, b))
    assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data


def _leftovers(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [ln for ln in ps.splitlines() if marker in ln and "ps -eo" not in ln]


@pytest.mark.slow
def test_prepare_on_two_simulated_nodes_through_ray_matches_one_host(ckpt: Path, tmp_path: Path) -> None:
    """The recipe's own commands. One host: validate, convert through the Megatron backend (its
    Python 3.12 environment, EP2 on two ranks, each reading only its experts), FP8 copy, prepare-cp
    to this host. Then the same conversion through Ray on a local cluster of 4 simulated nodes
    (2 training, 2 rollout), one torchrun per training node (one rank each, rendezvous on node 0):
    the same checkpoint, every rank's report combined; prepare-cp puts the Megatron checkpoint
    on each training node's local root and the FP8 one on each rollout node's; nothing left running."""
    from tests.megatron_venv import python

    python()  # skips without a Python >= 3.12
    pytest.importorskip("ray")
    from tests.test_recipe_glm52 import APPS

    app, cli = APPS["tbench2"], CliRunner()
    one, two, local = tmp_path / "one", tmp_path / "two", tmp_path / "local"
    from envs.tbench2.environment import BUNDLED_TASKS

    args = ["--model-name", "GLM-5.2_5layer", "--model-source", str(ckpt), "--ep", "2"]
    args += ["--tasks-source", str(BUNDLED_TASKS), "--eval-tasks", "3"]  # the data: no hub here
    result = cli.invoke(app, ["prepare", *args, "--root", str(one), "--single-host"])
    assert result.exit_code == 0, result.output
    assert "round trip max |diff| 0" in result.output and "on 2 ranks over 1 node" in result.output
    assert f"3 tasks -> {one / 'data' / 'tbench2-eval'}" in result.output
    meta = json.loads((one / "megatron" / "GLM-5.2_5layer" / "convert.json").read_text())
    assert meta["megatron"]["ep"] == 2 and meta["hf_tensors"] > 0
    # Each EP rank read only its own experts (4 experts: 0-1 and 2-3) from the checkpoint.
    assert [r["read"]["experts"] for r in meta["per_rank"]] == [[0, 1], [2, 3]]
    assert (one / "fp8" / "GLM-5.2_5layer" / "config.json").exists()
    result = cli.invoke(app, ["prepare-cp", "--model-name", "GLM-5.2_5layer", "--root", str(one),
                              "--local-root", str(local / "one"), "--single-host"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (local / "one" / "megatron" / "GLM-5.2_5layer" / "model" / "metadata.json").exists()

    nodes = ["--num-nodes", "4", "--hardware", "H200"]
    result = cli.invoke(
        app, ["prepare", *args, "--root", str(two), *nodes, "--local", "--convert-nodes", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "on 2 ranks over 2 nodes, round trip max |diff| 0" in result.output
    assert (
        "node-00 (127.0.0.1): node rank 0, 1 ranks" in result.output
        and "node-01 (127.0.0.1): node rank 1" in result.output
    )
    meta2 = json.loads((two / "megatron" / "GLM-5.2_5layer" / "convert.json").read_text())
    assert [(r["rank"], r["read"]["experts"]) for r in meta2["per_rank"]] == [(0, [0, 1]), (1, [2, 3])]
    _same_checkpoint(
        one / "megatron" / "GLM-5.2_5layer" / "model", two / "megatron" / "GLM-5.2_5layer" / "model"
    )
    specs = json.loads((two / "prepare" / "logs" / "convert-specs.json").read_text())
    assert [("--nnodes=2" in s["argv"], f"--node-rank={i}" in s["argv"]) for i, s in enumerate(specs)] == [
        (True, True),
        (True, True),
    ]

    result = cli.invoke(app, ["prepare-cp", "--model-name", "GLM-5.2_5layer", "--root", str(two),
                              "--local-root", str(local), *nodes, "--local"])  # fmt: skip
    assert result.exit_code == 0, result.output
    for n in (0, 1):
        node = local / f"node-{n:02d}"
        assert sorted(p.name for p in node.iterdir()) == ["megatron"]
        _same_checkpoint(
            node / "megatron" / "GLM-5.2_5layer" / "model", two / "megatron" / "GLM-5.2_5layer" / "model"
        )
    for n in (2, 3):
        node = local / f"node-{n:02d}"
        assert sorted(p.name for p in node.iterdir()) == ["fp8"]
        assert (node / "fp8" / "GLM-5.2_5layer" / "model.safetensors").read_bytes() == (
            two / "fp8" / "GLM-5.2_5layer" / "model.safetensors"
        ).read_bytes()
    assert sum(f"[node-{n:02d}]" in line for n in range(4) for line in result.output.splitlines()) == 4
    import ray

    # The local Ray cluster the commands started is shut down, and no conversion process is left.
    assert not ray.is_initialized() and _leftovers(str(two)) == []
