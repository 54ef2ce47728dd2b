#!/bin/bash
set -euo pipefail
cat > /app/server.py <<'PY'
"""A tiny HTTP service: /health and /add on 127.0.0.1:8088."""

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class Handler(BaseHTTPRequestHandler):
    def _send(self, status, body, content_type="text/plain"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path == "/health":
            self._send(200, "ok")
        elif url.path == "/add":
            query = parse_qs(url.query)
            try:
                a = int(query["a"][0])
                b = int(query["b"][0])
            except (KeyError, ValueError):
                self._send(400, "a and b must be integers")
                return
            self._send(200, json.dumps({"result": a + b}), "application/json")
        else:
            self._send(404, "not found")

    def log_message(self, format, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", 8088), Handler).serve_forever()
PY

# setsid + nohup detach the server from this shell, so it outlives the session.
nohup setsid python3 /app/server.py > /app/server.log 2>&1 < /dev/null &

for _ in $(seq 50); do
    if python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8088/health", timeout=1)' 2>/dev/null; then
        exit 0
    fi
    sleep 0.2
done
echo "server did not come up" >&2
exit 1
