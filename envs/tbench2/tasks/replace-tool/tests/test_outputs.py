import hashlib
import os
import subprocess
import tempfile


def run(*args):
    return subprocess.run(["/usr/local/bin/checksum", *args], capture_output=True, text=True)


def test_prints_the_sha256_of_a_file():
    for data in (b"", b"hello\n", os.urandom(100_000)):
        with tempfile.NamedTemporaryFile(delete=False) as fh:
            fh.write(data)
        out = run(fh.name)
        assert out.returncode == 0 and out.stdout == hashlib.sha256(data).hexdigest() + "\n"


def test_missing_file_exits_1_with_no_output():
    out = run("/nonexistent/file")
    assert out.returncode == 1 and out.stdout == ""


def test_is_executable_by_everyone():
    assert os.stat("/usr/local/bin/checksum").st_mode & 0o111 == 0o111
