"""Offline stand-in bases: served under their own name through a `FROM` rewrite at build time, never
by re-tagging a real image's name; listed, removed and pruned by `agentrl sandbox`.

Tests that list, remove or prune run against a private podman storage (a wrapper script passing
`--root`), so they never touch the images other work on this host relies on."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from agentrl.sandbox import images
from agentrl.sandbox.base import ImageBuildError
from agentrl.sandbox.lint import lint_task
from agentrl.tasks.task import Task

FIXTURE = Path(__file__).parent / "fixtures" / "sandbox_tasks" / "write-hello"
RECIPE = images.load_recipe()
HAVE_PODMAN = shutil.which("podman") is not None
container = pytest.mark.skipif(not HAVE_PODMAN, reason="podman is not installed")
DIGEST = "sha256:" + "0123456789abcdef" * 4


# -- which references a stand-in serves -------------------------------------------------------------
@pytest.mark.parametrize(
    ("ref", "repository"),
    [
        ("python:3.11.4-slim-bookworm", "docker.io/library/python"),
        ("debian:bookworm-20240110-slim", "docker.io/library/debian"),
        ("ubuntu:20.04", "docker.io/library/ubuntu"),
        (f"python@{DIGEST}", "docker.io/library/python"),
        (f"python:3.12@{DIGEST}", "docker.io/library/python"),
        ("docker.io/library/python:3.12", "docker.io/library/python"),
        ("index.docker.io/library/debian:12", "docker.io/library/debian"),
        ("docker.io/python:3.12", "docker.io/library/python"),
        ("registry.corp.example:5000/docker/library/debian:bookworm-slim", "docker.io/library/debian"),
        ("mirror.gcr.io/library/ubuntu:24.04", "docker.io/library/ubuntu"),
        (
            "mirror.example/ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250101",
            "ghcr.io/laude-institute/t-bench/ubuntu-24-04",
        ),
    ],
)
def test_any_tag_digest_pin_or_mirror_spelling_of_a_known_repository_is_served(ref, repository):
    assert images.standin_key(ref, RECIPE.repositories) == repository
    assert images.standin_for(ref, RECIPE) == RECIPE.standin


@pytest.mark.parametrize(
    "ref", ["acme/python:3.12", "quay.io/acme/debian:12", "pythonista:1", "ghcr.io/acme/ubuntu-24-04:latest"]
)
def test_other_repositories_are_not_served(ref):
    assert images.standin_for(ref, RECIPE) is None


@pytest.mark.parametrize(
    ("ref", "family", "really"),
    [
        ("node:20-alpine", "bookworm-node", "Node.js 18"),
        (f"golang:1.22@{DIGEST}", "bookworm-golang", "Go 1.19"),
        ("mirror.gcr.io/library/rust:1.80-slim", "bookworm-rust", "Rust 1.63"),
        ("gcc:14", "bookworm-gcc", "GCC 12"),
    ],
)
def test_language_families_answer_their_repositories_and_say_what_debian_has(ref, family, really):
    recipe = RECIPE.family(family)
    assert images.standin_for(ref, RECIPE) == recipe.standin
    assert recipe.standin.startswith(f"{images.STANDIN_REPO}/{family}:")
    assert really in recipe.content and "Debian bookworm" in recipe.content
    assert recipe.parent is RECIPE.root and f"FROM {RECIPE.root.standin}" in recipe.dockerfile
    assert images.standin_for("python:3.13-slim", RECIPE) == RECIPE.root.standin  # the root has python


def test_the_standin_lives_under_its_own_namespace():
    assert RECIPE.standin.startswith(images.STANDIN_REPO + "/")
    assert RECIPE.digest in RECIPE.standin


# -- FROM lines -------------------------------------------------------------------------------------
MULTI_STAGE = f"""\
ARG BASE=python:3.12-slim
FROM --platform=linux/amd64 python:3.11.4-slim-bookworm AS build
RUN echo build
from build as test
FROM scratch AS empty
FROM ${{BASE}}
FROM ubuntu@{DIGEST}
COPY --from=build /x /x
"""


def test_from_lines_name_images_but_not_stages_or_scratch():
    lines = images.from_lines(MULTI_STAGE)
    assert [(line.line, line.image) for line in lines] == [
        (1, "python:3.11.4-slim-bookworm"),
        (5, "python:3.12-slim"),
        (6, f"ubuntu@{DIGEST}"),
    ]


def test_rewrite_keeps_stage_names_drops_platform_and_leaves_other_lines():
    out = images.rewrite_froms(
        MULTI_STAGE, {1: "localhost/agentrl-base/x:1", 5: "localhost/agentrl-base/x:1"}
    )
    lines = out.splitlines()
    assert lines[1] == "FROM localhost/agentrl-base/x:1 AS build"
    assert lines[3] == "from build as test" and lines[4] == "FROM scratch AS empty"
    assert lines[5] == "FROM localhost/agentrl-base/x:1"
    assert lines[6] == f"FROM ubuntu@{DIGEST}"
    assert out.endswith("\n") and len(lines) == len(MULTI_STAGE.splitlines())


# -- lint -------------------------------------------------------------------------------------------
def _task(tmp_path: Path, from_line: str, name: str = "t") -> Task:
    root = tmp_path / name
    shutil.copytree(FIXTURE, root)
    (root / "environment" / "Dockerfile").write_text(
        f"{from_line}\nWORKDIR /app\nCOPY seed.txt /app/seed.txt\n"
    )
    return Task(root)


def test_lint_warns_about_a_from_that_would_fail_to_build_offline(tmp_path):
    result = lint_task(_task(tmp_path, "FROM registry.invalid/acme/toolchain:7"))
    assert result.ok
    (warning,) = [w for w in result.warnings if w.startswith("unservable base")]
    assert "registry.invalid/acme/toolchain:7" in warning and "would fail to build offline" in warning


def test_lint_accepts_a_dated_tag_of_a_known_base(tmp_path):
    result = lint_task(_task(tmp_path, f"FROM mirror.gcr.io/library/python:3.11.4-slim-bookworm@{DIGEST}"))
    assert not [w for w in result.warnings if w.startswith("unservable base")]


# -- building with the stand-in (host storage: the stand-in is built once, never removed) ------------
@pytest.fixture(scope="module")
def standin() -> str:
    return images.build_standin(log=lambda _: None)


@container
@pytest.mark.container
@pytest.mark.parametrize(
    "from_line",
    [
        "FROM python:3.11.4-slim-bookworm",
        f"FROM --platform=linux/amd64 python:3.12@{DIGEST} AS app",
        "FROM registry.corp.example/docker/library/debian:bookworm-20240110-slim",
    ],
    ids=["dated-tag", "digest-pin", "mirror"],
)
def test_a_known_base_that_cannot_be_pulled_builds_offline_from_the_standin(
    tmp_path, standin, from_line, caplog
):
    from agentrl.sandbox.podman import PodmanProvider, context_hash

    task = _task(tmp_path, from_line, name=f"standin-{abs(hash(from_line)) % 10**6}")
    written = task.dockerfile.read_text()

    async def run() -> tuple[str, str]:
        provider = PodmanProvider()
        try:
            tag = await provider.image_for(task)
            sandbox = await provider.create(task, run_id="standin-test")
            try:
                result = await sandbox.exec("cat /app/seed.txt; cat /etc/debian_version")
            finally:
                await sandbox.close()
            return tag, result.stdout
        finally:
            await provider.aclose()

    with caplog.at_level("WARNING"):
        tag, out = asyncio.run(run())
    assert out.split()[0] == "seed" and out.split()[1].startswith("12.")
    assert tag.rsplit(":", 1)[1] != context_hash(task.environment_dir)  # the rewrite is in the key
    assert task.dockerfile.read_text() == written  # rewritten in a temporary copy only
    said = " ".join(r.getMessage() for r in caplog.records)
    assert standin in said and "Debian bookworm" in said
    image = from_line.split()[-1] if " AS " not in from_line else from_line.split()[-3]
    assert subprocess.run(["podman", "image", "inspect", image], capture_output=True).returncode != 0
    subprocess.run(["podman", "rmi", tag], capture_output=True)


@container
@pytest.mark.container
def test_an_unknown_base_that_cannot_be_pulled_fails_with_what_to_do(tmp_path, standin):
    from agentrl.sandbox.podman import PodmanProvider

    task = _task(tmp_path, "FROM registry.invalid/acme/toolchain:7")

    async def run() -> None:
        provider = PodmanProvider()
        try:
            await provider.image_for(task)
        finally:
            await provider.aclose()

    with pytest.raises(ImageBuildError) as err:
        asyncio.run(run())
    message = str(err.value)
    assert "FROM registry.invalid/acme/toolchain:7" in message and "podman load" in message


# -- a private podman storage -------------------------------------------------------------------------
@pytest.fixture
def private_podman(tmp_path) -> str:
    """A `podman` on a storage of its own (vfs: no mounts to undo). podman wants a short runroot."""
    run_root = Path(tempfile.mkdtemp(prefix="arl-", dir="/tmp"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli = bin_dir / "podman"
    cli.write_text(
        f"#!/bin/sh\nexec /usr/bin/podman --root {tmp_path / 'storage'} --runroot {run_root} "
        '--storage-driver vfs "$@"\n'
    )
    cli.chmod(0o755)
    yield str(cli)
    subprocess.run([str(cli), "rm", "-af", "-t", "0"], capture_output=True)
    subprocess.run([str(cli), "rmi", "-af"], capture_output=True)
    shutil.rmtree(run_root, ignore_errors=True)


def _build(cli: str, tag: str, dockerfile: str, tmp_path: Path) -> None:
    ctx = tmp_path / f"ctx-{abs(hash(tag))}"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    subprocess.run([cli, "build", "-q", "--pull=never", "-t", tag, str(ctx)], check=True, capture_output=True)


def _names(cli: str) -> set[str]:
    out = subprocess.run([cli, "images", "--format", "json"], check=True, capture_output=True, text=True)
    return {n for item in json.loads(out.stdout or "[]") for n in item.get("Names") or []}


@container
@pytest.mark.container
def test_list_and_remove_find_legacy_real_name_tags_and_spare_derived_images(private_podman, tmp_path):
    cli = private_podman
    label = f'LABEL {images.RECIPE_LABEL}={RECIPE.digest}\nCMD ["bash"]\n'
    _build(cli, RECIPE.standin, "FROM scratch\n" + label, tmp_path)
    subprocess.run([cli, "tag", RECIPE.standin, "python:3.12-slim"], check=True)  # what old agentrl did
    _build(  # an old recipe's stand-in, left under a real name only: its recipe's own last layers
        cli,
        "docker.io/library/debian:bookworm-slim",
        f'FROM scratch\nLABEL {images.RECIPE_LABEL}=old\nCMD ["bash"]\n',
        tmp_path,
    )
    _build(
        cli, "localhost/acme/tool:1", f"FROM {RECIPE.standin}\nLABEL x=1\n", tmp_path
    )  # inherits the label
    _build(  # built FROM a stand-in under a known repository's name: the label, not the layers
        cli, "docker.io/library/python:3.10-custom", f"FROM {RECIPE.standin}\nENV A=1\n", tmp_path
    )
    _build(
        cli, "docker.io/library/python:3.9", "FROM scratch\nLABEL real=1\n", tmp_path
    )  # a real, unlabelled one

    listed = {item.name: item for item in images.list_standins(cli)}
    assert listed[RECIPE.standin].serves == RECIPE.root.repositories and not listed[RECIPE.standin].legacy
    (old_tag,) = [n for n in listed if n.endswith("/python:3.12-slim")]  # podman puts it under localhost/
    assert listed[old_tag].legacy
    assert listed["docker.io/library/debian:bookworm-slim"].legacy
    spared = {"localhost/acme/tool:1", "docker.io/library/python:3.9", "docker.io/library/python:3.10-custom"}
    assert not spared & set(listed)

    would, _ = images.remove_standins(cli, legacy_only=True, dry_run=True)
    assert set(would) == {old_tag, "docker.io/library/debian:bookworm-slim"}
    removed, failed = images.remove_standins(cli, legacy_only=True)
    assert failed == [] and set(removed) == set(would)
    assert _names(cli) == spared | {RECIPE.standin}

    would, _ = images.remove_standins(cli, dry_run=True)
    assert would == [RECIPE.standin]
    removed, failed = images.remove_standins(cli)
    assert failed == [] and removed == [RECIPE.standin]
    assert _names(cli) == spared


@container
@pytest.mark.container
def test_prune_removes_task_images_but_never_one_a_container_uses(private_podman, tmp_path):
    cli = private_podman
    _build(cli, "localhost/agentrl-task/old:1", "FROM scratch\nLABEL a=1\n", tmp_path)
    _build(cli, "localhost/agentrl-terminal/image:1", "FROM scratch\nLABEL a=2\n", tmp_path)
    _build(cli, "localhost/agentrl-task/used:1", "FROM scratch\nLABEL a=3\n", tmp_path)
    _build(cli, "localhost/acme/keep:1", "FROM scratch\nLABEL a=4\n", tmp_path)
    subprocess.run(
        [cli, "create", "--name", "prune-user", "localhost/agentrl-task/used:1", "true"], check=True
    )

    assert images.prune_task_images(cli, older_than_s=3600)[0] == []
    chosen, _ = images.prune_task_images(cli, dry_run=True)
    assert {i.name for i in chosen} == {"localhost/agentrl-task/old:1", "localhost/agentrl-terminal/image:1"}
    assert "localhost/agentrl-task/old:1" in _names(cli)
    removed, failed = images.prune_task_images(cli, older_than_s=0)
    assert failed == [] and {i.name for i in removed} == {i.name for i in chosen}
    assert _names(cli) == {"localhost/agentrl-task/used:1", "localhost/acme/keep:1"}


@container
@pytest.mark.container
@pytest.mark.slow
def test_build_bases_tags_no_real_name(private_podman):
    status = images.build_bases(cli=private_podman, try_pull=False, log=lambda _: None)
    assert set(status) == set(RECIPE.names) and set(status.values()) == {"stand-in"}
    names = _names(private_podman)
    assert RECIPE.standin in names
    assert all(n.startswith(images.STANDIN_REPO + "/") for n in names), names


@container
@pytest.mark.container
@pytest.mark.slow
def test_a_language_family_is_built_only_when_a_task_needs_it(tmp_path, standin, monkeypatch):
    """A family of our own (AGENTRL_BASES_TOML) with one small Debian package: nothing is built for
    a task that does not need it; the first task that does builds it, through `make_provider`."""
    from agentrl.sandbox.registry import make_provider

    bases = tmp_path / "bases.toml"
    family = '[families.tiny]\nhas = "file 5.44 (Debian\'s file)"\npackages = ["file"]\n'
    bases.write_text(images.BASES_TOML.read_text() + family + 'names = ["registry.invalid/acme/tiny:1"]\n')
    monkeypatch.setenv("AGENTRL_BASES_TOML", str(bases))
    catalog = images.load_recipe()
    tiny = catalog.family("bookworm-tiny")
    assert catalog.root.standin == standin  # the same root: nothing to rebuild
    if images.image_exists("podman", tiny.standin):
        subprocess.run(["podman", "rmi", tiny.standin], capture_output=True)

    assert images.ensure_standins(f"FROM {standin}\n") == []
    assert not images.image_exists("podman", tiny.standin)

    task = _task(tmp_path, "FROM registry.invalid/acme/tiny:7", name="tiny-family")

    async def run() -> tuple[list[str], str]:
        provider = make_provider("podman")
        try:
            tag = await provider.image_for(task)
            async with await provider.create(task, run_id="family-test") as sandbox:
                result = await sandbox.exec("file --version | head -1; cat /app/seed.txt")
            return [await provider.terminal_image(tag), tag], result.stdout
        finally:
            await provider.aclose()

    try:
        made, out = asyncio.run(run())
        assert out.split()[0].startswith("file-5.") and "seed" in out
        assert images.image_label("podman", tiny.standin, images.RECIPE_LABEL) == tiny.digest
        names = {i.name for i in images.list_standins("podman", catalog)}
        assert tiny.standin in names
        subprocess.run(["podman", "rmi", *dict.fromkeys(made)], capture_output=True)
    finally:
        subprocess.run(["podman", "rmi", tiny.standin], capture_output=True)
