#!/bin/bash
set -e
mkdir -p /app/out
tail -n +2 /app/sales.csv | awk -F, '{ s += $2 } END { print s }' > /app/out/total.txt
tail -n +2 /app/sales.csv | wc -l > /app/out/count.txt
