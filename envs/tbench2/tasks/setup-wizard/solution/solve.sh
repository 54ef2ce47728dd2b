#!/bin/bash
set -euo pipefail
# The wizard wants a terminal: `script` gives it a pseudo-terminal. The answers are typed one at
# a time, as a person would: the token prompt flushes anything typed ahead of it.
answer() { sleep 0.5; printf '%s\n' "$1"; }
{ answer ledger; answer 9090; answer tok-4711-alpha; answer y; sleep 0.5; } | script -qec setup-wizard /dev/null
test -f /app/service.conf
