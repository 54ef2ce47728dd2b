"""The Harbor task model: parsing, validation, lint CLI and training rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.errors import TaskFormatError
from agentrl.sandbox.lint import lint_tasks
from agentrl.tasks.config import parse_size_mb, parse_task_config, resolve_env_templates
from agentrl.tasks.dataset import read_jsonl, split_bucket
from agentrl.tasks.task import discover_tasks, load_task, strip_canary

BROKEN = Path(__file__).parent / "fixtures" / "broken_tasks"

FULL_TOML = """
version = "1.0"
[metadata]
author_name = "A"
author_email = "a@example.com"
difficulty = "easy"
category = "files"
tags = ["x", "y"]
expert_time_estimate_min = 2
junior_time_estimate_min = 5.5
custom = "kept"
[verifier]
timeout_sec = 90.0
[verifier.env]
MODE = "strict"
[agent]
timeout_sec = 300
[environment]
build_timeout_sec = 120
docker_image = "img:1"
cpus = 2
memory = "2G"
storage_mb = 4096
gpus = 0
allow_internet = false
[environment.env]
A = "b"
[solution.env]
S = "t"
"""


def write_task(root: Path, name: str, toml: str = 'version = "1.0"\n', *, solution: bool = True) -> Path:
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (d / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (d / "instruction.md").write_text(f"Solve {name}.\n")
    (d / "task.toml").write_text(toml)
    if solution:
        (d / "solution").mkdir()
        (d / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    return d


def test_every_documented_field_is_parsed() -> None:
    c = parse_task_config(FULL_TOML)
    assert c.schema_version == "1.0"
    assert c.metadata.difficulty == "easy" and c.metadata.tags == ("x", "y")
    assert c.metadata.expert_time_estimate_min == 2 and c.metadata.junior_time_estimate_min == 5.5
    assert c.metadata.extra == {"custom": "kept"}
    assert c.verifier.timeout_sec == 90.0 and c.verifier.env == {"MODE": "strict"}
    assert c.agent.timeout_sec == 300
    e = c.environment
    assert (e.build_timeout_sec, e.docker_image, e.cpus, e.memory_mb, e.storage_mb, e.gpus) == (
        120,
        "img:1",
        2,
        2048,
        4096,
        0,
    )
    assert e.network_mode == "no-network" and not e.internet_allowed
    assert e.env == {"A": "b"} and c.solution.env == {"S": "t"}
    assert c.unknown_keys == ()
    assert any("memory" in d for d in c.deprecations)


def test_defaults_match_harbor_and_network_defaults_to_off() -> None:
    c = parse_task_config("")
    assert c.verifier.timeout_sec == 600.0
    assert c.environment.build_timeout_sec == 600.0
    assert c.agent.timeout_sec is None
    assert not c.environment.internet_allowed


def test_allow_internet_true_and_network_mode_public_allow_network() -> None:
    assert parse_task_config("[environment]\nallow_internet = true\n").environment.internet_allowed
    assert parse_task_config('[environment]\nnetwork_mode = "public"\n').environment.internet_allowed
    explicit = parse_task_config('[environment]\nnetwork_mode = "no-network"\nallow_internet = true\n')
    assert not explicit.environment.internet_allowed


@pytest.mark.parametrize(
    ("text", "mb"), [("2G", 2048), ("1.5g", 1536), ("512M", 512), (" 2048k ", 2), ("0G", 0)]
)
def test_size_strings_follow_harbor(text: str, mb: int) -> None:
    assert parse_size_mb("f", "memory", text) == mb


@pytest.mark.parametrize("text", ["2GB", "2Gi", "1024", "", "G", "-1G", "nanG"])
def test_bad_size_strings_are_typed_errors(text: str) -> None:
    with pytest.raises(TaskFormatError) as info:
        parse_size_mb("task.toml", "environment.memory", text)
    assert info.value.field == "environment.memory"


def test_memory_mb_accepts_a_size_string_and_conflicts_are_errors() -> None:
    assert parse_task_config('[environment]\nmemory_mb = "1G"\n').environment.memory_mb == 1024
    with pytest.raises(TaskFormatError, match="disagrees"):
        parse_task_config('[environment]\nmemory_mb = 100\nmemory = "1G"\n')


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ('[verifier]\ntimeout_sec = "ten"\n', "verifier.timeout_sec"),
        ("[verifier]\ntimeout_sec = -1\n", "verifier.timeout_sec"),
        ("[environment]\ncpus = true\n", "environment.cpus"),
        ("[environment]\ngpus = 1.5\n", "environment.gpus"),
        ('[environment]\nnetwork_mode = "moon"\n', "environment.network_mode"),
        ("[environment]\nallow_internet = 1\n", "environment.allow_internet"),
        ("[verifier.env]\nX = 1\n", "verifier.env.X"),
        ("environment = 3\n", "environment"),
        ('[metadata]\ntags = "a"\n', "metadata.tags"),
        ('[environment]\nos = "plan9"\n', "environment.os"),
    ],
)
def test_wrong_types_name_the_field(toml: str, field: str) -> None:
    with pytest.raises(TaskFormatError) as info:
        parse_task_config(toml, "x/task.toml")
    assert info.value.field == field
    assert "x/task.toml" in str(info.value)


def test_unknown_keys_are_kept_as_warnings() -> None:
    c = parse_task_config('flavour = 1\n[environment]\nturbo = true\n[verifier]\nmystery = "x"\n')
    assert set(c.unknown_keys) == {"flavour", "environment.turbo", "verifier.mystery"}


def test_env_templates_resolve_from_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_T", "v")
    monkeypatch.delenv("AGENTRL_MISSING", raising=False)
    out = resolve_env_templates({"a": "${AGENTRL_T}", "b": "${AGENTRL_MISSING:-d}", "c": "x${Y}"})
    assert out == {"a": "v", "b": "d", "c": "x${Y}"}
    with pytest.raises(TaskFormatError, match="AGENTRL_MISSING"):
        resolve_env_templates({"a": "${AGENTRL_MISSING}"})


def test_canary_lines_are_stripped_only_at_the_top() -> None:
    text = "<!-- BENCHMARK DATA canary GUID 1234 -->\n# canary string\n\nDo X.\n# canary later stays\n"
    assert strip_canary(text) == "Do X.\n# canary later stays\n"


def test_broken_fixtures_each_name_file_and_field() -> None:
    results = {r.task.task_id: r for r in lint_tasks(discover_tasks(BROKEN))}
    expect = {
        "bad-toml": ("bad-toml/task.toml", "invalid TOML"),
        "wrong-type": ("wrong-type/task.toml [verifier.timeout_sec]", "expected a number"),
        "missing-test": ("missing-test/tests/test.sh", "missing"),
        "missing-instruction": ("missing-instruction/instruction.md", "missing"),
        "bad-memory": ("bad-memory/task.toml [environment.memory_mb]", "cannot parse size"),
        "no-environment": ("no-environment/task.toml [environment.docker_image]", "no environment/"),
    }
    for task_id, (where, what) in expect.items():
        (error,) = results[task_id].errors
        assert where in error and what in error, error
    unknown = results["unknown-keys"]
    assert unknown.ok
    assert any("'flavour'" in w for w in unknown.warnings)
    assert any("'environment.turbo'" in w for w in unknown.warnings)


def test_lint_cli_exit_codes_and_no_traceback(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["tasks", "lint", str(BROKEN)], env={"COLUMNS": "200"})
    assert bad.exit_code == 1
    assert "Traceback" not in bad.output
    assert "[verifier.timeout_sec]" in bad.output
    write_task(tmp_path, "good")
    good = runner.invoke(app, ["tasks", "lint", str(tmp_path)])
    assert good.exit_code == 0, good.output
    assert "0 with errors" in good.output


def test_make_data_rows_and_deterministic_split(tmp_path: Path) -> None:
    tasks_dir = tmp_path / "tasks"
    for i in range(40):
        write_task(tasks_dir, f"t{i:02d}")
    runner = CliRunner()
    args = [
        "tasks",
        "make-data",
        str(tasks_dir),
        "-o",
        str(tmp_path / "train.jsonl"),
        "--eval-output",
        str(tmp_path / "eval.jsonl"),
        "--eval-fraction",
        "0.25",
        "--seed",
        "3",
    ]
    assert runner.invoke(app, args).exit_code == 0
    train, evals = read_jsonl(tmp_path / "train.jsonl"), read_jsonl(tmp_path / "eval.jsonl")
    assert len(train) + len(evals) == 40 and 0 < len(evals) < 40
    row = train[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["metadata"]["instruction"] == row["prompt"][1]["content"]
    assert Path(row["metadata"]["task_path"]).is_dir()
    eval_ids = {r["metadata"]["task_id"] for r in evals}
    assert eval_ids == {f"t{i:02d}" for i in range(40) if split_bucket(f"t{i:02d}", 3) < 0.25}
    # Removing tasks never moves another task across the split.
    for i in range(20):
        import shutil

        shutil.rmtree(tasks_dir / f"t{i:02d}")
    assert runner.invoke(app, args).exit_code == 0
    evals2 = {r["metadata"]["task_id"] for r in read_jsonl(tmp_path / "eval.jsonl")}
    assert evals2 == {t for t in eval_ids if int(t[1:]) >= 20}
    json.dumps(row)


def test_loading_is_lazy_and_scales(tmp_path: Path) -> None:
    for i in range(1000):
        write_task(tmp_path, f"task-{i:04d}", solution=False)
    tasks = discover_tasks(tmp_path)
    assert len(tasks) == 1000
    assert all("config" not in t.__dict__ for t in tasks)  # nothing parsed yet
    results = lint_tasks(tasks)
    assert all(r.ok for r in results)


def test_load_task_rejects_a_file(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("")
    with pytest.raises(TaskFormatError, match="not a directory"):
        load_task(f)


_values = st.one_of(
    st.integers(-10, 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).replace("inf", "inf")),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.text(max_size=8).map(json.dumps),
    st.lists(st.text(max_size=4).map(json.dumps), max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
    st.just("{ a = 1 }"),
)
_keys = st.sampled_from(
    [
        "version",
        "timeout_sec",
        "cpus",
        "memory_mb",
        "memory",
        "storage",
        "storage_mb",
        "gpus",
        "allow_internet",
        "docker_image",
        "build_timeout_sec",
        "network_mode",
        "allowed_hosts",
        "os",
        "env",
        "tags",
        "difficulty",
        "user",
        "workdir",
        "name",
        "zzz",
    ]
)
_sections = st.sampled_from(
    [
        "",
        "[metadata]",
        "[verifier]",
        "[verifier.env]",
        "[agent]",
        "[environment]",
        "[environment.env]",
        "[solution]",
        "[solution.env]",
        "[task]",
        "[other]",
    ]
)
_toml_docs = st.lists(st.tuples(_sections, st.lists(st.tuples(_keys, _values), max_size=4)), max_size=5).map(
    lambda secs: "\n".join(sec + "\n" + "\n".join(f"{k} = {v}" for k, v in kvs) for sec, kvs in secs)
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), _toml_docs))
def test_arbitrary_task_toml_only_raises_typed_errors(text: str) -> None:
    try:
        parse_task_config(text)
    except TaskFormatError:
        pass
