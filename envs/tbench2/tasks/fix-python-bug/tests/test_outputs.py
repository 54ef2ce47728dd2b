"""The inventory package must behave as its own tests and docstrings say, tests left untouched."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, "/app")

from inventory import Inventory, OutOfStockError

VISIBLE_TESTS = Path("/app/tests/test_core.py")
VISIBLE_TESTS_SHA256 = "0b56a36a73323c6c0c8af4ee769b32fbf2957e19e9f8c118e812d7fe6f4a81af"


def test_visible_tests_unchanged():
    assert hashlib.sha256(VISIBLE_TESTS.read_bytes()).hexdigest() == VISIBLE_TESTS_SHA256


def test_visible_tests_pass():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd="/app",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_add_accumulates_and_takes_latest_price():
    inv = Inventory()
    inv.add("gear", 4, 100)
    inv.add("gear", 6, 120)
    inv.add("gear", 1, 90)
    assert inv.quantity("gear") == 11
    assert inv.total_value_cents() == 11 * 90


def test_partial_remove_keeps_item():
    inv = Inventory()
    inv.add("spring", 5, 7)
    inv.remove("spring", 2)
    assert inv.quantity("spring") == 3
    assert inv.names() == ["spring"]


def test_remove_exactly_all_drops_item_and_value():
    inv = Inventory()
    inv.add("spring", 5, 7)
    inv.add("cog", 1, 300)
    inv.remove("spring", 5)
    assert inv.names() == ["cog"]
    assert inv.quantity("spring") == 0
    assert inv.total_value_cents() == 300
    assert inv.low_stock(0) == []


def test_remove_unknown_or_too_many_raises():
    inv = Inventory()
    inv.add("cog", 1, 300)
    with pytest.raises(OutOfStockError):
        inv.remove("axle", 1)
    with pytest.raises(OutOfStockError):
        inv.remove("cog", 2)
    assert inv.quantity("cog") == 1


def test_low_stock_boundary():
    inv = Inventory()
    inv.add("a", 3, 1)
    inv.add("b", 4, 1)
    inv.add("c", 2, 1)
    assert inv.low_stock(3) == ["a", "c"]
    assert inv.low_stock(1) == []


def test_add_rejects_non_positive_quantity():
    with pytest.raises(ValueError):
        Inventory().add("x", 0, 1)
