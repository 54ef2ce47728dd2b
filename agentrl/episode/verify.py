"""The verifier, shared by the oracle sweep and the episode runner (Harbor 0.25's algorithm, hardened
against an agent that tries to forge its reward; `docs/failures.md`).

1. Stop every process the agent started (`Sandbox.stop_processes`; servers listening on a socket
   survive, as a task may ask for a service): nothing it left running can rewrite the reward, the
   tests or their inputs while they run.
2. Look for tampering from outside the sandbox (`Sandbox.tampered_paths`: changed system files or
   an interpreter, a module shadowing the test harness (`pytest.py`), `sitecustomize`, `.pth` or
   pytest configuration planted where the tests would pick it up). Tampering is the outcome `tampered`, reward 0: a policy failure.
3. Remove `/tests` and `/logs/verifier` whatever they are now (the agent may have planted a
   conftest.py, made test.sh a directory or /logs a file) and recreate them; upload `tests/` to
   `/tests` only now: tests are never inside the sandbox during the agent phase.
4. Run `/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1` in the task's working directory with
   `[verifier.env]` and the verifier timeout, Python made unable to read planted byte code
   (`VERIFIER_PYTHON_ENV`; the task's own env wins). Its exit code is ignored, as in Harbor.
5. Copy `/logs/verifier` out of the sandbox (through the backend, never the sandbox's own `cat`)
   and read `reward.json` (takes precedence; every value numeric and finite) or `reward.txt`.

Outcomes: `pass` (reward >= 1.0; the pass rate counts these), `fail` (any other reward in range),
`tampered` (reward 0, `cause` says why), `verifier-error` (no reward file, an empty, unparseable
or out-of-range one) and `timeout`. `infra_failure` is true for the last two: the verifier gave no
usable reward. Whether that is the agent's doing is the caller's call: after an agent phase it could
be (`policy_failure`), in an oracle sweep it is the task's.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.errors import TaskFormatError
from agentrl.sandbox.base import Sandbox, SandboxPolicyError
from agentrl.tasks.config import resolve_env_templates
from agentrl.tasks.task import Task, scripts_with_lf

PASS_THRESHOLD = 1.0
REWARD_RANGE = (0.0, 1.0)
REWARD_FILE_LIMIT = 64 * 1024  # bytes; a larger reward file is a verifier error, never read whole
VERIFIER_PYTHON_ENV = {
    # Planted byte code is never read (the cache lives elsewhere, emptied first) and none is
    # written. Module shadowing from the working directory (a `pytest.py` next to the work) is
    # detected as tampering instead of blocked with PYTHONSAFEPATH, which would also break the
    # many tests that import the project from the working directory.
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONPYCACHEPREFIX": "/tmp/.agentrl-verifier-pycache",
}
PREPARE = (
    "rm -rf /tests /logs/verifier /tmp/.agentrl-verifier-pycache"
    " && ( [ -d /logs ] && [ ! -L /logs ] || rm -rf /logs )"
    " && mkdir -p /tests /logs/verifier && chmod 777 /logs /logs/verifier"
)


@dataclass
class VerifyResult:
    outcome: str  # "pass" | "fail" | "tampered" | "verifier-error" | "timeout"
    reward: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    log_tail: str = ""
    error: str | None = None
    cause: str | None = None  # why, for anything but pass and fail (counted in metrics)

    @property
    def infra_failure(self) -> bool:
        """The verifier produced no usable reward."""
        return self.outcome in ("verifier-error", "timeout")

    @property
    def policy_failure(self) -> bool:
        """After an agent phase, the agent's own commands could have caused this outcome (its
        artefacts hang or break the tests, it tampered), so an episode scores it 0 with `cause`
        (docs/failures.md). A reward out of range is the task's own bug: never the agent's."""
        return (
            self.outcome in ("tampered", "timeout", "verifier-error") and self.cause != "reward_out_of_range"
        )


def parse_reward(
    json_text: str | None, txt_text: str | None, reward_range: tuple[float, float] | None = REWARD_RANGE
) -> tuple[dict[str, float] | None, str | None]:
    """Harbor's reward parsing: `(rewards, None)` or `(None, why)`. Arguments are file contents, None
    for a missing file. Deliberate differences: JSON booleans are not numbers, and with
    `reward_range` every value must lie in it (the value is shown when it does not)."""
    rewards, error = _parse_reward(json_text, txt_text)
    if rewards is not None and reward_range is not None:
        low, high = reward_range
        for k, v in rewards.items():
            if not low <= v <= high:
                return None, f"reward {k!r} = {v!r} is outside [{low:g}, {high:g}]"
    return rewards, error


def _parse_reward(json_text: str | None, txt_text: str | None) -> tuple[dict[str, float] | None, str | None]:
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

    Raises `TaskFormatError` for a missing tests/test.sh (one stored without its executable bit
    is made executable inside, as Harbor does; CRLF line ends of scripts are fixed) and lets sandbox
    infrastructure errors propagate; a `SandboxPolicyError` on the way (the agent broke the
    sandbox's shell or storage) becomes the outcome `tampered`. `timeout` overrides `[verifier]
    timeout_sec`. With a reward.json, `reward` is its "reward" key, or its first value.
    """
    if not task.test_script.is_file():
        raise TaskFormatError(
            str(task.test_script), None, "tests/test.sh is missing", "every task needs a verifier script"
        )
    timeout = timeout or task.config.verifier.timeout_sec
    env = {
        **VERIFIER_PYTHON_ENV,
        **resolve_env_templates(task.config.verifier.env, str(task.path / "task.toml")),
    }
    start = time.monotonic()
    try:
        await sandbox.stop_processes()
        changed = await sandbox.tampered_paths()
        if changed:
            shown = ", ".join(changed[:10]) + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
            return _tampered(
                start, "system_files", f"the agent changed files the verifier relies on: {shown}"
            )
        prepared = await sandbox.exec(PREPARE, timeout=60)
        if not prepared.ok:
            return _tampered(
                start,
                "verifier_inputs",
                f"/tests and /logs/verifier could not be recreated: {prepared.stderr.strip()[-300:]}",
            )
        with scripts_with_lf(task.tests_dir) as tests_dir:
            await sandbox.upload(tests_dir, "/tests")
        await sandbox.exec("chmod +x /tests/test.sh", timeout=60)
        run = await sandbox.exec(
            "/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1",
            timeout=timeout,
            env=env,
            user=task.config.verifier.user,
        )
        # Whatever test.sh started must not outlive it either (the agent's code runs under it).
        await sandbox.stop_processes()
        files = await _read_verifier_logs(sandbox)
    except SandboxPolicyError as exc:
        return _tampered(start, exc.cause, str(exc))
    duration = time.monotonic() - start
    tail = files.get("test-stdout.txt", "")[-3000:]
    if run.timed_out:
        return VerifyResult(
            "timeout",
            None,
            duration_s=duration,
            log_tail=tail,
            error=f"tests/test.sh did not finish within {timeout:.0f}s",
            cause="verifier_timeout",
        )
    rewards, error = parse_reward(
        files.get("reward.json"), files.get("reward.txt"), task.config.verifier.reward_range
    )
    if rewards is None:
        cause = "reward_out_of_range" if error and "outside" in error else "verifier_error"
        return VerifyResult(
            "verifier-error", None, duration_s=duration, log_tail=tail or run.stderr, error=error, cause=cause
        )
    reward = rewards.get("reward", next(iter(rewards.values()), 0.0))
    outcome = "pass" if reward >= PASS_THRESHOLD else "fail"
    return VerifyResult(outcome, reward, rewards, duration, tail)


def _tampered(start: float, cause: str, error: str) -> VerifyResult:
    return VerifyResult("tampered", 0.0, {"reward": 0.0}, time.monotonic() - start, error=error, cause=cause)


async def _read_verifier_logs(sandbox: Sandbox) -> dict[str, str]:
    """The verifier's files, copied out through the backend (`Sandbox.fetch_files`, never the
    sandbox's own tools): reward files up to `REWARD_FILE_LIMIT` bytes, the log's tail; links are
    not followed."""
    files: dict[str, str] = {}
    names = ["reward.json", "reward.txt", "test-stdout.txt"]
    with tempfile.TemporaryDirectory(prefix="agentrl-verifier-") as tmp:
        for name in await sandbox.fetch_files("/logs/verifier", names, Path(tmp)):
            path = Path(tmp) / name
            if path.is_symlink() or not path.is_file():
                continue
            size = path.stat().st_size
            with path.open("rb") as fh:
                if name == "test-stdout.txt":
                    fh.seek(max(0, size - 3000))
                    files[name] = fh.read().decode(errors="replace")
                elif size > REWARD_FILE_LIMIT:
                    files[name] = f"<{size} bytes or more: too large for a reward file>"
                else:
                    files[name] = fh.read().decode(errors="replace")
    return files
