#!/bin/bash
set -euo pipefail
sqlite3 -csv /app/shop.db "
SELECT c.name, printf('%.2f', SUM(o.amount_cents) / 100.0)
FROM orders AS o JOIN customers AS c ON c.id = o.customer_id
WHERE o.status = 'shipped'
GROUP BY c.id
ORDER BY SUM(o.amount_cents) DESC
LIMIT 3;" > /app/top_customers.csv
