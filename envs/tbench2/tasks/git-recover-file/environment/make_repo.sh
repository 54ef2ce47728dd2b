#!/bin/bash
# Builds the task's repository at image build time with fixed identities and dates, so every
# build yields the same history.
set -euo pipefail
export GIT_AUTHOR_NAME="Dana Developer" GIT_AUTHOR_EMAIL="dana@example.com"
export GIT_COMMITTER_NAME="Dana Developer" GIT_COMMITTER_EMAIL="dana@example.com"
commit() {
    export GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1"
    git add -A
    git commit -q -m "$2"
}

mkdir -p /app/project && cd /app/project
git init -q -b main
printf '# weather-station\n\nCollects sensor readings.\n' > README.md
mkdir -p config
cat > config/settings.ini <<'INI'
[station]
name = rooftop-7
latitude = 52.5200
longitude = 13.4050

[sampling]
interval_sec = 30
sensors = temperature,humidity,pressure

[upload]
endpoint = http://collector.internal:9000/ingest
retries = 5
INI
commit "2025-01-06T09:00:00+00:00" "Initial commit with station settings"

mkdir -p src
printf 'import configparser\n\n\ndef load(path="config/settings.ini"):\n    cfg = configparser.ConfigParser()\n    cfg.read(path)\n    return cfg\n' > src/main.py
commit "2025-01-07T10:30:00+00:00" "Add settings loader"

git rm -q config/settings.ini
printf '# weather-station\n\nCollects sensor readings from the rooftop station.\n' > README.md
commit "2025-01-08T16:45:00+00:00" "Tidy up README and remove stale files"

printf 'def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32\n' > src/units.py
commit "2025-01-09T11:15:00+00:00" "Add unit conversion helpers"
