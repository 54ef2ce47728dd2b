#!/bin/bash
set -euo pipefail
mkdir -p /app/project/src /app/project/tests /app/project/docs
