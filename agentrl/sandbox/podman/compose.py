"""Multi-container tasks on podman (`agentrl.tasks.compose`), as Docker compose runs them: one
network per sandbox (a bridge of its own, `--disable-dns`, so every container keeps the host's
resolvers), each service a container with its own network namespace, file system, processes and
limits, at a fixed address of that network, every service's name in every container's
/etc/hosts. `main` starts first and is the agent's sandbox; the others start after it, in
`depends_on` order, each waited for (healthy, started or completed) before the next and before
the agent runs. The sandbox's network policy and its phase switches (`PodmanSandbox.set_network`)
are applied in every service's namespace, from the host; within a closed policy the services
still reach each other, never the network's gateway (the host). The private verifier joins
`main`'s namespace. Removing the sandbox removes its services, network and named volumes.

Not like Docker compose: `ports` publish nothing; `main`'s own `command` is not run (agentrl
keeps `main` alive itself, as Harbor's base file does); names resolve through /etc/hosts, not a
DNS server. Harbor itself runs every service in one network namespace (its egress sidecar's)
whenever a phase is not public (`harbor/environments/docker/docker.py`,
`_egress_controlled_service_names`); agentrl keeps them apart under every policy.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from agentrl.sandbox.base import SandboxCreateError, tail
from agentrl.sandbox.podman.cli import rm_args, run_cli
from agentrl.tasks.compose import MAIN, ComposeSpec, Service
from agentrl.tasks.task import Task


class PodmanProvider(Protocol):
    """What starting services needs of the provider (`agentrl.sandbox.podman.PodmanProvider`)."""

    cli: str
    pids_limit: int
    default_cpus: float | None
    default_memory_mb: int | None
    default_storage_mb: int | None
    _podman: bool
    _storage_opt: bool | None

    async def image_for(self, task: Task) -> str: ...


log = logging.getLogger(__name__)


@dataclass
class ComposeNet:
    """A compose sandbox's network: its name, subnet and gateway, and each service's address and
    container."""

    name: str
    subnet: str
    gateway: str
    addresses: dict[str, str]  # service -> its address on the network
    containers: dict[str, str] = field(default_factory=dict)  # service -> container, once started
    volumes: list[str] = field(default_factory=list)  # the named volumes' names on the host

    def hosts_args(self) -> list[str]:
        return [arg for svc, ip in self.addresses.items() for arg in ("--add-host", f"{svc}:{ip}")]

    def run_args(self, service: str) -> list[str]:
        return ["--network", self.name, "--ip", self.addresses[service], *self.hosts_args()]


def main_args(spec: ComposeSpec, net: ComposeNet, volumes: dict[str, str]) -> list[str]:
    """What `main`'s `run` gets from the compose file and its network."""
    main = spec.services[MAIN]
    if main.command or main.entrypoint:
        log.warning("compose: the main service's command is not run (agentrl keeps main alive itself)")
    args = net.run_args(MAIN)
    for k, v in main.environment.items():
        args += ["-e", f"{k}={v}"]
    return args + _volume_args(main, volumes)


def _volume_args(service: Service, volumes: dict[str, str]) -> list[str]:
    args = []
    for source, target, ro in service.volumes:
        args += ["-v", f"{volumes.get(source, source)}:{target}{':ro' if ro else ''}"]
    return args


async def create_network(
    provider: PodmanProvider, spec: ComposeSpec, name: str, labels: list[str]
) -> ComposeNet:
    """The sandbox's network (a subnet podman picks, addresses from it in service order, the
    gateway left out) and its named volumes."""
    net_name = f"{name}-net"
    rc, _, err = await run_cli(
        provider.cli, "network", "create", "--disable-dns", *labels, net_name, timeout=120
    )
    if rc != 0:
        raise SandboxCreateError(f"creating the network {net_name} failed", log_tail=tail(err, 2000))
    net = ComposeNet(net_name, "", "", {})
    try:
        rc, out, err = await run_cli(
            provider.cli, "network", "inspect", "--format",
            "{{range .Subnets}}{{.Subnet}} {{.Gateway}}\n{{end}}", net_name, timeout=60,
        )  # fmt: skip
        lines = [line.split() for line in out.splitlines() if line.strip()]
        if rc != 0 or not lines or len(lines[0]) != 2:
            raise SandboxCreateError(
                f"reading the subnet of {net_name} failed", log_tail=tail(err + out, 2000)
            )
        net.subnet, net.gateway = lines[0]
        free = (str(ip) for ip in ipaddress.ip_network(net.subnet).hosts() if str(ip) != net.gateway)
        net.addresses = {svc: next(free) for svc in spec.services}
        for vol in spec.volumes:
            host_name = f"{name}-{vol}"
            rc, _, err = await run_cli(provider.cli, "volume", "create", *labels, host_name, timeout=120)
            if rc != 0:
                raise SandboxCreateError(f"creating the volume {vol} failed", log_tail=tail(err, 2000))
            net.volumes.append(host_name)
    except BaseException:
        await asyncio.shield(remove_network(provider.cli, net))  # nothing half-made stays behind
        raise
    return net


async def start_services(
    provider: PodmanProvider,
    task: Task,
    spec: ComposeSpec,
    sandbox: str,
    net: ComposeNet,
    labels: list[str],
    started: Callable[[str, str], Awaitable[None]],
) -> None:
    """Every service but `main`, in order, each handed to `started` (the network policy goes on
    it) and then waited for as the services depending on it ask."""
    volumes = dict(zip(spec.volumes, net.volumes, strict=True))
    deadline = time.monotonic() + task.config.environment.build_timeout_sec
    wanted: dict[str, str] = {}  # service -> the strongest condition any dependant asks of it
    rank = {"service_started": 0, "service_healthy": 1, "service_completed_successfully": 2}
    for svc in spec.services.values():
        for dep, cond in svc.depends_on.items():
            if rank[cond] >= rank.get(wanted.get(dep, ""), -1):
                wanted[dep] = cond
    for svc in spec.sidecars:
        image = await provider.image_for(task.service_task(svc))
        name = f"{sandbox}-{svc.name}"
        net.containers[svc.name] = name
        args = ["run", "-d", "--name", name, *net.run_args(svc.name), *labels]
        # The service's own limits, within the task's: agentrl's process cap, the task's cpus (a
        # service that names none gets them, one that names more is held to them). Its writable
        # layer counts against the task's storage limit: capped by the storage driver where it
        # can, else measured from the host with main's (`PodmanSandbox._measure_storage`).
        env = task.config.environment
        args += ["--pids-limit", str(min(svc.pids or provider.pids_limit, provider.pids_limit))]
        if provider._podman:
            args.append("--http-proxy=false")
        if memory := svc.memory_mb or provider.default_memory_mb:
            args += ["--memory", f"{memory}m", "--memory-swap", f"{memory}m"]
        if cpus := [c for c in (svc.cpus, env.cpus or provider.default_cpus) if c]:
            args += ["--cpus", f"{min(cpus):g}"]
        storage = env.storage_mb or provider.default_storage_mb
        if storage and provider._storage_opt:
            args += ["--storage-opt", f"size={storage}m"]
        for k, v in svc.environment.items():
            args += ["-e", f"{k}={v}"]
        args += _volume_args(svc, volumes)
        if svc.working_dir:
            args += ["-w", svc.working_dir]
        if svc.user:
            args += ["--user", svc.user]
        if svc.entrypoint is not None:
            args += ["--entrypoint", json.dumps(svc.entrypoint)]
        args += [image, *(svc.command or [])]
        rc, _, err = await run_cli(provider.cli, *args, timeout=120)
        if rc != 0:
            raise SandboxCreateError(
                f"{task.task_id}: starting service {svc.name!r} failed", log_tail=tail(err, 2000)
            )
        await started(svc.name, name)
        await _wait(provider, task, svc, name, wanted.get(svc.name, "service_started"), deadline)


async def _wait(
    provider: PodmanProvider, task: Task, svc: Service, name: str, condition: str, deadline: float
) -> None:
    cli = provider.cli
    if condition == "service_completed_successfully":
        rc, out, err = await run_cli(cli, "wait", name, timeout=max(1.0, deadline - time.monotonic()))
        if rc != 0 or out.strip() != "0":
            raise SandboxCreateError(
                f"{task.task_id}: service {svc.name!r} did not complete successfully (exit {out.strip()})",
                log_tail=tail(err, 500),
            )
        return
    if condition != "service_healthy":
        return
    if svc.healthcheck is None:
        raise SandboxCreateError(
            f"{task.task_id}: service {svc.name!r} is waited for healthy but has no healthcheck"
        )
    hc = svc.healthcheck
    started = time.monotonic()
    failures = 0
    while True:
        rc, out, err = await run_cli(cli, "exec", name, *hc.command, timeout=hc.timeout_s + 5)
        if rc == 0:
            return
        if time.monotonic() - started >= hc.start_period_s:
            failures += 1
        # Polled every second at most (compose waits `interval`): a healthy service is seen early.
        if failures >= hc.retries * max(1, int(hc.interval_s)) or time.monotonic() > deadline:
            logs = (await run_cli(cli, "logs", "--tail", "40", name, timeout=60))[1]
            raise SandboxCreateError(
                f"{task.task_id}: service {svc.name!r} never became healthy",
                log_tail=tail(logs + out + err, 2000),
            )
        await asyncio.sleep(min(1.0, hc.interval_s))


async def remove_network(cli: str, net: ComposeNet) -> None:
    """The services, then the network and the named volumes (`main` is removed by its owner)."""
    if net.containers:
        await run_cli(cli, *rm_args(cli), *net.containers.values(), timeout=120)
    await run_cli(cli, "network", "rm", "-f", net.name, timeout=120)
    if net.volumes:
        await run_cli(cli, "volume", "rm", "-f", *net.volumes, timeout=120)
