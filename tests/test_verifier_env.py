"""Harbor's separate verifier environments, `[[verifier.collect]]` hooks and artifacts, as parsed
and resolved (`reference/harbor.md` 1.4.2, 1.5, 2.8); the podman runs are in
`test_verifier_env_podman.py`."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from agentrl.errors import TaskFormatError
from agentrl.sandbox.base import SandboxPolicyError, untar_bounded
from agentrl.tasks.config import ArtifactConfig, CollectHook, parse_task_config
from agentrl.tasks.task import load_task

BUNDLED = Path(__file__).resolve().parents[1] / "envs" / "tbench2" / "tasks" / "sales-total-artifact"


def _task(tmp_path: Path, toml: str, *, tests_dockerfile: bool = False, steps: tuple[str, ...] = ()) -> Path:
    d = tmp_path / "t"
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    if tests_dockerfile:
        (d / "tests" / "Dockerfile").write_text("FROM debian:bookworm-slim\nCOPY test.sh /tests/\n")
    (d / "instruction.md").write_text("do it in /app\n")
    for name in steps:
        (d / "steps" / name / "tests").mkdir(parents=True)
        (d / "steps" / name / "instruction.md").write_text(f"step {name} in /app\n")
    (d / "task.toml").write_text(toml)
    return d


def test_the_bundled_task_resolves_to_a_separate_verifier_that_bundles_its_tests() -> None:
    task = load_task(BUNDLED)
    assert task.verifier_mode == "separate"
    vtask = task.verifier_task
    assert vtask is not None and vtask.bundled and vtask.environment_dir == BUNDLED / "tests"
    assert vtask.task_id == "sales-total-artifact-verifier"
    assert vtask.config.environment.docker_image is None and vtask.config.environment.cpus == 1
    assert vtask.config.phase_network("agent") == vtask.config.phase_network("verifier") == "no-network"
    assert [a.source for a in task.artifacts] == ["/logs/artifacts", "/app/out"]
    assert task.config.verifier.collect[0].service == "main"
    assert task.validate() == []


def test_modes_resolve_as_harbor_does(tmp_path: Path) -> None:
    shared = load_task(_task(tmp_path / "a", "[verifier]\ntimeout_sec = 5\n", tests_dockerfile=True))
    assert shared.verifier_mode == "shared" and shared.verifier_task is None  # a tests/Dockerfile alone
    # `separate` without an environment: a copy of [environment], the task's image, tests uploaded
    fallback = load_task(
        _task(tmp_path / "b", '[verifier]\nenvironment_mode = "separate"\n[environment]\ncpus = 2\n')
    )
    vt = fallback.verifier_task
    assert vt is not None and not vt.bundled and vt.environment_dir == fallback.environment_dir
    assert vt.config.environment.cpus == 2
    # precedence: the verifier environment's docker_image over a tests/Dockerfile
    image = load_task(
        _task(tmp_path / "c", '[verifier.environment]\ndocker_image = "python:3.12"\n', tests_dockerfile=True)
    )
    vt = image.verifier_task
    assert vt is not None and vt.bundled and vt.config.environment.docker_image == "python:3.12"
    # the verifier phase's network_mode over the verifier environment's own policy
    net = load_task(
        _task(tmp_path / "d", '[verifier]\nnetwork_mode = "public"\n[verifier.environment]\ncpus = 1\n')
    )
    assert net.verifier_task is not None and net.verifier_task.config.phase_network("agent") == "public"
    net.check_runnable()  # phases may differ when each has its own environment


def test_a_step_resolves_its_own_verifier_environment(tmp_path: Path) -> None:
    toml = (
        '[[steps]]\nname = "one"\n[steps.verifier]\nenvironment_mode = "separate"\n'
        '[[steps]]\nname = "two"\nartifacts = ["/app/two"]\n'
        '[[steps]]\nname = "three"\n[steps.verifier.environment]\ndocker_image = "alpine:3"\n'
    )
    d = _task(tmp_path, toml, steps=("one", "two", "three"))
    (d / "steps" / "one" / "tests" / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    one, two, three = load_task(d).steps
    assert one.verifier_mode == "separate" and one.verifier_task is not None
    assert one.verifier_task.environment_dir == d / "steps" / "one" / "tests" and one.verifier_task.bundled
    assert two.verifier_mode == "shared" and [a.source for a in two.artifacts] == [
        "/logs/artifacts",
        "/app/two",
    ]
    assert (
        three.verifier_task is not None and three.verifier_task.config.environment.docker_image == "alpine:3"
    )


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ('[verifier]\nenvironment_mode = "shared"\n[verifier.environment]\ncpus = 1\n', "'shared' with a"),
        ('[verifier]\nenvironment_mode = "elsewhere"\n', "unknown mode"),
        ("[[verifier.collect]]\ntimeout_sec = 3\n", "needs a command"),
        ('[[verifier.collect]]\ncommand = "x"\nservice = "-bad"\n', "not a compose service"),
        ('artifacts = ["/app/../etc"]\n', "without '..'"),
        ('artifacts = [{source = "/a", destination = "/abs"}]\n', "relative path"),
        ('artifacts = [{source = "/a", destination = "manifest.json"}]\n', "relative path"),
        ('artifacts = [{source = "rel", service = "db"}]\n', "absolute path"),
        ("artifacts = [3]\n", "a path or a table"),
    ],
)
def test_bad_verifier_tables_are_refused_with_the_field(toml: str, match: str) -> None:
    with pytest.raises(TaskFormatError, match=match):
        parse_task_config(toml)


def test_collect_hooks_parse_with_harbor_defaults() -> None:
    c = parse_task_config(
        '[[verifier.collect]]\ncommand = "cp a b"\ntimeout_sec = 7.9\nuser = "app"\n'
        '[[verifier.collect]]\ncommand = "true"\nartifacts = ["/x"]\n'
    )
    assert c.verifier.collect == (CollectHook("cp a b", "main", 7.9, "app"), CollectHook("true"))
    # a key TOML puts inside the hook's table is not taken for the task's
    assert c.unknown_keys == ("verifier.collect[1].artifacts",) and c.artifacts == ()


def test_artifacts_at_the_top_level() -> None:
    c = parse_task_config('artifacts = ["/x", {source = "/y", destination = "y", exclude = ["*.tmp"]}]\n')
    assert c.artifacts == (ArtifactConfig("/x"), ArtifactConfig("/y", "y", ("*.tmp",)))
    assert not c.unknown_keys


def test_a_hook_or_artifact_of_a_service_the_task_lacks_is_refused(tmp_path: Path) -> None:
    task = load_task(_task(tmp_path, '[[verifier.collect]]\ncommand = "x"\nservice = "db"\n'))
    with pytest.raises(TaskFormatError, match="'db' is not a service of the task"):
        task.check_runnable()
    art = load_task(_task(tmp_path / "b", 'artifacts = [{source = "/x", service = "cache"}]\n'))
    with pytest.raises(TaskFormatError, match=r"artifacts\.service"):
        art.check_runnable()


def _tar(entries: list[tuple[str, bytes | None, int]]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, kind in entries:
            info = tarfile.TarInfo(name)
            info.type = bytes([kind]) if isinstance(kind, int) and kind > 1 else tarfile.REGTYPE
            if info.type == tarfile.SYMTYPE:
                info.linkname = "/etc/passwd"
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def test_untar_bounded_keeps_files_and_dirs_inside_and_stops_at_the_limit(tmp_path: Path) -> None:
    stream = _tar(
        [
            ("out/a.txt", b"hello", 0),
            ("out/../../escape.txt", b"x", 0),
            ("/abs.txt", b"x", 0),
            ("out/link", None, ord(tarfile.SYMTYPE)),
        ]
    )
    untar_bounded(stream, tmp_path / "dst", 100, "/app/out")
    assert (tmp_path / "dst" / "out" / "a.txt").read_bytes() == b"hello"
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "dst" / "out" / "link").exists()
    with pytest.raises(SandboxPolicyError, match="too large") as err:
        untar_bounded(_tar([("big", b"x" * 101, 0)]), tmp_path / "d2", 100, "/big", single=True)
    assert err.value.cause == "artifact_too_large"


def test_allowed_hosts_are_normalised_and_refused_as_harbor_does() -> None:
    from agentrl.tasks.config import host_kind

    c = parse_task_config(
        '[environment]\nnetwork_mode = "allowlist"\n'
        'allowed_hosts = [" PyPI.org.. ", "*.Example.com", "10.0.0.1", "2001:DB8:0:0::1", "10.8.0.0/16", "pypi.org"]\n'
        '[agent]\nnetwork_mode = "allowlist"\nallowed_hosts = ["api.example.com"]\n'
    )
    hosts = c.environment.allowed_hosts
    assert hosts == ("pypi.org", "*.example.com", "10.0.0.1", "2001:db8::1", "10.8.0.0/16")
    assert [host_kind(h) for h in hosts] == [
        "hostname", "wildcard-hostname", "ipv4-address", "ipv6-address", "ipv4-cidr",
    ]  # fmt: skip
    assert c.phase_hosts("agent") == ("api.example.com",) and c.phase_hosts("verifier") == hosts
    for bad in (
        "https://pypi.org",
        "pypi.org:443",
        "10.0.0.1/8",
        "a*.b.com",
        "*.10.0.0.1",
        "fe80::1%eth0",
        "-x.com",
    ):
        with pytest.raises(TaskFormatError, match="allowed_hosts"):
            parse_task_config(f'[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["{bad}"]\n')
    with pytest.raises(TaskFormatError, match="only valid with network_mode = 'allowlist'"):
        parse_task_config('[environment]\nallowed_hosts = ["pypi.org"]\n')
    # an allowlist of nothing is valid, and reaches nothing
    assert parse_task_config('[verifier]\nnetwork_mode = "allowlist"\n').phase_hosts("verifier") == ()


def test_the_allowlist_rules_name_loopback_the_resolvers_and_the_addresses() -> None:
    from agentrl.errors import InputError
    from agentrl.sandbox.podman import netns

    script = netns.egress_script("t", ("10.0.0.1", "10.8.0.0/16", "2001:db8::1"), ("10.255.255.53",))
    assert "policy drop" in script and 'oifname "lo" accept' in script
    assert "ip daddr 10.255.255.53 udp dport 53 accept" in script
    assert "ip daddr 10.8.0.0/16 accept" in script and "ip6 daddr 2001:db8::1 accept" in script
    assert "policy drop" not in netns.egress_script("t", None)  # public: the table only deleted
    assert "accept" not in netns.egress_script("t", ()).replace('oifname "lo" accept', "")
    assert "127.0.0.1" in netns.allowed_addresses(("localhost",))  # resolved on the host
    assert netns.allowed_addresses(("no-such-host.invalid", "10.0.0.1")) == ("10.0.0.1",)
    with pytest.raises(InputError, match="wildcard"):
        netns.allowed_addresses(("*.example.com",))


def test_a_steps_network_overrides_win_over_the_tasks(tmp_path: Path) -> None:
    task = load_task(
        _task(
            tmp_path,
            '[agent]\nnetwork_mode = "public"\n\n[[steps]]\nname = "a"\n\n[[steps]]\nname = "b"\n'
            '[steps.agent]\nnetwork_mode = "allowlist"\nallowed_hosts = ["Example.com"]\n'
            '[steps.verifier]\nnetwork_mode = "no-network"\n',
            steps=("a", "b"),
        )
    )
    assert not task.config.unknown_keys
    a, b = task.steps
    assert (a.config.phase_network("agent"), a.config.phase_hosts("agent")) == ("public", ())
    assert (b.config.phase_network("agent"), b.config.phase_hosts("agent")) == ("allowlist", ("example.com",))
    assert b.config.phase_network("verifier") == "no-network"
