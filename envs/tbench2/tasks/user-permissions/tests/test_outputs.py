"""The webapp account, ownership, modes and group membership must match the specification."""

import grp
import pwd
import stat
from pathlib import Path

import pytest

ROOT = Path("/srv/webapp")
ORIGINAL_FILES = {
    "bin/start.sh": "#!/bin/bash\nexec python3 -m http.server 8000 --directory /srv/webapp/public\n",
    "bin/stop.sh": '#!/bin/bash\npkill -f "http.server 8000"\n',
    "bin/README.txt": "Operational notes: restart with bin/stop.sh then bin/start.sh.\n",
    "config/app.conf": "[app]\nname = webapp\nport = 8000\n",
    "config/secrets.env": "DB_PASSWORD=correct-horse-battery-staple\nSESSION_KEY=4f9a1c2e7b\n",
    "public/index.html": "<!doctype html>\n<title>webapp</title>\n<h1>It works</h1>\n",
    "public/css/site.css": "body { font-family: sans-serif; }\n",
    "lib/helpers.py": "def helper():\n    return 42\n",
}


def expected_mode(path: Path) -> int:
    rel = path.relative_to(ROOT).as_posix()
    if path.is_dir():
        return 0o2770 if rel == "uploads" else 0o750
    if rel == "config/secrets.env":
        return 0o600
    if rel.startswith("bin/") and rel.endswith(".sh"):
        return 0o750
    return 0o640


def all_paths() -> list[Path]:
    return [ROOT, *sorted(ROOT.rglob("*"))]


def test_webapp_user_and_group():
    user = pwd.getpwnam("webapp")
    group = grp.getgrnam("webapp")
    assert user.pw_gid == group.gr_gid
    assert user.pw_shell == "/usr/sbin/nologin"


def test_uploads_directory_exists():
    assert (ROOT / "uploads").is_dir()


def test_ownership():
    uid = pwd.getpwnam("webapp").pw_uid
    gid = grp.getgrnam("webapp").gr_gid
    wrong = [str(p) for p in all_paths() if (p.lstat().st_uid, p.lstat().st_gid) != (uid, gid)]
    assert not wrong, f"not owned by webapp:webapp: {wrong}"


def test_modes():
    wrong = {
        str(p): oct(stat.S_IMODE(p.lstat().st_mode))
        for p in all_paths()
        if stat.S_IMODE(p.lstat().st_mode) != expected_mode(p)
    }
    assert not wrong, f"wrong modes: {wrong}"


def test_alice_in_group_with_primary_group_kept():
    alice = pwd.getpwnam("alice")
    assert "alice" in grp.getgrnam("webapp").gr_mem
    assert grp.getgrgid(alice.pw_gid).gr_name == "alice"


@pytest.mark.parametrize("rel", sorted(ORIGINAL_FILES))
def test_files_unchanged(rel: str):
    assert (ROOT / rel).read_text() == ORIGINAL_FILES[rel]
