"""Agent-loop overhead per turn: parsing, token bookkeeping and observation tokenizing.

A zero-latency engine (replies are pre-tokenized, returned at once) and an instant sandbox isolate
the loop's own cost. The context grows to ~8k tokens over the episode; the script reports the
per-turn overhead p50/p95 and, side by side, the same loop with the template prefix check off,
which isolates the cost of that check.

    python benchmarks/agent_bench.py [--turns 40] [--context 8192]
Goal: p50 <= 1 ms per turn at 8k context.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.agent.actions import get_format
from agentrl.agent.loop import AgentConfig, run_agent
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import Engine, Generation, SamplingParams
from agentrl.sandbox.base import ExecResult, Sandbox


class ZeroLatencyEngine(Engine):
    """Returns pre-tokenized replies instantly and records when each call was made."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = replies
        self.calls: list[float] = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ):
        self.calls.append(time.perf_counter())
        ids = self.replies[min(len(self.calls) - 1, len(self.replies) - 1)]
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


class InstantSandbox(Sandbox):
    sandbox_id = "instant"

    def __init__(self, output: str) -> None:
        self.output = output

    async def exec(self, cmd, *, timeout=None, cwd=None, env=None, user=None):  # type: ignore[override]
        return ExecResult(self.output, "", 0, False, 0.0)

    async def upload(self, src, dst):  # type: ignore[override]
        return None

    async def download(self, src, dst):  # type: ignore[override]
        return None

    async def close(self) -> None:
        return None


def tokenizer():
    try:
        from agentrl.models.tiny import load_tiny

        return load_tiny()[1]
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from chat_tokenizer import byte_tokenizer

        return byte_tokenizer()


async def measure(turns: int, context: int, check_prefix: bool) -> tuple[list[float], int]:
    tok = tokenizer()
    fmt = get_format("terminus-json")
    reply = fmt.render(
        ["ls -la /app && cat /app/notes.txt"],
        task_complete=False,
        analysis="Look around.",
        plan="List files, then read notes.",
    )
    reply_ids = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    final_ids = tok.encode(fmt.render([], task_complete=True), add_special_tokens=False) + [tok.eos_token_id]
    obs_tokens = 120
    line = "drwxr-xr-x 2 root root 4096 file.txt\n"
    per_line = len(tok.encode(line, add_special_tokens=False))
    output = line * max(1, obs_tokens // per_line)
    engine = ZeroLatencyEngine([reply_ids] * turns + [final_ids])
    renderer = ChatRenderer(tok)
    run = await run_agent(
        engine=engine,
        sandbox=InstantSandbox(output),
        renderer=renderer,
        action_format=fmt,
        instruction="Summarize the notes in /app.",
        sampling=SamplingParams(max_new_tokens=256),
        # The session budget ends the episode once the context reaches `context` tokens.
        config=AgentConfig(
            max_turns=turns, max_total_tokens=context, max_new_tokens=256, check_prefix=check_prefix
        ),
        session_id="bench",
    )
    end = time.perf_counter()
    # Between consecutive engine calls the loop did everything but generate: that is its overhead.
    per_turn = [(b - a) * 1e3 for a, b in itertools.pairwise([*engine.calls, end])]
    return per_turn, run.segments[-1].total_len


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=1000, help="cap; the token budget ends the episode")
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args()
    rows = []
    for check in (True, False):
        asyncio.run(measure(4, 512, check))  # warm-up: template compilation, tokenizer caches
        per_turn, ctx = asyncio.run(measure(args.turns, args.context, check))
        rows.append(
            (check, statistics.median(per_turn), sorted(per_turn)[int(0.95 * (len(per_turn) - 1))], ctx)
        )
    print(f"{'prefix check':>12} {'p50 ms/turn':>12} {'p95 ms/turn':>12} {'final context':>14}")
    for check, p50, p95, ctx in rows:
        print(f"{'on' if check else 'off':>12} {p50:12.3f} {p95:12.3f} {ctx:14d}")
    on, off = rows[0][1], rows[1][1]
    print(f"prefix check costs {on - off:.3f} ms/turn ({on / off:.2f}x of the loop without it)")
    print(f"goal p50 <= 1 ms at {args.context} tokens: {'met' if on <= 1.0 else 'NOT met'} (p50 {on:.3f} ms)")


if __name__ == "__main__":
    main()
