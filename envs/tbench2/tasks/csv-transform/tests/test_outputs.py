"""/app/summary.csv must aggregate the sales per normalised region, highest revenue first."""

import hashlib
from pathlib import Path

SALES = Path("/app/sales.csv")
SUMMARY = Path("/app/summary.csv")
SALES_SHA256 = "44cac84b45480afb0a0ceb93f59fe9fe4dee17ceee31eab3e8c55b4ad594dcfd"
EXPECTED = [
    "region,units,revenue",
    "West,273,1775.77",
    "East,347,1755.99",
    "Central,248,1569.57",
    "South,198,1178.95",
    "North,101,716.30",
]


def _lines() -> list[str]:
    assert SUMMARY.is_file(), f"{SUMMARY} does not exist"
    return [line.rstrip("\r") for line in SUMMARY.read_text().splitlines() if line.strip()]


def test_header():
    assert _lines()[0] == EXPECTED[0]


def test_rows():
    assert _lines()[1:] == EXPECTED[1:]


def test_input_unchanged():
    assert hashlib.sha256(SALES.read_bytes()).hexdigest() == SALES_SHA256
