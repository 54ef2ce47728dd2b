"""Where a step of the terminal demo (`make demo`) spends the two cores, before and after, side by
side in one run.

Each side trains `--steps` real RL steps of the demo (its config, its six tasks, podman sandboxes,
the in-process engine and trainer, evals off) from the same SFT model, in a fresh interpreter, and
reports per step: wall time, the machine's CPU seconds (/proc/stat, both cores), the training
process's own CPU (engine, agent loop, trainer: Python and torch), the CPU of the container CLI
commands it waited for (`podman run/exec/rm/inspect/...`), and what remains (conmon, runc, the
containers' processes with the tasks' tests, podman's clean-up commands, the kernel); then the
episodes per step, the container CLI calls per episode by kind, and the summed per-episode timings
the runtime records (sandbox start, engine, verification) and the trainer's seconds.

"after" is this checkout; "before" is `--before REV` (default 1c08ef5, the start of the session
that added this benchmark) checked out into a temporary git worktree and imported from there. The
sides alternate round by round (before, after, before, ...) so load hits both alike.

    .venv/bin/python benchmarks/demo_step_bench.py --model runs/local_tbench2/sft [--steps 4] [--rounds 2]

Needs rootful podman, the offline base images (`make bases`) and an SFT model (`recipes/local_tbench2.py
prepare`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO_TASKS = ["count-lines", "hello-file", "make-dirs", "make-executable", "replace-word", "uppercase-file"]


def _machine_cpu() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return sum(int(x) for x in fields[1:8]) / os.sysconf("SC_CLK_TCK")


def _settings(model: str, steps: int, out: str, tasks: str) -> dict[str, Any]:
    import yaml

    cfg = yaml.safe_load((ROOT / "recipes" / "configs" / "local_tbench2.yaml").read_text())
    cfg["env"].pop("task_ids", None)  # the same six tasks on both sides, through a task directory
    cfg["env"]["tasks"] = tasks
    cfg.update(steps=steps, out=out)
    cfg["engine"] = {**cfg.get("engine", {}), "model": model}
    cfg["eval"] = {**cfg.get("eval", {}), "before": False, "after": False}
    return cfg


async def _one_side(settings: dict[str, Any]) -> dict[str, Any]:
    """Inside one interpreter with one revision's `agentrl`: train, count, time."""
    calls: collections.Counter[str] = collections.Counter()
    spawn = asyncio.create_subprocess_exec

    async def counted(*args: Any, **kw: Any) -> Any:
        if args and Path(str(args[0])).name in ("podman", "docker"):
            words = [str(a) for a in args[1:3] if not str(a).startswith("-")]
            calls[" ".join(words[:2] if words[:1] in (["image"], ["container"]) else words[:1])] += 1
        return await spawn(*args, **kw)

    asyncio.create_subprocess_exec = counted  # type: ignore[assignment]
    from agentrl.runtime import close_parts, train
    from agentrl.runtime.build import build_parts
    from agentrl.runtime.config import RunConfig

    cfg = RunConfig.model_validate(settings)
    parts = build_parts(cfg)
    # images resolved and built before the clock starts (both sides): the steps are what is measured
    for task in parts.env.tasks:  # type: ignore[attr-defined]
        provider = parts.env.provider  # type: ignore[attr-defined]
        await provider.terminal_image(await provider.image_for(task))
    calls.clear()
    cpu0, wall0 = _machine_cpu(), time.monotonic()
    self0, kids0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        result = await train(cfg, parts)
    finally:
        await close_parts(parts)
    self1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    metrics = [m if isinstance(m, dict) else m.__dict__ for m in result.metrics]
    return {
        "steps": len(metrics),
        "wall_s": time.monotonic() - wall0,
        "machine_cpu_s": _machine_cpu() - cpu0,
        "self_cpu_s": (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime),
        "cli_cpu_s": (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime),
        "episodes": sum(m["rollout_episodes"] for m in metrics),
        "calls": dict(calls),
        "engine_s": sum(m["engine_s"] for m in metrics),
        "verifier_s": sum(m["verifier_s"] for m in metrics),
        "trainer_s": sum(m["extra"]["trainer"].get("step_seconds", 0.0) for m in metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="The SFT model both sides start from.")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per side and round.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", default="1c08ef5")
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.settings:  # a child: one side, one round; the result as JSON on the last line
        print(json.dumps(asyncio.run(_one_side(json.loads(args.settings)))))
        return
    model = str(Path(args.model).resolve())
    totals: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="agentrl-step-bench-") as tmp:
        tasks = Path(tmp) / "tasks"
        tasks.mkdir()
        for name in DEMO_TASKS:
            (tasks / name).symlink_to(ROOT / "envs" / "tbench2" / "tasks" / name)
        worktree = Path(tmp) / "before"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.before],
            check=True,
            capture_output=True,
        )
        try:
            for r in range(args.rounds):
                for side, pkg in (("before", worktree), ("after", ROOT)):
                    settings = _settings(model, args.steps, str(Path(tmp) / f"run-{side}-{r}"), str(tasks))
                    env = {**os.environ, "PYTHONPATH": str(pkg), "AGENTRL_PROGRESS": "0"}
                    out = subprocess.run(
                        [sys.executable, __file__, "--model", model, "--settings", json.dumps(settings)],
                        env=env, check=True, capture_output=True, text=True, cwd=pkg,
                    )  # fmt: skip
                    totals[side].append(json.loads(out.stdout.splitlines()[-1]))
                    print(f"round {r + 1} {side}: {totals[side][-1]['wall_s']:.0f}s", file=sys.stderr)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False
            )

    def per(side: str, key: str, by: str) -> float:
        runs = totals[side]
        return sum(r[key] for r in runs) / max(1, sum(r[by] for r in runs))

    print(f"demo RL steps: {args.rounds} rounds x {args.steps} steps per side, sides alternating")
    print(f"{'per step':<34} {'before':>9} {'after':>9} {'after/before':>13}")
    rows = [
        ("wall s", "wall_s", "steps"),
        ("machine CPU s (2 cores)", "machine_cpu_s", "steps"),
        ("  training process CPU s", "self_cpu_s", "steps"),
        ("  container CLI commands CPU s", "cli_cpu_s", "steps"),
        ("episodes", "episodes", "steps"),
        ("trainer s (in the process)", "trainer_s", "steps"),
    ]
    for label, key, by in rows:
        b, a = per("before", key, by), per("after", key, by)
        print(f"{label:<34} {b:>9.2f} {a:>9.2f} {a / b if b else float('nan'):>13.2f}")
    print(f"{'per episode':<34} {'before':>9} {'after':>9} {'after/before':>13}")
    for side in ("before", "after"):
        for r in totals[side]:
            r["other_cpu_s"] = r["machine_cpu_s"] - r["self_cpu_s"] - r["cli_cpu_s"]
    for label, key in (
        ("machine CPU s", "machine_cpu_s"),
        ("  training process CPU s", "self_cpu_s"),
        ("  container CLI commands CPU s", "cli_cpu_s"),
        ("  the rest (conmon, runc, tests, kernel)", "other_cpu_s"),
        ("engine s (summed over episodes)", "engine_s"),
        ("verification s (summed)", "verifier_s"),
    ):
        b, a = per("before", key, "episodes"), per("after", key, "episodes")
        print(f"{label:<34} {b:>9.3f} {a:>9.3f} {a / b if b else float('nan'):>13.2f}")
    kinds = sorted({k for side in totals.values() for r in side for k in r["calls"]})
    for kind in kinds:
        b = sum(r["calls"].get(kind, 0) for r in totals["before"]) / max(
            1, sum(r["episodes"] for r in totals["before"])
        )
        a = sum(r["calls"].get(kind, 0) for r in totals["after"]) / max(
            1, sum(r["episodes"] for r in totals["after"])
        )
        print(f"{'  calls: podman ' + kind:<34} {b:>9.2f} {a:>9.2f}")


if __name__ == "__main__":
    main()
