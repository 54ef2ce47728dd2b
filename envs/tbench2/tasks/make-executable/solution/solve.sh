#!/bin/bash
set -euo pipefail
chmod 755 /app/run.sh
