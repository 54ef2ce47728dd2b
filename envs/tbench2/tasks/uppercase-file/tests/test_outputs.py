"""/app/output.txt must be the upper-cased input, which stays unchanged."""

from pathlib import Path

INPUT = (
    "The quick brown fox jumps over the lazy dog.\n"
    "Pack my box with five dozen liquor jugs!\n"
    "Sphinx of black quartz, judge my vow: 42 times.\n"
)


def test_input_unchanged():
    assert Path("/app/input.txt").read_text() == INPUT


def test_output_is_upper_case():
    out = Path("/app/output.txt")
    assert out.is_file(), f"{out} does not exist"
    assert out.read_text() == INPUT.upper()
