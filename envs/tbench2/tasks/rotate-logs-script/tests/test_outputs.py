"""/app/rotate.sh must keep the newest KEEP *.log files, delete and list the rest, and reject bad usage."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path("/app/rotate.sh")
BASE_TIME = 1_700_000_000


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=30)


def make(path: Path, age_rank: int) -> Path:
    """Create a file whose mtime grows with age_rank (higher is newer)."""
    path.write_text(f"{path.name}\n")
    os.utime(path, (BASE_TIME + age_rank * 60, BASE_TIME + age_rank * 60))
    return path


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    # Creation order differs from mtime order, so sorting by name or inode is wrong.
    make(tmp_path / "c.log", 3)
    make(tmp_path / "a.log", 5)
    make(tmp_path / "old app.log", 1)
    make(tmp_path / "e.log", 4)
    make(tmp_path / "b.log", 2)
    make(tmp_path / "app.log.gz", 0)
    make(tmp_path / "notes.txt", 0)
    sub = tmp_path / "archive"
    sub.mkdir()
    make(sub / "z.log", 0)
    return tmp_path


def names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_script_is_executable():
    assert SCRIPT.is_file() and os.access(SCRIPT, os.X_OK)


def test_keeps_newest_and_lists_deleted_oldest_first(logdir: Path):
    out = run(str(logdir), "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["old app.log", "b.log", "c.log"]
    assert names(logdir) == {"a.log", "e.log", "app.log.gz", "notes.txt", "archive"}
    assert (logdir / "archive" / "z.log").exists()


def test_keep_zero_deletes_all_logs(logdir: Path):
    out = run(str(logdir), "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["old app.log", "b.log", "c.log", "e.log", "a.log"]
    assert names(logdir) == {"app.log.gz", "notes.txt", "archive"}


def test_keep_more_than_present_deletes_nothing(logdir: Path):
    before = names(logdir)
    out = run(str(logdir), "10")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    assert names(logdir) == before


@pytest.mark.parametrize(
    "args",
    [(), ("only-one",), ("{dir}", "-1"), ("{dir}", "two"), ("{dir}", "1", "x"), ("{dir}/missing", "1")],
)
def test_bad_usage_exits_2_and_deletes_nothing(logdir: Path, args: tuple[str, ...]):
    before = names(logdir)
    out = run(*(a.format(dir=logdir) for a in args))
    assert out.returncode == 2
    assert out.stderr.strip(), "a usage message must go to stderr"
    assert out.stdout == ""
    assert names(logdir) == before
