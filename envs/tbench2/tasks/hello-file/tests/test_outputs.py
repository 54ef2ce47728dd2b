"""The agent must have written the greeting to /app/hello.txt."""

from pathlib import Path

HELLO = Path("/app/hello.txt")


def test_file_exists():
    assert HELLO.is_file(), f"{HELLO} does not exist"


def test_content_is_exactly_the_greeting():
    assert HELLO.read_bytes() in (b"Hello, world!", b"Hello, world!\n")
