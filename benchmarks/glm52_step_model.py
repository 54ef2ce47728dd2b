"""A step-time model of the GLM-5.2 terminal-bench-2 run (16 GB300 nodes: 8 train, 8 rollout).

Not a measurement: every input is a published figure or a stated assumption (the ASSUMPTIONS
table), and the output is arithmetic on them. It predicts the reference run's pace (~6.5 min per
step with evals) from component throughputs, then what agentrl's scheduler changes (fully async
rollout with partial episodes across weight versions, in-place pause, eval episodes interleaved
with training episodes instead of a stop-the-world eval), side by side. Goal: <= 5 min per step on
the same hardware. `python benchmarks/glm52_step_model.py [--sandbox-concurrency N ...]`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from agentrl.cluster.model import ModelSpec
from agentrl.cluster.planner import HARDWARE, GiB, Layout, memory_estimate


@dataclass
class Assumptions:
    episodes_per_step: int = 256  # 32 tasks x 8 samples (GRPO group 8)
    trained_tokens_per_episode: int = 24_000  # prompt + every turn's output and observations
    generated_tokens_per_episode: int = 6_000
    mfu: float = 0.30  # bf16 model-FLOPs utilisation of the Megatron step (MoE, PP4, CP4)
    nvme_gb_s_per_node: float = 28.0  # 4 NVMe drives x ~7 GB/s: optimizer state streamed to disk
    decode_tok_s_per_gpu: float = 2_500.0  # FP8 dp-attention engine, high concurrency
    weight_sync_s: float = 20.0  # pause, FP8 block quantise, broadcast 744 GB, engine load, resume
    mean_episode_minutes: float = 10.0  # sandbox start + agent turns + tests/test.sh
    sandbox_concurrency: int = 512  # Daytona sandboxes alive at once
    tail_stall_s: float = 60.0  # reference: the batch waits for the last groups of its version
    eval_every: int = 10
    eval_minutes: float = 5.0  # 89 terminal-bench-2 tasks, stop-the-world in the reference
    offload_overlap: float = 0.5  # ours: share of the disk stream hidden behind the next forward
    engine_wait_share: float = 0.5  # share of an episode's time spent waiting for the engines


def model(a: Assumptions) -> dict[str, float]:
    glm = ModelSpec.named("GLM-5.2")
    hw = HARDWARE["GB300"]
    train_gpus = 32  # 8 training nodes x 4 GB300
    active = glm.active_params()
    c = glm.config
    attn = 4 * c["index_topk"] * c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * glm.num_layers  # fmt: skip
    # forward + backward (6N) + full recompute (+2N) + the old-log-prob forward (+2N), attention x3
    flops_per_token = 10 * active + 3 * attn
    tokens = a.episodes_per_step * a.trained_tokens_per_episode
    train_s = flops_per_token * tokens / (train_gpus * hw.bf16_tflops * 1e12 * a.mfu)
    mem = memory_estimate(glm, Layout(2, 4, 4, 8, 1, 18, 20), dp=1, hw=hw, offload=True)
    offload_bytes = 2 * mem.optimizer_offloaded * 4  # read + write, per 4-GPU node
    offload_s = offload_bytes / (a.nvme_gb_s_per_node * 1e9)
    decode_s = a.episodes_per_step * a.generated_tokens_per_episode / (32 * a.decode_tok_s_per_gpu)
    production_s = a.episodes_per_step * a.mean_episode_minutes * 60 / a.sandbox_concurrency
    eval_s = a.eval_minutes * 60 / a.eval_every
    # Both pause every engine for the weight sync: an episode waiting for a turn then waits the
    # sync out too, holding its sandbox (with the default "abort" pause its partial turn is redone).
    sync_stall_s = a.engine_wait_share * a.weight_sync_s
    ref = max(train_s + offload_s + a.weight_sync_s, production_s) + a.tail_stall_s + eval_s + sync_stall_s
    # Ours: no tail stall (in-flight episodes continue across the update and land in a later batch,
    # staleness-bounded), eval episodes take their share of sandbox slots instead of a pause.
    eval_share = 89 / (a.eval_every * a.episodes_per_step)
    ours_train = train_s + offload_s * (1 - a.offload_overlap) + a.weight_sync_s
    ours = max(ours_train, production_s * (1 + eval_share) + sync_stall_s)
    return {
        "train compute (s)": train_s,
        "optimizer offload I/O (s)": offload_s,
        "weight sync (s)": a.weight_sync_s,
        "decode compute (s)": decode_s,
        "rollout production (s)": production_s,
        "reference: tail stall (s)": a.tail_stall_s,
        "reference: eval amortised (s)": eval_s,
        "sync stall of waiting episodes (s)": sync_stall_s,
        "reference step (min)": ref / 60,
        "ours step (min)": ours / 60,
        "ours / reference": ours / ref,
        "offloaded optimizer per node (GiB)": mem.optimizer_offloaded * 4 / GiB,
        "flops per trained token (G)": flops_per_token / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Assumptions):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    a = Assumptions(**{f.name: getattr(ap.parse_args(), f.name) for f in fields(Assumptions)})
    print("assumptions:")
    for f in fields(a):
        print(f"  {f.name:30s} {getattr(a, f.name)}")
    print("model:")
    for k, v in model(a).items():
        print(f"  {k:36s} {v:10.2f}")
    print("what moves the result (ours, minutes per step):")
    for name, change in [
        ("sandbox concurrency 640", {"sandbox_concurrency": 640}),
        ("sandbox concurrency 384", {"sandbox_concurrency": 384}),
        ("mean episode 8 min", {"mean_episode_minutes": 8.0}),
        ("MFU 0.15", {"mfu": 0.15}),
        ("no offload overlap", {"offload_overlap": 0.0}),
        ("episodes never wait on a sync", {"engine_wait_share": 0.0}),
    ]:
        b = Assumptions(**{**a.__dict__, **change})
        r = model(b)
        print(f"  {name:30s} reference {r['reference step (min)']:5.2f}  ours {r['ours step (min)']:5.2f}")


if __name__ == "__main__":
    main()
