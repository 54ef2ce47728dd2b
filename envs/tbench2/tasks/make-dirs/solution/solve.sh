#!/bin/bash
set -euo pipefail
mkdir -p /app/project/{src,tests,docs}
