"""The reward curve of a run (`<out>/metrics.jsonl` and its evals) as a PNG (needs matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def plot_run(
    metrics_path: Path, evals: list[dict[str, Any]], png: Path, *, title: str, window: int = 4
) -> None:
    """Rollout pass rate over every finished episode and over the trained groups (`window`-step
    means), with the evals' pass@1 as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))

    def smoothed(passed: str, count: str) -> list[float]:
        out = []
        for i in range(len(rows)):
            win = rows[max(0, i - window + 1) : i + 1]
            out.append(sum(r[passed] * r[count] for r in win) / max(sum(r[count] for r in win), 1))
        return out

    ax.plot(
        steps,
        smoothed("rollout_pass_rate", "rollout_episodes"),
        label=f"rollout pass rate, all finished episodes ({window}-step mean)",
        linewidth=2,
    )
    ax.plot(
        steps,
        smoothed("pass_rate", "samples"),
        label=f"pass rate of the trained groups ({window}-step mean)",
        linewidth=1,
        linestyle="--",
    )
    for e, marker in zip(evals, ("o", "s", "^", "D", "v"), strict=False):
        ax.scatter(
            [e["step"]], [e["pass@1"]], marker=marker, s=60, label=f"eval pass@1 ({e['label']})", zorder=3
        )
    ax.set_xlabel("trainer step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
