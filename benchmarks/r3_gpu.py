"""Rollout routing replay (R3) on a GPU: how far the Megatron trainer's log-probs are from the
engine's that sampled the tokens, with the trainer's own MoE routing and with the engine's routes
replayed (`trainer.megatron.routing_replay`), side by side in one run.

The engine is the real serving path: `agentrl engine serve --enable-return-routed-experts` (the
transformers model in bf16 on `--engine-device`), asked over HTTP as SGLang is asked
(`/generate` with `return_logprob`, `logprob_start_len` 0 and `return_routed_experts`; the routes
decoded by `agentrl.engine.routes`, as the SGLang client decodes them). The trainer is the bf16
Megatron trainer (megatron's DDP and distributed optimizer on a GPU) built twice on the same
initial weights, once with `routing_replay=false` and once with `true`. Nothing is perturbed: the
two differ only by their own kernels and precision, as an inference engine and a trainer do.

    PYTHONPATH=.:$SITE python benchmarks/r3_gpu.py --engine-device cuda:0 --json r3.json
    python benchmarks/r3_gpu.py --device cpu --tiny          # the code path, on the CPU

Printed per routing: mean, p99 and max |trainer - engine| over the probe's predicted tokens, and
the same on the tokens whose log-prob replay moved by more than 1e-3 (where routing differed).
"""

from __future__ import annotations

import os
import sys

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse
import copy
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from megatron_gpu import (
    free_port,
    hf_model,
    model_config,
    parity,
    post,
    random_samples,
    start_engine,
    wait_engine,
    write_engine_model,
)

from agentrl.engine.routes import routes_of_reply
from agentrl.episode.sample import Sample
from agentrl.train.config import TrainConfig


def engine_rows(url: str, samples: list[Sample], layers: int) -> list[tuple[list[float], Any]]:
    """Per sample: the engine's log-probs of tokens[1:] and its routes of tokens[:-1] (the positions
    that predict them), from one prefill as SGLang answers it."""
    out = []
    for s in samples:
        body = {
            "input_ids": s.tokens,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "return_routed_experts": True,
        }
        reply = post(url + "/generate", body)
        logp = [float(e[0]) for e in reply["meta_info"]["input_token_logprobs"][1:]]
        routes = routes_of_reply(reply, len(s.tokens), layers)  # input + 1 output - 1
        out.append((logp, routes[: len(s.tokens) - 1]))
    return out


def trainer_logprobs(
    cfg: Any, hf_state: dict[str, Any], samples: list[Sample], replay: bool, args: Any
) -> list[list[float]]:
    from agentrl.algo import LossConfig
    from agentrl.train.megatron.settings import MegatronSettings
    from agentrl.train.megatron.trainer import MegatronTrainer

    on_gpu = args.device == "cuda"
    settings = MegatronSettings(
        params_dtype="bfloat16" if on_gpu else "float32",
        ddp="megatron" if on_gpu else "local",
        distributed_optimizer=on_gpu,
        routing_replay=replay,
    )
    config = TrainConfig(
        max_tokens_per_micro_batch=args.mb_tokens, loss=LossConfig(use_tis=True, tis_clip=2.0)
    )
    tr = MegatronTrainer(cfg, config, settings, hf_state=hf_state)
    keep: dict[int, list[float]] = {}
    parity(tr, None, samples, keep)
    del tr
    if on_gpu:
        torch.cuda.empty_cache()
    return [keep[i] for i in range(len(samples))]


def stats(d: torch.Tensor) -> dict[str, float]:
    if d.numel() == 0:
        return {"tokens": 0}
    return {
        "tokens": int(d.numel()),
        "mean_abs": float(d.mean()),
        "p99_abs": float(torch.quantile(d, 0.99)),
        "max_abs": float(d.max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the CI test model's shape (for --device cpu)")
    parser.add_argument("--engine-device", default=None, help="default: cuda:0 on a GPU host, else cpu")
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--probe-len", type=int, default=320, help="tokens a sample (> the DSA top-k)")
    parser.add_argument("--mb-tokens", type=int, default=4096)
    parser.add_argument("--json")
    # The proxy model's shape, as benchmarks/megatron_gpu.py builds it.
    parser.add_argument("--shape", choices=["small", "glm52"], default="small")
    for flag in (
        "--vocab",
        "--layers",
        "--experts",
        "--experts-per-token",
        "--hidden",
        "--index-topk",
        "--index-topk-freq",
    ):
        parser.add_argument(flag, type=int, default=None)
    parser.add_argument("--dense-layers", type=int, default=1)
    args = parser.parse_args()
    if args.vocab is None:
        args.vocab = 128 if args.tiny else 16384
    if args.index_topk_freq is None:
        args.index_topk_freq = 2
    if args.tiny and args.probe_len == 320:
        args.probe_len = 48
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
    engine_device = args.engine_device or ("cuda:0" if on_gpu else "cpu")
    cfg = model_config(args)
    hf = hf_model(cfg)
    layers = cfg.num_hidden_layers
    samples = random_samples(cfg, args.samples, args.probe_len, seed=11)
    workdir = Path(tempfile.mkdtemp(prefix="r3-"))
    result: dict[str, Any] = {
        "args": vars(args),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "engine_device": engine_device,
    }
    try:
        # The engine's weights in its own dtype (an inference engine serves bf16).
        write_engine_model(copy.deepcopy(hf).to(getattr(torch, args.engine_dtype)), workdir / "model")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_engine(
            workdir / "model", port, engine_device, extra=["--enable-return-routed-experts"]
        )
        try:
            wait_engine(server, url)
            t0 = time.perf_counter()
            rows = engine_rows(url, samples, layers)
            result["engine_seconds"] = time.perf_counter() - t0
        finally:
            server.terminate()
            server.wait(30)
        engine_logp = torch.tensor([x for lp, _ in rows for x in lp])
        moe = [i for i in range(layers) if i >= cfg.first_k_dense_replace]
        for s, (_, routes) in zip(samples, rows, strict=True):
            s.routed_experts = routes
        result["routed"] = {"tokens": int(engine_logp.numel()), "moe_layers": moe}
        state = hf.state_dict()
        own = torch.tensor([x for row in trainer_logprobs(cfg, state, samples, False, args) for x in row])
        replayed = torch.tensor([x for row in trainer_logprobs(cfg, state, samples, True, args) for x in row])
        moved = (replayed - own).abs() > 1e-3  # tokens where the engine's routes changed the trainer's
        result["tokens_moved_by_replay"] = int(moved.sum())
        for name, logp in (("own_routing", own), ("replayed", replayed)):
            d = (logp - engine_logp).abs()
            result[name] = {"all": stats(d), "moved_tokens": stats(d[moved])}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
