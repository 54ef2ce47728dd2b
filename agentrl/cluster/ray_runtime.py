"""Ray orchestration of a resolved cluster plan (`agentrl.cluster.recipe.ClusterPlan`).

One placement group per role (training nodes, rollout nodes; one shared group when the recipe
colocates them), one bundle per plan node. Every process of the plan runs under a `ProcessActor`
placed in its node's bundle, started from the plan's own command line (the only source of command
lines): SGLang servers (`python -m sglang.launch_server ...`: launched, never imported), the `smg`
router in front of them (consistent hashing), and the trainer (`agentrl train run ...`, under
torchrun on clusters), which runs the library's loop: rollout manager through the router, GRPO + TIS,
weight sync to every server, checkpoints. Ray fills in the `node-NN` host names of the plan.

Supervision (`ClusterRun.supervise`): an engine or router actor whose process died is restarted by
Ray (`max_restarts`), which starts the same command line again. A restarted engine actor first takes
its server off the router, so nothing is generated on its launch weights; the trainer's fleet client
(the router for generation, every configured server for control) counts the dead server out of the
control plane and back in when it answers, the next weight sync gives it the whole model (the
distributed transport forms its group again with it), and the client then registers it with the
router again. The router replays the dead server's in-flight requests elsewhere and the rollout
manager retries any episode that failed with it (an infra failure, never a reward). A trainer that crashes is
restarted with `checkpoint.resume=true` (always on under the supervisor): it continues from its
last checkpoint.

Local mode (`LocalSettings`): the same code on one machine. The plan's nodes are simulated by
custom resources (`agentrl_node_NN`) of one local Ray cluster; `agentrl engine serve` processes
take the SGLang servers' places (same served name and TP size, a free loopback port each), behind
the real `smg` router; one trainer process (the torch backend, a tiny model, podman sandboxes,
weights by disk) takes the torchrun ranks' place.

Ray is imported lazily: `pip install -e '.[ray]'`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentrl.cluster.actors import ProcessActor, ProcessFailed, ProcessSpec, Readiness
from agentrl.cluster.launch import ensure_key, keyed
from agentrl.cluster.recipe import ClusterPlan, Process, RecipeError, engine_key_file, env_data
from agentrl.errors import AgentRLError

log = logging.getLogger("agentrl.cluster")

NODE_RESOURCE = "agentrl_node_{:02d}"
NAMESPACE = "agentrl"
# Under the supervisor a restarted trainer continues from its last checkpoint.
SUPERVISED_OVERRIDES = ("checkpoint.resume=true",)
# The local router notices a dead or restarted worker within about a second.
LOCAL_ROUTER_FLAGS = (
    "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1", "--health-success-threshold", "1",
    "--cb-timeout-duration-secs", "1", "--log-level", "warn",
)  # fmt: skip
_NODE = re.compile(r"node-(\d{2,})")


class ClusterError(AgentRLError):
    """The cluster run could not be placed, started or kept alive; the message says which part."""


@dataclass(frozen=True)
class LocalSettings:
    """Local mode: the plan's nodes simulated on this machine."""

    run_dir: Path
    model_dir: Path
    overrides: tuple[str, ...] = ()  # run settings on top of the plan's and the local defaults
    python: str = sys.executable
    ready_timeout_s: float = 180.0


# Plan settings that only make sense on the GPU cluster; local mode replaces them.
_CLUSTER_ONLY = ("trainer.megatron.", "trainer.backend=", "engine.model=", "out=", "sync.transport=",
                 "trainer.max_tokens_per_micro_batch=", "env.backend=", "env.tasks=",
                 "engine.api_key_file=")  # fmt: skip


def local_run_overrides(plan: ClusterPlan, settings: LocalSettings) -> list[str]:
    """The trainer's settings in local mode: the plan's (engine fleet through the router,
    algorithm, environment) minus the cluster-only ones, the local defaults (the environment's own
    from its data hooks' `smoke_settings`), then the user's."""
    base = [s for s in plan.run_overrides if not s.startswith(_CLUSTER_ONLY)]
    local = [
        f"out={settings.run_dir}",
        "trainer.backend=torch",
        f"engine.model={settings.model_dir}",
        "engine.request_timeout_s=120",
        "engine.control_timeout_s=60",
        "sync.transport=disk",
        "steps=2",
        "checkpoint.every=1",
        "eval.before=false",
        "eval.after=false",
        "eval.every=0",
        "rollout.n_samples_per_prompt=2",
        "rollout.batch_size=4",
        "rollout.max_in_flight=4",
        "rollout.max_staleness=1",
        "rollout.dynamic_filter=false",  # a tiny model's groups rarely carry signal; train them anyway
        "rollout.episode_timeout_s=120",
        "trainer.lr=3e-5",
        "trainer.logprob_chunk_size=null",
        "torch_threads=1",
    ]
    smoke_settings = getattr(env_data(plan.spec.env), "smoke_settings", None)
    if smoke_settings is not None:
        local += smoke_settings(settings.run_dir)
    key = run_key_file(plan, settings)
    if key:
        local.append(f"engine.api_key_file={key}")
    return [*base, *local, *settings.overrides]


def check_local(plan: ClusterPlan) -> None:
    if plan.enable_pd:
        raise RecipeError(
            "--local: prefill/decode disaggregation needs SGLang servers; `agentrl engine serve` has no "
            "prefill/decode split: drop --enable-pd (or pass --no-enable-pd)"
        )


def free_loopback_port() -> int:
    """A free loopback port below the kernel's ephemeral range (32768+), which Ray's own workers
    and other programs' "any free port" binds draw from, and above Ray's worker ports (10002-19999):
    a port chosen here stays free until its server binds it, seconds later."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20100, 32700)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ClusterError("no free loopback port between 20100 and 32700")


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def _flag(argv: list[str] | tuple[str, ...], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


_ENGINE_RANK = re.compile(r"^(sglang-\w+-\d+)-node\d+$")


def engine_siblings(names: list[str], name: str) -> list[str]:
    """The other node ranks of the multi-node SGLang engine `name` belongs to (`sglang-<role>-<i>-
    node<k>`): one rank's process cannot rejoin the others' (their NCCL world has lost a member),
    so when one restarts, all restart. Empty for a one-node engine or another process."""
    m = _ENGINE_RANK.match(name)
    if m is None:
        return []
    return [n for n in names if n != name and (g := _ENGINE_RANK.match(n)) and g.group(1) == m.group(1)]


def engine_processes(plan: ClusterPlan) -> list[tuple[int, Process]]:
    """(engine index, process) for every SGLang process of the plan, in engine order."""
    out = []
    for e in plan.engines:
        name = f"sglang-{e.role}-{e.index}"
        out += [(e.index, p) for p in plan.processes if p.name == name or p.name.startswith(f"{name}-node")]
    return out


def build_specs(
    plan: ClusterPlan, hosts: dict[int, str], local: LocalSettings | None = None
) -> list[ProcessSpec]:
    """Every process of the plan as an actor will start it: `node-NN` replaced by that node's
    address (`hosts`); in local mode the SGLang servers become `agentrl engine serve` processes on
    free loopback ports (one per engine, on its first node) and the trainer ranks one process."""

    def host(text: str) -> str:
        return _NODE.sub(lambda m: hosts[int(m.group(1))], text)

    key = run_key_file(plan, local)
    router = next(p for p in plan.processes if p.name == "router")
    plan_router = f"http://node-{router.node:02d}:{_flag(router.argv, '--port')}"
    if local is None:
        router_url = host(plan_router)
    else:
        router_port = free_loopback_port()
        router_url = f"http://127.0.0.1:{router_port}"
    urls: dict[str, str] = {plan_router: router_url}  # plan URL -> real URL
    specs: list[ProcessSpec] = []
    for index, p in engine_processes(plan):
        e = plan.engines[index]
        # A restarted server leaves the router until an update brings it to the fleet's version;
        # prefill servers of a PD pair are registered with their decode peers, not by this path.
        if local is None:
            real = host(e.url)
            urls[e.url] = real
            argv = tuple(host(a) for a in p.argv)
            first = p.name == f"sglang-{e.role}-{e.index}" or p.name.endswith("-node0")
            member = real if e.role != "prefill" and first else ""
            specs.append(ProcessSpec(p.name, "engine", p.node, _keyed(argv, key), dict(p.env),
                                     Readiness(f"{real}/health"), drop_env=("CUDA_VISIBLE_DEVICES",),
                                     router_url=router_url, worker_url=member, key_file=key))  # fmt: skip
            continue
        if p.name.endswith("-node0") is False and "-node" in p.name:
            continue  # the other ranks of a multi-node engine: one local server stands for it
        port = free_loopback_port()
        real = f"http://127.0.0.1:{port}"
        urls[e.url] = real
        argv = (
            local.python, "-m", "agentrl.cli", "engine", "serve", "--model", str(local.model_dir),
            "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", _flag(p.argv, "--served-model-name") or plan.options.model_name,
            "--tp-size", _flag(p.argv, "--tp-size") or "1",
        )  # fmt: skip
        name = p.name.removesuffix("-node0")
        ready = Readiness(f"{real}/health")
        env = {"OMP_NUM_THREADS": "1"}
        specs.append(
            ProcessSpec(name, "engine", p.node, _keyed(argv, key, local.python), env, ready,
                        router_url=router_url, worker_url=real, key_file=key)
        )  # fmt: skip

    def swap(text: str) -> str:
        for plan_url, real in urls.items():
            text = text.replace(plan_url, real)
        return host(text)

    r_argv: list[str] = [swap(a) for a in router.argv]
    if local is not None:
        r_argv = _set_flag(_set_flag(r_argv, "--host", "127.0.0.1"), "--port", str(router_port))
        metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_loopback_port())]
        r_argv = [_smg(), *r_argv[1:], *LOCAL_ROUTER_FLAGS, *metrics]
    workers = tuple(urls[e.url] for e in plan.engines if e.url in urls)
    python = local.python if local is not None else "python"
    specs.append(ProcessSpec("router", "router", router.node, _keyed(r_argv, key, python), dict(router.env),
                             Readiness(f"{router_url}/workers", workers), key_file=key))  # fmt: skip

    trainers = [p for p in plan.processes if p.name.startswith("trainer-")]
    if local is None:
        for p in trainers:
            t_argv = [swap(a) for a in p.argv]
            for s in SUPERVISED_OVERRIDES:
                t_argv += ["--set", s]
            specs.append(ProcessSpec(p.name, "trainer", p.node, tuple(t_argv), dict(p.env),
                                     drop_env=("CUDA_VISIBLE_DEVICES",)))  # fmt: skip
    else:
        sets = [swap(s) for s in local_run_overrides(plan, local)] + list(SUPERVISED_OVERRIDES)
        t_argv = [local.python, "-m", "agentrl.cli", "train", "run"]
        for s in sets:
            t_argv += ["--set", s]
        env = {k: v for k, v in trainers[0].env.items() if not k.startswith("CUDA_")}
        env["OMP_NUM_THREADS"] = "1"
        specs.append(ProcessSpec("trainer-0", "trainer", trainers[0].node, tuple(t_argv), env))
    return specs


def run_key_file(plan: ClusterPlan, local: LocalSettings | None = None) -> str:
    """The run's engine key file as the processes see it: the plan's (a path on the shared storage;
    a relative one made absolute here, on the driver), in local mode `run_dir/engine.key`; '' with
    --no-engine-auth."""
    key = engine_key_file(plan.options)
    if not key:
        return ""
    if local is not None:
        return str((Path(local.run_dir) / "engine.key").resolve())
    return key if key.startswith(("/", "~")) else str(Path(key).resolve())


def _keyed(argv: list[str] | tuple[str, ...], key: str, python: str = "python") -> tuple[str, ...]:
    return tuple(keyed(argv, key, python)) if key else tuple(argv)


def _smg() -> str:
    here = Path(sys.executable).parent / "smg"
    if here.exists():
        return str(here)
    found = shutil.which("smg")
    if found is None:
        raise ClusterError("the SGLang router `smg` is not installed: pip install smg")
    return found


def require_ray() -> Any:
    """The `ray` module, or a ClusterError that says how to install it."""
    try:
        import ray
    except ModuleNotFoundError:
        raise ClusterError("Ray is not installed: pip install -e '.[ray]'") from None
    return ray


@dataclass
class RunOutcome:
    seconds: float
    trainer_exit: int
    restarts: dict[str, int] = field(default_factory=dict)
    specs: list[ProcessSpec] = field(default_factory=list)


class ClusterRun:
    """Places and supervises one plan on a Ray cluster (`ray_address`, default "auto"), or on a
    local simulated one (`local`). Use as a context manager: leaving it stops every process,
    removes the placement groups and shuts down the Ray it started, also after a failure."""

    def __init__(
        self,
        plan: ClusterPlan,
        *,
        log_dir: Path,
        local: LocalSettings | None = None,
        ray_address: str | None = None,
        max_engine_restarts: int = 3,
        max_trainer_restarts: int = 2,
    ) -> None:
        if local is not None:
            check_local(plan)
        self.plan = plan
        self.local = local
        self.log_dir = Path(log_dir)
        self.ray_address = ray_address
        self.max_engine_restarts = max_engine_restarts
        self.max_trainer_restarts = max_trainer_restarts
        self.specs: list[ProcessSpec] = []
        self.actors: dict[str, Any] = {}
        self.groups: dict[str, Any] = {}
        self.pids: dict[str, list[int]] = {}  # every pid each process has had (leak checks)
        self.restarts: dict[str, int] = {}
        self._owns_ray = False
        # Plan nodes pinned to hosts: every cluster node advertises its `agentrl_node_NN` resource
        # (`ray start --resources '{"agentrl_node_03": 1}'`), so node N's processes run where
        # `prepare-cp` put node N's files. Local mode always is; a cluster is checked on start.
        self.pinned = local is not None

    # --- placement -----------------------------------------------------------------------------

    def role_nodes(self) -> dict[str, list[int]]:
        p = self.plan
        if p.colocated:
            return {"colocated": sorted(set(p.train_nodes) | set(p.rollout_nodes))}
        return {"trainer": list(p.train_nodes), "rollout": list(p.rollout_nodes)}

    def bundles(self) -> dict[str, list[dict[str, float]]]:
        """Per role, one bundle per node: a simulated node's custom resource (local), or the
        node's GPUs (held for the plan's processes, which pick their devices by its flags)."""
        out = {}
        for role, nodes in self.role_nodes().items():
            if self.local is not None:
                out[role] = [{NODE_RESOURCE.format(n): 1.0} for n in nodes]
            else:
                pin = (lambda n: {NODE_RESOURCE.format(n): 1.0}) if self.pinned else (lambda n: {})
                out[role] = [{"CPU": 1.0, "GPU": float(self.plan.gpus_per_node), **pin(n)} for n in nodes]
        return out

    def _where(self, node: int) -> tuple[Any, int]:
        for role, nodes in self.role_nodes().items():
            if node in nodes:
                return self.groups[role], nodes.index(node)
        raise ClusterError(f"node-{node:02d} is in no placement group")

    def _start_ray(self) -> None:
        ray = require_ray()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if ray.is_initialized():
            return
        if self.local is not None:
            resources = {NODE_RESOURCE.format(n): 1.0 for n in range(self.plan.options.num_nodes)}
            ray.init(
                num_cpus=2,
                num_gpus=0,
                resources=resources,
                include_dashboard=False,
                log_to_driver=False,
                namespace=NAMESPACE,
                object_store_memory=80 * 2**20,
                configure_logging=False,
            )
        else:
            ray.init(address=self.ray_address or "auto", namespace=NAMESPACE, log_to_driver=False)
        self._owns_ray = True

    def _place(self) -> None:
        from ray.util.placement_group import placement_group

        ray = require_ray()
        if self.local is None:
            have = ray.cluster_resources()
            self.pinned = all(NODE_RESOURCE.format(n) in have for n in range(self.plan.options.num_nodes))
            if not self.pinned:
                log.warning(
                    "the Ray cluster does not pin plan nodes to hosts (no agentrl_node_NN resources): Ray "
                    "chooses which host runs which plan node, so node-local files from `prepare-cp` may be "
                    "on another host; start each node's Ray with --resources '{\"agentrl_node_NN\": 1}'"
                )
        strategy = "PACK" if self.local is not None else "STRICT_SPREAD"
        for role, bundles in self.bundles().items():
            self.groups[role] = placement_group(bundles, strategy=strategy, name=f"agentrl-{role}")
        pending = {role: pg.ready() for role, pg in self.groups.items()}
        try:
            ray.get(list(pending.values()), timeout=120 if self.local is not None else 1800)
        except ray.exceptions.GetTimeoutError:
            need = {role: b for role, b in self.bundles().items()}
            raise ClusterError(
                f"the placement groups were not granted: the plan needs {json.dumps(need)} (one bundle per "
                f"node, {self.plan.options.num_nodes} nodes); `ray status` shows what the cluster has"
            ) from None

    def _hosts(self) -> dict[int, str]:
        if self.local is not None:
            return {n: "127.0.0.1" for n in range(self.plan.options.num_nodes)}
        ray = require_ray()

        @ray.remote(num_cpus=0)
        def ip() -> str:
            return str(ray.util.get_node_ip_address())

        refs = {}
        for n in range(self.plan.options.num_nodes):
            pg, i = self._where(n)
            refs[n] = ip.options(scheduling_strategy=self._strategy(pg, i)).remote()
        return {n: ray.get(r, timeout=300) for n, r in refs.items()}

    @staticmethod
    def _strategy(pg: Any, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)

    def actor_options(self, spec: ProcessSpec) -> dict[str, Any]:
        """Everything given to Ray for `spec`'s actor besides the spec itself (no runtime_env: the
        nodes run the installed agentrl; nothing of the driver's environment travels)."""
        restarts = self.max_trainer_restarts if spec.role == "trainer" else self.max_engine_restarts
        return {
            "name": f"agentrl-{spec.name}",
            "num_cpus": 0,
            "num_gpus": 0,
            "max_restarts": restarts,
            "max_task_retries": 0,
            "max_concurrency": 1,
        }

    def _spawn(self, spec: ProcessSpec) -> Any:
        ray = require_ray()
        pg, index = self._where(spec.node)
        cls = ray.remote(ProcessActor)
        opts = self.actor_options(spec)
        actor = cls.options(scheduling_strategy=self._strategy(pg, index), **opts).remote(
            spec, str(self.log_dir)
        )
        self.actors[spec.name] = actor
        return actor

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Ray, placement groups, engines (ready), router (every engine registered), trainer."""
        ray = require_ray()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._start_ray()
        self._place()
        key = run_key_file(self.plan, self.local)
        if key:  # before any process reads it: created here, on the driver, if missing
            ensure_key(key)
        self.specs = build_specs(self.plan, self._hosts(), self.local)
        (self.log_dir / "specs.json").write_text(json.dumps([asdict(s) for s in self.specs], indent=1))
        timeout = self.local.ready_timeout_s if self.local is not None else 3600.0
        engines = [s for s in self.specs if s.role == "engine"]
        for s in engines:
            self._spawn(s)
        self._wait_ready([s.name for s in engines], timeout)
        router = next(s for s in self.specs if s.role == "router")
        self._spawn(router)
        self._wait_ready([router.name], 120.0)
        for s in self.specs:
            if s.role == "trainer":
                self._spawn(s)
        for name in self.actors:
            self._record(name, ray.get(self.actors[name].status.remote(), timeout=60))
        log.info("cluster run started: %s", ", ".join(self.actors))

    def _wait_ready(self, names: list[str], timeout_s: float) -> None:
        ray = require_ray()
        refs = {n: self.actors[n].wait_ready.remote(timeout_s) for n in names}
        for n, r in refs.items():
            try:
                seconds = ray.get(r, timeout=timeout_s + 30)
            except ray.exceptions.RayTaskError as exc:
                raise ClusterError(f"{n}: {exc.cause if hasattr(exc, 'cause') else exc}") from None
            log.info("%s ready in %.1f s", n, seconds)

    def _restart_siblings(self, name: str, handled: set[tuple[str, int]], *, pending: bool) -> None:
        """Restart the other node ranks of `name`'s engine, once per restart of `name`.
        `pending`: `name` itself is about to be restarted (its process exited), not restarted yet.
        The restarts this causes are remembered in `handled` (as (rank, the pid count it will
        have)), so they do not set off another round."""
        count = len(self.pids.get(name, [])) + (1 if pending else 0)
        if (name, count) in handled:
            return
        handled.add((name, count))
        for sib in engine_siblings(list(self.actors), name):
            handled.add((sib, len(self.pids.get(sib, [])) + 1))
            log.warning("%s restarted: restarting %s too (one multi-node engine)", name, sib)
            self.kill(sib)

    def _record(self, name: str, status: dict[str, Any]) -> bool:
        """Note the process's pid; True when it is a new one (the actor was restarted)."""
        seen = self.pids.setdefault(name, [])
        if status["pid"] in seen:
            return False
        seen.append(status["pid"])
        if len(seen) > 1:
            self.restarts[name] = self.restarts.get(name, 0) + 1
            log.warning("%s restarted (restart %d)", name, self.restarts[name])
        return True

    def kill(self, name: str) -> None:
        """Kill one actor as a crash would (Ray restarts it): fault injection and supervision."""
        require_ray().kill(self.actors[name], no_restart=False)

    def supervise(
        self,
        *,
        timeout_s: float = 24 * 3600.0,
        poll_s: float = 1.0,
        on_poll: Callable[[ClusterRun], None] | None = None,
    ) -> RunOutcome:
        """Until the trainer finishes: restart what died, give up after the restart budgets."""
        ray = require_ray()
        t0 = time.monotonic()
        trainers = [s.name for s in self.specs if s.role == "trainer"]
        failing: dict[str, int] = {}
        handled: set[tuple[str, int]] = set()  # (engine rank, its pid count) whose siblings restarted
        while True:
            if time.monotonic() - t0 > timeout_s:
                raise ClusterError(f"the run did not finish within {timeout_s:.0f} s; logs in {self.log_dir}")
            statuses: dict[str, dict[str, Any]] = {}
            for name, actor in self.actors.items():
                try:
                    statuses[name] = ray.get(actor.status.remote(), timeout=60)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                    # A call made while Ray restarts an actor waits for it; one made just before
                    # it died fails once. Failing again and again: out of restarts.
                    failing[name] = failing.get(name, 0) + 1
                    if failing[name] >= 3:
                        raise ClusterError(
                            f"{name} is dead and not restarted any more (after {self.restarts.get(name, 0)} "
                            f"restarts): {type(exc).__name__}; its log is {self.log_dir / (name + '.log')}"
                        ) from None
                    continue
                failing.pop(name, None)
                if self._record(name, statuses[name]) and len(self.pids[name]) > 1:
                    self._restart_siblings(name, handled, pending=False)  # Ray restarted it
            for name, st in statuses.items():
                if st["returncode"] is None or name in trainers:
                    continue
                log.warning("%s exited with %s: restarting it", name, st["returncode"])
                self.kill(name)
                self._restart_siblings(name, handled, pending=True)
            codes = [statuses[n]["returncode"] for n in trainers if n in statuses]
            if len(codes) == len(trainers) and all(c == 0 for c in codes):
                return RunOutcome(time.monotonic() - t0, 0, dict(self.restarts), list(self.specs))
            if any(c not in (None, 0) for c in codes):
                failed = sum(self.restarts.get(n, 0) for n in trainers)
                if failed >= self.max_trainer_restarts:
                    tail = ray.get(self.actors[trainers[0]].log_tail.remote(), timeout=30)
                    raise ClusterError(
                        f"the trainer failed {failed + 1} times; its log {self.log_dir / 'trainer-0.log'} "
                        f"ends:\n{tail}"
                    )
                log.warning("the trainer exited with %s: restarting it from its last checkpoint", codes)
                for n in trainers:
                    self.kill(n)
            if on_poll is not None:
                on_poll(self)
            time.sleep(poll_s)

    def shutdown(self) -> None:
        """Stop every process (their actors, then the placement groups; Ray itself when this run
        started it). Safe to call twice and after a failed start."""
        ray = require_ray()
        if not ray.is_initialized():
            return
        for name in reversed(list(self.actors)):
            actor = self.actors[name]
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception as exc:  # dead or restarting: the kill below ends it
                log.info("stop %s: %s", name, exc)
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception as exc:  # already gone with the cluster
                log.info("remove placement group: %s", exc)
        self.groups.clear()
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> ClusterRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def prepare_local_data(plan: ClusterPlan, run_dir: Path, seed: int = 0) -> None:
    """The environment's data in local mode (its data hooks' `prepare_smoke`, if it has one: e.g.
    a few synthetic rows written once under <run_dir>/data)."""
    prepare_smoke = getattr(env_data(plan.spec.env), "prepare_smoke", None)
    if prepare_smoke is not None:
        prepare_smoke(run_dir, seed=seed)


def run_local(
    plan: ClusterPlan,
    run_dir: Path,
    *,
    model_dir: Path | None = None,
    overrides: list[str] | None = None,
    timeout_s: float = 3600.0,
    on_poll: Callable[[ClusterRun], None] | None = None,
) -> RunOutcome:
    """The plan on simulated nodes of a local Ray cluster (see the module docstring)."""
    if model_dir is None:
        from agentrl.models.tiny import tiny_model_dir

        model_dir = Path(tiny_model_dir())
    run_dir = Path(run_dir).resolve()
    settings = LocalSettings(run_dir=run_dir, model_dir=Path(model_dir), overrides=tuple(overrides or ()))
    prepare_local_data(plan, run_dir)
    with ClusterRun(plan, log_dir=run_dir / "logs", local=settings) as run:
        try:
            run.start()
            return run.supervise(timeout_s=timeout_s, on_poll=on_poll)
        except ProcessFailed as exc:
            raise ClusterError(str(exc)) from None


def run_cluster(plan: ClusterPlan, *, ray_address: str | None = None) -> RunOutcome:
    """The plan on a running Ray cluster (`ray start --head` / `ray start --address` on every node)."""
    run_dir = Path(plan.options.root) / "runs" / plan.options.recipe
    with ClusterRun(plan, log_dir=run_dir / "logs", ray_address=ray_address) as run:
        run.start()
        return run.supervise()
