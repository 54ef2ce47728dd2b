"""/app/top_customers.csv must list the top 3 customers by shipped revenue, highest first."""

import csv
import sqlite3
from pathlib import Path

OUT = Path("/app/top_customers.csv")
EXPECTED = [
    ["Alan Turing", "15691.48"],
    ["Ken Thompson", "15019.62"],
    ["Frances Allen", "14948.43"],
]


def test_rows_match():
    assert OUT.is_file(), f"{OUT} does not exist"
    rows = [row for row in csv.reader(OUT.read_text().splitlines()) if row]
    assert [[cell.strip() for cell in row] for row in rows] == EXPECTED


def test_database_untouched():
    db = sqlite3.connect("file:/app/shop.db?mode=ro", uri=True)
    try:
        assert db.execute("SELECT COUNT(*), SUM(amount_cents) FROM orders").fetchone() == (200, 23927752)
        assert db.execute("SELECT COUNT(*) FROM customers").fetchone() == (12,)
    finally:
        db.close()
