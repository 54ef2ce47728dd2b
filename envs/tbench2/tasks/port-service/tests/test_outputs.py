"""The service started by the agent must still be listening on 127.0.0.1:8088 and answer correctly.

The test never starts the server itself: it must have survived the end of the agent's session.
"""

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

BASE = "http://127.0.0.1:8088"


def get(path: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(BASE + path, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture(scope="module", autouse=True)
def listening():
    deadline = time.monotonic() + 5
    while True:
        try:
            socket.create_connection(("127.0.0.1", 8088), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail("nothing is listening on 127.0.0.1:8088")
            time.sleep(0.2)


def test_server_code_exists():
    assert Path("/app/server.py").is_file()


def test_health():
    status, _, body = get("/health")
    assert status == 200
    assert body.strip() == b"ok"


@pytest.mark.parametrize("a,b", [(2, 3), (-3, 10), (0, 0), (123456789, 987654321)])
def test_add(a: int, b: int):
    status, headers, body = get(f"/add?a={a}&b={b}")
    assert status == 200
    content_type = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
    assert content_type.split(";")[0].strip() == "application/json"
    assert json.loads(body) == {"result": a + b}


@pytest.mark.parametrize("query", ["", "?a=1", "?b=2", "?a=x&b=2", "?a=1.5&b=2"])
def test_add_bad_input(query: str):
    status, _, _ = get("/add" + query)
    assert status == 400


def test_unknown_path():
    status, _, _ = get("/nope")
    assert status == 404
