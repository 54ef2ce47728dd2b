#!/bin/bash
set -euo pipefail
cat > /app/config.json <<'JSON'
{
  "service": "inventory-api",
  "server": {
    "host": "0.0.0.0",
    "port": 8080,
    "workers": 4
  },
  "database": {
    "url": "postgresql://inventory@db/inventory",
    "pool_size": 10,
    "timeout_sec": 5.5
  },
  "features": ["search", "export", "audit-log"],
  "debug": false
}
JSON
python3 -m json.tool /app/config.json > /dev/null
