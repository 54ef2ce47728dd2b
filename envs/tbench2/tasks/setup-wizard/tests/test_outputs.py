"""The wizard itself must have written /app/service.conf with the requested answers."""

import hashlib
from pathlib import Path

CONF = Path("/app/service.conf")


def settings() -> dict[str, str]:
    pairs = (line.split(" = ", 1) for line in CONF.read_text().splitlines() if " = " in line)
    return {key.strip(): value.strip() for key, value in pairs}


def test_written_by_the_wizard():
    assert CONF.is_file(), f"{CONF} does not exist"
    assert CONF.read_text().startswith("# written by setup-wizard 1.2\n")


def test_answers():
    conf = settings()
    assert (conf.get("name"), conf.get("port")) == ("ledger", "9090")


def test_the_token_went_through_the_wizard():
    expected = hashlib.sha256(b"ledger:9090:tok-4711-alpha").hexdigest()
    assert settings().get("fingerprint") == expected
