"""/app/run.sh must be mode 755, unchanged, and runnable by path."""

import hashlib
import stat
import subprocess
from pathlib import Path

SCRIPT = Path("/app/run.sh")
ORIGINAL = b'#!/bin/bash\necho "ready"\n'


def test_mode_is_755():
    assert stat.S_IMODE(SCRIPT.stat().st_mode) == 0o755


def test_content_unchanged():
    assert hashlib.sha256(SCRIPT.read_bytes()).digest() == hashlib.sha256(ORIGINAL).digest()


def test_runs_by_path():
    out = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0
    assert out.stdout == "ready\n"
