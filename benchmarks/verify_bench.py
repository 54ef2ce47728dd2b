"""Verification cost per episode, before and after private verification, side by side in one run.

For each of `--episodes` episodes per task: start a sandbox, do the task's honest work (its
solution), then time `agentrl.episode.verify.verify` alone. "after" is this checkout (tests in a
verification container of their own, provenance by fanotify); "before" is the same script run on
an older revision's package (`--before REV`, default 5fe452d: in-sandbox verification after a
`podman diff` tamper scan), checked out into a temporary git worktree and imported from there.
The two alternate episode by episode (before, after, before, ...) on the same tasks, so load on a
shared machine hits both alike. Prints p50 / p95 per side and the difference.

    .venv/bin/python benchmarks/verify_bench.py [--episodes 20] [--before 5fe452d]

Needs rootful podman (the private path) and the offline base images (`make bases`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = [
    "tests/fixtures/adversarial/guarded-hello",
    "envs/tbench2/tasks/hello-file",
    "envs/tbench2/tasks/port-service",
]


async def one_side(tasks_root: Path, episodes: int, concurrency: int = 1) -> dict[str, list[float]]:
    """Runs inside one interpreter with one revision's `agentrl`: seconds of `verify` per episode,
    `concurrency` episodes of a task at once (their verifications overlap, as in a rollout)."""
    import time

    from agentrl.episode.verify import verify
    from agentrl.sandbox.podman import PodmanProvider
    from agentrl.tasks.task import load_task

    provider = PodmanProvider(shell_grace_s=3)
    out: dict[str, list[float]] = {}

    async def one(task, times: list[float], ready: asyncio.Barrier | None) -> None:  # type: ignore[no-untyped-def]
        async with await provider.create(task, run_id="verify-bench") as sandbox:
            await sandbox.upload(task.solution_dir, "/solution")
            await sandbox.exec("bash /solution/solve.sh", timeout=120)
            if ready is not None:
                await ready.wait()  # every sandbox ready: the verifications start together
            start = time.monotonic()
            result = await verify(sandbox, task)
            times.append(time.monotonic() - start)
            assert result.outcome == "pass", (task.task_id, result.outcome, result.error)

    try:
        for rel in TASKS:
            task = load_task(tasks_root / rel)
            times = out.setdefault(task.task_id, [])
            for _ in range(episodes):
                ready = asyncio.Barrier(concurrency) if concurrency > 1 else None
                await asyncio.gather(*(one(task, times, ready) for _ in range(concurrency)))
    finally:
        await provider.aclose()
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--before", default="5fe452d")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="verifications at once (8: the demo's rollout)"
    )
    parser.add_argument("--side", choices=["before", "after"], help=argparse.SUPPRESS)
    parser.add_argument("--tasks-root", default=str(ROOT), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a child: one batch of one side, times as JSON on stdout
        print(json.dumps(asyncio.run(one_side(Path(args.tasks_root), args.episodes, args.concurrency))))
        return
    with tempfile.TemporaryDirectory(prefix="agentrl-before-") as tmp:
        worktree = Path(tmp) / "before"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.before],
            check=True,
            capture_output=True,
        )
        try:
            results: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
            for _ in range(args.episodes):
                for side, pkg in (("before", worktree), ("after", ROOT)):
                    env = {**os.environ, "PYTHONPATH": str(pkg)}
                    out = subprocess.run(
                        [sys.executable, __file__, "--side", side, "--episodes", "1", "--tasks-root", str(ROOT),
                         "--concurrency", str(args.concurrency)],
                        env=env, check=True, capture_output=True, text=True, cwd=pkg,
                    )  # fmt: skip
                    for task, times in json.loads(out.stdout.splitlines()[-1]).items():
                        results[side].setdefault(task, []).extend(times)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False
            )
    print(
        f"verification per episode, {args.episodes} rounds of {args.concurrency} at once per task and side (seconds)"
    )
    print(
        f"{'task':<16} {'before p50':>10} {'after p50':>10} {'diff p50':>9} {'before p95':>11} {'after p95':>10}"
    )
    every = {"before": [], "after": []}  # type: dict[str, list[float]]
    for task in results["after"]:
        b, a = results["before"][task], results["after"][task]
        every["before"] += b
        every["after"] += a
        print(
            f"{task:<16} {pct(b, 0.5):>10.3f} {pct(a, 0.5):>10.3f} {pct(a, 0.5) - pct(b, 0.5):>+9.3f} {pct(b, 0.95):>11.3f} {pct(a, 0.95):>10.3f}"
        )
    b, a = every["before"], every["after"]
    print(
        f"{'all':<16} {pct(b, 0.5):>10.3f} {pct(a, 0.5):>10.3f} {pct(a, 0.5) - pct(b, 0.5):>+9.3f} {pct(b, 0.95):>11.3f} {pct(a, 0.95):>10.3f}"
    )
    print(
        f"means: before {statistics.mean(b):.3f} s, after {statistics.mean(a):.3f} s; load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
