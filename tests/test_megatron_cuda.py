"""The Megatron backend on a GPU: bf16, the all-to-all MoE dispatcher, full recompute, megatron's
DDP and distributed optimizer (the trainer's default on CUDA).

Skipped without CUDA and megatron-core in this interpreter, so skipped in CI; meant for the GPU
machine (Python 3.12 with the megatron-core wheel on PYTHONPATH: docs/megatron.md). Both tests
passed on one H200 (2026-12-01; benchmarks/RESULTS.md). The larger measurement is
benchmarks/megatron_gpu.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("megatron") is None,
    reason="needs CUDA and megatron-core in this interpreter (the GPU machine)",
)


def test_bf16_logprobs_match_hf_and_a_grpo_step_runs_on_the_gpu(tmp_path: Path) -> None:
    """Both model types (glm_moe_dsa, glm4_moe), with and without LoRA."""
    from tests.megatron_venv import run_case

    for model, r in run_case("gpu", tmp_path, interpreter=sys.executable).items():
        assert r["logprob_max_abs_diff_bf16"] < 0.1, model  # bf16 weights and activations on both sides
        assert r["skipped"] == 0 and r["loss"] == r["loss"]
        # LoRA on CUDA: its own reduction (not megatron's DDP), two finite steps that move B; the
        # first step's loss is the full model's (B = 0: the same forward)
        assert not r["lora_megatron_ddp"] and r["lora_skipped"] == [0, 0], model
        assert all(x == x for x in r["lora_losses"]) and r["lora_b_moved"] > 0
        assert r["lora_first_loss_equals_full"] <= 1e-3


def test_megatrons_distributed_optimizer_resumes_to_the_same_next_step(tmp_path: Path) -> None:
    """torch's Adam under megatron's distributed optimizer (no TE / apex on the machine): a fresh
    trainer loads the checkpoint (no `KeyError: 'step'`), gets the saved optimizer state exactly,
    and takes the same next step as the trainer that saved it."""
    from tests.megatron_venv import run_case

    r = run_case("gpu_resume", tmp_path, interpreter=sys.executable)
    assert r["states"] > 0 and {"param", "exp_avg", "exp_avg_sq", "step"} <= set(r["state_keys"])
    assert r["loaded_state_max_abs_diff"] == 0.0
    assert r["skipped"] == [0.0, 0.0] and r["next_loss"][0] == r["next_loss"][1]
    # One Adam step per parameter after the resume (a shared step tensor would count one per
    # parameter), and the weights after it equal the uninterrupted trainer's.
    assert r["adam_steps_after"] == [2.0] and r["trainer_steps"] == [2, 2]
    assert r["next_step_moved"] > 0 and r["after_next_step_max_abs_diff"] <= 1e-6 * r["next_step_moved"]


def test_routing_replay_under_full_recompute_replays_each_micro_batchs_routes(tmp_path: Path) -> None:
    """R3 with full activation recompute: the recompute in the backward pass replays the routes of
    the micro-batch it recomputes (`agentrl/train/megatron/replay.py`), so the step equals the one
    without recompute; without replay the step is another (the random routes matter)."""
    from tests.megatron_venv import run_case

    r = run_case("gpu_r3_recompute", tmp_path, interpreter=sys.executable)
    assert r["recompute_vs_not_max_abs"] <= 1e-5 * max(1.0, r["grad_max_abs"])
    assert r["replay_vs_not_max_abs"] > 1e-3
