"""/app/config.json must be strict JSON with the two requested changes and nothing else."""

import json
from pathlib import Path

import pytest

CONFIG = Path("/app/config.json")
EXPECTED = {
    "service": "inventory-api",
    "server": {"host": "0.0.0.0", "port": 8080, "workers": 4},
    "database": {
        "url": "postgresql://inventory@db/inventory",
        "pool_size": 10,
        "timeout_sec": 5.5,
    },
    "features": ["search", "export", "audit-log"],
    "debug": False,
}


@pytest.fixture
def config():
    try:
        return json.loads(CONFIG.read_text())
    except json.JSONDecodeError as exc:
        pytest.fail(f"{CONFIG} is not valid JSON: {exc}")


def test_port_is_integer(config):
    port = config["server"]["port"]
    assert type(port) is int and port == 8080


def test_debug_is_false(config):
    assert config["debug"] is False


def test_everything_else_preserved(config):
    assert config == EXPECTED
    assert type(config["database"]["timeout_sec"]) is float
    assert type(config["server"]["workers"]) is int
