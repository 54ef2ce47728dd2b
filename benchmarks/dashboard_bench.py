"""How fast the dashboard opens a run with 10,000 episodes (issue 21: the first page in under 2 s).

Writes a synthetic run directory (`agentrl.testing.dashboard`: the runtime's own record and
metric types, made-up numbers), starts `agentrl dashboard` on it as a fresh process, and times
what the page asks for on first load: the page, the run list, the metrics, the evals and the
first page of episodes (which reads the newest records first, for at most 0.5 s, and says how
many are left; the page asks again until none are), then the time until every record is
indexed. Side by side, in the same run: the
index's partial read of every record against parsing every record in full, as the naive reader
would.

    python benchmarks/dashboard_bench.py [--episodes 10000] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrl.dashboard.records import RecordIndex  # noqa: E402
from agentrl.testing.dashboard import write_run  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


def full_parse(records: Path) -> int:
    n = 0
    for path in records.glob("*.jsonl"):
        with path.open("rb") as fh:
            for line in fh:
                json.loads(line)
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--response-tokens", type=int, default=1000)
    ap.add_argument("--dir", type=Path, default=None, help="Run directory (default: a temporary one).")
    ap.add_argument("--keep", action="store_true", help="Keep the run directory.")
    args = ap.parse_args()

    run = args.dir or Path(tempfile.mkdtemp(prefix="dashboard-bench-")) / "run"
    t = time.perf_counter()
    if not (run / "records").is_dir() or len(list((run / "records").iterdir())) != args.episodes:
        shutil.rmtree(run, ignore_errors=True)
        write_run(run, episodes=args.episodes, steps=args.steps, response_tokens=args.response_tokens)
    size = sum(p.stat().st_size for p in (run / "records").iterdir())
    print(
        f"run: {run}: {args.episodes} episodes, {args.steps} steps, records {size / 2**20:.0f} MiB"
        f" (written in {time.perf_counter() - t:.1f}s)"
    )

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "dashboard", str(run), "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                get(f"{base}/api/runs")
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(
                        f"the server did not start: {server.stderr.read().decode()[-2000:]}"
                    ) from None
                time.sleep(0.05)
        parts = {}
        t0 = time.perf_counter()
        for name, path in [
            ("page", "/"),
            ("runs", "/api/runs"),
            ("metrics", "/api/runs/0/metrics"),
            ("evals", "/api/runs/0/evals"),
            ("episodes (first index slice + page)", "/api/runs/0/episodes?limit=50"),
        ]:
            t1 = time.perf_counter()
            body = get(base + path)
            parts[name] = (time.perf_counter() - t1, len(body))
        first = time.perf_counter() - t0
        first_listing = json.loads(get(base + "/api/runs/0/episodes?limit=50"))
        while True:  # what the page does while the index is still being read: ask again
            listing = json.loads(get(base + "/api/runs/0/episodes?limit=50"))
            if not listing["pending"]:
                break
        full = time.perf_counter() - t0
        assert listing["indexed"] == args.episodes, listing["indexed"]
        t1 = time.perf_counter()
        get(base + "/api/runs/0/episodes?limit=50&offset=5000&task=make-dirs&min_reward=1")
        filtered = time.perf_counter() - t1
        eid = listing["items"][0]["id"]
        t1 = time.perf_counter()
        get(f"{base}/api/runs/0/episodes/{eid}")
        one = time.perf_counter() - t1
        browser = None
        chromium = shutil.which("chromium")
        if chromium:
            t1 = time.perf_counter()
            subprocess.run(
                [
                    chromium,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--virtual-time-budget=3000",
                    f"--user-data-dir={run.parent / 'chromium-profile'}",
                    "--dump-dom",
                    f"{base}/#episodes",
                ],
                capture_output=True,
                timeout=120,
                check=True,
            )
            browser = time.perf_counter() - t1
    finally:
        server.terminate()
        server.wait(timeout=10)

    t1 = time.perf_counter()
    index = RecordIndex(run / "records")
    index.refresh()
    partial = time.perf_counter() - t1
    t1 = time.perf_counter()
    n = full_parse(run / "records")
    naive = time.perf_counter() - t1
    assert n == len(index.entries) == args.episodes

    print("first page, fresh server process (cold index):")
    for name, (sec, nbytes) in parts.items():
        print(f"  {name:32s} {sec * 1000:8.1f} ms  {nbytes / 1024:7.1f} KiB")
    print(f"  {'total':32s} {first * 1000:8.1f} ms   (target: < 2000 ms)")
    print(
        f"  the first page listed {len(first_listing['items'])} episodes with {first_listing['indexed']} indexed;"
        f" every record indexed after {full:.2f} s"
    )
    print(f"a filtered later page (warm index): {filtered * 1000:.1f} ms; one episode: {one * 1000:.1f} ms")
    if browser is not None:
        print(f"headless chromium, start to DOM of #episodes (browser start-up included): {browser:.2f} s")
    print(
        f"index of {n} records, page-cache warm: {partial:.2f} s; every record parsed in full: {naive:.2f} s;"
        f" ratio {partial / naive:.3f}"
    )
    if not args.keep and args.dir is None:
        shutil.rmtree(run.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
