#!/bin/bash
set -euo pipefail
sed -i s/olour/olor/g /app/notes.txt
