"""Multi-container tasks on podman (`agentrl.tasks.compose`): one pod per sandbox that shares
only its network namespace, so services answer each other and the agent on localhost and by
name (every service name is an /etc/hosts entry for 127.0.0.1), while each keeps its own file
system, processes and limits. `main` starts first and is the agent's sandbox; the others start
after it, in `depends_on` order, each waited for (healthy, started or completed) before the
next and before the agent runs. The pod's network is a bridge closed by the sandbox's own
nftables switch unless a phase is public (`PodmanSandbox.set_network`), so the network policy
and its phase switches hold for every service. The private verifier joins the pod (network
only). Removing the sandbox removes the pod, its containers and its named volumes.

Not like Docker compose: services share one network namespace, so two services may not listen
on one port; `ports` publish nothing; `main`'s own `command` is not run (agentrl keeps `main`
alive itself, as Harbor's base file does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Protocol

from agentrl.sandbox.base import SandboxCreateError, tail
from agentrl.sandbox.podman.cli import run_cli
from agentrl.tasks.compose import MAIN, ComposeSpec, Service
from agentrl.tasks.task import Task


class PodmanProvider(Protocol):
    """What starting services needs of the provider (`agentrl.sandbox.podman.PodmanProvider`)."""

    cli: str
    pids_limit: int
    default_memory_mb: int | None
    _podman: bool

    async def image_for(self, task: Task) -> str: ...


log = logging.getLogger(__name__)


def main_args(spec: ComposeSpec, pod: str, volumes: dict[str, str]) -> list[str]:
    """What `main`'s `run` gets from the compose file (its network is the pod's)."""
    main = spec.services[MAIN]
    if main.command or main.entrypoint:
        log.warning("compose: the main service's command is not run (agentrl keeps main alive itself)")
    args = ["--pod", pod]
    for k, v in main.environment.items():
        args += ["-e", f"{k}={v}"]
    return args + _volume_args(main, volumes)


def _volume_args(service: Service, volumes: dict[str, str]) -> list[str]:
    args = []
    for source, target, ro in service.volumes:
        args += ["-v", f"{volumes.get(source, source)}:{target}{':ro' if ro else ''}"]
    return args


async def create_pod(
    provider: PodmanProvider, spec: ComposeSpec, name: str, labels: list[str]
) -> dict[str, str]:
    """The pod (a bridge network, every service's name on 127.0.0.1) and its named volumes (their
    names on the host)."""
    hosts = [arg for svc in spec.services for arg in ("--add-host", f"{svc}:127.0.0.1")]
    rc, _, err = await run_cli(
        provider.cli, "pod", "create", "--name", name, "--share", "net", "--network", "bridge",
        *hosts, *labels, timeout=120,
    )  # fmt: skip
    if rc != 0:
        raise SandboxCreateError(f"creating the pod {name} failed", log_tail=tail(err, 2000))
    volumes = {}
    for vol in spec.volumes:
        host_name = f"{name}-{vol}"
        rc, _, err = await run_cli(provider.cli, "volume", "create", *labels, host_name, timeout=120)
        if rc != 0:
            raise SandboxCreateError(f"creating the volume {vol} failed", log_tail=tail(err, 2000))
        volumes[vol] = host_name
    return volumes


async def start_services(
    provider: PodmanProvider,
    task: Task,
    spec: ComposeSpec,
    pod: str,
    volumes: dict[str, str],
    labels: list[str],
) -> None:
    """Every service but `main`, in order, each waited for as the services depending on it ask."""
    deadline = time.monotonic() + task.config.environment.build_timeout_sec
    wanted: dict[str, str] = {}  # service -> the strongest condition any dependant asks of it
    rank = {"service_started": 0, "service_healthy": 1, "service_completed_successfully": 2}
    for svc in spec.services.values():
        for dep, cond in svc.depends_on.items():
            if rank[cond] >= rank.get(wanted.get(dep, ""), -1):
                wanted[dep] = cond
    for svc in spec.sidecars:
        image = await provider.image_for(task.service_task(svc))
        name = f"{pod}-{svc.name}"
        args = ["run", "-d", "--name", name, "--pod", pod, *labels, "--pids-limit", str(provider.pids_limit)]
        if provider._podman:
            args.append("--http-proxy=false")
        if provider.default_memory_mb:
            args += ["--memory", f"{provider.default_memory_mb}m"]
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


async def remove_pod(cli: str, pod: str, volumes: list[str]) -> None:
    await run_cli(cli, "pod", "rm", "-f", "-t", "0", pod, timeout=120)
    if volumes:
        await run_cli(cli, "volume", "rm", "-f", *volumes, timeout=120)
