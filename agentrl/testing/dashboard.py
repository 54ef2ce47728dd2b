"""A synthetic run directory of any size, for the dashboard's benchmark and tests.

Written with the runtime's own record and metric types (`agentrl.episode.run.Recorder`, `TurnRecord`,
`Sample`, `StepMetrics`), so its files have exactly the shape a real run writes; the numbers in
them are made up (deterministic per seed) and say nothing about training.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

from agentrl.agent.loop import CommandOutput, TurnRecord
from agentrl.episode.record import RECORD_VERSION, Recorder
from agentrl.episode.sample import Sample, Status
from agentrl.rollout.metrics import StepMetrics

TASKS = ("count-lines", "hello-file", "make-dirs", "replace-word", "uppercase-file", "fix-build")


def write_episode(
    record_dir: Path,
    rng: random.Random,
    *,
    index: int,
    version: int,
    turns: int = 3,
    response_tokens: int = 120,
    prompt_tokens: int = 200,
    output_chars: int = 300,
    created_at: float | None = None,
) -> Path:
    """One complete episode record: header, `turns` turns, a result with one token segment."""
    task = TASKS[index % len(TASKS)]
    session = f"train-synth:{version}:{index}:{index % 4}:{index:08x}"
    rec = Recorder(record_dir / f"{task}__{session.replace(':', '_')}.jsonl")
    rec.write(
        "header",
        {
            "version": RECORD_VERSION,
            "task_id": task,
            "task_path": f"/tasks/{task}",
            "action_format": "fenced-bash",
            "run_id": "train-synth",
            "session_id": session,
            "prompt_id": f"{version}:{index // 4}",
            "sample_index": index % 4,
            "agent": {"max_turns": turns},
            "sampling": {"temperature": 1.0},
            "created_at": created_at if created_at is not None else time.time(),
        },
    )
    for t in range(turns):
        cmd = f"ls -la /app/dir{t}\n"
        out = CommandOutput(
            cmd, ("line of output\n" * (output_chars // 15))[:output_chars], "", 0, False, 0.01
        )
        rec.write(
            "turn",
            asdict(
                TurnRecord(
                    index=t,
                    model_text=f"Turn {t}: I will look around.\n```bash\n{cmd}```",
                    action={
                        "commands": [{"keystrokes": cmd, "duration": 1.0}],
                        "task_complete": t == turns - 1,
                        "error": None,
                        "warnings": [],
                    },
                    outputs=[out],
                    observation=f"New Terminal Output:\n$ {cmd}{out.stdout}",
                    weight_versions=[version],
                    engine_s=0.2,
                    sandbox_s=0.01,
                    finish_reason="stop",
                )
            ),
        )
    reward = float(rng.random() < 0.4)
    n = response_tokens
    mask = [1 if (i // 40) % 2 == 0 else 0 for i in range(n)]
    sample = Sample(
        prompt_id=f"{version}:{index // 4}",
        tokens=[rng.randrange(3, 3000) for _ in range(prompt_tokens + n)],
        prompt_length=prompt_tokens,
        loss_mask=mask,
        rollout_logprobs=[round(-rng.random() * 3, 4) if m else 0.0 for m in mask],
        reward=reward,
        status=Status.COMPLETED,
        end_reason="task_complete",
        sample_index=index % 4,
        weight_versions=[version],
        task_id=task,
    )
    rec.write(
        "result",
        {
            "status": "completed",
            "end_reason": "task_complete",
            "reward": reward,
            "outcome": "pass" if reward else "fail",
            "failure_cause": None,
            "rewards": {"reward": reward},
            "timings": {"engine_s": 0.6, "sandbox_s": 0.03, "verifier_s": 0.1},
            "verifier_log_tail": "1 passed" if reward else "1 failed",
            "samples": [sample.to_dict()],
        },
    )
    rec.close()
    return rec.path


def metrics_row(step: int, rng: random.Random) -> StepMetrics:
    return StepMetrics(
        step=step,
        weight_version=step - 1,
        wall_s=10.0,
        samples=16,
        groups=4,
        groups_incomplete=0,
        reward_mean=round(min(1.0, 0.2 + 0.01 * step + 0.05 * rng.random()), 4),
        pass_rate=round(min(1.0, 0.2 + 0.01 * step), 4),
        truncation_ratio=0.1,
        policy_failure_ratio=0.05,
        failures_by_cause={"sandbox_create": step % 3} if step % 3 else {},
        policy_failures_by_cause={},
        samples_exhausted=0,
        groups_filtered=1,
        stale_groups=0,
        stale_cancelled=0,
        internal_errors=0,
        version_mismatches=0,
        staleness_hist={0: 12, 1: 4},
        in_flight=8,
        buffered_groups=1,
        unfinished_groups=2,
        engine_s=30.0,
        sandbox_s=8.0,
        verifier_s=2.0,
        response_tokens=4000,
        tokens_per_s=400.0,
        extra={"trainer": {"loss": 0.01, "grad_norm": 1.0, "mismatch_kl": 1e-3, "mismatch_k1": 5e-4}},
        rollout_episodes=20,
        rollout_pass_rate=round(min(1.0, 0.18 + 0.01 * step), 4),
    )


def write_run(out: Path, *, episodes: int, steps: int, seed: int = 0, **episode_kw: int) -> Path:
    """<out>/config.json, metrics.jsonl (`steps` rows), evals.json and `episodes` records."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"env": {"name": "synthetic"}, "steps": steps}))
    with (out / "metrics.jsonl").open("w") as fh:
        for step in range(1, steps + 1):
            fh.write(metrics_row(step, rng).to_json() + "\n")
    evals = [{"label": "before", "step": 0, "pass@1": 0.2}, {"label": "after", "step": steps, "pass@1": 0.5}]
    (out / "evals.json").write_text(json.dumps(evals))
    per_version = max(episodes // max(steps, 1), 1)
    t0 = time.time() - episodes
    for i in range(episodes):
        write_episode(
            out / "records",
            rng,
            index=i,
            version=min(i // per_version, steps),
            created_at=t0 + i,
            **episode_kw,
        )
    return out
