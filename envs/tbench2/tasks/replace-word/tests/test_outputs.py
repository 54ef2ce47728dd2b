"""/app/notes.txt must use `color` everywhere and be otherwise byte-identical."""

from pathlib import Path

NOTES = Path("/app/notes.txt")
EXPECTED = """Meeting notes: website redesign

Color palette: the team agreed on a warm color scheme.
The primary color is a deep red; the secondary colors are beige and grey.
Action item: document every color token in the style guide.
Marketing asked whether the logo color can stay the same. Color contrast
must meet the accessibility guidelines (watercolors on the landing page are out).
The word "colorful" appeared in the brief; keep it in mind.
Next meeting: Thursday.
"""


def test_no_british_spelling_left():
    assert "olour" not in NOTES.read_text()


def test_rest_of_file_unchanged():
    assert NOTES.read_text() == EXPECTED
