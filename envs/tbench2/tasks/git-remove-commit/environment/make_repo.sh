#!/bin/bash
# Builds the task's repository at image build time with fixed identities and dates, so every
# build yields the same history.
set -euo pipefail
export GIT_AUTHOR_NAME="Sam Maintainer" GIT_AUTHOR_EMAIL="sam@example.com"
export GIT_COMMITTER_NAME="Sam Maintainer" GIT_COMMITTER_EMAIL="sam@example.com"
commit() {
    export GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1"
    git add -A
    git commit -q -m "$2"
}

mkdir -p /app/repo && cd /app/repo
git init -q -b main
printf '# invoice-tool\n\nGenerates PDF invoices.\n' > README.md
commit "2025-02-03T09:00:00+00:00" "Initial commit"

cat > app.py <<'PY'
import os


def api_key():
    return os.environ["BILLING_API_KEY"]
PY
commit "2025-02-04T10:00:00+00:00" "Read the billing key from the environment"

printf 'BILLING_API_KEY=sk_live_51HxQ2eZvKYlo2C9f3kQ8rT7\nDB_PASSWORD=hunter2-prod\n' > .env
commit "2025-02-04T17:20:00+00:00" "Add local credentials for testing"

cat >> app.py <<'PY'


def invoice_total(lines):
    return round(sum(qty * price for qty, price in lines), 2)
PY
commit "2025-02-05T11:00:00+00:00" "Add invoice_total"

printf 'invoice_total([(2, 9.99)]) == 19.98\n' > checks.txt
commit "2025-02-06T14:30:00+00:00" "Add manual checks"

printf '# invoice-tool\n\nGenerates PDF invoices.\n\nSet BILLING_API_KEY before running.\n' > README.md
commit "2025-02-07T08:45:00+00:00" "Document BILLING_API_KEY"
