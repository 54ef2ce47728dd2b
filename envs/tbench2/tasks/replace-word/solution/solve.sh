#!/bin/bash
set -euo pipefail
sed -i 's/colour/color/g; s/Colour/Color/g' /app/notes.txt
