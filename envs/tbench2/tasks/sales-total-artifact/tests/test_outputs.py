"""Checks the artifacts in the verifier's own environment: the agent's /app/out, nothing else."""

from pathlib import Path

OUT = Path("/app/out")


def test_total():
    assert (OUT / "total.txt").read_text().strip() == "7967"


def test_count():
    assert (OUT / "count.txt").read_text().strip() == "37"
