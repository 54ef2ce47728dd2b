"""The verifier, shared by the oracle sweep and the episode runner (Harbor 0.25's algorithm).

1. Clear `/logs/verifier` entirely (Harbor removes only the reward files; we also drop anything the
   agent planted there) and recreate it.
2. Upload `tests/` to `/tests` only now: tests are never inside the sandbox during the agent phase.
3. Run `/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1` in the task's working directory with
   `[verifier.env]` and the verifier timeout. Its exit code is ignored, as in Harbor.
4. Read `reward.json` (takes precedence; every value numeric and finite) or `reward.txt` (one float).

Outcomes: `pass` (reward >= 1.0; the pass rate counts these), `fail` (any other reward),
`verifier-error` (no reward file, an empty or unparseable one) and `timeout`. The last two are
infrastructure failures for the caller: a broken verifier never becomes a reward of 0.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

from agentrl.errors import TaskFormatError
from agentrl.sandbox.base import Sandbox
from agentrl.tasks import Task, resolve_env_templates

PASS_THRESHOLD = 1.0


@dataclass
class VerifyResult:
    outcome: str  # "pass" | "fail" | "verifier-error" | "timeout"
    reward: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    log_tail: str = ""
    error: str | None = None

    @property
    def infra_failure(self) -> bool:
        return self.outcome in ("verifier-error", "timeout")


def parse_reward(json_text: str | None, txt_text: str | None) -> tuple[dict[str, float] | None, str | None]:
    """Harbor's reward parsing: `(rewards, None)` or `(None, why)`. Arguments are file contents, None
    for a missing file. One deliberate difference: JSON booleans are not numbers here."""
    if json_text is not None:
        if json_text == "":
            return None, "reward.json is empty"
        try:
            data = json.loads(json_text)
        except json.JSONDecodeError as exc:
            return None, f"reward.json is not valid JSON: {exc}"
        if not isinstance(data, dict):
            return None, "reward.json must be an object of numbers"
        for k, v in data.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                return None, f"reward.json value {k!r} is not a finite number: {v!r}"
        return {k: float(v) for k, v in data.items()}, None
    if txt_text is not None:
        if txt_text == "":
            return None, "reward.txt is empty"
        try:
            value = float(txt_text.strip())
        except ValueError:
            return None, f"reward.txt is not a number: {txt_text.strip()[:80]!r}"
        if not math.isfinite(value):
            return None, f"reward.txt is not finite: {value}"
        return {"reward": value}, None
    return None, "test.sh wrote neither /logs/verifier/reward.txt nor reward.json"


async def verify(sandbox: Sandbox, task: Task, *, timeout: float | None = None) -> VerifyResult:
    """Run the task's verifier in `sandbox` after the agent phase and read its reward.

    Raises `TaskFormatError` for a missing or non-executable tests/test.sh and lets sandbox
    transport errors propagate; `timeout` overrides `[verifier] timeout_sec`. With a reward.json,
    `reward` is its "reward" key, or its first value when it has none.
    """
    if not task.test_script.is_file():
        raise TaskFormatError(
            str(task.test_script), None, "tests/test.sh is missing", "every task needs a verifier script"
        )
    if not os.access(task.test_script, os.X_OK):
        raise TaskFormatError(
            str(task.test_script), None, "tests/test.sh is not executable", "chmod +x tests/test.sh"
        )
    timeout = timeout or task.config.verifier.timeout_sec
    env = resolve_env_templates(task.config.verifier.env, str(task.path / "task.toml"))
    start = time.monotonic()
    await sandbox.exec(
        "rm -rf /logs/verifier && mkdir -p /logs/verifier && chmod 777 /logs/verifier", timeout=60
    )
    await sandbox.upload(task.tests_dir, "/tests")
    await sandbox.exec("chmod +x /tests/test.sh", timeout=60)
    run = await sandbox.exec(
        "/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1",
        timeout=timeout,
        env=env or None,
        user=task.config.verifier.user,
    )
    # Plain `cat`s (one pipe round trip each through the persistent shell) keep every backend,
    # fakes included, on the same simple protocol.
    files: dict[str, str] = {}
    for name in ("reward.json", "reward.txt"):
        res = await sandbox.exec(f"cat /logs/verifier/{name}", timeout=60)
        if res.exit_code == 0:
            files[name] = res.stdout
    tail = (await sandbox.exec("tail -c 3000 /logs/verifier/test-stdout.txt", timeout=60)).stdout
    duration = time.monotonic() - start
    if run.timed_out:
        return VerifyResult(
            "timeout",
            None,
            duration_s=duration,
            log_tail=tail,
            error=f"tests/test.sh did not finish within {timeout:.0f}s",
        )
    rewards, error = parse_reward(files.get("reward.json"), files.get("reward.txt"))
    if rewards is None:
        return VerifyResult(
            "verifier-error", None, duration_s=duration, log_tail=tail or run.stderr, error=error
        )
    reward = rewards.get("reward", next(iter(rewards.values()), 0.0))
    outcome = "pass" if reward >= PASS_THRESHOLD else "fail"
    return VerifyResult(outcome, reward, rewards, duration, tail)
