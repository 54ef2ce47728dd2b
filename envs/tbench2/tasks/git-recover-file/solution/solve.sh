#!/bin/bash
set -euo pipefail
cd /app/project
deleted_in=$(git log --format=%H --diff-filter=D -n 1 -- config/settings.ini)
git checkout "${deleted_in}^" -- config/settings.ini
git commit -q -m "Restore config/settings.ini"
