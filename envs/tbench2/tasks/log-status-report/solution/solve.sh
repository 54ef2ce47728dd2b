#!/bin/bash
set -euo pipefail
LOG=/app/logs/requests.jsonl
jq -r '.status' "$LOG" | sort | uniq -c | awk '{print $2, $1}' | sort -k2,2nr -k1,1n > /app/report.txt
jq -r 'select(.ms > 1000) | .path' "$LOG" | LC_ALL=C sort -u > /app/slow_paths.txt
