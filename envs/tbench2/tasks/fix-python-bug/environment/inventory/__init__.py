from inventory.core import Inventory, OutOfStockError

__all__ = ["Inventory", "OutOfStockError"]
