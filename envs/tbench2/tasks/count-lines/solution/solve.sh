#!/bin/bash
set -euo pipefail
wc -l < /app/data/access.log > /app/line_count.txt
