"""`prepare` and `prepare-cp` across the nodes of a Ray cluster.

- Conversion (`run_conversion`): the HF -> Megatron job of `agentrl.cluster.prepare` spread over
  the first N training nodes of the plan (N from `prepare.place_conversion`: enough that each
  node's ranks fit its host memory). Per node one torchrun (`--nnodes N --node-rank r
  --master-addr <node 0> --master-port P --nproc-per-node ranks/N`), started on its node by a
  `ConvertActor` (a `ProcessActor` that resolves the Megatron environment's interpreter on its own
  node) in that node's bundle of one placement group. The ranks combine their reports over the
  job's process group as on one host; rank 0 writes it beside the output on the shared storage and
  node 0's actor hands it back, so the driver needs no view of that storage. A node whose torchrun
  fails stops the others; the error names every node's log.
- Copies (`copy_to_nodes`): `prepare-cp` on every node of the plan that loads files, one Ray task
  per node in that node's bundle, each node's set of directories copied all or nothing
  (`prepare.copy_set_to_local`), and a per-node report of what was copied.

Which physical host is "node NN" is Ray's choice per placement group, so a copy made for a role
only lands where `train` later runs that role when the cluster pins plan nodes to hosts: every Ray
node started with the custom resource `agentrl_node_NN` (`ray start --resources
'{"agentrl_node_03": 1}'`). Without it, `copy_to_nodes` gives every node every role's files and
says so. Local mode (`local=True`) is the same code on simulated nodes: those custom resources on
one local Ray cluster (as `agentrl.cluster.ray_runtime`'s local mode), each simulated node's
"node-local disk" `<local_root>/node-NN`.

Ray is imported lazily: `pip install -e '.[ray]'`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agentrl.cluster.actors import ProcessActor, ProcessSpec
from agentrl.cluster.planner import Layout
from agentrl.cluster.prepare import (
    CONVERT_PORT,
    MEGATRON_PYTHON,
    ConvertPlacement,
    ModelCheckpointError,
    check_report,
    convert_argv,
    copy_set_to_local,
    report_path,
)
from agentrl.cluster.ray_runtime import (
    NAMESPACE,
    NODE_RESOURCE,
    ClusterError,
    free_loopback_port,
    require_ray,
)

log = logging.getLogger("agentrl.cluster.prepare")


def conversion_specs(
    placement: ConvertPlacement,
    layout: Layout,
    hf_dir: Path,
    out: Path,
    report: Path,
    *,
    master_addr: str,
    master_port: int | str,
    dtype: str | None = None,
    cpu: bool = False,
) -> list[ProcessSpec]:
    """One process per node of the placement: its torchrun line, `MEGATRON_PYTHON` standing for
    the node's own Megatron interpreter (`--dry-run` prints these). `cpu`: the ranks see no GPU
    and run over gloo (simulated nodes share one host's GPUs, where NCCL would put two ranks of
    different "nodes" on the same device)."""
    n = len(placement.nodes)
    env = {"OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    return [
        ProcessSpec(
            f"convert-node-{node:02d}",
            "convert",
            node,
            tuple(
                convert_argv(
                    MEGATRON_PYTHON,
                    hf_dir,
                    out,
                    report,
                    layout,
                    nnodes=n,
                    node_rank=r,
                    nproc=placement.nproc_per_node,
                    master_addr=master_addr,
                    master_port=master_port,
                    dtype=dtype,
                )
            ),
            dict(env),
            drop_env=("CUDA_VISIBLE_DEVICES", "VIRTUAL_ENV"),
        )
        for r, node in enumerate(placement.nodes)
    ]


class ConvertActor(ProcessActor):
    """A `ProcessActor` for a conversion node: `MEGATRON_PYTHON` in its command line becomes this
    node's Megatron interpreter (`agentrl.train.megatron.venv.ensure()`, built here once if the node
    has none) and the source tree goes on PYTHONPATH; it also waits for the exit and reads files
    of the shared storage for the driver."""

    def __init__(self, spec: ProcessSpec, log_dir: str) -> None:
        if spec.argv and spec.argv[0] == MEGATRON_PYTHON:
            from agentrl.train.megatron import venv

            env = venv.env()
            extra: dict[str, str] = {
                k: env[k] for k in ("PYTHONPATH", "OMP_NUM_THREADS", "TORCH_NUM_THREADS") if k in env
            }
            spec = replace(
                spec, argv=(str(venv.ensure(log=False)), *spec.argv[1:]), env={**extra, **spec.env}
            )
        super().__init__(spec, log_dir)

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status, or None while it still runs after `timeout_s`."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def read_text(self, path: str, remove: bool = False) -> str | None:
        p = Path(path)
        if not p.is_file():
            return None
        text = p.read_text()
        if remove:
            p.unlink()
        return text


def _copy_node(node: int, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """The Ray task of one node's `prepare-cp`."""
    copied = copy_set_to_local([(Path(s), Path(d)) for s, d in pairs])
    return {"node": node, "host": socket.gethostname(), "copied": copied}


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def init_local_ray(num_nodes: int) -> None:
    """A local Ray cluster whose simulated nodes are the custom resources `agentrl_node_NN` (as
    `ray_runtime`'s local mode starts it)."""
    ray = require_ray()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False,
        resources={NODE_RESOURCE.format(n): 1.0 for n in range(num_nodes)},
        namespace=NAMESPACE, object_store_memory=80 * 2**20, configure_logging=False,
    )  # fmt: skip


@dataclass
class PrepareCluster:
    """One placement group with a bundle per plan node in `nodes`, on a Ray cluster
    (`ray_address`, default "auto") or on the simulated nodes of a local one (`local`). A context
    manager: leaving it stops the actors it started, removes the group and shuts down the Ray it
    started, also after a failure."""

    nodes: list[int]
    num_nodes: int
    local: bool = False
    ray_address: str | None = None
    bundle: dict[str, float] | None = None  # cluster bundles (default one CPU); local: the node's resource
    place_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.group: Any = None
        self.actors: list[Any] = []
        self.pinned = self.local
        self._owns_ray = False

    def __enter__(self) -> PrepareCluster:
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _start(self) -> None:
        ray = require_ray()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if not ray.is_initialized():
            if self.local:
                init_local_ray(self.num_nodes)
            else:
                address = self.ray_address or "auto"
                try:
                    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
                except (ConnectionError, RuntimeError) as exc:
                    raise ClusterError(
                        f"no Ray cluster at {address} ({exc}): start one (`ray start --head` here, `ray start "
                        "--address HEAD:6379` on the other nodes) and pass --ray-address, or use --local "
                        "(simulated nodes) or --single-host"
                    ) from None
            self._owns_ray = True
        from ray.util.placement_group import placement_group

        if not self.local:
            have = ray.cluster_resources()
            self.pinned = all(NODE_RESOURCE.format(n) in have for n in self.nodes)
        bundles = []
        for n in self.nodes:
            b = {NODE_RESOURCE.format(n): 1.0} if self.pinned else {}
            if not self.local:
                b.update(self.bundle or {"CPU": 1.0})
            bundles.append(b)
        strategy = "PACK" if self.local else "STRICT_SPREAD"
        self.group = placement_group(bundles, strategy=strategy, name="agentrl-prepare")
        try:
            ray.get(self.group.ready(), timeout=self.place_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"the placement group was not granted within {self.place_timeout_s:.0f} s: prepare needs "
                f"{json.dumps(bundles)} ({strategy}, one bundle per node); `ray status` shows what the cluster has"
            ) from None

    def strategy(self, node: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=self.nodes.index(node)
        )

    def host(self, node: int) -> str:
        """The address of the host that holds `node`'s bundle (loopback for a simulated node)."""
        if self.local:
            return "127.0.0.1"
        ray = require_ray()
        task = ray.remote(num_cpus=0)(_node_ip)
        return str(ray.get(task.options(scheduling_strategy=self.strategy(node)).remote(), timeout=300))

    def spawn(self, spec: ProcessSpec, log_dir: Path) -> Any:
        ray = require_ray()
        actor = (
            ray.remote(ConvertActor)
            .options(
                scheduling_strategy=self.strategy(spec.node),
                name=f"agentrl-prepare-{spec.name}",
                num_cpus=0,
                num_gpus=0,
                max_restarts=0,
                max_task_retries=0,
                max_concurrency=2,
            )
            .remote(spec, str(log_dir))
        )
        self.actors.append(actor)
        return actor

    def run_on(self, node: int, fn: Any, *args: Any) -> Any:
        ray = require_ray()
        task = ray.remote(num_cpus=0, max_retries=0)(fn)
        return task.options(scheduling_strategy=self.strategy(node)).remote(*args)

    def shutdown(self) -> None:
        ray = require_ray()
        if not ray.is_initialized():
            return
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception as exc:  # already dead: the kill below is enough
                log.info("stop: %s", exc)
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.group)
            self.group = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def _task_error(exc: BaseException) -> BaseException:
    """The exception a Ray task raised (Ray wraps it)."""
    return getattr(exc, "cause", None) or exc


def run_conversion(
    placement: ConvertPlacement,
    layout: Layout,
    hf_dir: Path,
    out: Path,
    *,
    num_nodes: int,
    log_dir: Path,
    local: bool = False,
    ray_address: str | None = None,
    dtype: str | None = None,
    timeout_s: float = 6 * 3600.0,
    gpus: bool | None = None,
) -> dict[str, Any]:
    """The conversion on `placement.nodes` through Ray; the job's combined report (every rank's
    read summary and peak RSS, the round-trip result, which `check_report` requires exact) plus
    `nodes`: per node its host, node rank, ranks and seconds. `out` and `hf_dir` must be on storage
    every node sees (the recipe's shared root). `gpus`: bundles hold one GPU per rank (default on
    a cluster, off in local mode)."""
    ray = require_ray()
    hf_dir, out, log_dir = Path(hf_dir).resolve(), Path(out).resolve(), Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    report = report_path(out)
    use_gpus = (not local) if gpus is None else gpus
    bundle = {"CPU": 1.0, **({"GPU": float(placement.nproc_per_node)} if use_gpus else {})}
    with PrepareCluster(
        list(placement.nodes), num_nodes, local=local, ray_address=ray_address, bundle=bundle
    ) as c:
        master = c.host(placement.nodes[0])
        port = free_loopback_port() if local else CONVERT_PORT
        specs = conversion_specs(
            placement, layout, hf_dir, out, report, master_addr=master, master_port=port, dtype=dtype,
            cpu=not use_gpus,
        )  # fmt: skip
        hosts = {s.node: (master if s.node == placement.nodes[0] else c.host(s.node)) for s in specs}
        actors = {s.node: c.spawn(s, log_dir) for s in specs}
        (log_dir / "convert-specs.json").write_text(
            json.dumps([{"node": s.node, "host": hosts[s.node], "argv": s.argv} for s in specs], indent=1)
        )
        done = wait_for_nodes(actors, what=f"HF -> Megatron conversion of {hf_dir}", log_dir=log_dir,
                              timeout_s=timeout_s)  # fmt: skip
        text = ray.get(actors[placement.nodes[0]].read_text.remote(str(report), True), timeout=120)
    if text is None:
        raise ModelCheckpointError(
            f"the conversion's ranks exited 0 but rank 0 wrote no report at {report}; logs in {log_dir}"
        )
    result = check_report(json.loads(text), hf_dir, out)
    result["nodes"] = [
        {
            "node": s.node,
            "host": hosts[s.node],
            "node_rank": r,
            "ranks": placement.nproc_per_node,
            "seconds": round(done[s.node], 1),
        }
        for r, s in enumerate(specs)
    ]
    return result


def wait_for_nodes(
    actors: dict[int, Any], *, what: str, log_dir: Path, timeout_s: float, poll_s: float = 5.0
) -> dict[int, float]:
    """Seconds until each node's process (a `ConvertActor` per plan node) exited 0. The first node
    that fails (a non-zero exit, a dead actor) or the timeout raises `ModelCheckpointError` naming it,
    with every node's log tail; the caller's `PrepareCluster` then stops the others, which would
    otherwise wait for the failed node's ranks until the job's own timeouts."""
    ray = require_ray()
    t0 = time.monotonic()
    pending = {actor.wait_exit.remote(poll_s): node for node, actor in actors.items()}
    done: dict[int, float] = {}
    while pending:
        if time.monotonic() - t0 > timeout_s:
            raise ModelCheckpointError(
                f"{what} did not finish within {timeout_s:.0f} s; logs in {log_dir}" + _tails(actors)
            )
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=poll_s * 2)
        for ref in ready:
            node = pending.pop(ref)
            try:
                code = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise ModelCheckpointError(
                    f"{what}: the actor of node-{node:02d} died or never started ({str(exc)[-1500:]}); the "
                    f"other nodes are stopped; logs in {log_dir}" + _tails(actors)
                ) from None
            if code is None:
                pending[actors[node].wait_exit.remote(poll_s)] = node
            elif code != 0:
                raise ModelCheckpointError(
                    f"{what} failed on node-{node:02d} (exit {code}); the other nodes are stopped; logs in "
                    f"{log_dir}" + _tails(actors)
                )
            else:
                done[node] = time.monotonic() - t0
    return done


def _tails(actors: dict[int, Any]) -> str:
    ray = require_ray()
    out = []
    for node, actor in actors.items():
        try:
            tail = ray.get(actor.log_tail.remote(1500), timeout=30)
        except Exception as exc:  # a dead actor's log stays on its node's disk
            tail = f"(no log: {type(exc).__name__})"
        out.append(f"\n--- node-{node:02d}:\n{tail}")
    return "".join(out)


@dataclass(frozen=True)
class NodeCopy:
    node: int
    host: str
    copied: list[dict[str, Any]]


def copy_to_nodes(
    needs: dict[int, list[str]],
    *,
    root: Path,
    local_root: Path,
    model_name: str,
    num_nodes: int,
    local: bool = False,
    ray_address: str | None = None,
) -> tuple[list[NodeCopy], list[str]]:
    """`prepare-cp` on every node of `needs` (plan node -> the kinds it loads: megatron, fp8, hf):
    `<root>/<kind>/<model>` -> `<local_root>/<kind>/<model>` on that node (local mode:
    `<local_root>/node-NN/...`). Returns per node what was copied, and notes (e.g. that the cluster
    does not pin plan nodes to hosts, so every node got every role's files). A node that fails
    raises `ModelCheckpointError` naming it, after the other nodes finished."""
    ray = require_ray()
    notes: list[str] = []
    results: list[NodeCopy] = []
    failed: list[str] = []
    with PrepareCluster(sorted(needs), num_nodes, local=local, ray_address=ray_address) as c:
        if not c.pinned:
            union = sorted({k for kinds in needs.values() for k in kinds})
            needs = {n: union for n in needs}
            notes.append(
                "the Ray cluster does not pin plan nodes to hosts (no agentrl_node_NN resources), so the "
                f"roles of `train` may land on other hosts: every node got {', '.join(union)}"
            )
        refs = {}
        for node, kinds in needs.items():
            dest_root = Path(local_root) / f"node-{node:02d}" if local else Path(local_root)
            pairs = [(str(Path(root) / k / model_name), str(dest_root / k / model_name)) for k in kinds]
            refs[node] = c.run_on(node, _copy_node, node, pairs)
        for node, ref in refs.items():
            try:
                r = ray.get(ref, timeout=24 * 3600)
            except ray.exceptions.RayError as exc:
                failed.append(f"node-{node:02d}: {_task_error(exc)}")
                continue
            results.append(NodeCopy(node, r["host"], r["copied"]))
    if failed:
        done = ", ".join(f"node-{r.node:02d}" for r in results) or "none"
        raise ModelCheckpointError(f"prepare-cp failed on {'; '.join(failed)} (copied on: {done})")
    return results, notes
