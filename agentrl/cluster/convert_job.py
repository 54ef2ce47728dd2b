"""HF `glm_moe_dsa` checkpoint -> megatron-core `torch_dist` checkpoint, in the Megatron backend's
Python >= 3.12 environment (started by `agentrl.cluster.prepare.convert_to_megatron`, under
torchrun: one process per rank of PP x lcm(TP, EP x ETP)).

No rank reads the whole model. Each rank builds its own pipeline stage's shard of the model with
the backend's builder and fills it from a streaming reader of the checkpoint's safetensors
(`hf_io.HFCheckpoint`): only its stage's layers, its experts and its tensor-parallel slices are
read, one tensor at a time (`convert.load_hf_into`: strict, shapes checked). It saves through
megatron's distributed checkpointing, overwrites its weights with NaN, loads the saved checkpoint
back, exports it to HF names (`convert.megatron_to_hf`, experts one at a time) and compares each
exported tensor with the checkpoint's, one at a time: a rank compares only the tensors it read
itself (its TP rank 0 the full tensor, one copy per data-parallel group). The report has the
largest difference, what every rank read (layers, experts, bytes) and its peak RSS, and the
checkpoint's tensors that the model has no place for (e.g. MTP layers).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
from pathlib import Path

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def checkpoint_dtype(hf_dir: Path) -> str:
    """The params dtype that holds the checkpoint exactly: bfloat16 for a bf16 checkpoint,
    float32 for anything else."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return "bfloat16" if dtype == "bfloat16" else "float32"


def read_summary(names: set[str], bytes_read: int) -> dict[str, object]:
    layers = sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))})
    experts = sorted({int(m.group(1)) for n in names if (m := _EXPERT.search(n))})
    return {
        "tensors": len(names),
        "bytes": bytes_read,
        "layers": layers,
        "experts": experts,
        "other": sorted(n for n in names if not _LAYER.match(n)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--hf", "--out", "--report"):
        ap.add_argument(name, required=True)
    for name in ("--tp", "--pp", "--ep", "--etp"):
        ap.add_argument(name, type=int, default=1)
    ap.add_argument("--first-stage-layers", type=int, default=None)
    ap.add_argument("--last-stage-layers", type=int, default=None)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: the checkpoint's")
    args = ap.parse_args()

    from agentrl.train.megatron.model import plain_jit_on_cpu

    plain_jit_on_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from agentrl.train.megatron import convert, parallel
    from agentrl.train.megatron.hf_io import HFCheckpoint
    from agentrl.train.megatron.model import build_model, check_hf_config, layout_of
    from agentrl.train.megatron.settings import MegatronSettings

    hf_dir = Path(args.hf)
    cfg = AutoConfig.from_pretrained(hf_dir)
    check_hf_config(cfg)
    dtype = args.dtype or checkpoint_dtype(hf_dir)
    settings = MegatronSettings(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        params_dtype=dtype,
    )
    parallel.initialize(settings)
    stage = ps.get_pipeline_model_parallel_rank()
    layers = convert.stage_layers(layout_of(cfg, settings), stage)
    hf = HFCheckpoint(hf_dir, dtype=_DTYPES[dtype])
    model = build_model(cfg, settings)
    if dtype == "bfloat16":  # as the trainer builds it: megatron keeps torch norms in fp32
        for p in model.parameters():
            if p.dtype == torch.float32:
                p.data = p.data.to(torch.bfloat16)
    convert.load_hf_into(hf, model, stage_layers=layers, arch=convert.Arch.of(cfg))
    loaded_names, loaded_bytes = set(hf.names_read), hf.bytes_read
    rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = Path(args.out)
    if dist.get_rank() == 0:
        (out / "model").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out / "model"))

    # Round trip in the same model (no second copy): NaN everywhere, so a weight the load misses
    # cannot compare equal.
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not convert._SKIP.search(key):
                t.fill_(float("nan"))
    model.load_state_dict(
        dist_checkpointing.load(model.sharded_state_dict(), str(out / "model")), strict=False
    )
    layout = "checkpoint" if any(_PER_EXPERT.search(n) for n in hf) else "stacked"
    expert_owner = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    dense_owner = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    worst, exported, compared, mismatched = 0.0, set(), set(), []
    with torch.no_grad():
        for name, tensor in convert.megatron_to_hf(
            model, stage_layers=layers, arch=convert.Arch.of(cfg), layout=layout
        ):
            exported.add(name)
            owner = expert_owner if _EXPERT.search(name) else dense_owner
            if name not in loaded_names or not owner:
                continue
            ref = hf[name]
            if tuple(ref.shape) != tuple(tensor.shape):
                diff = math.inf
            else:
                # The reference comes from the checkpoint files (CPU); on a GPU rank the export is
                # on the GPU: compare on the CPU.
                mine = tensor.detach().to("cpu", torch.float32)
                diff = (mine - ref.to("cpu", torch.float32)).abs().max().item() if ref.numel() else 0.0
                diff = math.inf if diff != diff else diff  # NaN: a weight the load did not restore
            if diff != 0.0:
                mismatched.append(name)
            worst = max(worst, diff)
            compared.add(name)
    hf.close()
    rank = {
        "rank": dist.get_rank(),
        "stage": stage,
        "stage_layers": layers,
        "read": read_summary(loaded_names, loaded_bytes),
        "compared": len(compared),
        "maxrss_after_load_bytes": rss_after_load,
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rank, sorted(exported), sorted(compared), mismatched, worst))
    if dist.get_rank() == 0:
        all_exported = set().union(*(r[1] for r in everyone))
        all_compared = set().union(*(r[2] for r in everyone))
        bad = sorted({n for r in everyone for n in r[3]})
        not_compared = sorted(all_exported - all_compared)
        unconverted = sorted(set(hf) - all_exported)
        meta = {
            "source": str(hf_dir.resolve()),
            "megatron": settings.to_dict(),
            "hf_tensors": len(all_exported),
            "checkpoint_tensors": len(hf),
            "checkpoint_bytes": sum(p.stat().st_size for p in hf_dir.glob("*.safetensors")),
            "per_rank": [r[0] for r in everyone],
        }
        (out / "convert.json").write_text(json.dumps(meta, indent=1))
        report = {
            **meta,
            "max_abs_diff": max(r[4] for r in everyone),
            "mismatched": bad[:20],
            "not_compared": not_compared[:20],
            "unconverted": unconverted[:20],
            "unconverted_count": len(unconverted),
            "ranks": dist.get_world_size(),
        }
        Path(args.report).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
