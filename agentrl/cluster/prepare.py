"""`prepare` and `prepare-cp` of the cluster recipes: download, validate, convert, copy.

- `download_model`: a Hugging Face repository (huggingface_hub) or a local directory, as is.
- `validate_checkpoint`: the config has the recipe's model type and architectures (by default
  `glm_moe_dsa` / `GlmMoeDsaForCausalLM`, the architecture the planner models), the expected
  layer count, no `auto_map` (the native transformers class must load it) and weights exist;
  a `ModelCheckpointError` that says what is wrong otherwise.
- `convert_to_megatron`: HF -> a megatron-core `torch_dist` checkpoint through the Megatron
  backend (`agentrl.train.megatron`: its model builder and `convert.load_hf_into`), run in that
  backend's Python >= 3.12 environment as a subprocess (`agentrl/cluster/convert_job.py`), one
  process per rank of the layout's PP x TP / EP: each reads only its own shard of the checkpoint
  (`hf_io.HFCheckpoint`, one tensor at a time), and checks the round trip tensor by tensor. This
  is the single-host path (one torchrun here); `place_conversion` works out over how many nodes
  the ranks must spread so that each node's ranks fit its host memory, `convert_argv` is one
  node's torchrun line, and `agentrl.cluster.prepare_ray` starts one per node through Ray.
- `quantize_fp8`: the block-FP8 (128 x 128) copy of the checkpoint that FP8 rollout engines
  load (`agentrl.train.megatron.fp8`), Megatron keeps BF16.
- `copy_to_local` / `copy_set_to_local`: `prepare-cp`, shared storage -> node-local disk,
  atomically (per directory / per node); `node_needs`: what each node of a plan loads.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.cluster.model import ModelSpec
from agentrl.cluster.planner import GiB, Layout, stages_of
from agentrl.errors import AgentRLError
from agentrl.train.megatron import venv

CONVERT_JOB = Path(__file__).with_name("convert_job.py")
CONVERT_MODULE = "agentrl.cluster.convert_job"
# Stands for the Megatron environment's interpreter in a node's command line: the node resolves it
# (`agentrl.train.megatron.venv.ensure()` there), since its path is per machine.
MEGATRON_PYTHON = "<megatron-venv>/bin/python"
CONVERT_PORT = 29600  # the conversion's torchrun master port on node 0 of a cluster
# A converting rank's peak RSS, measured on the 2-core CPU machine (the cluster docs): 1.76 GB for a
# 422 MB shard, of which ~0.8 GB is the process itself (torch, megatron, the model built): ~2.3x
# its shard (model shard, the round trip's load back, mapped safetensors pages) plus the process.
CONVERT_RSS_FACTOR = 2.3
CONVERT_BASE_GIB = 1.0
# The share of a node's host memory the conversion may plan for (the OS, page cache, Ray).
HOST_HEADROOM = 0.8
# Host memory per node of the vendors' reference systems, GiB (32 x 64 GiB DIMMs in a DGX H200 /
# DGX B200; two Grace CPUs of 480 GiB LPDDR5X in a GB300 NVL72 compute tray). Assumptions:
# pass the cluster's own figure with --host-memory-gib.
HOST_MEMORY_GIB = {"H100": 2048.0, "H200": 2048.0, "B200": 2048.0, "GB300": 960.0}


class ModelCheckpointError(AgentRLError):
    """A checkpoint that is not the model the recipe expects, or that failed to convert."""


def download_model(source: str, dest: Path, *, report: Callable[[str], Any] = print) -> Path:
    """A local directory is used where it is; anything else is a hub repository id."""
    if Path(source).expanduser().is_dir():
        return Path(source).expanduser()
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelCheckpointError(
            "downloading needs huggingface_hub (pip install 'agentrl[math]')"
        ) from None
    report(f"downloading {source} into {dest}")
    try:
        return Path(snapshot_download(source, local_dir=str(dest)))
    except Exception as exc:  # offline, 401/404, disk: huggingface_hub raises many types
        raise ModelCheckpointError(
            f"cannot download {source}: {type(exc).__name__}: {exc}. Give a local directory with "
            "--model-source, or set HF_ENDPOINT / HF_TOKEN"
        ) from exc


def validate_checkpoint(
    path: Path,
    *,
    num_layers: int,
    model_type: str = "glm_moe_dsa",
    architectures: list[str] | tuple[str, ...] = ("GlmMoeDsaForCausalLM",),
) -> dict[str, Any]:
    """The checkpoint's config, if it is a native `model_type` / `architectures` model of
    `num_layers` layers (the recipe's model entry says which)."""
    architectures = list(architectures)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelCheckpointError(f"{path}: no config.json; is this a Hugging Face checkpoint directory?")
    cfg = json.loads(cfg_file.read_text())
    problems = []
    if cfg.get("model_type") != model_type:
        problems.append(f"model_type is {cfg.get('model_type')!r}, expected {model_type!r}")
    if cfg.get("architectures") != architectures:
        problems.append(f"architectures is {cfg.get('architectures')!r}, expected {architectures!r}")
    if cfg.get("num_hidden_layers") != num_layers:
        problems.append(f"num_hidden_layers is {cfg.get('num_hidden_layers')!r}, this model has {num_layers}")
    if "auto_map" in cfg:
        problems.append("config has an auto_map: remote code would replace the native transformers class")
    if not any(path.glob("*.safetensors")):
        problems.append("no *.safetensors weight files")
    if problems:
        raise ModelCheckpointError(f"{path} is not the expected checkpoint: " + "; ".join(problems))
    return cfg


def convert_to_megatron(
    hf_dir: Path,
    out: Path,
    layout: Layout,
    *,
    python: str | None = None,
    dtype: str | None = None,
    timeout: float = 3600,
) -> dict[str, Any]:
    """HF -> megatron `torch_dist` at `out` with the layout's TP / PP (and uneven first / last
    stages) / EP / expert-TP, one process per rank (`conversion_ranks`); CP does not shard weights
    and torch_dist reshards on load, but every rank holds only its own stage's, TP slice's and
    experts' tensors, read one at a time from the checkpoint's safetensors. `dtype`: the
    megatron params dtype (default: the checkpoint's, bf16 for a bf16 checkpoint). The round trip (save,
    load back, export to HF names, compare) must be exact, else `ModelCheckpointError`. Returns the
    job's report: tensors converted, round-trip difference, per rank what it read and its peak RSS."""
    ranks = conversion_ranks(layout)
    py = python or str(venv.ensure())
    report = report_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = convert_argv(
        py, hf_dir, out, report, layout, nnodes=1, node_rank=0, nproc=ranks, master_addr="127.0.0.1",
        master_port=_free_port(), dtype=dtype,
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=venv.env())
    if proc.returncode != 0 or not report.exists():
        raise ModelCheckpointError(
            f"HF -> Megatron conversion of {hf_dir} failed (exit {proc.returncode}):\n"
            f"{(proc.stdout + proc.stderr)[-4000:]}"
        )
    result = json.loads(report.read_text())
    report.unlink()
    return check_report(result, hf_dir, out)


def report_path(out: Path) -> Path:
    """Where rank 0 of a conversion into `out` writes the combined report (beside `out`, on the
    same shared storage)."""
    return out.parent / f".{out.name}-report-{uuid.uuid4().hex[:6]}.json"


def convert_argv(
    python: str,
    hf_dir: Path,
    out: Path,
    report: Path,
    layout: Layout,
    *,
    nnodes: int,
    node_rank: int,
    nproc: int,
    master_addr: str,
    master_port: int | str,
    dtype: str | None = None,
) -> list[str]:
    """One node's command line of the conversion: torchrun with `nproc` of the job's ranks on this
    node (global ranks `node_rank * nproc ...`: megatron orders pipeline stages slowest, so a node
    holds whole or consecutive parts of stages), or the job alone when it has one rank."""
    cmd = [python]
    if nnodes * nproc > 1:
        cmd += ["-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}"]
        cmd += [f"--nproc-per-node={nproc}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
    cmd += ["-m", CONVERT_MODULE, "--hf", str(hf_dir), "--out", str(out), "--report", str(report)]
    cmd += ["--tp", str(layout.tp), "--pp", str(layout.pp), "--ep", str(layout.ep), "--etp", str(layout.etp)]
    if layout.first_stage_layers is not None:
        cmd += ["--first-stage-layers", str(layout.first_stage_layers)]
    if layout.last_stage_layers is not None:
        cmd += ["--last-stage-layers", str(layout.last_stage_layers)]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    return cmd


def check_report(result: dict[str, Any], hf_dir: Path, out: Path) -> dict[str, Any]:
    """The job's combined report, if the round trip was exact on every rank; else `ModelCheckpointError`."""
    if result["max_abs_diff"] != 0 or result["mismatched"] or result["not_compared"]:
        raise ModelCheckpointError(
            f"HF -> Megatron conversion of {hf_dir} does not round-trip: max |diff| {result['max_abs_diff']}, "
            f"differing {result['mismatched']}, not compared {result['not_compared']}; the checkpoint at "
            f"{out} is not usable: report this with the checkpoint's config.json"
        )
    return result


def conversion_ranks(layout: Layout) -> int:
    """Processes of the conversion job: PP x lcm(TP, EP x ETP) (megatron needs EP x ETP to divide
    TP x DP; CP is left out: it does not shard weights)."""
    return layout.pp * math.lcm(layout.tp, layout.ep * layout.etp)


def rank_shard_params(model: ModelSpec, layout: Layout) -> list[int]:
    """Parameters one conversion rank holds, per pipeline stage: its stage's TP-split weights / TP,
    the replicated ones whole, its experts (routed experts / (EP x ETP)), the embedding on the
    first stage and the LM head and final norm on the last. (MTP layers are not converted.)"""
    out = []
    stages = stages_of(model, layout)
    for s, layers in enumerate(stages):
        params = [model.layer_params(i) for i in layers]
        n = sum(p.tp for p in params) / layout.tp + sum(p.dup for p in params)
        n += sum(p.expert for p in params) / (layout.ep * layout.etp)
        if s == 0:
            n += model.embedding_params / layout.tp
        if s == len(stages) - 1:
            n += model.embedding_params / layout.tp + int(model.config["hidden_size"])
        out.append(int(n))
    return out


def param_bytes(config: dict[str, Any]) -> int:
    """Bytes per parameter of the conversion (`convert_job.checkpoint_dtype`'s rule: bf16 for a
    bf16 checkpoint, fp32 otherwise)."""
    return 2 if (config.get("dtype") or config.get("torch_dtype")) == "bfloat16" else 4


class ConvertPlacementError(ModelCheckpointError):
    """The conversion's ranks fit no number of the plan's training nodes; the message has the
    arithmetic."""


@dataclass(frozen=True)
class ConvertPlacement:
    """Over how many nodes the conversion runs and why (`explain`)."""

    ranks: int
    nodes: tuple[int, ...]  # plan nodes (the first training nodes)
    nproc_per_node: int
    shard_bytes: int  # the heaviest rank's share of the checkpoint
    heaviest_stage: int
    rank_peak_bytes: float
    host_memory_gib: float
    gpus_per_node: int | None  # None: no GPU bound (CPU ranks over gloo: local mode, one host)
    candidates: tuple[tuple[int, str], ...]  # (nodes, why not) for each smaller node count

    def explain(self, layout: Layout, bytes_per_param: int) -> list[str]:
        budget = self.host_memory_gib * HOST_HEADROOM
        per_node = self.nproc_per_node * self.rank_peak_bytes / GiB
        lines = [
            f"conversion ranks: PP{layout.pp} x lcm(TP{layout.tp}, EP{layout.ep} x ETP{layout.etp}) = {self.ranks}",
            f"per rank (heaviest: stage {self.heaviest_stage}): {_count(self.shard_bytes // bytes_per_param)} "
            f"parameters x {bytes_per_param} bytes = {_gib(self.shard_bytes)} GiB of the checkpoint; peak RSS "
            f"~{CONVERT_RSS_FACTOR} x {_gib(self.shard_bytes)} + {CONVERT_BASE_GIB:.1f} = "
            f"{_gib(self.rank_peak_bytes)} GiB",
            f"host memory per node: {self.host_memory_gib:.0f} GiB x {HOST_HEADROOM:.0%} = {budget:.0f} GiB"
            + (
                ""
                if self.gpus_per_node is None
                else f"; one rank per GPU: <= {self.gpus_per_node} ranks per node"
            ),
        ]
        lines += [f"  {n} node{'s' if n > 1 else ''}: {why}" for n, why in self.candidates]
        lines.append(
            f"nodes: {len(self.nodes)} x {self.nproc_per_node} ranks, {self.nproc_per_node} x "
            f"{self.rank_peak_bytes / GiB:.2f} = {per_node:.1f} GiB <= {budget:.0f} GiB per node"
        )
        return lines


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}e9" if n >= 1e8 else f"{n:,.0f}"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}" if n >= 0.01 * GiB else f"{n / GiB:.5f}"


def place_conversion(
    model: ModelSpec,
    layout: Layout,
    *,
    train_nodes: list[int],
    host_memory_gib: float,
    gpus_per_node: int | None,
    bytes_per_param: int = 2,
    nodes: int | None = None,
    scope: str | None = None,
) -> ConvertPlacement:
    """The fewest of the plan's training nodes (a divisor of the rank count, at most all of them)
    whose ranks fit each node's host memory (and, with GPUs, one rank per GPU); `nodes` asks for
    a given count, checked the same way. `ConvertPlacementError` with the arithmetic otherwise
    (`scope` names where it was placed in that message, default the plan's training nodes)."""
    ranks = conversion_ranks(layout)
    shards = [p * bytes_per_param for p in rank_shard_params(model, layout)]
    stage = max(range(len(shards)), key=lambda s: shards[s])
    peak = CONVERT_RSS_FACTOR * shards[stage] + CONVERT_BASE_GIB * GiB
    budget = host_memory_gib * HOST_HEADROOM * GiB
    tried: list[tuple[int, str]] = []
    counts = [nodes] if nodes is not None else [n for n in range(1, ranks + 1) if ranks % n == 0]
    for n in counts:
        per = ranks // n if ranks % n == 0 else 0
        if n < 1 or ranks % n:
            why = f"{ranks} ranks do not divide over {n} nodes"
        elif n > len(train_nodes):
            why = f"the plan has {len(train_nodes)} training nodes"
        elif gpus_per_node is not None and per > gpus_per_node:
            why = f"{per} ranks per node > {gpus_per_node} GPUs"
        elif per * peak > budget:
            why = f"{per} ranks x {peak / GiB:.2f} GiB = {per * peak / GiB:.1f} GiB > {budget / GiB:.0f} GiB"
        else:
            return ConvertPlacement(
                ranks, tuple(train_nodes[:n]), per, int(shards[stage]), stage, peak, host_memory_gib,
                gpus_per_node, tuple(tried),
            )  # fmt: skip
        tried.append((n, why))
        if n > len(train_nodes):
            break
    detail = "; ".join(f"{n} node{'s' if n > 1 else ''}: {why}" for n, why in tried)
    where = scope or f"the plan's {len(train_nodes)} training nodes"
    raise ConvertPlacementError(
        f"the conversion's {ranks} ranks ({layout.short()}) fit no placement on {where} ({detail}): use "
        "more nodes (--num-nodes), a larger --host-memory-gib if the nodes have it, or more pipeline "
        "stages (--pp)"
    )


def node_needs(plan: Any) -> dict[int, list[str]]:
    """What each node of a plan (`recipe.ClusterPlan`) loads from node-local disk: a training
    node the Megatron checkpoint, a rollout node the checkpoint its engines serve (block-FP8 with
    FP8 rollout, else the HF one); a colocated node both."""
    rollout = "fp8" if plan.fp8_rollout else "hf"
    out: dict[int, list[str]] = {}
    for n in range(plan.options.num_nodes):
        kinds = []
        if n in plan.train_nodes:
            kinds.append("megatron")
        if n in plan.rollout_nodes:
            kinds.append(rollout)
        if kinds:
            out[n] = kinds
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quantize_fp8(hf_dir: Path, out: Path) -> int:
    """Write the block-FP8 rollout checkpoint of `hf_dir` into `out` (config gets the
    `quantization_config` SGLang reads); returns how many weights were quantised."""
    import torch
    from safetensors.torch import load_file, save_file

    from agentrl.train.megatron.fp8 import BLOCK, quantize_named

    tmp = out.parent / f".{out.name}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True)
    count = 0
    try:
        for f in sorted(hf_dir.glob("*.safetensors")):
            named = load_file(str(f))
            q = dict(quantize_named(named.items(), dtype=torch.bfloat16))
            count += sum(1 for k in q if k.endswith("weight_scale_inv"))
            save_file(q, str(tmp / f.name), metadata={"format": "pt"})
        for f in hf_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        cfg = json.loads((hf_dir / "config.json").read_text())
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        }
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return count


def copy_to_local(src: Path, dest: Path) -> Path:
    """`prepare-cp`: copy a prepared directory to node-local disk; the copy appears whole or not
    at all (written beside `dest`, then renamed)."""
    if not src.is_dir():
        raise ModelCheckpointError(f"{src} does not exist: run `prepare` first")
    tmp = dest.parent / f".{dest.name}-{uuid.uuid4().hex[:6]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(src, tmp, symlinks=False)
        _replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def copy_set_to_local(pairs: list[tuple[Path, Path]]) -> list[dict[str, Any]]:
    """`prepare-cp` of one node: every (source, destination) pair, all or nothing: each source is
    copied beside its destination first; only when every copy is whole are they renamed into place
    (a failure leaves the node's earlier copies as they were). Per pair: files, bytes, seconds."""
    missing = [str(src) for src, _ in pairs if not src.is_dir()]
    if missing:
        raise ModelCheckpointError(f"{', '.join(missing)} does not exist: run `prepare` first")
    staged: list[tuple[Path, Path]] = []
    out = []
    try:
        for src, dest in pairs:
            t0 = time.monotonic()
            tmp = dest.parent / f".{dest.name}-{uuid.uuid4().hex[:6]}"
            dest.parent.mkdir(parents=True, exist_ok=True)
            staged.append((tmp, dest))
            shutil.copytree(src, tmp, symlinks=False)
            files = [f for f in tmp.rglob("*") if f.is_file()]
            out.append({
                "source": str(src), "dest": str(dest), "files": len(files),
                "bytes": sum(f.stat().st_size for f in files), "seconds": round(time.monotonic() - t0, 3),
            })  # fmt: skip
        for tmp, dest in staged:
            _replace_dir(tmp, dest)
    finally:
        for tmp, _ in staged:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _replace_dir(tmp: Path, dest: Path) -> None:
    if dest.exists():
        old = dest.parent / f".{dest.name}-old-{uuid.uuid4().hex[:6]}"
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use a recipe's launcher: python recipes/<recipe>.py prepare --help")
