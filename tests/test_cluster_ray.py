"""The GLM-5.2 recipes on Ray (`agentrl.cluster.ray_runtime`): the plan's processes as actors.

Fast: what each actor starts comes from the resolved plan (one source of command lines), local mode
swaps SGLang for `agentrl engine serve` and keeps the router's consistent hashing, placement groups
per role, and no credential value in anything handed to Ray.

Slow: local mode for real, through Ray on two simulated nodes. tbench2: two engine servers behind
the real `smg` router, the torch trainer actor, podman sandboxes, weights by disk; one engine actor
is killed while it generates: Ray restarts it, the run finishes its 2 steps, no episode is scored
for it, and no process or container is left. DAPO-math: the recipe's own `train --local` command.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agentrl.cluster.recipe import ClusterPlan
from agentrl.cluster.recipe import plan_recipe as resolve_plan
from tests.test_recipe_glm52 import SPECS

ROOT = Path(__file__).resolve().parents[1]
SECRET = "dtn_not-a-real-key-but-secret-0123456789"


def _local_plan(recipe: str = "tbench2", **kw: Any) -> Any:
    defaults: dict[str, Any] = {"model_name": "GLM-5.2_5layer", "num_nodes": 2}
    if recipe == "tbench2":
        defaults["hardware"] = "H200"  # 8 GPUs per node: two 4-GPU engines on the rollout node
    else:
        defaults["enable_pd"] = False
    return plan_of(recipe, **{**defaults, **kw})


def plan_of(recipe: str, **kw: Any) -> ClusterPlan:
    """The plan of the GLM-5.2 recipe `recipe` (recipes/_glm52.py) with these flags."""
    return resolve_plan(SPECS[recipe].options(**kw), SPECS[recipe])


def _settings(tmp_path: Path) -> Any:
    from agentrl.cluster.ray_runtime import LocalSettings

    return LocalSettings(run_dir=tmp_path / "run", model_dir=tmp_path / "model")


def _sets(argv: tuple[str, ...]) -> dict[str, str]:
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    return dict(p.split("=", 1) for p in pairs)


def _plain(spec) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
    """A keyed process's own command line (after the launcher that hands it the run's key)."""
    argv = spec.argv
    assert argv[1:4] == ("-m", "agentrl.cluster.launch", "--key-file") and argv[4] == spec.key_file
    assert argv[5] == "--"
    return tuple(argv[6:])


def test_local_processes_are_the_plans_with_engine_serve_in_place_of_sglang(tmp_path: Path) -> None:
    from dataclasses import replace

    from agentrl.cluster.ray_runtime import build_specs

    plan = _local_plan()
    specs = {s.name: s for s in build_specs(plan, {0: "127.0.0.1", 1: "127.0.0.1"}, _settings(tmp_path))}
    key = str((tmp_path / "run" / "engine.key").resolve())
    assert {s.key_file for s in specs.values() if s.role != "trainer"} == {key}
    specs = {n: replace(s, argv=_plain(s)) if s.role != "trainer" else s for n, s in specs.items()}
    assert sorted(specs) == ["router", "sglang-regular-0", "sglang-regular-1", "trainer-0"]
    engines = [specs["sglang-regular-0"], specs["sglang-regular-1"]]
    for spec, proc in zip(engines, [p for p in plan.processes if p.name.startswith("sglang")], strict=True):
        assert spec.node == proc.node == 1
        assert spec.argv[1:5] == ("-m", "agentrl.cli", "engine", "serve")
        for flag in ("--served-model-name", "--tp-size"):  # carried over from the SGLang line
            assert spec.argv[spec.argv.index(flag) + 1] == proc.argv[proc.argv.index(flag) + 1]
    urls = [s.ready.url.removesuffix("/health") for s in engines]
    router = specs["router"]
    assert Path(router.argv[0]).name == "smg" and router.argv[1] == "launch" and router.node == 0
    assert router.argv[router.argv.index("--policy") + 1] == "consistent_hashing"
    workers = router.argv[router.argv.index("--worker-urls") + 1 : router.argv.index("--policy")]
    assert list(workers) == urls and set(router.ready.workers) == set(urls)
    sets = _sets(specs["trainer-0"].argv)
    assert sets["engine.router_url"] == router.ready.url.removesuffix("/workers")
    # The fleet client generates through the router and sends control calls to every configured
    # server (a restarted one is off the router until an update has caught it up).
    assert json.loads(sets["engine.urls"]) == urls
    router_url = router.ready.url.removesuffix("/workers")
    assert [(s.router_url, s.worker_url) for s in engines] == [(router_url, u) for u in urls]
    assert sets["engine.kind"] == "sglang" and sets["trainer.backend"] == "torch"
    assert sets["trainer.loss.tis_clip"] == "2.0" and sets["checkpoint.resume"] == "true"
    assert sets["env.backend"] == "podman" and sets["sync.transport"] == "disk"
    assert sets["engine.api_key_file"] == key
    assert "localhost" not in " ".join(specs["trainer-0"].argv) and "node-0" not in " ".join(router.argv)


def test_cluster_processes_keep_the_plans_command_lines_with_real_hosts() -> None:
    from agentrl.cluster.ray_runtime import build_specs

    plan = plan_of("tbench2", num_nodes=16)
    hosts = {n: f"192.0.2.{n + 1}" for n in range(16)}  # TEST-NET addresses: never contacted
    specs = build_specs(plan, hosts)
    engines = [s for s in specs if s.role == "engine"]
    assert {s.key_file for s in specs if s.role != "trainer"} == {"/shared/glm52/engine.key"}
    assert len(engines) == 8 and all(
        _plain(s)[:3] == ("python", "-m", "sglang.launch_server") for s in engines
    )
    for spec in engines:
        proc = next(p for p in plan.processes if p.name == spec.name)
        assert list(_plain(spec)) == proc.argv  # bound to 0.0.0.0: nothing to rewrite
        assert spec.ready.url == f"http://{hosts[proc.node]}:30000/health"
        assert (
            spec.router_url == f"http://{hosts[0]}:8000"
            and spec.worker_url == f"http://{hosts[proc.node]}:30000"
        )
    router = next(s for s in specs if s.role == "router")
    assert f"http://{hosts[8]}:30000" in router.argv and "--pd-disaggregation" not in router.argv
    trainers = [s for s in specs if s.role == "trainer"]
    assert len(trainers) == 8 and trainers[3].argv[0] == "torchrun"
    assert f"--master-addr={hosts[0]}" in trainers[3].argv
    assert _sets(trainers[3].argv)["engine.router_url"] == f"http://{hosts[0]}:8000"
    assert _sets(trainers[3].argv)["engine.api_key_file"] == "/shared/glm52/engine.key"
    assert all(f"http://{hosts[n]}:30000" in _sets(trainers[3].argv)["engine.urls"] for n in range(8, 16))


def test_placement_groups_per_role() -> None:
    from agentrl.cluster.ray_runtime import ClusterRun

    tb = ClusterRun(plan_of("tbench2", num_nodes=16), log_dir=Path("/nonexistent"))
    assert tb.role_nodes() == {"trainer": list(range(8)), "rollout": list(range(8, 16))}
    assert tb.bundles()["rollout"] == [{"CPU": 1.0, "GPU": 4.0}] * 8
    # A cluster whose nodes advertise agentrl_node_NN pins plan node N to that host (where
    # prepare-cp put node N's files).
    tb.pinned = True
    assert tb.bundles()["rollout"][2] == {"CPU": 1.0, "GPU": 4.0, "agentrl_node_10": 1.0}
    assert tb.bundles()["trainer"][0] == {"CPU": 1.0, "GPU": 4.0, "agentrl_node_00": 1.0}
    math = ClusterRun(
        plan_of("dapo_math", num_nodes=16, gpus_per_node=8, hardware="H200"),
        log_dir=Path("/nonexistent"),
    )
    assert list(math.role_nodes()) == ["colocated"] and len(math.bundles()["colocated"]) == 16


def test_local_mode_refuses_prefill_decode_disaggregation(tmp_path: Path) -> None:
    from agentrl.cluster.ray_runtime import ClusterRun
    from agentrl.cluster.recipe import RecipeError

    plan = plan_of("dapo_math", model_name="GLM-5.2_5layer", num_nodes=2)
    assert plan.enable_pd
    with pytest.raises(RecipeError, match="drop --enable-pd"):
        ClusterRun(plan, log_dir=tmp_path, local=_settings(tmp_path))


def test_no_credential_value_reaches_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Daytona key and the run's engine key travel as file paths: not in any actor's command
    line, environment or options, whatever the driver's environment holds."""
    from agentrl.cluster.ray_runtime import ClusterRun, build_specs

    key_file = tmp_path / "daytona_key"
    key_file.write_text(SECRET)
    engine_key = tmp_path / "engine.key"
    engine_key.write_text(SECRET[::-1])
    monkeypatch.setenv("DAYTONA_API_KEY", SECRET)
    monkeypatch.setenv("DAYTONA_API_KEY_FILE", str(key_file))
    plan = plan_of("tbench2", num_nodes=16, daytona_key_file=str(key_file), engine_key_file=str(engine_key))
    run = ClusterRun(plan, log_dir=tmp_path)
    specs = build_specs(plan, {n: f"192.0.2.{n + 1}" for n in range(16)})
    local = build_specs(_local_plan(), {0: "127.0.0.1", 1: "127.0.0.1"}, _settings(tmp_path))
    handed = json.dumps(
        [[s.__dict__, run.actor_options(s)] for s in [*specs, *local]], default=str
    ) + json.dumps(run.bundles())
    assert SECRET not in handed and SECRET[::-1] not in handed
    assert {s.key_file for s in specs if s.role != "trainer"} == {str(engine_key)}
    trainers = [s for s in specs if s.role == "trainer"]
    assert all(s.env["DAYTONA_API_KEY_FILE"] == str(key_file) for s in trainers)
    assert all("DAYTONA_API_KEY" not in s.env for s in [*specs, *local])


# --- local mode, for real ------------------------------------------------------------------------


def _need(tool: str) -> None:
    found = shutil.which(tool) or (Path(sys.executable).parent / tool).exists()
    if not found:
        pytest.fail(f"{tool} is not installed: run `make setup` (CI runs it before the tests)")


def _running(url: str, key_file: str) -> int:
    """Requests running on the server at `url` (which wants the run's engine key)."""
    from agentrl.cluster.launch import auth_headers

    req = urllib.request.Request(f"{url}/v1/loads", headers=auth_headers(key_file))
    with urllib.request.urlopen(req, timeout=2) as r:
        return sum(load["num_running_reqs"] for load in json.loads(r.read())["loads"])


def _refused_without_key(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/v1/loads", timeout=2)
    except urllib.error.HTTPError as e:
        return e.code == 401
    return False


def _alive(pid: int) -> bool:
    """Running (a zombie awaiting its parent's wait counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _results(out: Path) -> tuple[list[dict[str, Any]], set[str]]:
    results, runs = [], set()
    for f in sorted((out / "records").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec["type"] == "header":
                runs.add(rec["run_id"])
            elif rec["type"] == "result":
                results.append(rec)
    return results, runs


@pytest.fixture
def ray_cleanup():
    """Ray is shut down and every process a run started is gone, also when the test fails."""
    runs: list[Any] = []
    yield runs
    import ray

    for run in runs:
        with contextlib.suppress(Exception):
            run.shutdown()
    if ray.is_initialized():
        ray.shutdown()
    for run in runs:
        for pids in run.pids.values():
            for pid in pids:
                if _alive(pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        import os
                        import signal

                        os.killpg(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.container
def test_tbench2_two_steps_on_two_simulated_nodes_survive_a_killed_engine(
    tmp_path: Path, ray_cleanup
) -> None:
    pytest.importorskip("ray")
    _need("podman")
    _need("smg")
    from agentrl.cluster import ray_runtime

    plan = _local_plan()
    out = tmp_path / "run"
    killed: dict[str, Any] = {}

    def kill_mid_step(run: Any) -> None:
        """Once: the first engine with a generation running, while step 1 is still going."""
        if not ray_cleanup:
            ray_cleanup.append(run)
        if killed or (out / "metrics.jsonl").exists():
            return
        for spec in run.specs:
            if spec.role == "engine":
                url = spec.ready.url.removesuffix("/health")
                with contextlib.suppress(OSError, ValueError, KeyError):
                    if _running(url, spec.key_file) > 0:
                        killed.update(name=spec.name, pid=run.pids[spec.name][-1])
                        killed["keyless_refused"] = _refused_without_key(url)
                        run.kill(spec.name)
                        return

    outcome = ray_runtime.run_local(
        plan,
        out,
        overrides=["trainer.weight_decay=0.5", "rollout.batch_size=4", "rollout.max_in_flight=4"],
        timeout_s=400,
        on_poll=kill_mid_step,
    )
    run = ray_cleanup[0]
    assert killed, "no engine had a generation running during step 1"
    assert outcome.trainer_exit == 0 and outcome.restarts.get(killed["name"], 0) >= 1
    assert not _alive(killed["pid"])  # the killed actor's server went with it
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["extra"]["version"] for r in rows] == [1, 2] and rows[0]["samples"] == 4
    assert all(r["samples_exhausted"] == 0 for r in rows)
    # Weights really moved and reached the servers by disk (weight decay moves every weight).
    assert (out / "weights").is_dir() and any((out / "weights").iterdir())
    # The restarted server left the router before it started, so nothing ran on its launch
    # weights; a sync brought it to the fleet's version and the trainer registered it again.
    engine_log = (out / "logs" / f"{killed['name']}.log").read_text()
    assert engine_log.count("=== start") == 2 and "is off the router" in engine_log, engine_log[-2000:]
    assert "registered with the router again" in (out / "run.log").read_text()
    # Engines and router ran keyed: a request without the run's key is refused, and the key is in
    # no log and in nothing handed to Ray.
    assert killed["keyless_refused"]
    key = (out / "engine.key").read_text().strip()
    assert oct((out / "engine.key").stat().st_mode & 0o777) == "0o600"
    for f in [*(out / "logs").iterdir(), out / "run.log"]:
        assert key not in f.read_text(errors="replace"), f
    assert all(r["version_mismatches"] == 0 for r in rows), [r["version_mismatches"] for r in rows]
    results, runs = _results(out)
    assert len(results) >= 8
    for rec in results:  # an episode the dead engine broke is retried, never scored
        if (rec.get("failure_cause") or "").startswith("engine"):
            assert rec["status"] == "failed-infra" and rec["reward"] is None, rec
    # Nothing leaks: every process any actor started, Ray, and the sandboxes.
    import ray

    assert not ray.is_initialized()
    assert all(not _alive(pid) for pids in run.pids.values() for pid in pids), run.pids
    for run_id in runs:
        left = subprocess.run(
            ["podman", "ps", "-aq", "--filter", f"label=agentrl.run-id={run_id}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert left == [], f"containers of {run_id} left behind"


@pytest.mark.slow
def test_dapo_math_two_steps_through_ray_resume_after_the_trainer_crashes(
    tmp_path: Path, ray_cleanup
) -> None:
    pytest.importorskip("ray")
    _need("smg")
    from agentrl.cluster import ray_runtime

    plan = _local_plan("dapo_math")
    out = tmp_path / "run"
    crashed: dict[str, Any] = {}

    def crash_after_first_checkpoint(run: Any) -> None:
        if not ray_cleanup:
            ray_cleanup.append(run)
        if not crashed and (out / "checkpoints" / "latest").exists():
            crashed.update(pid=run.pids["trainer-0"][-1])
            run.kill("trainer-0")

    outcome = ray_runtime.run_local(
        plan, out, overrides=["rollout.batch_size=8"], timeout_s=400, on_poll=crash_after_first_checkpoint
    )
    run = ray_cleanup[0]
    assert [s.role for s in run.specs] == ["engine", "router", "trainer"]
    assert crashed and not _alive(crashed["pid"]) and outcome.restarts.get("trainer-0") == 1
    log = (out / "logs" / "trainer-0.log").read_text()
    assert log.count("=== start") == 2 and "resumed from" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["samples"] == 8 for r in rows)
    # The resumed trainer re-sends step 1's weights as a new version (the fleet already had 1):
    # versions only go up.
    assert rows[0]["extra"]["version"] == 1 and rows[1]["extra"]["version"] > 1
    assert all(r["failures_by_cause"] == {} for r in rows)
    import ray

    assert not ray.is_initialized()
    assert all(not _alive(pid) for pids in run.pids.values() for pid in pids), run.pids


def test_local_dry_run_prints_the_processes_local_mode_starts() -> None:
    from typer.testing import CliRunner

    from tests.test_recipe_glm52 import recipe_module

    module = recipe_module("glm52_dapo_math")
    result = CliRunner().invoke(module.app, ["train", "--num-nodes", "2", "--local", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "# dapo_math: GLM-5.2_5layer on 2 x 4 GB300" in result.output
    local = result.output.split("## local mode", 1)[1]
    assert "agentrl.cli engine serve" in local and "consistent_hashing" in local and "train run" in local
    assert "sglang.launch_server" in result.output.split("## local mode", 1)[0]
    refused = CliRunner().invoke(module.app, ["train", "--num-nodes", "2", "--local", "--enable-pd"])
    assert refused.exit_code == 2 and "no prefill/decode split" in refused.output


def test_a_multi_node_engine_restarts_all_its_ranks_once(tmp_path: Path) -> None:
    """One node rank of a multi-node SGLang engine cannot rejoin the others' NCCL world: when one
    restarts, the supervisor restarts its siblings, once, and their restarts set off nothing more."""
    from agentrl.cluster.ray_runtime import ClusterRun, engine_siblings

    plan = plan_of("dapo_math", num_nodes=16)
    names = [p.name for p in plan.processes]
    prefill = [n for n in names if n.startswith("sglang-prefill-0-node")]
    assert len(prefill) > 1
    assert engine_siblings(names, "sglang-prefill-0-node1") == [
        n for n in prefill if n != "sglang-prefill-0-node1"
    ]
    assert engine_siblings(names, "sglang-decode-1-node0")  # its other ranks
    assert engine_siblings(names, "router") == [] and engine_siblings(names, "trainer-1") == []
    run = ClusterRun(plan, log_dir=tmp_path)
    run.actors = dict.fromkeys(names)
    run.pids = {n: [100] for n in names}
    killed: list[str] = []
    run.kill = killed.append  # type: ignore[method-assign]
    handled: set[tuple[str, int]] = set()
    run.pids["sglang-prefill-0-node1"].append(101)  # Ray restarted rank 1 (its node died)
    run._restart_siblings("sglang-prefill-0-node1", handled, pending=False)
    assert killed == [n for n in prefill if n != "sglang-prefill-0-node1"]
    for sib in killed:  # ... the supervisor's kills restarted them: that sets off nothing more
        run.pids[sib].append(102)
        run._restart_siblings(sib, handled, pending=False)
    run._restart_siblings("sglang-prefill-0-node1", handled, pending=False)  # seen again: nothing
    assert killed == [n for n in prefill if n != "sglang-prefill-0-node1"]
    killed.clear()
    # A rank whose process exits: the supervisor restarts it and its siblings, once.
    run._restart_siblings("sglang-decode-1-node0", handled, pending=True)
    first = list(killed)
    run.pids["sglang-decode-1-node0"].append(103)
    for sib in engine_siblings(names, "sglang-decode-1-node0"):
        run.pids[sib].append(104)
        run._restart_siblings(sib, handled, pending=False)
    run._restart_siblings("sglang-decode-1-node0", handled, pending=False)
    assert killed == first == engine_siblings(names, "sglang-decode-1-node0")
