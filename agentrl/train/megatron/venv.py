"""The Python >= 3.12 virtual environment the Megatron backend runs in.

megatron-core >= 0.17 needs Python >= 3.12, and 0.19 is the first release with DSA index sharing
(`dsa_indexer_topk_freq`); the project's main environment is Python 3.11 (its CPU torch wheel is
on local disk). So the Megatron backend lives in a second environment: Python 3.12 (found on PATH
or under pyenv), torch from the registry (a CUDA build, which also runs on a CPU), megatron-core
0.19.x and agentrl's own runtime dependencies, read from pyproject.toml (`dependencies` and the
`local` and `megatron` extras), so there is one list of requirements. agentrl itself is not
installed there: commands run with the source tree on PYTHONPATH.

The environment is built once into `$AGENTRL_CACHE_DIR/megatron-venv-<hash>` (default
~/.cache/agentrl), the hash covering the requirements and the interpreter version: it is built in a
scratch directory and renamed into place when megatron-core and transformers import, so an
interrupted or concurrent build never leaves a half-made one. `make test` runs
`python -m agentrl.train.megatron.venv`, which prints the interpreter's path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

from agentrl.errors import AgentRLError

ROOT = Path(__file__).resolve().parents[3]
EXTRAS = ("local", "megatron")
# What a finished environment must import (DSA index sharing is megatron-core >= 0.19).
_PROBE = (
    "import megatron.core, transformers, torch;"
    "from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer;"
    "from transformers import GlmMoeDsaForCausalLM;"
    "print(megatron.core.__version__, transformers.__version__, torch.__version__)"
)


class VenvError(AgentRLError):
    """The Megatron environment could not be built."""


def requirements(pyproject: Path | None = None) -> list[str]:
    """agentrl's runtime requirements plus the `local` and `megatron` extras."""
    path = pyproject or ROOT / "pyproject.toml"
    if not path.exists():
        raise VenvError(f"{path} not found: the Megatron environment is built from a source checkout")
    project = tomllib.loads(path.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return reqs


def find_python312() -> str | None:
    """A Python >= 3.12 interpreter with `venv`: python3.13 / python3.12 on PATH, then pyenv's."""
    candidates = [shutil.which("python3.13"), shutil.which("python3.12")]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(str(p) for p in pyenv_root.glob("versions/3.1[2-9]*/bin/python3"))
    for exe in filter(None, candidates):
        probe = subprocess.run(
            [exe, "-c", "import sys, venv; assert sys.version_info >= (3, 12)"],
            capture_output=True,
            timeout=60,
        )
        if probe.returncode == 0:
            return exe
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE_DIR", Path.home() / ".cache" / "agentrl"))


def venv_dir(base_python: str, reqs: list[str]) -> Path:
    version = subprocess.run(
        [base_python, "-c", "import sys; print(sys.version.split()[0])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    key = hashlib.sha256("\n".join([version, *sorted(reqs)]).encode()).hexdigest()[:12]
    return cache_dir() / f"megatron-venv-{key}"


def build(
    venv: Path,
    installs: list[list[str]],
    *,
    base: str | None = None,
    probe: str | None = None,
    pip_timeout: float = 1800,
) -> Path:
    """A Python >= 3.12 virtual environment at `venv`, built once: into a scratch directory, with
    one `pip install` per entry of `installs`, then `probe` (Python code that must run there), then
    renamed into place with a `ready` marker, so an interrupted or concurrent build never leaves a
    half-made one. Returns its interpreter. Raises `VenvError` (pip's or the probe's output in the
    message) when no Python >= 3.12 exists or a step fails. The Megatron environment and the
    Harbor test's environment are both built here."""
    if (venv / "ready").exists():
        return venv / "bin" / "python"
    base = base or find_python312()
    if base is None:
        raise VenvError("no Python >= 3.12 found (python3.12 on PATH or under pyenv)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    scratch = venv.parent / f".{venv.name}-{uuid.uuid4().hex[:8]}"
    try:
        subprocess.run([base, "-m", "venv", str(scratch)], check=True, capture_output=True, timeout=300)
        py = str(scratch / "bin" / "python")
        for args in installs:
            pip = subprocess.run(
                [py, "-m", "pip", "install", "-q", *args], capture_output=True, text=True, timeout=pip_timeout
            )
            if pip.returncode != 0:
                raise VenvError(f"pip install {' '.join(args)} failed:\n{(pip.stdout + pip.stderr)[-3000:]}")
        marker = "\n".join(a for args in installs for a in args) + "\n"
        if probe is not None:
            ran = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=600)
            if ran.returncode != 0:
                raise VenvError(f"the new environment fails its import probe:\n{ran.stderr[-3000:]}")
            marker = ran.stdout
        (scratch / "ready").write_text(marker)
        try:
            scratch.rename(venv)
        except OSError:  # another build finished first; use its copy
            if not (venv / "ready").exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return venv / "bin" / "python"


def ensure(*, log: bool = True) -> Path:
    """The Megatron environment's interpreter, building the environment first if needed.
    Raises `VenvError` when no Python >= 3.12 exists or pip fails (its output in the message)."""
    base = find_python312()
    if base is None:
        raise VenvError(
            "no Python >= 3.12 found (python3.12 on PATH or under pyenv): megatron-core 0.19 needs it"
        )
    reqs = requirements()
    venv = venv_dir(base, reqs)
    if (venv / "ready").exists():
        return venv / "bin" / "python"
    if log:
        print(f"building the Megatron environment in {venv} (once; ~1-2 minutes, ~5.5 GB)", file=sys.stderr)
    python = build(venv, [["--upgrade", "pip"], reqs], base=base, probe=_PROBE)
    # Environments of earlier requirements are 5.5 GB each and nothing uses them any more.
    for old in venv.parent.glob("megatron-venv-*"):
        if old != venv and (old / "ready").exists():
            shutil.rmtree(old, ignore_errors=True)
    return python


def env(threads: int = 1) -> dict[str, str]:
    """Environment variables for a command in the Megatron environment: the source tree on
    PYTHONPATH, few threads (tests share two cores), no CUDA device lookups on a CPU machine."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    out.setdefault("OMP_NUM_THREADS", str(threads))
    out.setdefault("TORCH_NUM_THREADS", str(threads))
    out.pop("VIRTUAL_ENV", None)
    return out


def main() -> int:
    """Print the interpreter's path, building the environment if needed. Without any Python
    >= 3.12 this only says so (exit 0): the Megatron tests then skip with the same reason."""
    if find_python312() is None:
        print("megatron environment: no Python >= 3.12 found; the Megatron tests will skip", file=sys.stderr)
        return 0
    try:
        print(ensure())
    except VenvError as exc:
        print(f"megatron environment: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
