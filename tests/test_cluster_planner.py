"""The GLM-5.2 cluster planner (agentrl.cluster): pure functions, no Ray, no GPUs."""

from __future__ import annotations

import pytest

from agentrl.cluster.model import ModelSpec
from agentrl.cluster.planner import (
    GiB,
    Layout,
    LayoutError,
    MemoryBudgetError,
    SkipLayerStageError,
    WorldSizeError,
    check_layout,
    choose_layout,
    find_pipeline_split,
    hardware,
    memory_estimate,
)
from tests.test_recipe_glm52 import SPECS

MODELS = SPECS["tbench2"].models
GLM52_CONFIG = MODELS["GLM-5.2"].config
GLM52 = MODELS["GLM-5.2"].spec()
PRUNED = MODELS["GLM-5.2_5layer"].spec()


def test_glm52_has_744b_parameters_and_about_40b_active() -> None:
    assert 740e9 < GLM52.total_params(with_mtp=False) < 748e9
    assert 38e9 < GLM52.active_params() < 43e9
    assert PRUNED.num_layers == 5 and PRUNED.mtp_layers == 0


def test_computing_layers_follow_the_config_not_a_list() -> None:
    assert GLM52.computing_layers[:5] == [1, 2, 3, 7, 11] and GLM52.computing_layers[-1] == 75
    assert all(max(L - 3, 0) % 4 == 0 for L in GLM52.computing_layers)
    # Change the config's frequency and the computing layers move with it.
    every_other = ModelSpec("x", {**GLM52_CONFIG, "index_topk_freq": 2})
    assert every_other.computing_layers[:5] == [1, 2, 3, 5, 7]
    # Indexer weights exist only on computing layers.
    assert GLM52.layer_params(6).dup > GLM52.layer_params(7).dup


def test_the_best_pipeline_splits_start_every_stage_on_a_computing_layer() -> None:
    assert find_pipeline_split(GLM52, 4) == (18, 20)
    first, last = find_pipeline_split(GLM52, 8)
    stages = [first, *[(78 - first - last) // 6] * 6, last]
    starts = [1 + sum(stages[:k]) for k in range(8)]
    assert set(starts) <= set(GLM52.computing_layers) and max(stages) <= 16


def test_reference_branches_are_valid() -> None:
    gb300, h200 = hardware("GB300"), hardware("H200")
    dp, est = check_layout(GLM52, Layout(8, 4, 1, 16, 1, 18, 20), gpus=64, hw=gb300, offload=False)
    assert dp == 2 and est.fits
    dp, est = check_layout(GLM52, Layout(4, 8, 8, 32, 1, 14, 16), gpus=256, hw=h200, offload=False)
    assert dp == 1
    dp, _ = check_layout(PRUNED, Layout(4, 1, 1, 8, 1, None, None, 2048), gpus=8, hw=h200, offload=False)
    assert dp == 2


def test_tbench2_reference_fits_gb300_only_with_the_optimizer_offloaded() -> None:
    lay, gb300 = Layout(2, 4, 4, 8, 1, 18, 20), hardware("GB300")
    dp, est = check_layout(GLM52, lay, gpus=32, hw=gb300, offload=True)
    assert dp == 1 and est.optimizer_on_gpu == 0 and est.optimizer_offloaded > 200 * GiB
    with pytest.raises(MemoryBudgetError, match=r"GiB per GPU .* > 268\.2 GiB"):
        check_layout(GLM52, lay, gpus=32, hw=gb300, offload=False)


def test_world_size_rejection_shows_the_arithmetic() -> None:
    with pytest.raises(WorldSizeError, match=r"4 x 8 x 8 = 256 GPUs, and 128 GPUs is not a multiple of 256"):
        check_layout(GLM52, Layout(4, 8, 8, 32, 1, 14, 16), gpus=128, hw=hardware("H200"), offload=False)
    with pytest.raises(WorldSizeError, match="must divide"):
        check_layout(GLM52, Layout(2, 4, 1, 16, 1, 18, 20), gpus=32, hw=hardware("GB300"), offload=True)


def test_a_stage_on_a_skip_layer_is_rejected_with_the_layer() -> None:
    with pytest.raises(SkipLayerStageError, match=r"starts at layer 40 \(1-indexed\)"):
        check_layout(GLM52, Layout(8, 2, 1, 16), gpus=64, hw=hardware("GB300"), offload=True)
    with pytest.raises(SkipLayerStageError, match="layer 20"):
        check_layout(GLM52, Layout(8, 4, 1, 16, 1, 19, 19), gpus=64, hw=hardware("GB300"), offload=True)


def test_memory_grows_with_the_token_budget_and_offload_only_moves_optimizer_state() -> None:
    lay, hw = Layout(4, 4, 1, 32, 1, 18, 20), hardware("H200")
    a = memory_estimate(GLM52, lay, dp=8, hw=hw, offload=False)
    b = memory_estimate(GLM52, Layout(4, 4, 1, 32, 1, 18, 20, 16384), dp=8, hw=hw, offload=False)
    c = memory_estimate(GLM52, lay, dp=8, hw=hw, offload=True)
    assert b.activations > a.activations and b.weights == a.weights
    assert (
        c.total == pytest.approx(a.total - a.optimizer_on_gpu) and c.optimizer_offloaded == a.optimizer_on_gpu
    )


def test_16_nodes_of_8_h200_get_a_valid_layout_with_room_to_spare() -> None:
    choice = choose_layout(
        GLM52,
        gpus=128,
        hw=hardware("H200"),
        offload=False,
        references=[(">= 16 nodes of 8 GPUs", Layout(4, 8, 8, 32, 1, 14, 16))],
    )
    assert choice.source == "search" and "256 GPUs" in choice.rejected[0][1]
    lay = choice.layout
    assert lay.model_parallel * choice.dp == 128 and choice.memory.total <= 0.9 * choice.memory.capacity
    assert (lay.tp, lay.pp, lay.cp, lay.ep) == (4, 4, 1, 32) and choice.dp == 8


def test_too_few_gpus_fail_with_the_closest_miss() -> None:
    with pytest.raises(
        LayoutError, match=r"(?s)no parallel layout of GLM-5.2 fits 16 H200.*closest: .* GiB per GPU"
    ) as e:
        choose_layout(GLM52, gpus=16, hw=hardware("H200"), offload=False)
    assert "--enable-optimizer-offload" in str(e.value)
