"""Sandbox speed, side by side in one run on real podman containers.

1. Per-command latency: the persistent shell vs one `podman exec` per command (p50, p95, ratio).
   Goal: p50 <= 2 ms and >= 20x faster. Commands run in the agent's shell session (one long-lived
   bash, its state saved after commands that can change it, `agentrl/sandbox/shellstate.py`).
1b. The terminal beside it: `send_keys` + `capture` on a tmux session in the sandbox, interleaved
   one for one with session commands in the same container. Goal: round trip p50 <= 10 ms.
2. Warm-pool acquire (a pre-started, liveness-checked container handed out), p50. Goal <= 20 ms.
3. Cold start from a cached image (`podman run` + /logs set-up + first command), p50.
4. Oracle sweep wall time over envs/tbench2/tasks at concurrency 2 (skipped if that is empty).
5. The verification step (`agentrl.episode.verify.verify` on a fresh sandbox of the fixture task), p50.

With `--baseline-podman OLD/podman.py` (e.g. `git show REV:agentrl/sandbox/podman.py > /tmp/old.py`,
and `--baseline-shellstate` with that revision's `agentrl/sandbox/shellstate.py`)
section 1 also runs that version's persistent shell in a second container, commands interleaved
one for one with the current one, so load on a shared machine hits both alike: the p50 ratio is
the comparison to trust there. It times a command that cannot change the session (`echo i`) and
one that does (`export V=i`, whose session is saved), and prints the load average it saw.
`--only-exec` runs sections 1 and 1b only.

    .venv/bin/python benchmarks/sandbox_bench.py [--commands 300] [--tasks-dir envs/tbench2/tasks]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from agentrl.episode.oracle import run_oracle
from agentrl.episode.verify import verify
from agentrl.sandbox.podman import PodmanProvider, PodmanSandbox, reap
from agentrl.tasks.task import discover_tasks, load_task

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "tests" / "fixtures" / "sandbox_tasks" / "write-hello"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def ms(x: float) -> str:
    return f"{x * 1000:.2f} ms"


async def exec_latency(sb: PodmanSandbox, n: int, fallback: bool) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        res = await (
            sb._exec_cli(f"echo {i}", timeout=30, cwd=None, env=None, user=None)
            if fallback
            else sb.exec(f"echo {i}", timeout=30)
        )
        times.append(time.perf_counter() - start)
        assert res.stdout == f"{i}\n", res
    return times


async def terminal_latency(sb: PodmanSandbox, n: int) -> tuple[list[float], list[float]]:
    """(send_keys + capture round trips, session commands), one of each in turn."""
    term = await sb.open_terminal()
    keys, command = [], []
    try:
        for i in range(n):
            start = time.perf_counter()
            await term.send_keys(f"echo {i}")
            await term.capture()  # the echo may land a moment later: typing is not waited for
            keys.append(time.perf_counter() - start)
            await term.send_keys("C-u")  # clear the typed line (not timed)
            start = time.perf_counter()
            res = await sb.exec(f"echo {i}", timeout=30)
            command.append(time.perf_counter() - start)
            assert res.stdout == f"{i}\n", res
        await term.send_keys("echo typed\n", duration=0.5)
        assert "\ntyped\n" in await term.capture(), "the terminal did not run what was typed"
    finally:
        await term.close()
    return keys, command


def load_baseline(podman_py: str, shellstate_py: str | None):  # type: ignore[no-untyped-def]
    """The older podman.py as a module, importing the older shellstate.py where one is given (the
    current package's otherwise)."""
    import agentrl.sandbox as package

    current = package.shellstate
    if shellstate_py:
        spec = importlib.util.spec_from_file_location("baseline_shellstate", shellstate_py)
        assert spec is not None and spec.loader is not None
        older = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(older)
        package.shellstate = older  # type: ignore[attr-defined]
        sys.modules["agentrl.sandbox.shellstate"] = older
    try:
        spec = importlib.util.spec_from_file_location("baseline_podman", podman_py)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        package.shellstate = current  # type: ignore[attr-defined]
        sys.modules["agentrl.sandbox.shellstate"] = current
    return module


async def interleaved(args: argparse.Namespace, task, run_id: str) -> None:  # type: ignore[no-untyped-def]
    """Section 1 against an older podman.py: both in their own container, commands interleaved one
    for one (the order alternating), so load on a shared machine hits both alike. Two commands:
    `echo i` (its text shows it cannot change the session) and `export V=i` (it does: the session
    is saved)."""
    old = load_baseline(args.baseline_podman, args.baseline_shellstate)
    base_provider = old.PodmanProvider(cli=args.cli)
    provider = PodmanProvider(cli=args.cli)
    try:
        async with (
            await base_provider.create(task, run_id=run_id) as a,
            await provider.create(task, run_id=run_id) as b,
        ):
            for label, make, check in (
                ("echo i", lambda i: f"echo {i}", lambda i, r: r.stdout == f"{i}\n"),
                ("export V=i", lambda i: f"export V={i}", lambda i, r: r.exit_code == 0),
            ):
                times: dict[str, list[float]] = {"baseline": [], "current": []}
                for i in range(args.commands + 10):
                    for name, sb in (
                        (("baseline", a), ("current", b)) if i % 2 else (("current", b), ("baseline", a))
                    ):
                        start = time.perf_counter()
                        res = await sb.exec(make(i), timeout=30)
                        if i >= 10:  # warm-up
                            times[name].append(time.perf_counter() - start)
                        assert check(i, res), res
                b50, c50 = pct(times["baseline"], 0.5), pct(times["current"], 0.5)
                b95, c95 = pct(times["baseline"], 0.95), pct(times["current"], 0.95)
                print(
                    f"`{label}` n={len(times['current'])}: baseline p50 {ms(b50)} p95 {ms(b95)} | "
                    f"current p50 {ms(c50)} p95 {ms(c95)} | current/baseline p50 {c50 / b50:.3f} "
                    f"p95 {c95 / b95:.3f}  (goal: current p50 <= 2 ms)"
                )
            assert (await b.exec("printenv V")).stdout == f"{args.commands + 9}\n"
        print(f"load average after section 1: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        await base_provider.aclose()
        await provider.aclose()


async def main(args: argparse.Namespace, tasks: list) -> None:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    task = load_task(TASK)
    provider = PodmanProvider(cli=args.cli)
    await provider.image_for(task)
    try:
        print("== 1. per-command latency (`echo i`, timeout set, one container)")
        async with await provider.create(task, run_id=run_id) as sb:
            assert isinstance(sb, PodmanSandbox)
            await exec_latency(sb, 10, fallback=False)  # warm-up
            shell = await exec_latency(sb, args.commands, fallback=False)
            per_exec = await exec_latency(sb, args.exec_commands, fallback=True)
        s50, s95, e50, e95 = pct(shell, 0.5), pct(shell, 0.95), pct(per_exec, 0.5), pct(per_exec, 0.95)
        print(f"persistent shell  n={len(shell):4d}  p50 {ms(s50)}  p95 {ms(s95)}")
        print(f"podman exec each  n={len(per_exec):4d}  p50 {ms(e50)}  p95 {ms(e95)}")
        print(f"ratio p50 {e50 / s50:.1f}x  p95 {e95 / s95:.1f}x  (goal: shell p50 <= 2 ms, >= 20x)")
        if args.baseline_podman:
            await interleaved(args, task, run_id)

        print("== 1b. terminal: send_keys + capture round trip, interleaved with session commands")
        async with await provider.create(task, run_id=run_id) as sb:
            await terminal_latency(sb, 10)  # warm-up
            keys, command = await terminal_latency(sb, args.commands)
        k50, k95, c50 = pct(keys, 0.5), pct(keys, 0.95), pct(command, 0.5)
        print(f"send_keys + capture  n={len(keys):4d}  p50 {ms(k50)}  p95 {ms(k95)}  (goal p50 <= 10 ms)")
        print(f"command path (same container, interleaved)  p50 {ms(c50)}  (goal p50 <= 2 ms)")
        print(f"load average after section 1b: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.only_exec:
            return

        print("== 2. warm-pool acquire (liveness check included)")
        warm = PodmanProvider(cli=args.cli, warm_pool=1)
        acquire = []
        try:
            for _ in range(args.rounds):
                warm.prefetch(task, run_id=run_id)
                assert await warm.wait_warm(task) >= 1
                start = time.perf_counter()
                sb = await warm.create(task, run_id=run_id)
                acquire.append(time.perf_counter() - start)
                await sb.close()
        finally:
            await warm.aclose()
        print(
            f"acquire  n={len(acquire)}  p50 {ms(pct(acquire, 0.5))}  p95 {ms(pct(acquire, 0.95))}  (goal p50 <= 20 ms)"
        )

        print("== 3. cold start from a cached image (create + first command)")
        cold = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            sb = await provider.create(task, run_id=run_id)
            await sb.exec("true")
            cold.append(time.perf_counter() - start)
            await sb.close()
        print(f"cold start  n={len(cold)}  p50 {ms(pct(cold, 0.5))}  p95 {ms(pct(cold, 0.95))}")
        print(f"warm acquire is {pct(cold, 0.5) / pct(acquire, 0.5):.0f}x faster than a cold start (p50)")

        print("== 5. verification step (verify() after one agent command, fresh sandbox each round)")
        times = []
        for _ in range(args.rounds):
            async with await provider.create(task, run_id=run_id) as sb:
                await sb.exec("echo hello > /app/out.txt", timeout=30)
                start = time.perf_counter()
                result = await verify(sb, task)
                times.append(time.perf_counter() - start)
                assert result.reward == 1.0, result
        print(f"verify  n={len(times)}  p50 {ms(pct(times, 0.5))}  p95 {ms(pct(times, 0.95))}")

        print(f"== 4. oracle sweep over {args.tasks_dir} at concurrency 2")
        if not tasks:
            print("skipped: no tasks there")
            return
        start = time.perf_counter()
        results = await run_oracle(PodmanProvider(cli=args.cli), tasks, run_id=run_id, concurrency=2)
        wall = time.perf_counter() - start
        ok = sum(r.ok for r in results)
        print(
            f"{len(tasks)} tasks in {wall:.1f} s wall ({wall / len(tasks):.1f} s a task), {ok}/{len(tasks)} rewarded 1"
        )
        for r in results:
            if not r.ok:
                print(f"  {r.task_id}: {r.cause} reward={r.reward} {r.detail[-300:]!r}")
        print(f"per-task seconds: median {statistics.median(r.seconds for r in results):.1f}")
    finally:
        await provider.aclose()
        left = await reap(cli=args.cli, run_id=run_id)
        print(f"containers left behind: {len(left)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", default="podman")
    parser.add_argument("--commands", type=int, default=300)
    parser.add_argument("--exec-commands", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tasks-dir", default=str(ROOT / "envs" / "tbench2" / "tasks"))
    parser.add_argument(
        "--baseline-shellstate", help="The shellstate.py of that version (the current one otherwise)."
    )
    parser.add_argument("--only-exec", action="store_true", help="Sections 1 and 1b only.")
    parser.add_argument(
        "--baseline-podman", help="An older agentrl/sandbox/podman.py to compare in section 1."
    )
    args = parser.parse_args()
    tasks_dir = Path(args.tasks_dir)
    asyncio.run(main(args, discover_tasks(tasks_dir) if tasks_dir.is_dir() else []))
