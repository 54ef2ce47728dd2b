#!/bin/bash
set -euo pipefail
cd /app/repo
git checkout -q main
bad=$(git log --format=%H --diff-filter=A -n 1 main -- .env)
git rebase -q --onto "${bad}^" "$bad" main
# Drop the old commits from the reflog and the object store too, so the secret is gone locally.
git reflog expire --expire=now --all
git gc -q --prune=now
test ! -e .env
test -z "$(git status --porcelain)"
git log --oneline main
