"""Checks the agent's answer and what it left in the key-value service (asked over the network)."""

import socket
from pathlib import Path


def ask(line: str) -> str:
    with socket.create_connection(("db", 7000), timeout=10) as conn:
        conn.sendall(line.encode() + b"\n")
        return conn.makefile().readline().strip()


def test_active_count():
    assert Path("/app/active.txt").read_text().strip() == "17"


def test_marked_reviewed():
    assert ask("GET reviewed") == "yes"
