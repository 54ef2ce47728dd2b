#!/bin/bash
set -euo pipefail
dpkg -i /opt/pkgs/greet_1.0_all.deb
