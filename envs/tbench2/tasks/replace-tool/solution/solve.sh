#!/bin/bash
set -euo pipefail
cat > /usr/local/bin/checksum <<'SH'
#!/bin/sh
[ -f "$1" ] || exit 1
sha256sum "$1" | cut -d' ' -f1
SH
chmod 755 /usr/local/bin/checksum
