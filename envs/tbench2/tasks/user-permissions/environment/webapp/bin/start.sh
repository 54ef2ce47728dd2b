#!/bin/bash
exec python3 -m http.server 8000 --directory /srv/webapp/public
