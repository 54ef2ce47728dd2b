#!/usr/bin/env bash
# Host set-up for local sandboxes: podman + runc + the configuration this kernel needs (nft and
# nsenter: a sandbox's network phase switch is set from the host, `PodmanSandbox.set_network`).
# Idempotent: installs only what is missing, writes the config only if it is not there yet.
set -euo pipefail

need=()
for bin in podman buildah runc fuse-overlayfs newuidmap debootstrap nft nsenter; do
  command -v "$bin" >/dev/null 2>&1 || need+=("$bin")
done
if ((${#need[@]})); then
  echo "setup_host: installing podman buildah runc fuse-overlayfs uidmap debootstrap nftables (missing: ${need[*]})"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq podman buildah runc fuse-overlayfs uidmap debootstrap nftables util-linux >/dev/null
fi

# Hybrid cgroups and a shell that cannot raise hard rlimits: crun fails on both, runc with lowered
# default ulimits works (see ../shared/ENVIRONMENT.md).
conf=/etc/containers/containers.conf
if [ "$(id -u)" -ne 0 ]; then
  conf="${XDG_CONFIG_HOME:-$HOME/.config}/containers/containers.conf"
fi
if ! grep -qs 'agentrl' "$conf" && ! grep -qs '^runtime *= *"runc"' "$conf"; then
  mkdir -p "$(dirname "$conf")"
  if grep -qs '^\[containers\]\|^\[engine\]' "$conf"; then
    # Appending would repeat a TOML table; merging by hand is the safe route.
    echo "setup_host: $conf has its own [containers]/[engine] tables; add runtime = \"runc\" and" \
      'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"] there yourself' >&2
  else
    cat >> "$conf" <<'CONF'
# written by agentrl sandbox_images/setup_host.sh
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
CONF
    echo "setup_host: wrote $conf"
  fi
fi
podman info --format '{{.Host.OCIRuntime.Name}}' >/dev/null
echo "setup_host: podman $(podman --version | awk '{print $3}') ready (runtime $(podman info --format '{{.Host.OCIRuntime.Name}}'))"
