"""Tasks written the way public corpora write them: scripts stored without their executable bit or
with CRLF line ends, a multi-step task, a healthcheck, phase network overrides, env templates,
a Dockerfile that copies a file it does not have. They load, lint with the expected findings,
are refused where agentrl would run them wrongly, and the runnable ones pass the oracle."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agentrl.episode.healthcheck import HealthcheckError, run_healthcheck
from agentrl.errors import TaskFormatError
from agentrl.sandbox.base import ExecResult
from agentrl.sandbox.lint import lint_task, warning_kinds
from agentrl.tasks.task import load_task

HELLO = Path(__file__).resolve().parents[1] / "envs" / "tbench2" / "tasks" / "hello-file"


def corpus_task(root: Path, name: str, *, toml_extra: str = "", dockerfile_extra: str = "") -> Path:
    d = root / name
    shutil.copytree(HELLO, d)
    (d / "tests" / "test.sh").chmod(0o644)
    (d / "solution" / "solve.sh").chmod(0o644)
    if toml_extra:
        (d / "task.toml").write_text((d / "task.toml").read_text() + "\n" + toml_extra + "\n")
    if dockerfile_extra:
        df = d / "environment" / "Dockerfile"
        df.write_text(df.read_text() + dockerfile_extra + "\n")
    return d


def based_on(root: Path, name: str, image: str) -> Path:
    """A corpus task whose Dockerfile starts FROM `image` (its COPY source present)."""
    d = corpus_task(root, name)
    df = d / "environment" / "Dockerfile"
    df.write_text(df.read_text().replace("FROM debian:bookworm-slim", f"FROM {image}"))
    (d / "environment" / "COPY_ME").write_text("")
    return d


def test_non_executable_and_crlf_scripts_lint_as_warnings(tmp_path: Path) -> None:
    d = corpus_task(tmp_path, "crlf")
    script = d / "solution" / "solve.sh"
    script.write_bytes(script.read_bytes().replace(b"\n", b"\r\n"))
    result = lint_task(load_task(d))
    assert result.ok
    assert any("tests/test.sh is not executable" in w for w in result.warnings)
    assert any("solution/solve.sh has CRLF line ends" in w for w in result.warnings)


def test_a_multi_step_task_resolves_each_step_as_harbor_does(tmp_path: Path) -> None:
    d = corpus_task(
        tmp_path,
        "multi",
        toml_extra='[[steps]]\nname = "one"\nmin_reward = 0.5\n'
        '[steps.agent]\ntimeout_sec = 30\n[steps.verifier]\nenv = { B = "2" }\n\n[[steps]]\nname = "two"',
    )
    (d / "instruction.md").unlink()  # multi-step tasks have per-step instructions
    (d / "task.toml").write_text('multi_step_reward_strategy = "final"\n' + (d / "task.toml").read_text())
    task = load_task(d)
    with pytest.raises(TaskFormatError, match=r"steps/one/instruction\.md: instruction\.md is missing"):
        task.validate()
    for name in ("one", "two"):
        (d / "steps" / name).mkdir(parents=True)
        (d / "steps" / name / "instruction.md").write_text(f"Step {name}.\n")
    (d / "steps" / "two" / "tests").mkdir()
    (d / "steps" / "two" / "tests" / "test.sh").write_text(
        "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"
    )
    task = load_task(d)
    assert lint_task(task).ok and task.instruction == ""
    one, two = task.steps
    assert (one.instruction, two.instruction) == ("Step one.\n", "Step two.\n")
    assert one.tests_dir == d / "tests" and two.tests_dir == d / "steps" / "two" / "tests"
    assert one.solution_dir == d / "solution"  # no step solution: the task's
    assert task.config.reward_strategy == "final" and one.step.min_reward == 0.5
    # the agent timeout is the step's, else the task's; the verifier timeout never inherits (600)
    assert (
        one.config.agent.timeout_sec == 30 and two.config.agent.timeout_sec == task.config.agent.timeout_sec
    )
    assert one.config.verifier.timeout_sec == 600.0 and one.config.verifier.env.get("B") == "2"
    (d / "task.toml").write_text((d / "task.toml").read_text().replace('name = "two"', 'name = "ONE"'))
    with pytest.raises(TaskFormatError, match="used twice"):
        load_task(d).config  # noqa: B018
    (d / "task.toml").write_text((d / "task.toml").read_text().replace('name = "ONE"', 'name = "a/b"'))
    with pytest.raises(TaskFormatError, match="may not hold"):
        load_task(d).config  # noqa: B018


def test_phase_network_overrides_that_differ_are_switched_not_refused(tmp_path: Path) -> None:
    # (Harbor switches a sandbox's policy between phases; `set_network` does it on podman and
    # Daytona, tests/test_verifier_env_podman.py)
    d = corpus_task(tmp_path, "net")
    text = (d / "task.toml").read_text().replace("[agent]\n", '[agent]\nnetwork_mode = "public"\n')
    (d / "task.toml").write_text(text)
    task = load_task(d)
    result = lint_task(task)
    assert result.ok and task.config.phase_network("agent") == "public"
    assert task.config.phase_network("verifier") == "no-network"


def test_public_network_is_a_warning(tmp_path: Path) -> None:
    d = corpus_task(tmp_path, "pub")
    (d / "task.toml").write_text((d / "task.toml").read_text().replace('"no-network"', '"public"'))
    result = lint_task(load_task(d))
    assert result.ok and any(w.startswith("network: the agent phase is 'public'") for w in result.warnings)


def test_a_copy_source_missing_from_the_context_is_an_error(tmp_path: Path) -> None:
    d = corpus_task(tmp_path, "copy", dockerfile_extra="COPY data.csv \\\n     config/ /app/")
    (d / "environment" / "config").mkdir()
    result = lint_task(load_task(d))
    assert result.errors == ["Dockerfile: COPY source 'data.csv' is not in environment/"]


def test_warnings_are_summarised_by_kind(tmp_path: Path) -> None:
    results = [lint_task(load_task(corpus_task(tmp_path, f"t{i}"))) for i in range(3)]
    assert warning_kinds(results)["tests/test.sh is not executable"] == 3


def test_the_healthcheck_is_parsed_with_harbors_defaults(tmp_path: Path) -> None:
    d = corpus_task(
        tmp_path, "hc", toml_extra='[environment.healthcheck]\ncommand = "test -f /app/ready"\nretries = 2'
    )
    hc = load_task(d).config.environment.healthcheck
    assert hc is not None and (hc.command, hc.retries, hc.interval_sec, hc.timeout_sec) == (
        "test -f /app/ready", 2, 5.0, 30.0,
    )  # fmt: skip
    bad = corpus_task(tmp_path, "hc-bad", toml_extra="[environment.healthcheck]\nretries = 2")
    with pytest.raises(TaskFormatError, match="needs a command"):
        load_task(bad).config  # noqa: B018


class _Flaky:
    """Fails `fails` times, then succeeds."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.calls = 0

    async def exec(self, cmd: str, **kwargs: object) -> ExecResult:
        self.calls += 1
        ok = self.calls > self.fails
        return ExecResult("", "" if ok else "not ready", 0 if ok else 1)


async def test_the_healthcheck_retries_then_passes_or_fails_typed(tmp_path: Path) -> None:
    d = corpus_task(
        tmp_path,
        "hc",
        toml_extra='[environment.healthcheck]\ncommand = "true"\nretries = 3\ninterval_sec = 0',
    )
    task = load_task(d)
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    assert await run_healthcheck(_Flaky(2), task, sleep=sleep) == 3  # type: ignore[arg-type]
    with pytest.raises(HealthcheckError, match="failed 3 times in a row") as info:
        await run_healthcheck(_Flaky(5), task, sleep=sleep)  # type: ignore[arg-type]
    assert info.value.cause == "healthcheck"


@pytest.mark.container
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
async def test_the_runnable_corpus_tasks_pass_the_oracle(tmp_path: Path) -> None:
    from agentrl.episode.oracle import run_oracle
    from agentrl.sandbox.podman import PodmanProvider

    crlf = corpus_task(tmp_path, "corpus-crlf")
    for script in (crlf / "tests" / "test.sh", crlf / "solution" / "solve.sh"):
        script.write_bytes(script.read_bytes().replace(b"\n", b"\r\n"))
    healthy = corpus_task(
        tmp_path,
        "corpus-healthcheck",
        toml_extra='[environment.healthcheck]\ncommand = "test -d /app"\ninterval_sec = 0.2',
    )
    sick = corpus_task(
        tmp_path,
        "corpus-sick",
        toml_extra='[environment.healthcheck]\ncommand = "test -f /nope"\ninterval_sec = 0.1\nretries = 2',
    )
    tasks = [load_task(d) for d in (crlf, healthy, sick)]
    results = await run_oracle(PodmanProvider(), tasks, run_id="corpus", concurrency=2)
    by_id = {r.task_id: r for r in results}
    assert by_id["corpus-crlf"].ok and by_id["corpus-crlf"].reward == 1.0, by_id["corpus-crlf"].detail
    assert by_id["corpus-healthcheck"].ok, by_id["corpus-healthcheck"].detail
    assert by_id["corpus-sick"].cause == "healthcheck" and "failed 2 times" in by_id["corpus-sick"].detail


def test_environment_env_templates_come_from_the_host(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from agentrl.sandbox.daytona import DaytonaProvider
    from agentrl.sandbox.podman import PodmanProvider

    d = corpus_task(tmp_path, "tmpl")
    text = (
        (d / "task.toml")
        .read_text()
        .replace(
            "[environment.env]\n",
            '[environment.env]\nMODE = "${AGENTRL_CORPUS_MODE:-fallback}"\nKEY = "${AGENTRL_CORPUS_KEY}"\n',
        )
    )
    (d / "task.toml").write_text(text)
    task = load_task(d)
    monkeypatch.delenv("AGENTRL_CORPUS_MODE", raising=False)
    monkeypatch.delenv("AGENTRL_CORPUS_KEY", raising=False)
    with pytest.raises(TaskFormatError, match="AGENTRL_CORPUS_KEY is not set"):
        PodmanProvider()._run_args(task, "r", "n")
    monkeypatch.setenv("AGENTRL_CORPUS_KEY", "k1")
    args, _ = PodmanProvider()._run_args(task, "r", "n")
    assert "MODE=fallback" in args and "KEY=k1" in args
    params = DaytonaProvider(client_factory=lambda: None, trusted_checks=False).params_for(task, "r")  # type: ignore[arg-type,return-value]
    assert params.env_vars == {"MODE": "fallback", "KEY": "k1"}


def test_lint_says_when_the_offline_stand_in_is_too_old_for_the_tasks_toolchain(tmp_path: Path) -> None:
    go = based_on(tmp_path, "go", "golang:1.24-bookworm")
    (go / "environment" / "go.mod").write_text("module example.com/x\n\ngo 1.24\n")
    warnings = lint_task(load_task(go)).warnings
    assert any(w.startswith("toolchain: environment/go.mod asks for Go 1.24") for w in warnings), warnings
    (go / "environment" / "go.mod").write_text("module example.com/x\n\ngo 1.18\n")
    assert not any(w.startswith("toolchain:") for w in lint_task(load_task(go)).warnings)

    rust = based_on(tmp_path, "rust", "rust:1.80-slim-bookworm")
    (rust / "environment" / "Cargo.lock").write_text("# generated\nversion = 4\n")
    warnings = lint_task(load_task(rust)).warnings
    assert any("lock-file version 4" in w for w in warnings), warnings


def test_lint_checks_python_and_node_versions_and_says_how_each_task_builds(tmp_path: Path) -> None:
    """The stand-ins hold Python 3.11 and Node.js 18 whatever the tag says: a task whose own files
    ask for more cannot build offline, and `build_plan` says so beside how each FROM would build."""
    from agentrl.sandbox.lint import build_plan

    py = based_on(tmp_path, "py", "python:3.13-slim")
    ok, how = build_plan(load_task(py))
    assert ok and any("FROM python:3.13-slim: stand-in localhost/agentrl-base/bookworm" in h and "Python 3.11" in h
                      for h in how), how  # fmt: skip
    (py / "environment" / "pyproject.toml").write_text('[project]\nname = "x"\nrequires-python = ">=3.12"\n')
    warnings = lint_task(load_task(py)).warnings
    assert any(
        w.startswith("toolchain: environment/pyproject.toml asks for Python 3.12") for w in warnings
    ), warnings
    ok, how = build_plan(load_task(py))
    assert not ok and any("asks for Python 3.12" in h for h in how)
    (py / "environment" / "pyproject.toml").write_text('[project]\nname = "x"\nrequires-python = ">=3.10"\n')
    assert not any(w.startswith("toolchain:") for w in lint_task(load_task(py)).warnings)

    node = based_on(tmp_path, "node", "node:22-bookworm-slim")
    (node / "environment" / "package.json").write_text('{"name": "x", "engines": {"node": ">=20.0.0"}}')
    warnings = lint_task(load_task(node)).warnings
    assert any("asks for Node.js 20, but the offline node stand-in has Node.js 18" in w for w in warnings), (
        warnings
    )
    (node / "environment" / "package.json").write_text('{"name": "x", "engines": {"node": "^18 || ^20"}}')
    assert not any(w.startswith("toolchain:") for w in lint_task(load_task(node)).warnings)

    unknown = based_on(tmp_path, "unknown", "nowhere.example/base:1")
    ok, how = build_plan(load_task(unknown))
    assert not ok and "cannot build offline (no stand-in serves it)" in how[0]


async def test_a_steps_healthcheck_runs_after_its_setup_and_a_failure_is_said(tmp_path: Path) -> None:
    from agentrl.episode.steps import prepare_step
    from agentrl.testing.sandbox import FakeSandboxProvider

    d = corpus_task(
        tmp_path,
        "hc",
        toml_extra='[[steps]]\nname = "one"\n[steps.healthcheck]\ncommand = "exit 1"\ninterval_sec = 0\nretries = 2',
    )
    (d / "steps" / "one").mkdir(parents=True)
    (d / "steps" / "one" / "instruction.md").write_text("Write `/app/x`.\n")
    task = load_task(d)
    (step,) = task.steps
    assert step.step.healthcheck is not None and step.step.healthcheck.retries == 2
    provider = FakeSandboxProvider()
    async with await provider.create(task, run_id="hc") as sandbox:
        problem = await prepare_step(sandbox, step)
    assert problem is not None and "the healthcheck of step 'one' failed" in problem and "2 times" in problem
    (d / "task.toml").write_text((d / "task.toml").read_text().replace('"exit 1"', '"true"'))
    (step,) = load_task(d).steps
    async with await provider.create(task, run_id="hc") as sandbox:
        assert await prepare_step(sandbox, step) is None
