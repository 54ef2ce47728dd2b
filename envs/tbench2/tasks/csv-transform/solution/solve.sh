#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv
from collections import defaultdict
from decimal import Decimal

units = defaultdict(int)
revenue = defaultdict(Decimal)
with open("/app/sales.csv", newline="") as fh:
    for row in csv.DictReader(fh):
        region = row["region"].strip().title()
        units[region] += int(row["units"])
        revenue[region] += int(row["units"]) * Decimal(row["unit_price"])

with open("/app/summary.csv", "w", newline="") as fh:
    fh.write("region,units,revenue\n")
    for region in sorted(revenue, key=revenue.get, reverse=True):
        fh.write(f"{region},{units[region]},{revenue[region]:.2f}\n")
PY
