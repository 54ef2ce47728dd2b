"""A small in-memory stock ledger."""


class OutOfStockError(ValueError):
    """Raised when removing more units than are in stock."""


class Inventory:
    def __init__(self):
        # name -> [quantity, unit price in cents]
        self._items = {}

    def add(self, name, quantity, price_cents):
        """Add `quantity` units of `name`; the latest price wins."""
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        if name in self._items:
            self._items[name] = [quantity, price_cents]
        else:
            self._items[name] = [quantity, price_cents]

    def remove(self, name, quantity):
        """Remove `quantity` units; an item whose stock reaches zero disappears."""
        if name not in self._items or self._items[name][0] < quantity:
            raise OutOfStockError(f"not enough {name!r} in stock")
        self._items[name][0] -= quantity
        if self._items[name][0] < 0:
            del self._items[name]

    def quantity(self, name):
        return self._items.get(name, [0, 0])[0]

    def names(self):
        return sorted(self._items)

    def total_value_cents(self):
        return sum(qty * price for qty, price in self._items.values())

    def low_stock(self, threshold):
        """Names of items with at most `threshold` units, alphabetically."""
        return sorted(name for name, (qty, _) in self._items.items() if qty < threshold)
