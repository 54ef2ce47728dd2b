"""The verifier, shared by the oracle sweep and the episode runner (Harbor 0.25's algorithm, built
so that an agent optimised against the reward cannot move it; `docs/failures.md`).

1. Stop every process the agent started (`Sandbox.stop_processes`; servers listening on a socket
   survive, as a task may ask for a service).
2. Where the backend can (`Sandbox.run_tests`: podman), the tests run privately: in a container of
   their own over the agent's files, sharing only its network, with /tests and /logs/verifier that
   exist for the verifier's processes alone, set up and read from the host (no tool of the
   container's takes part). What the verification executed or loaded as code that the agent made
   decides `tampered` (`agentrl.sandbox.provenance`): no list of names to get around. The task's
   graded work (its working directory, unless a module there shadows one the verifier's Python
   provides) and what its reference solution installs (`save_footprint`) are allowed.
3. Elsewhere (Daytona, the fakes): the listed system paths are checked from outside
   (`Sandbox.tampered_paths`), then in the sandbox or in a copy of it that runs nothing of the
   agent's (`Sandbox.verification_copy`: Daytona with `private_verification`) `/tests` and
   `/logs/verifier` are recreated whatever they are now, `tests/` uploaded only now,
   `/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1` run, what it started stopped, and the
   files copied out through the backend.
4. Either way: the task's working directory, `[verifier.env]` and timeout, Python made unable to
   read planted byte code (`VERIFIER_PYTHON_ENV`; the task's own env wins); test.sh's exit code is
   ignored, as in Harbor; `reward.json` (takes precedence; every value numeric and finite) or
   `reward.txt` is read; every text kept is made printable.

Outcomes: `pass` (reward >= 1.0; the pass rate counts these), `fail` (any other reward in range),
`tampered` (reward 0, `cause` says why), `verifier-error` (no reward file, an empty, unparseable
or out-of-range one) and `timeout`. `infra_failure` is true for the last two: the verifier gave no
usable reward. After an agent phase every such outcome could be the agent's doing (`policy_failure`:
reward 0 with its cause, never a re-roll); in an oracle sweep it is the task's.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.episode.healthcheck import run_healthcheck
from agentrl.errors import TaskFormatError
from agentrl.sandbox.base import (
    REWARD_FILE_LIMIT,
    Sandbox,
    SandboxCreateError,
    SandboxPolicyError,
    SandboxProvider,
    printable,
)
from agentrl.sandbox.provenance import agent_code
from agentrl.tasks.config import ArtifactConfig, resolve_env_templates
from agentrl.tasks.task import Task, scripts_with_lf

log = logging.getLogger(__name__)
PASS_THRESHOLD = 1.0
# What a separate verifier environment may receive of the agent's artifacts, in all.
ARTIFACTS_LIMIT = 256 * 2**20
REWARD_RANGE = (0.0, 1.0)
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
    # With reference=True: the agent-made code the verification used (None: this backend has no
    # provenance, so nothing is known).
    agent_code: list[str] | None = None

    @property
    def infra_failure(self) -> bool:
        """The verifier produced no usable reward."""
        return self.outcome in ("verifier-error", "timeout")

    @property
    def policy_failure(self) -> bool:
        """After an agent phase, the agent's own commands could have caused this outcome (its
        artefacts hang or break the tests, it tampered, its code run by the tests wrote a reward
        out of range), so an episode scores it 0 with `cause` (docs/failures.md). In an oracle
        sweep the same outcomes are the task's own bug."""
        return self.outcome in ("tampered", "timeout", "verifier-error")


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


async def verify(
    sandbox: Sandbox,
    task: Task,
    *,
    timeout: float | None = None,
    reference: bool = False,
    footprint: Callable[[], Awaitable[frozenset[str]]] | None = None,
    tests_dir: Path | None = None,
) -> VerifyResult:
    """Run the task's verifier in `sandbox` after the agent phase and read its reward.

    Raises `TaskFormatError` for a missing tests/test.sh (one stored without its executable bit
    is made executable, as Harbor does; CRLF line ends of scripts are fixed) and lets sandbox
    infrastructure errors propagate; a `SandboxPolicyError` on the way (the agent broke the
    sandbox's shell or storage) becomes the outcome `tampered`. `timeout` overrides `[verifier]
    timeout_sec`. With a reward.json, `reward` is its "reward" key, or its first value.
    `reference=True` (the oracle sweep: what is in the sandbox is the task's own solution) trusts
    the agent-made code the verification uses and reports it in `agent_code`, for
    `save_footprint`. `footprint` computes the reference solution's footprint when none is saved
    yet and the agent's work needs it (`agentrl.episode.oracle.ensure_footprint`). `tests_dir`
    replaces the task's tests/ (a separate verifier's tests, bundled in its image).
    """
    tests_dir = tests_dir or task.tests_dir
    if not (tests_dir / "test.sh").is_file():
        raise TaskFormatError(
            str(tests_dir / "test.sh"), None, "tests/test.sh is missing", "every task needs a verifier script"
        )
    timeout = timeout or task.config.verifier.timeout_sec
    env = {
        **VERIFIER_PYTHON_ENV,
        **resolve_env_templates(task.config.verifier.env, str(task.path / "task.toml")),
    }
    user = task.config.verifier.user
    start = time.monotonic()
    used: list[str] | None = None
    try:
        await sandbox.stop_processes()
        with scripts_with_lf(tests_dir) as lf_tests:
            private = await sandbox.run_tests(lf_tests, timeout=timeout, env=env, user=user)
        if private is None:
            changed = await sandbox.tampered_paths()
            if changed:
                return _tampered(
                    start,
                    "system_files",
                    f"the agent changed files the verifier relies on: {_shown(changed)}",
                )
            async with sandbox.verification_copy() as target:
                timed_out, files = await _verify_inside(target, tests_dir, timeout, env, user)
        else:
            timed_out, files = private.timed_out, private.files
            judge = functools.partial(
                agent_code, private.opened, workdir=private.workdir, provided=private.provided.__contains__
            )
            used = judge()
            if used and not reference:
                # The footprint is read (and hashed, and computed) only when there is something to
                # judge: most verifications use no agent-made code at all.
                used = judge(trusted=load_footprint(task))
                if used and footprint is not None and task.solve_script is not None:
                    if not footprint_path(task).is_file():
                        used = judge(trusted=await footprint())
                if used:
                    return _tampered(
                        start,
                        "agent_code",
                        f"the verification used code or configuration the agent made or changed: {_shown(used)}"
                        + _FOOTPRINT_HINT * (task.solve_script is not None and footprint is None),
                    )
    except SandboxPolicyError as exc:
        return _tampered(start, exc.cause, str(exc))
    duration = time.monotonic() - start
    tail = printable(files.get("test-stdout.txt", "")[-3000:])
    if timed_out:
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
            "verifier-error",
            None,
            duration_s=duration,
            log_tail=tail,
            error=printable(error or ""),
            cause=cause,
        )
    reward = rewards.get("reward", next(iter(rewards.values()), 0.0))
    outcome = "pass" if reward >= PASS_THRESHOLD else "fail"
    return VerifyResult(outcome, reward, rewards, duration, tail, agent_code=used)


_FOOTPRINT_HINT = (
    " (if the task asks for exactly this, run `agentrl tasks oracle` on it once: what its reference"
    " solution installs is then trusted)"
)


def _shown(paths: list[str]) -> str:
    shown = ", ".join(printable(p) for p in paths[:10])
    return shown + (f" and {len(paths) - 10} more" if len(paths) > 10 else "")


async def _verify_inside(
    sandbox: Sandbox, tests: Path, timeout: float, env: dict[str, str], user: str | int | None
) -> tuple[bool, dict[str, str]]:
    """Where the backend has no private verification: recreate /tests and /logs/verifier inside the
    sandbox (the agent may have planted a conftest.py, made test.sh a directory or /logs a file),
    upload tests/, run test.sh there and copy the results out through the backend."""
    prepared = await sandbox.exec(PREPARE, timeout=60)
    if not prepared.ok:
        raise SandboxPolicyError(
            f"/tests and /logs/verifier could not be recreated: {printable(prepared.stderr.strip()[-300:])}",
            cause="verifier_inputs",
        )
    with scripts_with_lf(tests) as lf_tests:
        await sandbox.upload(lf_tests, "/tests")
    await sandbox.exec("chmod +x /tests/test.sh", timeout=60)
    run = await sandbox.exec(
        "/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1", timeout=timeout, env=env, user=user
    )
    # Whatever test.sh started must not outlive it either (the agent's code runs under it).
    await sandbox.stop_processes()
    files = await _read_verifier_logs(sandbox)
    if not files.get("test-stdout.txt") and run.stderr:
        files["test-stdout.txt"] = run.stderr
    return run.timed_out, files


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


async def verify_phase(
    sandbox: Sandbox,
    task: Task,
    *,
    provider: SandboxProvider,
    run_id: str,
    reference: bool = False,
    footprint: Callable[[], Awaitable[frozenset[str]]] | None = None,
    artifacts_dir: Path | None = None,
) -> VerifyResult:
    """What follows an agent phase, as Harbor runs it (2.2 step 5): `main`'s `[[verifier.collect]]`
    hooks and artifacts, then (a separate verifier: with `main`'s processes stopped) the other
    compose services' hooks and artifacts, into `artifacts_dir` with Harbor's `manifest.json` when
    given; then the verifier, over the agent's sandbox ("shared", switching the network to the
    verifier phase's policy where it differs) or in a fresh environment of its own
    (`Task.verifier_task`, "separate") that gets nothing of the agent's but the artifacts, each at
    its own path, copied out within `ARTIFACTS_LIMIT` (over it, a policy outcome there; elsewhere
    the artifact is only marked failed, as Harbor's collection is best effort)."""
    vtask = task.verifier_task
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        collected: list[Collected] = []
        dst = artifacts_dir
        if dst is None and vtask is not None:  # a training episode's separate verifier: not kept
            dst = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentrl-artifacts-")))
        services = list(dict.fromkeys(["main", *(h.service for h in task.config.verifier.collect),
                                       *(a.service or "main" for a in task.artifacts)]))  # fmt: skip
        try:
            for service in services:
                if service != "main" and service == services[1] and vtask is not None and _last_phase(task):
                    # Harbor stops `main` before the sidecars in separate mode (on the last step):
                    # nothing the agent left running there touches what they hand over.
                    await sandbox.stop_processes()
                target = sandbox.service(service)
                await run_collect_hooks(target, task, service)
                if dst is not None:
                    collected += await collect_artifacts(
                        target, task, dst, service, strict=vtask is not None, claimed=collected
                    )
        except SandboxPolicyError as exc:
            return _tampered(start, exc.cause or "artifact_too_large", str(exc))
        if artifacts_dir is not None:
            write_manifest(artifacts_dir, collected)
        if vtask is None:
            return await _verify_shared(sandbox, task, reference=reference, footprint=footprint)
        return await _verify_separate(
            task, vtask, collected, provider=provider, run_id=run_id, reference=reference, footprint=footprint
        )


def _last_phase(task: Task) -> bool:
    step = getattr(task, "step_name", None)
    return step is None or task.root.steps[-1].step_name == step


async def _verify_separate(
    task: Task,
    vtask: Task,
    collected: list[Collected],
    *,
    provider: SandboxProvider,
    run_id: str,
    reference: bool,
    footprint: Callable[[], Awaitable[frozenset[str]]] | None,
) -> VerifyResult:
    """The verifier in a fresh environment from its own image: its healthcheck (if it has one)
    before anything of the agent's is in it, /tests from the image where bundled, the artifacts at
    their source paths, then the tests."""
    build = vtask.config.environment.build_timeout_sec
    try:
        vbox = await asyncio.wait_for(provider.create(vtask, run_id=run_id), build)
    except TimeoutError:
        raise SandboxCreateError(
            f"the verifier environment of {task.task_id} not ready after {build:.0f}s"
        ) from None
    async with vbox:
        # Harbor runs no healthcheck here; agentrl does (the task asked for it), and before the
        # artifacts, so a failure is the environment's, never the agent's.
        await run_healthcheck(vbox, vtask)
        with tempfile.TemporaryDirectory(prefix="agentrl-tests-") as scratch:
            tests_dir = None
            if vtask.bundled:  # before anything of the agent's is in it
                tests_dir = Path(scratch)
                try:
                    await vbox.download("/tests", tests_dir, limit_bytes=ARTIFACTS_LIMIT)
                except FileNotFoundError:
                    raise TaskFormatError(
                        str(vtask.environment_dir),
                        None,
                        "the verifier image has no /tests",
                        "COPY the tests to /tests",
                    ) from None
            for item in collected:
                if item.path is not None:
                    await vbox.upload(item.path, item.artifact.source)
            return await verify(vbox, task, reference=reference, footprint=footprint, tests_dir=tests_dir)


async def _verify_shared(
    sandbox: Sandbox,
    task: Task,
    *,
    reference: bool,
    footprint: Callable[[], Awaitable[frozenset[str]]] | None,
) -> VerifyResult:
    config = task.config
    agent = config.phase_network("agent"), config.phase_hosts("agent")
    verifier = config.phase_network("verifier"), config.phase_hosts("verifier")
    if agent == verifier:
        return await verify(sandbox, task, reference=reference, footprint=footprint)
    # Harbor's phase switch, from outside the sandbox; back for a next step's agent.
    await sandbox.set_network(*verifier)
    try:
        return await verify(sandbox, task, reference=reference, footprint=footprint)
    finally:
        if task.root.steps:
            await sandbox.set_network(*agent)


async def run_collect_hooks(sandbox: Sandbox, task: Task, service: str = "main") -> None:
    """`service`'s `[[verifier.collect]]` hooks, best effort (a failing hook is logged, as in
    Harbor), each in a clean shell as its user under its timeout."""
    for hook in task.config.verifier.collect:
        if hook.service != service:
            continue
        try:
            run = await sandbox.exec(hook.command, timeout=int(hook.timeout_sec), env={}, user=hook.user)
        except SandboxPolicyError as exc:
            log.warning("%s: collect hook %r: %s", task.task_id, hook.command[:80], exc)
            continue
        if not run.ok:
            why = "timed out" if run.timed_out else f"exited {run.exit_code}"
            log.warning(
                "%s: collect hook %r %s: %s",
                task.task_id,
                hook.command[:80],
                why,
                printable(run.stderr[-300:]),
            )


@dataclass
class Collected:
    """One artifact as collected: its copy (None unless `ok` or `empty`) and Harbor's status."""

    artifact: ArtifactConfig
    path: Path | None
    status: str  # "ok" | "empty" | "failed" | "skipped"
    kind: str = "file"  # or "directory"

    @property
    def destination(self) -> str:
        return self.artifact.destination or self.artifact.source.strip("/")


async def collect_artifacts(
    sandbox: Sandbox,
    task: Task,
    dst: Path,
    service: str = "main",
    *,
    strict: bool = False,
    claimed: list[Collected] = (),  # type: ignore[assignment]
) -> list[Collected]:
    """`service`'s artifacts copied under `dst` as Harbor lays them out (`destination`, else the
    source path without its root; every service shares that one base), bounded in all by
    `ARTIFACTS_LIMIT` (with what `claimed` already holds); `exclude` patterns applied to
    directories; a claim on a path already collected (here or in `claimed`) is skipped; a missing
    one is `failed`. Over the limit: `SandboxPolicyError` with `strict` (a separate verifier needs
    them), else that artifact is `failed`."""
    out: list[Collected] = []
    budget = ARTIFACTS_LIMIT - sum(_size(c.path) for c in claimed if c.path is not None)
    taken = [c.destination for c in claimed if c.status != "skipped"]
    for art in task.artifacts:
        if (art.service or "main") != service:
            continue
        item = Collected(art, None, "failed")
        rel = item.destination
        if any(rel == c or rel.startswith(c + "/") or c.startswith(rel + "/") for c in taken):
            log.warning("%s: artifact %s overlaps one collected before: skipped", task.task_id, art.source)
            out.append(Collected(art, None, "skipped"))
            continue
        taken.append(rel)
        local = dst / rel
        try:
            await sandbox.download(art.source.rstrip("/") or "/", local, limit_bytes=budget)
        except FileNotFoundError:
            out.append(item)
            continue
        except SandboxPolicyError:
            if strict:
                raise
            shutil.rmtree(local, ignore_errors=True) if local.is_dir() else local.unlink(missing_ok=True)
            out.append(item)
            continue
        if local.is_dir():
            for path in sorted(local.rglob("*"), reverse=True):
                rel_path = path.relative_to(local).as_posix()
                if any(
                    fnmatch.fnmatch(rel_path, pat) or fnmatch.fnmatch(path.name, pat) for pat in art.exclude
                ):
                    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            files = [p for p in local.rglob("*") if p.is_file()]
            budget -= sum(p.stat().st_size for p in files)
            out.append(Collected(art, local, "ok" if files else "empty", "directory"))
        else:
            budget -= local.stat().st_size
            out.append(Collected(art, local, "ok"))
    return out


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.is_file() else 0


def write_manifest(dst: Path, collected: list[Collected]) -> None:
    """Harbor's `artifacts/manifest.json`: one entry per artifact, in order."""
    dst.mkdir(parents=True, exist_ok=True)
    entries = [
        {
            "source": c.artifact.source,
            "destination": f"artifacts/{c.destination}" if c.destination else "artifacts",
            "type": c.kind,
            "status": c.status,
            "service": c.artifact.service if c.artifact.service not in (None, "main") else None,
            "exclude": list(c.artifact.exclude) if c.kind == "directory" else [],
        }
        for c in collected
    ]
    (dst / "manifest.json").write_text(json.dumps(entries, indent=2) + "\n")


def footprint_path(task: Task) -> Path:
    """Where the reference solution's footprint of `task` is kept: under `$AGENTRL_CACHE`, keyed by
    the content of the task's files, so an edited task is validated afresh."""
    files = sorted(p for p in task.path.rglob("*") if p.is_file())
    cache = Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))
    stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)
    step = getattr(task, "step_name", None)  # a multi-step task's steps each have their own
    name = _content_digest(str(task.path), stamp) + (
        f"-step-{hashlib.sha256(step.encode()).hexdigest()[:8]}" if step else ""
    )
    return cache / "footprints" / f"{name}.json"


@functools.lru_cache(maxsize=1024)
def _content_digest(root: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for path, _, _ in stamp:
        digest.update(os.path.relpath(path, root).encode() + b"\0" + Path(path).read_bytes())
    return digest.hexdigest()[:24]


def save_footprint(task: Task, paths: Collection[str]) -> None:
    """Record the agent-made code the task's reference solution made its verifier use (a tool it
    installs, a system file it replaces as asked): an episode may use the same."""
    target = footprint_path(task)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"task": task.task_id, "trusted": sorted(paths)}, indent=1))
    tmp.replace(target)


def load_footprint(task: Task) -> frozenset[str]:
    try:
        data = json.loads(footprint_path(task).read_text())
    except (OSError, ValueError):
        return frozenset()
    return frozenset(p for p in data.get("trusted", []) if isinstance(p, str))
