"""HF `glm_moe_dsa` checkpoint -> megatron-core `torch_dist` checkpoint, in the Megatron backend's
Python >= 3.12 environment (started by `agentrl.cluster.prepare.convert_to_megatron`, under
torchrun for TP / EP > 1).

Each rank builds its shard of the model with the backend's builder, copies its slice of the HF
weights in (`convert.load_hf_into`: strict, every weight set, shapes checked), saves through
megatron's distributed checkpointing, then loads the saved checkpoint into a fresh model and
gathers it back to HF names (`convert.megatron_to_hf`) to report the largest difference.
The whole HF model is read into host memory: fine for the pruned model; the full 744B model
would need a per-stage reader (not written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--hf", "--out", "--report"):
        ap.add_argument(name, required=True)
    for name in ("--tp", "--ep", "--etp"):
        ap.add_argument(name, type=int, default=1)
    args = ap.parse_args()

    from agentrl.train.megatron.model import plain_jit_on_cpu

    plain_jit_on_cpu()
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig, GlmMoeDsaForCausalLM

    from agentrl.train.megatron import convert, parallel
    from agentrl.train.megatron.model import build_model, check_hf_config, layout_of
    from agentrl.train.megatron.settings import MegatronSettings

    cfg = AutoConfig.from_pretrained(args.hf)
    check_hf_config(cfg)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    settings = MegatronSettings(tp=args.tp, ep=args.ep, etp=args.etp, params_dtype=dtype)
    parallel.initialize(settings)
    hf = GlmMoeDsaForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
    state = {k: v for k, v in hf.state_dict().items()}
    layers = convert.stage_layers(layout_of(cfg, settings), 0)
    model = build_model(cfg, settings)
    with torch.no_grad():
        convert.load_hf_into(state, model, stage_layers=layers, num_experts=cfg.n_routed_experts)
    out = Path(args.out)
    if dist.get_rank() == 0:
        (out / "model").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out / "model"))

    fresh = build_model(cfg, settings)
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(out / "model"))
    fresh.load_state_dict(loaded, strict=False)
    worst, count = 0.0, 0
    with torch.no_grad():
        for name, tensor in convert.megatron_to_hf(
            fresh, stage_layers=layers, num_experts=cfg.n_routed_experts
        ):
            ref = state[name].to(tensor.dtype)
            worst = max(worst, (tensor.float() - ref.float()).abs().max().item())
            count += 1
    if dist.get_rank() == 0:
        meta = {"source": str(Path(args.hf).resolve()), "megatron": settings.to_dict(), "hf_tensors": count}
        (out / "convert.json").write_text(json.dumps(meta, indent=1))
        Path(args.report).write_text(
            json.dumps({**meta, "max_abs_diff": worst, "ranks": dist.get_world_size()})
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
