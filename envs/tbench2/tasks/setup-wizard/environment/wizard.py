#!/usr/bin/env python3
"""setup-wizard: configures the ledger service interactively.

It talks to a person at a terminal: it refuses to run without one, asks its questions there and
reads the admin token without echo (from the terminal itself, like `passwd`).
"""

import getpass
import hashlib
import sys
from pathlib import Path

VERSION = "1.2"
CONF = Path("/app/service.conf")


def ask(prompt: str, default: str | None = None) -> str:
    answer = input(prompt).strip()
    return answer or (default or "")


def main() -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("setup-wizard: this wizard needs an interactive terminal", file=sys.stderr)
        return 2
    print(f"ledger setup wizard {VERSION}")
    name = ask("Service name: ")
    port = ask("Port [8080]: ", "8080")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        print(f"setup-wizard: {port!r} is not a port number", file=sys.stderr)
        return 1
    token = getpass.getpass("Admin token: ")
    if len(token) < 8:
        print("setup-wizard: the admin token needs at least 8 characters", file=sys.stderr)
        return 1
    if ask(f"Write {CONF} for {name!r} on port {port}? [y/N] ").lower() not in ("y", "yes"):
        print("setup-wizard: nothing written")
        return 1
    fingerprint = hashlib.sha256(f"{name}:{port}:{token}".encode()).hexdigest()
    CONF.write_text(
        f"# written by setup-wizard {VERSION}\nname = {name}\nport = {port}\nfingerprint = {fingerprint}\n"
    )
    print(f"wrote {CONF}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
