"""The Megatron backend on a GPU: bf16, the all-to-all MoE dispatcher, full recompute, megatron's
DDP and distributed optimizer (the trainer's default on CUDA).

Skipped without CUDA and megatron-core in this interpreter, so skipped in CI; meant for the GPU
machine (Python 3.12 with the megatron-core wheel on PYTHONPATH: docs/megatron.md). Passed on one
H200 (2026-12-01). The larger measurement is benchmarks/megatron_gpu.py.
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
    from tests.megatron_venv import run_case

    r = run_case("gpu", tmp_path, interpreter=sys.executable)
    assert r["logprob_max_abs_diff_bf16"] < 0.1  # bf16 weights and activations on both sides
    assert r["skipped"] == 0 and r["loss"] == r["loss"]
