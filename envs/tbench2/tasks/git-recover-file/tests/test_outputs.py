"""config/settings.ini must be restored by a new commit on top of the untouched history."""

import subprocess
from pathlib import Path

REPO = Path("/app/project")
SETTINGS = """[station]
name = rooftop-7
latitude = 52.5200
longitude = 13.4050

[sampling]
interval_sec = 30
sensors = temperature,humidity,pressure

[upload]
endpoint = http://collector.internal:9000/ingest
retries = 5
"""
# The image builds the history with fixed identities and dates, so its tip commit id is fixed.
ORIGINAL_TIP = "7349899c958fc2447a6f881af7ea81bc23cc967c"
ORIGINAL_SUBJECTS = [
    "Add unit conversion helpers",
    "Tidy up README and remove stale files",
    "Add settings loader",
    "Initial commit with station settings",
]


def git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_file_restored_in_work_tree():
    assert (REPO / "config" / "settings.ini").read_text() == SETTINGS


def test_file_committed_on_main():
    assert git("show", "main:config/settings.ini") == SETTINGS


def test_history_kept_and_extended():
    subjects = git("log", "--format=%s", "main").splitlines()
    assert len(subjects) > len(ORIGINAL_SUBJECTS), "the restoration must be a new commit"
    assert subjects[-len(ORIGINAL_SUBJECTS) :] == ORIGINAL_SUBJECTS
    ancestor = subprocess.run(
        ["git", "-C", str(REPO), "merge-base", "--is-ancestor", ORIGINAL_TIP, "main"], timeout=30
    )
    assert ancestor.returncode == 0, "the original commits were rewritten"


def test_other_files_untouched():
    assert (REPO / "src" / "units.py").is_file()
    assert "rooftop station" in git("show", "main:README.md")


def test_work_tree_clean():
    assert git("status", "--porcelain") == ""
