#!/bin/bash
set -euo pipefail
groupadd --system webapp
useradd --system --gid webapp --shell /usr/sbin/nologin --no-create-home --home-dir /srv/webapp webapp
mkdir -p /srv/webapp/uploads
chown -R webapp:webapp /srv/webapp
find /srv/webapp -type d -exec chmod 750 {} +
find /srv/webapp -type f -exec chmod 640 {} +
chmod 750 /srv/webapp/bin/*.sh
chmod 600 /srv/webapp/config/secrets.env
chmod 2770 /srv/webapp/uploads
usermod -aG webapp alice
