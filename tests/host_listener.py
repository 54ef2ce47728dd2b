"""A TCP listener on every address of this host, recording the first bytes of each connection:
what network tests check a sandbox could or could not reach."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def host_listener() -> Iterator[tuple[int, list[bytes]]]:
    """(port, what each connection sent), listening until the block ends."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", 0))
    sock.listen()
    seen: list[bytes] = []

    def accept() -> None:
        try:
            while True:
                conn, _ = sock.accept()
                seen.append(conn.recv(64))
                conn.close()
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield sock.getsockname()[1], seen
    finally:
        sock.close()
