"""main must be the same history minus the commit that added .env, with the same final files."""

import subprocess
from pathlib import Path

REPO = Path("/app/repo")
EXPECTED_SUBJECTS = [
    "Document BILLING_API_KEY",
    "Add manual checks",
    "Add invoice_total",
    "Read the billing key from the environment",
    "Initial commit",
]
EXPECTED_FILES = {
    "README.md": "# invoice-tool\n\nGenerates PDF invoices.\n\nSet BILLING_API_KEY before running.\n",
    "app.py": (
        'import os\n\n\ndef api_key():\n    return os.environ["BILLING_API_KEY"]\n\n\n'
        "def invoice_total(lines):\n    return round(sum(qty * price for qty, price in lines), 2)\n"
    ),
    "checks.txt": "invoice_total([(2, 9.99)]) == 19.98\n",
}


def git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_commit_removed_and_others_kept_in_order():
    assert git("log", "--format=%s", "main").splitlines() == EXPECTED_SUBJECTS


def test_no_commit_on_main_contains_env_file():
    for commit in git("rev-list", "main").split():
        names = git("ls-tree", "-r", "--name-only", commit).splitlines()
        assert ".env" not in names, f"commit {commit} still contains .env"


def test_secret_not_in_any_commit_diff():
    assert "sk_live_" not in git("log", "-p", "main")


def test_final_tree_is_unchanged_apart_from_env():
    assert sorted(git("ls-tree", "-r", "--name-only", "main").splitlines()) == sorted(EXPECTED_FILES)
    for name, content in EXPECTED_FILES.items():
        assert git("show", f"main:{name}") == content


def test_main_checked_out_and_clean():
    assert git("rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
    assert git("status", "--porcelain", "--ignored") == ""
    assert not (REPO / ".env").exists()
