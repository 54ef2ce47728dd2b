"""A container's outbound network, switched from the host: an nftables table in the container's
network namespace (entered with `nsenter` through its init's pid), which no process inside can
change (the container has no CAP_NET_ADMIN). Open: no table. Closed: every packet out dropped but
loopback's. An allowlist: closed but for DNS to the resolvers the container started with and the
allowed addresses and ranges; hostnames are resolved on the host when the policy is applied, so
a name whose addresses change later (a CDN) reaches only the addresses it had then.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
from collections.abc import Iterable

from agentrl.errors import InputError
from agentrl.sandbox.base import SandboxError, tail
from agentrl.tasks.config import host_kind


def resolvers(pid: int) -> tuple[str, ...]:
    """The nameservers of the container's /etc/resolv.conf, read through its init's root: call it
    before the agent's first command (later the agent could have written its own)."""
    try:
        text = open(f"/proc/{pid}/root/etc/resolv.conf", encoding="utf-8", errors="replace").read(65536)
    except OSError:
        return ()
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                found.append(str(ipaddress.ip_address(parts[1].split("%")[0])))
            except ValueError:
                continue
    return tuple(found)


def allowed_addresses(hosts: Iterable[str]) -> tuple[str, ...]:
    """The addresses and ranges an allowlist's entries stand for (hostnames resolved here, on the
    host). A *.wildcard cannot be enforced by address: `InputError`."""
    out: list[str] = []
    for host in hosts:
        kind = host_kind(host)
        if kind == "wildcard-hostname":
            raise InputError(
                f"allowed host {host!r}: podman enforces an allowlist by address, and a wildcard names "
                "no address; list the hostnames, or run the task on Daytona"
            )
        if kind != "hostname":
            out.append(host)
            continue
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError:
            continue  # a name that does not resolve reaches nothing, as behind Harbor's proxy
        out += [str(info[4][0]) for info in infos]
    return tuple(dict.fromkeys(out))


def egress_script(
    table: str,
    allow: tuple[str, ...] | None,
    dns: tuple[str, ...] = (),
    *,
    local: tuple[str, str] | None = None,
) -> str:
    """The nft script: `allow` None opens the network; else loopback, DNS to `dns`, `allow`, and
    (`local`: a compose sandbox's subnet and gateway) the other services, never the gateway."""
    script = f"table inet {table}\ndelete table inet {table}\n"
    if allow is None:
        return script
    rules = ['  oifname "lo" accept']
    for server in dns:
        family = "ip" if ipaddress.ip_address(server).version == 4 else "ip6"
        rules += [
            f"  {family} daddr {server} udp dport 53 accept",
            f"  {family} daddr {server} tcp dport 53 accept",
        ]
    for entry in allow:
        family = "ip" if ipaddress.ip_network(entry, strict=False).version == 4 else "ip6"
        rules.append(f"  {family} daddr {entry} accept")
    if local is not None:
        subnet, gateway = local
        family = "ip" if ipaddress.ip_network(subnet).version == 4 else "ip6"
        rules += [f"  {family} daddr {gateway} drop", f"  {family} daddr {subnet} accept"]
    return (
        script
        + f"table inet {table} {{\n chain out {{\n  type filter hook output priority 0; policy drop;\n"
        + "\n".join(rules)
        + "\n }\n}\n"
    )


async def apply(pid: int, script: str, *, what: str) -> None:
    """Run `script` with nft in the network namespace of `pid`; `SandboxError` if it fails."""
    nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
    nft = shutil.which("nft") or "/usr/sbin/nft"
    if not (os.path.exists(nsenter) and os.path.exists(nft)):
        raise SandboxError(
            f"switching the network of {what} needs nft and nsenter on the host: run `make host`"
        )
    proc = await asyncio.create_subprocess_exec(
        nsenter, "-t", str(pid), "-n", nft, "-f", "-",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(script.encode()), 60)
    if proc.returncode != 0:
        raise SandboxError(
            f"switching the network of {what} failed: {tail(err.decode(errors='replace'), 300)}"
        )
