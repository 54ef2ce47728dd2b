"""A step-time model of the GLM-5.2 terminal-bench-2 run (16 GB300 nodes: 8 train, 8 rollout).

Not a measurement: every input is a published figure or a stated assumption (`Assumptions`), and
the output is arithmetic on them. The published figures are the reference run's own
(radixark/miles, examples/experimental/openenv/glm52_tbench2: the README and the run script's
defaults, read at commit 31f1ca9): 100 rollout steps in 21 h "(~6.5 min/step incl. evals every
10)", 8 tasks x 8 samples per step, 128 episodes in flight (a slot freed per finished sample),
"~90-100 concurrent generating requests across 32 dp ranks", an eval of 20 held-out tasks x 2
samples every 10 steps on the shared engines with the producer paused (blocking), episodes capped
at 30 turns and 3,600 s, weight updates with an in_place pause.

The two published paces disagree: 21 h / 100 steps is 12.6 min per step. They agree if 6.5 min
is the step between evals and each of the 11 blocking evals (one before training, then every 10
steps) takes the rest, ~55 min: about the 3,600 s cap, which the slowest of 40 eval episodes
reaches. The model checks that with an episode-length distribution, then gives agentrl's pace on
the same config, where an eval runs on engine servers set aside at its step's weights while
training goes on (`eval.mode=aside`, `agentrl.runtime.loop.AsideEvals`).

    python benchmarks/glm52_step_model.py [--aside-servers 2 --decode-alpha 1 ...]
Goal (the issue's): <= 5 min per step on the same hardware, against the reference's ~6.5.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from _glm52 import MODELS

from agentrl.cluster.planner import HARDWARE, GiB, Layout, memory_estimate


@dataclass
class Assumptions:
    # Published (the reference run's README and run script).
    steps: int = 100
    run_hours: float = 21.0
    step_minutes: float = 6.5  # between evals (the reading that agrees with the 21 h)
    samples_per_step: int = 64  # 8 tasks x 8 samples
    in_flight: int = 128  # --async-max-concurrent-samples
    generating: float = 95.0  # "~90-100 concurrent generating requests across 32 dp ranks"
    dp_ranks: int = 32  # 8 engines x dp-attention 4
    engines: int = 8
    eval_every: int = 10
    evals: int = 11  # before training, then after steps 10, 20, ..., 100
    eval_episodes: int = 40  # 20 held-out tasks x 2 samples
    episode_cap_s: float = 3600.0
    # Assumed.
    trained_tokens_per_episode: int = 30_000  # up to the 65,536-token session
    mfu: float = 0.30  # bf16 model-FLOPs utilisation of the Megatron step
    nvme_gb_s_per_node: float = 28.0  # optimizer state streamed to node-local NVMe
    weight_sync_s: float = 20.0  # pause, FP8 block quantise, broadcast, load, resume
    episode_sigma: float = 1.0  # lognormal spread of episode wall time (heavy tail)
    decode_alpha: float = 0.5  # 0: a turn's latency ignores the engine's load; 1: grows with it
    aside_servers: int = 1  # agentrl: engines an eval takes (eval.aside_servers)


def lognormal_cdf(x: float, mean: float, sigma: float) -> float:
    if x <= 0:
        return 0.0
    mu = math.log(mean) - sigma**2 / 2
    return 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))


def expected_max(n: int, mean: float, sigma: float, cap: float) -> float:
    """E[max of n episode times], each lognormal(mean, sigma) and cut at `cap`."""
    grid = 4000
    dx = cap / grid
    return sum((1 - lognormal_cdf((i + 0.5) * dx, mean, sigma) ** n) * dx for i in range(grid))


def model(a: Assumptions) -> dict[str, float]:
    glm = MODELS["GLM-5.2"].spec()
    hw = HARDWARE["GB300"]
    train_gpus = 32  # 8 training nodes x 4 GB300
    c = glm.config
    attn = 4 * c["index_topk"] * c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * glm.num_layers  # fmt: skip
    # forward + backward (6N) + full recompute (+2N) + the old-log-prob forward (+2N), attention x3
    flops_per_token = 10 * glm.active_params() + 3 * attn
    tokens = a.samples_per_step * a.trained_tokens_per_episode
    train_s = flops_per_token * tokens / (train_gpus * hw.bf16_tflops * 1e12 * a.mfu)
    mem = memory_estimate(glm, Layout(2, 4, 4, 8, 1, 18, 20), dp=1, hw=hw, offload=True)
    offload_s = 2 * mem.optimizer_offloaded * 4 / (a.nvme_gb_s_per_node * 1e9)  # read + write, 4 GPUs
    share = a.generating / a.in_flight  # of an episode's time, waiting for a turn
    # An in_place pause holds every generating episode for the sync; the others run on.
    sync_stall_s = share * a.weight_sync_s
    step_s = a.step_minutes * 60
    # The step is bound by episode production (the training path is far shorter): a batch of
    # `samples_per_step` completes every P seconds, P = samples x T / in_flight.
    production_s = step_s - sync_stall_s
    episode_s = production_s * a.in_flight / a.samples_per_step
    train_path_s = train_s + offload_s + a.weight_sync_s
    # Evals. Published: the 21 h less 100 steps, over 11 evals. Modelled: the slowest of the 40.
    eval_published_s = (a.run_hours * 3600 - a.steps * step_s) / a.evals
    eval_modelled_s = expected_max(a.eval_episodes, episode_s, a.episode_sigma, a.episode_cap_s)
    ref_avg_s = (a.steps * step_s + a.evals * eval_published_s) / a.steps

    # agentrl: the same step between evals; an eval in between takes `aside_servers` engines at its
    # step's weights while training goes on with the rest. Engine load per dp rank decides what
    # that costs: the eval's turns on the set-aside ranks (their load averaged over the eval: the
    # 40 episodes' generating time over its length; the slowest one runs mostly alone) and the
    # training turns on fewer ranks, a turn's time slower by `decode_alpha` x (load / load before
    # - 1), on the generating share of an episode.
    ranks = a.dp_ranks / a.engines
    load_ref = a.generating / a.dp_ranks
    eval_load = a.eval_episodes * episode_s * share / (a.aside_servers * ranks * eval_modelled_s)
    eval_slow = 1 + share * a.decode_alpha * max(0.0, eval_load / load_ref - 1)
    train_slow = 1 + a.decode_alpha * (a.engines / (a.engines - a.aside_servers) - 1)
    aside_eval_s = eval_modelled_s * eval_slow
    window_s = a.eval_every * step_s * (1 + (train_slow - 1) * share)
    busy = min(1.0, aside_eval_s / window_s)  # share of the time one eval holds its servers
    ours_step_s = step_s * (1 + busy * (train_slow - 1) * share)
    wait_s = max(0.0, aside_eval_s - window_s)  # the next eval waits for the last one
    in_between = a.steps // a.eval_every - 1  # evals at steps 10..90; the last step ends the run
    ours_avg_s = (a.steps * ours_step_s + in_between * wait_s + 2 * eval_modelled_s) / a.steps
    return {
        "train compute (s)": train_s,
        "optimizer offload I/O (s)": offload_s,
        "weight sync (s)": a.weight_sync_s,
        "training path per step (s)": train_path_s,
        "sync stall of generating episodes (s)": sync_stall_s,
        "mean episode, implied (min)": episode_s / 60,
        "eval, published (min)": eval_published_s / 60,
        "eval, slowest of 40 episodes (min)": eval_modelled_s / 60,
        "reference step between evals (min)": step_s / 60,
        "reference step, run average (min)": ref_avg_s / 60,
        "ours: eval load per set-aside dp rank": eval_load,
        "ours: eval on servers set aside (min)": aside_eval_s / 60,
        "ours: time with servers aside (share)": busy,
        "ours step between evals (min)": ours_step_s / 60,
        "ours step, run average (min)": ours_avg_s / 60,
        "ours / reference, run average": ours_avg_s / ref_avg_s,
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
        print(f"  {k:40s} {v:9.2f}")
    print("what moves the result (minutes per step, run average: reference / ours):")
    for name, change in [
        ("turn latency ignores load", {"decode_alpha": 0.0}),
        ("turn latency grows with load", {"decode_alpha": 1.0}),
        ("eval takes 2 servers", {"aside_servers": 2}),
        ("2 servers, latency grows", {"aside_servers": 2, "decode_alpha": 1.0}),
        ("eval of 80 episodes, grows", {"eval_episodes": 80, "decode_alpha": 1.0}),
        ("episode sigma 0.7", {"episode_sigma": 0.7}),
        ("weight sync 60 s", {"weight_sync_s": 60.0}),
    ]:
        r = model(Assumptions(**{**a.__dict__, **change}))
        print(
            f"  {name:30s} {r['reference step, run average (min)']:5.2f} / {r['ours step, run average (min)']:5.2f}"
            f"  (between evals {r['ours step between evals (min)']:.2f})"
        )


if __name__ == "__main__":
    main()
