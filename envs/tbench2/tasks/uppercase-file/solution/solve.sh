#!/bin/bash
set -euo pipefail
tr '[:lower:]' '[:upper:]' < /app/input.txt > /app/output.txt
