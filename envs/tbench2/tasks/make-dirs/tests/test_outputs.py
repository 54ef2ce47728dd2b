"""The three project directories must exist as directories."""

from pathlib import Path

import pytest


@pytest.mark.parametrize("name", ["src", "tests", "docs"])
def test_directory_exists(name: str):
    path = Path("/app/project") / name
    assert path.is_dir() and not path.is_symlink(), f"{path} is not a directory"
