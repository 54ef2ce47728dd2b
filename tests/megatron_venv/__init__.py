"""Runs the Megatron backend's checks in its own Python 3.12 environment.

The main test suite is Python 3.11; megatron-core 0.19 needs 3.12. `agentrl.train.megatron.venv`
builds that environment once (cached; `make test` builds it first), and `run_case` runs one case
of `tests/megatron_venv/cases.py` there (under torchrun for several ranks) and returns the JSON it
wrote: the numbers the tests in `tests/test_megatron.py` assert on.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from agentrl.train.megatron import venv

CASES = Path(__file__).with_name("cases.py")


def python() -> Path:
    """The environment's interpreter (skips the test when no Python >= 3.12 exists here)."""
    if venv.find_python312() is None:
        pytest.skip(
            "no Python >= 3.12 found (python3.12 on PATH or under pyenv): megatron-core 0.19 needs it"
        )
    return venv.ensure()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_case(
    name: str, tmp: Path, *args: str, nproc: int = 1, timeout: float = 900, interpreter: str | None = None
) -> dict[str, Any]:
    """Run case `name` (in `nproc` processes) and return its JSON result. `interpreter`: a Python
    that already has megatron-core (the GPU machine's); default: the Megatron environment's."""
    py = interpreter or python()
    out = tmp / f"{name}-{uuid.uuid4().hex[:6]}.json"
    cmd = [str(py)]
    if nproc > 1:
        cmd += [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
        ]
    cmd += [str(CASES), name, "--out", str(out), "--tmp", str(tmp), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=venv.env())
    if proc.returncode != 0 or not out.exists():
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-20000:])
        raise AssertionError(f"case {name} failed with exit status {proc.returncode} (output above)")
    return json.loads(out.read_text())
