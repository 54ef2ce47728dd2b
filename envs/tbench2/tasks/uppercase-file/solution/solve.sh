#!/bin/bash
set -euo pipefail
tr a-z A-Z < /app/input.txt > /app/output.txt
