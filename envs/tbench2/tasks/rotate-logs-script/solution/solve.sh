#!/bin/bash
set -euo pipefail
cat > /app/rotate.sh <<'SH'
#!/bin/bash
# Keep the KEEP newest *.log files directly in DIR; delete and print the rest, oldest first.
set -euo pipefail

usage() {
    echo "usage: $0 DIR KEEP   (KEEP: number of newest *.log files to keep)" >&2
    exit 2
}

[ $# -eq 2 ] || usage
dir=$1
keep=$2
[[ $keep =~ ^[0-9]+$ ]] || usage
[ -d "$dir" ] || usage

mapfile -t oldest_first < <(find "$dir" -mindepth 1 -maxdepth 1 -type f -name '*.log' -printf '%T@\t%f\n' \
    | sort -t $'\t' -k1,1n | cut -f2-)

n_delete=$(( ${#oldest_first[@]} - 10#$keep ))
for (( i = 0; i < n_delete; i++ )); do
    rm -f -- "$dir/${oldest_first[i]}"
    printf '%s\n' "${oldest_first[i]}"
done
SH
chmod 755 /app/rotate.sh
