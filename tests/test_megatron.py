"""The Megatron trainer backend (glm_moe_dsa on megatron-core 0.19) on CPU over gloo.

The layout rules and the run-config registration run here, in the main (3.11) environment. The
rest needs megatron-core, i.e. Python >= 3.12: each `slow` test runs one case of
`tests/megatron_venv/cases.py` in that environment (built once, cached; `make test` builds it
first) and asserts on the numbers it reports. The model is a tiny glm_moe_dsa: 4 layers (1 dense +
3 MoE with a shared expert), MLA, DSA top-k 4 with index sharing (layer 3 reuses layer 2's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.runtime.config import RunConfig, resolve
from agentrl.train.megatron.plan import (
    PipelineSplitError,
    check_pipeline_split,
    computing_layers,
    megatron_index_sharing,
    pipeline_layout,
)

transformers = pytest.importorskip("transformers")


def glm52_shaped(layers: int = 78, freq: int = 4, offset: int = 3) -> object:
    """GLM-5.2's layer pattern (3 dense, DSA index freq 4) on a config small enough to build."""
    return transformers.GlmMoeDsaConfig(
        num_hidden_layers=layers,
        first_k_dense_replace=3,
        index_topk_freq=freq,
        index_skip_topk_offset=offset,
        vocab_size=64,
        hidden_size=32,
    )


def test_glm52_computing_layers_come_from_the_hf_pattern() -> None:
    cfg = glm52_shaped()
    assert computing_layers(cfg)[:6] == [1, 2, 3, 7, 11, 15] and computing_layers(cfg)[-1] == 75
    # megatron-core's (freq, offset) reproduce HF's pattern exactly (their offset defaults differ).
    assert megatron_index_sharing(cfg) == (4, 3)


def test_a_config_without_indexer_types_follows_hfs_frequency_rule() -> None:
    from types import SimpleNamespace

    old_style = SimpleNamespace(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3)
    assert computing_layers(old_style) == computing_layers(glm52_shaped())
    assert computing_layers(SimpleNamespace(num_hidden_layers=3)) == [1, 2, 3]  # no sharing


def test_the_glm52_recipe_splits_pass_and_an_even_split_is_rejected() -> None:
    cfg = glm52_shaped()
    check_pipeline_split(cfg, pipeline_layout(78, 4, first_stage_layers=18, last_stage_layers=20))
    check_pipeline_split(cfg, pipeline_layout(78, 8, first_stage_layers=14, last_stage_layers=16))
    with pytest.raises(PipelineSplitError, match=r"starts at layer 40 \(1-indexed\)"):
        check_pipeline_split(cfg, pipeline_layout(78, 2))


def test_a_stage_starting_on_a_sharing_layer_is_rejected_with_its_number() -> None:
    cfg = glm52_shaped(layers=8, freq=2, offset=2)  # layers 1, 2, 4, 6, 8 compute
    assert computing_layers(cfg) == [1, 2, 4, 6, 8]
    with pytest.raises(PipelineSplitError, match=r"stage 1 starts at layer 5 .* indices of layer 4"):
        check_pipeline_split(cfg, pipeline_layout(8, 2))
    check_pipeline_split(cfg, pipeline_layout(8, 2, first_stage_layers=3, last_stage_layers=5))
    # Virtual stages too: 8 layers over 2 ranks x 2 virtual stages start at 1, 3, 5, 7.
    with pytest.raises(PipelineSplitError, match="starts at layer 3"):
        check_pipeline_split(cfg, pipeline_layout(8, 2, vpp=2))


def test_uneven_split_that_does_not_add_up_is_rejected() -> None:
    with pytest.raises(PipelineSplitError, match="middle stage"):
        pipeline_layout(78, 4, first_stage_layers=18, last_stage_layers=21)


def test_backend_megatron_is_selectable_in_the_run_config() -> None:
    cfg = resolve(
        RunConfig, overrides=["trainer.backend=megatron", "trainer.megatron.tp=2", "trainer.lr=3e-5"]
    )
    assert cfg.trainer.backend == "megatron" and cfg.trainer.megatron.tp == 2 and cfg.trainer.lr == 3e-5
    assert cfg.dump()["trainer"]["megatron"]["tp"] == 2  # --dry-run shows the layout
    assert resolve(RunConfig).trainer.backend == "torch"
    with pytest.raises(Exception, match=r"trainer\.megatron\.tpp"):
        resolve(RunConfig, overrides=["trainer.megatron.tpp=2"])


# --- in the Megatron environment (Python 3.12, megatron-core 0.19) --------------------------------


@pytest.fixture(scope="module")
def one_rank_cases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-rank cases, each with its own trainer, in one process (one start-up instead of
    seven). `split` runs first: it checks that nothing has initialised a process group yet.
    `references` stores the one-rank GRPO steps the two-rank layouts are compared with."""
    from tests.megatron_venv import run_case

    tmp = tmp_path_factory.mktemp("megatron-one-rank")
    return run_case(
        "split,build,hf_parity,glm4_parity,lora,checkpoint,kl,fp8,references,head_loss,on_policy", tmp
    )


TWO_RANK_LAYOUTS = [
    "tp2",
    "tp2-ep2",
    "dp2",
    "dp2-ep2",
    "pp2",
    "vpp2",
    "cp2",
    "cp2-ep2",
    "cp2-indexer-loss",
    "cp2-gspo",
    "tp2-checkpoint",
    "tp2-r3",
    "cp2-r3",
    "pp2-r3",
    "glm4-tp2",
    "glm4-cp2",
    "glm4-pp2",
    "lora-tp2",
    "lora-cp2",
    "lora-pp2",
    "lora-vpp2",
    "glm4-lora-tp2",
]


@pytest.fixture(scope="module")
def two_rank_layouts(one_rank_cases: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every two-rank layout in one torchrun world over gloo (one launch; each layout builds its
    own trainer and model-parallel groups), each against the one-rank step of its model."""
    from tests.megatron_venv import run_case

    reference_dir = str(Path(one_rank_cases["references"]["4"]["path"]).parent)
    tmp = tmp_path_factory.mktemp("megatron-two-ranks")
    layouts = ",".join(TWO_RANK_LAYOUTS)
    return run_case("layouts", tmp, "--layouts", layouts, "--reference-dir", reference_dir, nproc=2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiny_glm_moe_dsa_builds_runs_forward_backward_and_a_grpo_step(one_rank_cases: dict) -> None:
    r = one_rank_cases["build"]
    assert r["megatron_params"] == r["hf_params"]
    # Index sharing is real: only the computing layers own indexer weights.
    assert r["hf_indexer_types"] == ["full", "full", "shared", "full"] and r["indexer_layers"] == [1, 2, 4]
    assert r["params_without_grad"] == []  # with the indexer loss on, every weight trains
    assert r["train_step"]["skipped"] == 0 and r["train_step"]["step"] == 1


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", ["hf_parity", "glm4_parity"])
def test_packed_logprobs_equal_transformers_and_the_hf_round_trip_is_exact(
    one_rank_cases: dict, case: str
) -> None:
    """`glm_moe_dsa` against GlmMoeDsaForCausalLM, and `glm4_moe` (GLM-4.5's grouped-query
    attention: fused QKV with bias, QK norm, half-rotary RoPE, our packed core attention) against
    Glm4MoeForCausalLM."""
    r = one_rank_cases[case]
    if case == "glm4_parity":  # GLM-4.5's own setting: no QK norm (2 norms a layer fewer)
        assert r["no_qk_norm_logprob_max_abs_diff"] <= 1e-4 and r["no_qk_norm_round_trip_exact"]
        assert r["no_qk_norm_tensors"] == r["hf_tensors"] - 2 * 4
        assert "has no DSA indexer" in r["indexer_loss_refusal"]
    assert r["packed_rows_per_micro_batch"] == [4]  # four sequences in one THD row
    assert r["logprob_max_abs_diff"] <= 1e-4 and r["entropy_max_abs_diff"] <= 1e-4
    assert r["round_trip_exact"] and r["missing"] == [] and r["extra"] == []
    # For SGLang: per-expert names, exactly the tensors transformers' save_pretrained writes.
    assert r["checkpoint_layout_equals_save_pretrained"] and r["checkpoint_tensors"] > r["hf_tensors"]
    # The weight source of every sync transport: HF names and shapes, bounded buckets, cast floats.
    assert r["buckets"] > 1 and r["buckets_within_limit"] and r["bucket_names_and_shapes_are_hf"]
    assert r["bucket_dtypes"] == ["torch.bfloat16"]


def _same_step(r: dict) -> None:
    """The layout's GRPO step equals the one-rank step: log-probs, loss, gradient norm, every
    gradient in HF layout (a wrong TP, DP or CP reduction shows here, not in the forward) and the
    weights after AdamW."""
    assert r["micro_batches"] == 2
    assert r["logprob_max_abs_diff"] <= 1e-5
    assert r["loss_abs_diff"] <= 1e-6 and r["grad_norm_abs_diff"] <= 1e-5
    assert r["grad_max_abs_diff"] <= 1e-6 * max(1.0, r["grad_max_abs"])
    # The weights after AdamW, except where the gradient is near Adam's eps (its step g / (|g| +
    # eps) turns a last-bit gradient difference into a share of the lr there); those within 1e-4.
    assert r["weight_max_abs_diff_conditioned"] <= 1e-5
    assert r["weight_max_abs_diff"] <= 1e-4
    # The checkpoint-layout export (experts streamed one slot at a time over EP / expert TP, as
    # SGLang engines take them) is the stacked export split per expert, exactly.
    assert r["checkpoint_layout_exact"] and r["checkpoint_layout_tensors"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_loss_made_in_the_lm_head_takes_the_step_of_the_loss_made_from_log_probs(
    one_rank_cases: dict,
) -> None:
    """The default (the head makes the GRPO loss and its gradients in one pass over the
    vocabulary) against log-probs first and the loss through autograd: the same step."""
    r = one_rank_cases["head_loss"]
    # The default made its loss in the head (two micro-batches), "chunked" never did.
    assert r["head_loss_calls"] == {"auto": 2, "chunked": 0}
    assert r["logprob_max_abs_diff"] == 0.0  # the forward-only log-probs do not change
    assert r["loss_abs_diff"] <= 1e-6 and r["grad_norm_abs_diff"] <= 1e-5
    assert r["grad_max_abs_diff"] <= 1e-6 * max(1.0, r["grad_max_abs"])
    assert r["weight_max_abs_diff"] <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_on_policy_old_logprobs_take_the_recomputed_step_with_one_forward_pass_less(
    one_rank_cases: dict, impl: str
) -> None:
    """`trainer.old_logprobs`: one optimizer step a batch, so the update's own log-probs (detached)
    stand for the old ones: the step of recomputing them (TIS clipped, a KL term), with the loss
    made in the head or from log-probs, and one forward-only schedule fewer."""
    r = one_rank_cases["on_policy"][impl]
    assert r["schedules"]["recompute"].count(True) == r["schedules"]["on_policy"].count(True) + 1
    assert r["schedules"]["recompute"].count(False) == r["schedules"]["on_policy"].count(False) == 1
    assert r["loss_abs_diff"] <= 1e-6 and r["grad_norm_abs_diff"] <= 1e-5
    assert r["grad_max_abs_diff"] <= 1e-6 * max(1.0, r["grad_max_abs"])
    assert r["weight_max_abs_diff"] <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", ["tp2", "tp2-ep2", "dp2", "dp2-ep2"])
def test_two_ranks_over_gloo_take_the_same_grpo_step_as_one(two_rank_layouts: dict, layout: str) -> None:
    r = two_rank_layouts[layout]
    assert (r["tp"], r["dp"], r["ep"]) == {
        "tp2": (2, 1, 1),
        "tp2-ep2": (2, 1, 2),
        "dp2": (1, 2, 1),
        "dp2-ep2": (1, 2, 2),
    }[layout]
    _same_step(r)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", ["glm4-tp2", "glm4-cp2", "glm4-pp2"])
def test_glm4_moe_layouts_take_the_same_grpo_step_as_one_rank(two_rank_layouts: dict, layout: str) -> None:
    """GLM-4.5's architecture: query groups split over TP (sequence parallel), every sequence over
    two CP ranks (keys and values gathered for the packed core attention), two pipeline stages."""
    r = two_rank_layouts[layout]
    assert (r["tp"], r["cp"], r["pp"]) == {
        "glm4-tp2": (2, 1, 1),
        "glm4-cp2": (1, 2, 1),
        "glm4-pp2": (1, 1, 2),
    }[layout]
    _same_step(r)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model", ["dsa", "glm4"])
def test_lora_on_megatron_takes_the_brute_force_gradient_and_exports_what_an_engine_loads(
    one_rank_cases: dict, model: str
) -> None:
    """LoRA on the Megatron trainer (`agentrl/train/megatron/lora.py`), both model types: with B
    non-zero, one GRPO step's adapter gradients equal the chain rule through the full model's
    gradient at the merged weights (dL/dB = s G A^T; dL/dA = s sum B^T G over a fused group); the
    PEFT adapter it exports, loaded by the engine's adapter loader into the HF model, gives the
    trainer's log-probs (the fused q/k/v and gate/up split exactly, the absorbed MLA's KV
    up-projection folded); the merged export is W + s B A; only adapters are in the optimizer; the
    frozen weights never move; a checkpoint holds the adapters alone and resumes to the same step."""
    r = one_rank_cases["lora"][model]
    expected = {"dsa": {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"},
                "glm4": {"q_proj", "k_proj", "v_proj", "o_proj"}}[model]  # fmt: skip
    assert set(r["targets"]) == expected | {"gate_proj", "up_proj", "down_proj"}
    # Routed experts stay frozen: the MoE layers' adapters are on their shared experts only.
    assert not any(".experts." in m for m in r["adapted_modules"])
    assert any(".shared_experts." in m for m in r["adapted_modules"])
    assert r["grad_max_abs_diff"] <= 1e-6 * max(1.0, r["grad_max_abs"])
    assert r["engine_logprob_max_abs_diff"] <= 1e-5 and r["merged_export_max_abs_diff"] <= 1e-6
    assert r["trainable_params"] == r["adapter_params"] < 0.1 * r["model_params"]
    assert r["frozen_weights_unchanged"]
    assert r["checkpoint_files"] == ["adapters-rank00000.pt"]
    assert r["resume_loss_abs_diff"] <= 1e-6 and r["resume_grad_norm_abs_diff"] <= 1e-6
    # A LoRA checkpoint and a full one do not load into each other's trainers.
    mismatch = r["checkpoint_mismatch"]
    assert (
        mismatch["lora_into_full"].startswith("CheckpointError")
        and "holds LoRA adapters only" in mismatch["lora_into_full"]
    )
    assert (
        mismatch["full_into_lora"].startswith("CheckpointError")
        and "saved without LoRA?" in mismatch["full_into_lora"]
    )
    # Refused with the reason: part of a fused group (glm4's q/k/v), a target matching nothing
    # (the message lists the model's projections), megatron's DDP with LoRA.
    refusals = r["refusals"]
    if model == "glm4":
        assert "megatron fuses ['q_proj', 'k_proj', 'v_proj']" in refusals["partial_fused_group"]
    assert "match no projection" in refusals["no_target"] and "'o_proj'" in refusals["no_target"]
    assert "ddp='auto'" in refusals["megatron_ddp"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", ["lora-tp2", "lora-cp2", "lora-pp2", "lora-vpp2", "glm4-lora-tp2"])
def test_lora_layouts_take_the_same_step_as_one_rank(two_rank_layouts: dict, layout: str) -> None:
    """Two LoRA steps (the second moves A too) under TP2 (adapters cut like their linears, the
    low-rank products gathered / reduce-scattered over the sequence), CP2, PP2 and PP2 x VPP2 (two
    model chunks a rank): the adapters' gradients and values (PEFT names, gathered) and the merged
    export equal one rank's."""
    _same_step(two_rank_layouts[layout])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_torch_dist_checkpoint_resumes_to_the_same_next_step(one_rank_cases: dict) -> None:
    r = one_rank_cases["checkpoint"]
    assert r["files"] == ["model", "optimizer-rank00000.pt", "state.json"] and r["latest"] == "step-00000001"
    assert r["state_step"] == 1 and r["buffer_state"] == {"step": 1, "rollout": {"cursor": 3}}
    assert r["loaded_max_abs_diff"] == 0.0
    assert r["after_next_step_max_abs_diff"] == 0.0 and r["steps"] == [2, 2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_tp2_torch_dist_checkpoint_saves_and_resumes_to_the_same_next_step(two_rank_layouts: dict) -> None:
    """TP=2: the DSA indexer's duplicated linears are replicated on both TP ranks; each rank's copy
    is its own replica in the checkpoint (before, both claimed replica 0 and `torch_dist` refused
    to save: "Invalid access pattern"). A fresh trainer with other initial weights loads it: every
    rank's shards equal the saved ones, and both trainers take the same next step."""
    r = two_rank_layouts["tp2-checkpoint"]
    assert r["tp"] == 2 and r["latest"] == "step-00000001" and r["state_step"] == 1
    assert r["files"] == ["model", "optimizer-rank00000.pt", "optimizer-rank00001.pt", "state.json"]
    assert r["local_init_min_max_abs_diff"] > 0  # every local tensor had to change in the load
    assert r["loaded_max_abs_diff"] == 0.0 and r["local_loaded_max_abs_diff"] == 0.0
    assert r["after_next_step_max_abs_diff"] == 0.0 and r["local_after_next_step_max_abs_diff"] == 0.0
    assert r["steps"] == [2, 2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_bad_pipeline_split_is_refused_before_the_model_is_built(one_rank_cases: dict) -> None:
    r = one_rank_cases["split"]
    assert not r["dist_initialized"] and not r["dist_initialized_after"]
    assert "starts at layer 3" in r["bad"]["ours"] and "local layer 3" in r["bad"]["megatron"]
    assert r["good"]["megatron"] is None and r["good"]["ours"].startswith("passed the check")


@pytest.fixture(scope="module")
def runtime_steps(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One GRPO step through the runtime per sync transport, one after another against one
    `agentrl engine serve` process (set back to the initial weights between runs)."""
    from tests.megatron_venv import free_port, run_case

    tmp = tmp_path_factory.mktemp("megatron-runtime")
    transports = "tensor,distributed,disk,lora_adapter"
    return run_case("runtime", tmp, "--port", str(free_port()), "--transport", transports)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("transport", ["tensor", "distributed", "disk", "lora_adapter"])
def test_a_grpo_step_through_the_runtime_syncs_an_engine_serve_process(
    runtime_steps: dict, transport: str
) -> None:
    """lora_adapter: the Megatron trainer's LoRA adapters alone (PEFT names), loaded by the server
    (`--enable-lora`) by name and named in the request: the engine with the adapter equals the
    trainer with it."""
    r = runtime_steps[transport]
    assert r["steps"] == 1 and r["trainer"]["skipped_steps"] == 0 and r["trainer"]["step"] == 1
    assert r["version"] == 1 and r["engine_version"] == "1"
    # Before the step the engine's rollout log-probs were the trainer's (no mismatch: for the
    # second and third transports this also shows the server was set back to the initial weights) ...
    assert r["mismatch_kl"] <= 1e-6
    # ... and after the sync the engine serves the trained weights: its log-probs moved away from
    # the initial model's and equal the trainer's.
    assert r["engine_vs_initial_max_abs_diff"] > 1e-3
    assert r["engine_vs_trainer_max_abs_diff"] <= 1e-4


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_run_over_two_trainer_ranks_is_driven_by_rank_0_and_followed_by_the_other(tmp_path: Path) -> None:
    """`agentrl train run` under torchrun (what the recipe starts on each training node): rank 0
    runs the loop (rollouts from an engine serve process, two steps, a tensor weight sync and a
    checkpoint each), rank 1 runs each collective call with it (DP 2: its gradients are half of
    every step), and both stop together."""
    from tests.megatron_venv import free_port, run_case

    r = run_case("runtime_ranks", tmp_path, "--port", str(free_port()), nproc=2)
    assert r["steps"] == 2 and r["versions"] == [1, 2] and r["trainer_steps"] == [1.0, 2.0]
    assert r["checkpoint_world_size"] == 2 and r["checkpoint_step"] == 2
    follower = r["ranks"][1]
    assert follower["rank"] == 1 and follower["step"] == 2
    assert follower["calls"] == {"train_step": 2, "export_weights": 2, "save": 2, "stop": 1}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_uneven_pipeline_stages_take_the_same_grpo_step_as_one_rank(two_rank_layouts: dict) -> None:
    """megatron-core's 1F1B schedule over gloo (layers 1-3 | 4: layer 4 computes its own DSA
    indices), two micro-batches in flight; the step's log-probs, loss, gradients and updated
    weights (exported in HF names from both stages) equal the one-rank step."""
    r = two_rank_layouts["pp2"]
    assert r["pp"] == 2 and r["chunks"] == 1
    assert [x["stage_layers"] for x in r["ranks"]] == [[[1, 2, 3]], [[4]]]
    assert [x["indexer_layers"] for x in r["ranks"]] == [[[1, 2]], [[4]]]  # index sharing per stage
    _same_step(r)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_virtual_pipeline_stages_take_the_same_grpo_step_as_one_rank(two_rank_layouts: dict) -> None:
    """The interleaved schedule: 8 layers over 2 ranks x 2 virtual stages (1-2, 3-4 | 5-6, 7-8,
    each starting on a computing layer); idle micro-batches fill the schedule's groups. Compared
    with the one-rank step of the same 8-layer model."""
    r = two_rank_layouts["vpp2"]
    assert r["pp"] == 2 and r["chunks"] == 2
    assert [x["stage_layers"] for x in r["ranks"]] == [[[1, 2], [5, 6]], [[3, 4], [7, 8]]]
    assert [x["indexer_layers"] for x in r["ranks"]] == [[[1], [5]], [[3], [7]]]
    _same_step(r)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", ["cp2", "cp2-ep2", "cp2-indexer-loss", "cp2-gspo"])
def test_context_parallel_ranks_take_the_same_grpo_step_as_one(two_rank_layouts: dict, layout: str) -> None:
    """CP=2: every packed sequence split over the two ranks in megatron's zigzag THD layout, DSA's
    all-gather CP (keys / values and indexer keys gathered, top-k over the whole sequence, the
    shared-index layer 3 reusing layer 2's indices), log-probs gathered back for the loss;
    gradients summed over the CP ranks. With cp2-ep2 the experts are spread over the CP ranks;
    with cp2-indexer-loss the DSA indexer trains on its KL loss (padding rows marked, so the
    sequences' CP padding adds nothing to it), compared with one rank with the same loss; with
    cp2-gspo each sequence's GSPO ratio averages tokens of both ranks."""
    r = two_rank_layouts[layout]
    assert (r["cp"], r["dp"], r["tp"], r["ep"]) == (2, 1, 1, 2 if layout == "cp2-ep2" else 1)
    # Each rank ran half of every sequence (sequences padded to a multiple of 2 x CP).
    assert [x["cp_local_tokens"] for x in r["ranks"]] == [r["cp_global_tokens"] // 2] * 2
    _same_step(r)
    if layout == "cp2-gspo":
        assert r["seq_ratio_mean"] is not None  # the sequence-level objective ran


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_kl_term_is_measured_against_a_frozen_copy_of_the_initial_weights(one_rank_cases: dict) -> None:
    r = one_rank_cases["kl"]
    assert r["kl"][0] == 0.0 and r["kl"][1] > 0  # the policy starts as its reference, then leaves it
    assert r["reference_moved"] == 0.0 and r["policy_moved"] > 0


def test_fp8_block_quantisation_has_one_scale_per_128_block_and_bounded_error() -> None:
    torch = pytest.importorskip("torch")
    from agentrl.train.megatron.fp8 import block_dequantize, block_quantize

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * 0.02
    w[:128, :128] *= 100  # blocks of very different ranges keep their own scales
    q, scale = block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.shape == (3, 2) and scale.dtype == torch.float32
    err = (block_dequantize(q, scale) - w).abs()
    # e4m3 keeps 3 mantissa bits: within a block the error is at most 2^-4 of the value (plus the
    # subnormal step near 0), so each block's error is bounded by its own range.
    for i in range(3):
        for j in range(2):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert err[blk].max() <= w[blk].abs().max() / 16
    # The small blocks are not drowned by the large one: their error is far below its bound.
    assert err[128:, 128:].max() < 0.01 * w[:128, :128].abs().max() / 16


def test_fp8_export_quantises_decoder_projections_only() -> None:
    torch = pytest.importorskip("torch")
    from agentrl.train.megatron.fp8 import quantize_named

    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.0.self_attn.indexer.wk.weight",
        "model.layers.0.self_attn.indexer.weights_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "lm_head.weight",
    ]
    named = [
        (n, torch.ones(4, 4) if n.endswith("weight") and "norm" not in n else torch.ones(4)) for n in names
    ]
    out = dict(quantize_named(named))
    fp8 = sorted(n for n, t in out.items() if t.dtype == torch.float8_e4m3fn)
    assert fp8 == [
        "model.layers.0.self_attn.indexer.wk.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
    ]
    assert all(n.removesuffix("weight") + "weight_scale_inv" in out for n in fp8)
    assert {t.dtype for n, t in out.items() if n not in fp8 and "scale_inv" not in n} == {torch.bfloat16}


def test_fp8_export_needs_the_checkpoint_layout() -> None:
    from agentrl.train.megatron.settings import MegatronSettings

    with pytest.raises(ValueError, match="export_layout='checkpoint'"):
        MegatronSettings(export_quantization="fp8_block128")
    MegatronSettings(export_quantization="fp8_block128", export_layout="checkpoint")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_trainer_exports_fp8_blocks_an_hf_model_can_be_rebuilt_from(one_rank_cases: dict) -> None:
    r = one_rank_cases["fp8"]
    assert r["fp8_tensors"] == r["scale_tensors"] > 0 and r["other_dtypes"] == ["torch.bfloat16"]
    assert r["missing"] == [] and r["unexpected"] == []
    # Dequantised, the tiny model's log-probs stay close to the trained weights' (fp8 noise only).
    assert r["dequantised_logprob_max_abs_diff"] < 0.1


def test_optimizer_offload_needs_megatrons_distributed_optimizer() -> None:
    from agentrl.train.megatron.settings import MegatronSettings

    with pytest.raises(ValueError, match="optimizer_cpu_offload needs ddp='megatron'"):
        MegatronSettings(optimizer_cpu_offload=True, ddp="local")
    with pytest.raises(ValueError, match="optimizer_cpu_offload needs"):
        MegatronSettings(optimizer_cpu_offload=True, distributed_optimizer=False)
    with pytest.raises(ValueError, match="ddp='fsdp'"):
        MegatronSettings(ddp="fsdp")
    MegatronSettings(optimizer_cpu_offload=True, ddp="megatron")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_routing_replay_brings_the_trainers_log_probs_to_the_engines(tmp_path: Path) -> None:
    """R3 on the proxy model: an engine whose routers compute a little differently (bf16, other
    numerics) sends some tokens to other experts; replaying its routes in the trainer's routers
    brings the trainer's log-probs closer to the engine's, and replaying the trainer's own routes
    changes nothing (the routes land on the right tokens of the packed row)."""
    from tests.megatron_venv import run_case

    r = run_case("routing_replay", tmp_path)
    assert r["flipped"] > 0 and r["flipped_tokens"] > 0  # the two really route differently
    assert r["own_routes_replayed_max_abs"] == 0.0
    assert r["replay"]["mean_abs"] < r["own_routing"]["mean_abs"]
    assert r["replay"]["flipped_mean_abs"] < r["own_routing"]["flipped_mean_abs"]
    assert r["train_step_skipped"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", ["tp2-r3", "cp2-r3", "pp2-r3"])
def test_routing_replay_takes_the_one_rank_step_under_tp_cp_and_pp(
    one_rank_cases: dict, two_rank_layouts: dict, layout: str
) -> None:
    """R3 with random engine routes (nothing like the trainer's own): with TP=2 each rank's
    routers get their sequence-parallel slice of the packed row, with CP=2 their zigzag share of
    every sequence, with PP=2 (1F1B) each stage's routers the routes of the micro-batch they run;
    each takes the one-rank replayed step. The replayed step is not the unreplayed one."""
    refs = one_rank_cases["references"]
    assert abs(refs["4-r3"]["grad_norm"] - refs["4"]["grad_norm"]) > 1e-3  # the routes matter
    r = two_rank_layouts[layout]
    assert (r["tp"], r["cp"], r["pp"]) == {"tp2-r3": (2, 1, 1), "cp2-r3": (1, 2, 1), "pp2-r3": (1, 1, 2)}[
        layout
    ]
    _same_step(r)
