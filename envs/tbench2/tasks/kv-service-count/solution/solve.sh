#!/bin/bash
set -e
ask() {
    exec 3<>/dev/tcp/db/7000
    printf '%s\n' "$1" >&3
    read -r reply <&3
    exec 3<&-
    printf '%s\n' "$reply"
}
n=$(ask "GET orders")
active=0
for i in $(seq 1 "$n"); do
    if [ "$(ask "GET order:$i")" = active ]; then active=$((active + 1)); fi
done
echo "$active" > /app/active.txt
ask "SET reviewed yes" > /dev/null
