"""`agentrl train run --dry-run` needs no torch, transformers or peft (the `local` and `lora`
extras): a user of a remote OpenEnv environment checks a run's settings on a slim install."""

from __future__ import annotations

import json
import subprocess
import sys

BLOCK = """
import builtins, sys
real = builtins.__import__
def blocked(name, *args, **kwargs):
    if name.split(".")[0] in ("torch", "transformers", "peft"):
        raise ImportError(f"No module named {name!r} (blocked by the test)")
    return real(name, *args, **kwargs)
builtins.__import__ = blocked
from agentrl.cli import main
sys.argv = ["agentrl", *sys.argv[1:]]
main()
"""


def test_an_openenv_run_resolves_and_prints_without_torch() -> None:
    args = ["train", "run", "--set", "env.name=openenv", "--set", "env.url=http://envs.example:8000",
            "--set", "trainer.loss.objective=gspo", "--set", "trainer.lora.rank=8", "--dry-run"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", BLOCK, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    cfg = json.loads(done.stdout)
    assert cfg["env"]["name"] == "openenv" and cfg["env"]["url"] == "http://envs.example:8000"
    assert cfg["trainer"]["loss"]["objective"] == "gspo" and cfg["trainer"]["lora"]["rank"] == 8
    # A bad setting is still refused by name, torch or not.
    bad = subprocess.run([sys.executable, "-c", BLOCK, "train", "run", "--set", "trainer.lora.rank=-1", "--dry-run"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "rank must be >= 0" in bad.stdout + bad.stderr
