"""wordstat must build from clean with make and print lines, words, bytes and the first longest word."""

import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path("/app/wordstat")

CASES = {
    "simple": b"the quick brown fox\njumps over the lazy dog\n",
    "no_trailing_newline": b"alpha beta\ngamma",
    "tie_first_wins": b"abc xyz\nlmn opq rst\n",
    "mixed_whitespace": b"  lead\t\ttabs\r\nform\x0cfeed\x0bvert  \n\n  trailing   ",
    "empty": b"",
    "only_space": b" \n\t \n",
    "single_word": b"supercalifragilistic",
    "longer_later": b"a bb ccc dddd ccc bb a eeee\n",
}


def expected(data: bytes) -> str:
    # bytes.split() splits on exactly the ASCII whitespace set of C's isspace() in the C locale.
    words = data.split()
    longest = b""
    for w in words:
        if len(w) > len(longest):
            longest = w
    newlines = data.count(b"\n")
    return f"{newlines} {len(words)} {len(data)} {longest.decode() if words else '-'}"


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    build = tmp_path_factory.mktemp("build") / "wordstat"
    shutil.copytree(SRC, build)
    for target in ("clean", ""):
        out = subprocess.run(
            ["make", *([target] if target else [])], cwd=build, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, f"make {target} failed:\n{out.stdout}{out.stderr}"
    exe = build / "wordstat"
    assert exe.is_file(), "make did not produce ./wordstat"
    return exe


def test_agent_built_binary_exists():
    assert (SRC / "wordstat").is_file()


def test_sources_are_still_c():
    assert (SRC / "src" / "count.c").is_file() and (SRC / "src" / "main.c").is_file()


@pytest.mark.parametrize("name", sorted(CASES))
def test_output(binary: Path, tmp_path: Path, name: str):
    data = CASES[name]
    f = tmp_path / f"{name}.txt"
    f.write_bytes(data)
    out = subprocess.run([str(binary), str(f)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected(data) + "\n"


def test_missing_file_fails_with_message(binary: Path, tmp_path: Path):
    out = subprocess.run(
        [str(binary), str(tmp_path / "nope.txt")], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 1
    assert out.stderr.strip()
    assert out.stdout == ""
