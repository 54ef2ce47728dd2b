import pytest
from inventory import Inventory, OutOfStockError


def test_add_new_item():
    inv = Inventory()
    inv.add("bolt", 10, 25)
    assert inv.quantity("bolt") == 10


def test_adding_twice_accumulates_quantity():
    inv = Inventory()
    inv.add("bolt", 10, 25)
    inv.add("bolt", 5, 30)
    assert inv.quantity("bolt") == 15
    assert inv.total_value_cents() == 15 * 30


def test_remove_to_zero_drops_item():
    inv = Inventory()
    inv.add("nut", 3, 5)
    inv.remove("nut", 3)
    assert inv.names() == []


def test_remove_too_many_raises():
    inv = Inventory()
    inv.add("nut", 3, 5)
    with pytest.raises(OutOfStockError):
        inv.remove("nut", 4)


def test_low_stock_includes_threshold():
    inv = Inventory()
    inv.add("washer", 2, 1)
    inv.add("screw", 50, 2)
    inv.add("rivet", 1, 3)
    assert inv.low_stock(2) == ["rivet", "washer"]
