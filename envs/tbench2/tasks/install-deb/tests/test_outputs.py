import shutil
import subprocess


def test_dpkg_lists_greet_as_installed():
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status} ${Version}", "greet"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "install ok installed 1.0"


def test_greet_is_on_path_and_greets():
    assert shutil.which("greet") == "/usr/bin/greet"
    out = subprocess.run(["greet", "Ada"], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and out.stdout == "Hello, Ada!\n"
