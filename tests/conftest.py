"""Shared test fixtures: episode and sample builders, the bundled tasks, and a tiny model; and how
the suite is split between pytest-xdist workers (`make test` runs `-n 2 --dist loadgroup`)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from agentrl.episode.sample import Episode, Sample, Status

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_TASKS = ROOT / "envs" / "tbench2" / "tasks"


def make_sample(
    prompt_id: str = "p",
    *,
    response: Sequence[int] = (5, 6),
    prompt: Sequence[int] = (1, 2, 3),
    reward: float | None = 1.0,
    sample_index: int = 0,
    versions: Sequence[int] = (0,),
    logprob: float = -1.0,
) -> Sample:
    """A one-segment sample whose response tokens are all trained."""
    return Sample(
        prompt_id=prompt_id,
        tokens=[*prompt, *response],
        prompt_length=len(prompt),
        loss_mask=[1] * len(response),
        rollout_logprobs=[logprob] * len(response),
        reward=reward,
        sample_index=sample_index,
        weight_versions=list(versions),
    )


def make_episode(
    prompt_id: str = "p",
    *,
    reward: float | None = 1.0,
    sample_index: int = 0,
    segments: int = 1,
    version: int = 0,
    status: Status = Status.COMPLETED,
    response: Sequence[int] = (5, 6),
) -> Episode:
    """An episode of `segments` segments (as a history-rewriting template would split it)."""
    segs = [
        make_sample(
            prompt_id, response=response, reward=reward, sample_index=sample_index, versions=(version,)
        )
        for _ in range(segments)
    ]
    return Episode(
        segments=segs,
        reward=reward,
        status=status,
        start_version=version,
        turn_versions=[version] * segments,
        prompt_id=prompt_id,
        sample_index=sample_index,
    )


@pytest.fixture
def bundled_tasks() -> Path:
    return BUNDLED_TASKS


# --- Parallel runs -----------------------------------------------------------------------------------
# `make test` runs the suite on two pytest-xdist workers with `--dist loadgroup`: tests that carry the
# same `xdist_group` run one after another in one worker; every other test is handed out alone to
# whichever worker is free. The groups are assigned here, from the module a test lives in, so test
# files stay free of scheduling marks:
#
# - SERIAL: tests that must never overlap each other, wherever they are. `ray`: each run starts a local
#   Ray cluster (`ray.init` without an address, two simulated nodes, `num_cpus=2`); two at once would
#   share /tmp/ray's "latest session", and each needs both cores to its own processes to finish its
#   steps in time.
# - A module with a module-, class- or session-scoped fixture of its own (a trained tiny model, a
#   built wheel, a Megatron run, a server) is one group, so the fixture is built once, not once per
#   worker.
#
# What else was checked for concurrent runs (docs/testing.md): every "nothing was left behind" check
# lists containers by a label unique to its test (a uuid run id, or the fake Daytona server's own tag)
# and processes by the pids its own run started, never all containers or processes on the host; task
# containers run with --network=none and host servers bind free loopback ports; caches under
# ~/.cache/agentrl (tiny models, the Megatron and Harbor environments, the wheelhouse) are built in a
# scratch directory and renamed into place; list/remove/prune tests of the stand-in bases use a
# private podman storage.
SERIAL: dict[str, tuple[str, ...]] = {
    "ray": (
        "tests/test_cluster_ray.py",
        "tests/test_cluster_prepare.py",
        "tests/test_cluster_prepare_ray.py",
    ),
}

# Tests that run alone: before one starts, the other worker finishes its current test, and it takes
# no new one until this one is done (a file lock shared by the workers, `_machine_share`). For tests
# that wait on other processes against a clock and that a CPU-heavy neighbour (a Megatron run, a
# training step) could push past it. An entry is a test id or a prefix of one (all its parameters).
ALONE: tuple[str, ...] = (
    # Two `engine serve` workers and the smg router must all be up within 30 s.
    "tests/test_fleet_router.py::test_rollout_manager_drives_two_servers_behind_the_sglang_router",
    # Ray's local cluster on both cores (num_cpus=2): the actors, two engines or an engine and a
    # trainer, the router, and a kill and restart each run must see within its polling window.
    "tests/test_cluster_ray.py::test_tbench2_two_steps_on_two_simulated_nodes_survive_a_killed_engine",
    "tests/test_cluster_ray.py::test_dapo_math_two_steps_through_ray_resume_after_the_trainer_crashes",
)
_ALONE = pytest.StashKey[bool]()

# Order in which the workers take work (the scheduler hands out groups and single tests in collection
# order, `--no-loadscope-reorder`): the heaviest first, so the run does not end with one worker on a
# long test while the other idles. Weights are rough seconds per test from its markers.
_WEIGHT = {"slow": 30.0, "container": 5.0}
_FAST = 0.2


def _own_wide_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture wider than a function that its own module (or class) defines."""
    info = getattr(item, "_fixtureinfo", None)
    module = item.nodeid.split("::", 1)[0]
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for fixturedef in defs:
            if fixturedef.scope != "function" and fixturedef.baseid.split("::", 1)[0] == module:
                return True
    return False


def xdist_group_of(item: pytest.Item) -> str | None:
    """The group a test runs in (None: alone, anywhere). Group names are short: xdist appends
    `@<group>` to the test's id in its report lines."""
    module = item.nodeid.split("::", 1)[0]
    for group, modules in SERIAL.items():
        if module in modules:
            return group
    if _own_wide_fixture(item):
        return Path(module).stem
    return None


def _weight(item: pytest.Item) -> float:
    return max((w for name, w in _WEIGHT.items() if item.get_closest_marker(name)), default=_FAST)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks (it runs in each worker)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups: dict[str, str | None] = {}
    for item in items:
        group = groups[item.nodeid] = xdist_group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        item.stash[_ALONE] = item.nodeid.startswith(ALONE)
    worker: Any = getattr(config, "workerinput", None)
    if worker is None:
        return  # not an xdist worker: keep the collection order
    # Every worker sorts the same collection the same way (the controller checks that they agree).
    totals: dict[str, float] = {}
    for item in items:
        scope = groups[item.nodeid] or item.nodeid
        totals[scope] = totals.get(scope, 0.0) + _weight(item)
    items.sort(key=lambda item: -totals[groups[item.nodeid] or item.nodeid])


def _loadgroup_is_broken() -> bool:
    """pytest 9.2 made a test's id a structured value that pytest-xdist <= 3.8 no longer manages to
    append `@<group>` to, and that suffix is how its loadgroup scheduler sees a group: the groups
    would silently fall apart (pytest-dev/pytest-xdist#1386)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(pytest.__version__) >= Version("9.2.dev0") and Version(version("pytest-xdist")) < Version(
        "3.9.dev0"
    )


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or getattr(config.option, "dist", "no") != "loadgroup":
        return
    if _loadgroup_is_broken():
        raise pytest.UsageError(
            f"--dist loadgroup does not group tests with pytest {pytest.__version__} and this "
            "pytest-xdist (pytest-dev/pytest-xdist#1386): install the versions pyproject.toml's dev "
            "extra pins (`make venv`), or run in one process (`make test PYTEST_WORKERS=0`)"
        )


@contextlib.contextmanager
def _machine_share(lock: Path, *, alone: bool) -> Iterator[None]:
    """A readers-writer lock between the workers: a test alone holds `lock` exclusively, every other
    test shares it. The gate in front makes a waiting test alone bar new shared holders, so it starts
    as soon as the test running on the other worker ends."""
    with open(lock.with_suffix(".gate"), "a") as gate, open(lock, "a") as held:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Set-up, call and tear-down of each test (module fixtures built for it included) under the
    workers' shared lock, in the run's base temp directory (the parent of each worker's own).
    `trylast`: inside pytest-timeout's wrapper, so a wait for the lock counts against the test's
    timeout too and can never hang the run."""
    worker: Any = getattr(item.config, "workerinput", None)
    if worker is None or worker.get("workercount", 1) < 2 or not item.config.option.basetemp:
        return (yield)
    lock = Path(item.config.option.basetemp).parent / "agentrl-workers.lock"
    with _machine_share(lock, alone=item.stash.get(_ALONE, False)):
        return (yield)
