"""`prepare` and `prepare-cp` of the GLM-5.2 recipes: download, validate, convert, copy.

- `download_model`: a Hugging Face repository (huggingface_hub) or a local directory, as is.
- `validate_checkpoint`: the config says `glm_moe_dsa` / `GlmMoeDsaForCausalLM`, the expected
  layer count, no `auto_map` (the native transformers class must load it) and weights exist;
  a `CheckpointError` that says what is wrong otherwise.
- `convert_to_megatron`: HF -> a megatron-core `torch_dist` checkpoint through the Megatron
  backend (`agentrl.train.megatron`: its model builder and `convert.load_hf_into`), run in that
  backend's Python >= 3.12 environment as a subprocess (`agentrl/cluster/convert_job.py`), one
  process per rank of the layout's PP x TP / EP: each reads only its own shard of the checkpoint
  (`hf_io.HFCheckpoint`, one tensor at a time), and checks the round trip tensor by tensor.
- `quantize_fp8`: the block-FP8 (128 x 128) copy of the checkpoint that FP8 rollout engines
  load (`agentrl.train.megatron.fp8`), Megatron keeps BF16.
- `copy_to_local`: `prepare-cp`, shared storage -> node-local disk, atomically.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.cluster.planner import Layout
from agentrl.errors import AgentRLError

CONVERT_JOB = Path(__file__).with_name("convert_job.py")


class CheckpointError(AgentRLError):
    """A checkpoint that is not the model the recipe expects, or that failed to convert."""


def download_model(source: str, dest: Path, *, report: Callable[[str], Any] = print) -> Path:
    """A local directory is used where it is; anything else is a hub repository id."""
    if Path(source).expanduser().is_dir():
        return Path(source).expanduser()
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError("downloading needs huggingface_hub (pip install 'agentrl[math]')") from None
    report(f"downloading {source} into {dest}")
    try:
        return Path(snapshot_download(source, local_dir=str(dest)))
    except Exception as exc:  # offline, 401/404, disk: huggingface_hub raises many types
        raise CheckpointError(
            f"cannot download {source}: {type(exc).__name__}: {exc}. Give a local directory with "
            "--model-source, or set HF_ENDPOINT / HF_TOKEN"
        ) from exc


def validate_checkpoint(path: Path, *, num_layers: int) -> dict[str, Any]:
    """The checkpoint's config, if it is a native `glm_moe_dsa` of `num_layers` layers."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json; is this a Hugging Face checkpoint directory?")
    cfg = json.loads(cfg_file.read_text())
    problems = []
    if cfg.get("model_type") != "glm_moe_dsa":
        problems.append(f"model_type is {cfg.get('model_type')!r}, expected 'glm_moe_dsa'")
    if cfg.get("architectures") != ["GlmMoeDsaForCausalLM"]:
        problems.append(f"architectures is {cfg.get('architectures')!r}, expected ['GlmMoeDsaForCausalLM']")
    if cfg.get("num_hidden_layers") != num_layers:
        problems.append(f"num_hidden_layers is {cfg.get('num_hidden_layers')!r}, this model has {num_layers}")
    if "auto_map" in cfg:
        problems.append("config has an auto_map: remote code would replace the native transformers class")
    if not any(path.glob("*.safetensors")):
        problems.append("no *.safetensors weight files")
    if problems:
        raise CheckpointError(f"{path} is not the expected checkpoint: " + "; ".join(problems))
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
    megatron params dtype (default: the checkpoint's, bf16 for GLM-5.2). The round trip (save,
    load back, export to HF names, compare) must be exact, else `CheckpointError`. Returns the
    job's report: tensors converted, round-trip difference, per rank what it read and its peak RSS."""
    from agentrl.train.megatron import venv

    ranks = conversion_ranks(layout)
    py = python or str(venv.ensure())
    report = out.parent / f".{out.name}-report-{uuid.uuid4().hex[:6]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [py]
    if ranks > 1:
        cmd += ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1"]
        cmd += [f"--master-port={_free_port()}"]
    cmd += [str(CONVERT_JOB), "--hf", str(hf_dir), "--out", str(out), "--report", str(report)]
    cmd += ["--tp", str(layout.tp), "--pp", str(layout.pp), "--ep", str(layout.ep), "--etp", str(layout.etp)]
    if layout.first_stage_layers is not None:
        cmd += ["--first-stage-layers", str(layout.first_stage_layers)]
    if layout.last_stage_layers is not None:
        cmd += ["--last-stage-layers", str(layout.last_stage_layers)]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=venv.env())
    if proc.returncode != 0 or not report.exists():
        raise CheckpointError(
            f"HF -> Megatron conversion of {hf_dir} failed (exit {proc.returncode}):\n"
            f"{(proc.stdout + proc.stderr)[-4000:]}"
        )
    result = json.loads(report.read_text())
    report.unlink()
    if result["max_abs_diff"] != 0 or result["mismatched"] or result["not_compared"]:
        raise CheckpointError(
            f"HF -> Megatron conversion of {hf_dir} does not round-trip: max |diff| {result['max_abs_diff']}, "
            f"differing {result['mismatched']}, not compared {result['not_compared']}; the checkpoint at "
            f"{out} is not usable: report this with the checkpoint's config.json"
        )
    return result


def conversion_ranks(layout: Layout) -> int:
    """Processes of the conversion job: PP x lcm(TP, EP x ETP) (megatron needs EP x ETP to divide
    TP x DP; CP is left out: it does not shard weights)."""
    return layout.pp * math.lcm(layout.tp, layout.ep * layout.etp)


def _free_port() -> int:
    import socket

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
        raise CheckpointError(f"{src} does not exist: run `prepare` first")
    tmp = dest.parent / f".{dest.name}-{uuid.uuid4().hex[:6]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(src, tmp, symlinks=False)
        _replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


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
    sys.exit("use the recipes: python recipes/glm52_tbench2.py prepare --help")
