"""The built wheel, installed into a fresh virtual environment without extras, is a working product:
no torch, the bundled tasks and the stand-in base list inside it, `agentrl tasks lint`,
`agentrl tasks oracle` (podman) and `agentrl eval` against an `agentrl engine serve` process (the
tiny model, served from the development environment) writing a Harbor job directory that Harbor's
own models and viewer read.

Dependencies come from a wheelhouse cached under ~/.cache/agentrl (filled once with `pip download`
from the registry), and the install itself runs with `--no-index`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_terminus_harbor_diff import _NO_REGISTRY

ROOT = Path(__file__).resolve().parents[1]
CLI = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")
EVAL_TASKS = ("hello-file", "make-dirs")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.container,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(shutil.which(CLI) is None, reason=f"{CLI} is not installed"),
]


def _run(cmd: list[str], *, timeout: float = 600, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run away from the checkout (a `python -c` would import the checkout's packages from the
    working directory) and without PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    kw.setdefault("cwd", Path(os.environ.get("TMPDIR", "/tmp")))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)  # type: ignore[call-overload]


def _source_tree(dst: Path) -> Path:
    """The working tree as git sees it (tracked and untracked, ignored files left out)."""
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    for rel in filter(None, files.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def _requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist without extras."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    reqs = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Requires-Dist:")]
    return sorted(r for r in reqs if "extra ==" not in r)


def _wheelhouse(reqs: list[str]) -> Path:
    cache = Path(os.environ.get("AGENTRL_CACHE_DIR", Path.home() / ".cache" / "agentrl"))
    house = cache / f"wheelhouse-{hashlib.sha256(json.dumps(reqs).encode()).hexdigest()[:12]}"
    if (house / "ready").exists():
        return house
    house.mkdir(parents=True, exist_ok=True)
    out = _run([sys.executable, "-m", "pip", "download", "-q", "-d", str(house), *reqs])
    if out.returncode != 0:
        if _NO_REGISTRY.search(out.stdout + out.stderr):
            pytest.skip(f"no registry for the wheel's dependencies: {out.stderr[-300:]}")
        raise AssertionError(out.stderr[-3000:])
    (house / "ready").write_text("\n".join(reqs))
    return house


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with only the wheel and its plain dependencies; yields its bin directory."""
    base = tmp_path_factory.mktemp("wheel")
    src = _source_tree(base / "src")
    dist = base / "dist"
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(src),
        ]
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("agentrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sandbox_images/bases.toml" in names and "agentrl/dashboard/page.html" in names
    bundled = {n for n in names if n.startswith("envs/tbench2/tasks/")}
    on_disk = {p.relative_to(src).as_posix() for p in (src / "envs/tbench2/tasks").rglob("*") if p.is_file()}
    assert on_disk <= bundled, f"task files missing from the wheel: {sorted(on_disk - bundled)[:5]}"
    house = _wheelhouse(_requirements(wheel))
    venv = base / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    pip = _run(
        [
            str(venv / "bin/python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(house),
            str(wheel),
        ]
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    yield venv / "bin"


def _site_tasks(bin_dir: Path) -> Path:
    code = "import envs.tbench2, pathlib; print(pathlib.Path(envs.tbench2.__file__).parent / 'tasks')"
    return Path(_run([str(bin_dir / "python"), "-c", code]).stdout.strip())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """`agentrl engine serve` with the tiny model, from the development environment."""
    pytest.importorskip("torch")
    from agentrl.models.tiny import tiny_model_dir

    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentrl.cli",
            "engine",
            "serve",
            "--model",
            str(tiny_model_dir()),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(360):
            if proc.poll() is not None:
                raise AssertionError(f"engine serve exited: {proc.stdout.read() if proc.stdout else ''}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.25)
        else:
            raise AssertionError("engine serve did not become healthy")
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log = proc.stdout.read() if proc.stdout else ""
        # the request log names requests, never their prompts
        assert "POST /v1/chat/completions 200" in log or not log
        assert "Task Description" not in log


def test_a_plain_install_has_no_torch_and_finds_its_data(installed: Path) -> None:
    code = (
        "import sys, agentrl.cli, agentrl.cli.eval, agentrl.cli.tasks, agentrl.cli.sandbox, agentrl.eval.harbor_job\n"
        "from agentrl.sandbox.images import load_recipe\n"
        "assert 'debian:bookworm-slim' in load_recipe().names\n"
        "assert not any(m in sys.modules for m in ('torch', 'transformers', 'numpy'))\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('torch') is None\n"
    )
    out = _run([str(installed / "python"), "-c", code])
    assert out.returncode == 0, out.stderr
    where = _run([str(installed / "python"), "-c", "import agentrl; print(agentrl.__file__)"]).stdout
    assert "site-packages" in where, where
    for args in (["--help"], ["sandbox", "--help"], ["eval", "--help"], ["tasks", "--help"]):
        out = _run([str(installed / "agentrl"), *args])
        assert out.returncode == 0, (args, out.stderr)
    # a command that needs the local extra says so instead of a traceback
    out = _run([str(installed / "agentrl"), "engine", "serve", "--model", "/nonexistent"])
    assert out.returncode == 2 and "pip install -e '.[local]'" in out.stderr


def test_tasks_lint_and_oracle_from_the_installed_wheel(installed: Path) -> None:
    tasks = _site_tasks(installed)
    assert "site-packages" in str(tasks)
    lint = _run([str(installed / "agentrl"), "tasks", "lint", str(tasks)])
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "24 tasks: 0 with errors" in lint.stdout
    oracle = _run(
        [str(installed / "agentrl"), "tasks", "oracle", str(tasks / "hello-file"), "--backend", CLI]
    )
    assert oracle.returncode == 0, oracle.stdout[-3000:] + oracle.stderr[-3000:]
    assert "1/1 tasks gave the expected reward" in oracle.stdout


def test_eval_against_engine_serve_writes_a_harbor_job_harbor_reads(
    installed: Path, served: str, tmp_path: Path
) -> None:
    from tests.test_eval_harbor import harbor_check

    tasks = _site_tasks(installed)
    jobs = tmp_path / "jobs"
    cmd = [str(installed / "agentrl"), "eval", str(tasks), "--engine", "openai", "--url", f"{served}/v1"]
    cmd += [arg for t in EVAL_TASKS for arg in ("--task-name", t)]
    # The tiny model's context is 4096 tokens: small turns, a small budget, few turns.
    cmd += ["--backend", CLI, "--jobs-dir", str(jobs), "--job-name", "wheel", "-n", "2"]
    cmd += ["--max-turns", "3", "--max-new-tokens", "96", "--max-total-tokens", "2400"]
    # Within Terminus-2's summary threshold (8000 free) Harbor would summarise before every turn.
    cmd += ["--no-summarize"]
    out = _run(cmd, timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "warning:" in out.stdout and "--max-turns 3" in out.stdout  # demo-sized settings flagged
    summary = json.loads((jobs / "wheel" / "agentrl-eval.json").read_text())
    assert summary["episodes"] + summary["unscored"] == len(EVAL_TASKS)
    assert summary["settings"]["mode"] == "tmux"  # terminus-json drives a terminal, as Terminus-2
    report = harbor_check(jobs, "wheel")
    assert report["viewer_jobs"] == ["wheel"]
    assert sorted(t["task"] for t in report["trials"].values()) == sorted(EVAL_TASKS)
    for t in report["trials"].values():
        assert t["checksum_equal"] and t["viewer_steps"] == len(t["sources"])
        # Terminus-2's first prompt is one user message, then the model's turns
        assert t["sources"][0] == "user" and set(t["sources"][1:]) <= {"agent"}
