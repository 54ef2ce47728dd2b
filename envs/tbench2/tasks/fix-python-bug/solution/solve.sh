#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
from pathlib import Path

path = Path("/app/inventory/core.py")
src = path.read_text()
fixes = [
    # Adding an existing item must accumulate its quantity.
    ("            self._items[name] = [quantity, price_cents]\n        else:",
     "            self._items[name] = [self._items[name][0] + quantity, price_cents]\n        else:"),
    # An item whose stock reaches exactly zero disappears.
    ("        if self._items[name][0] < 0:", "        if self._items[name][0] == 0:"),
    # "At most threshold" includes the threshold.
    ("if qty < threshold)", "if qty <= threshold)"),
]
for old, new in fixes:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
path.write_text(src)
PY
python3 -m pytest -q -p no:cacheprovider tests
