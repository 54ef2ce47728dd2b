"""The Ray actors of a cluster run: each one owns one process of the resolved plan.

`ProcessActor` starts its command line (an SGLang server, the `smg` router, a trainer) when Ray
constructs it, and again when Ray restarts it (`max_restarts`): the process is tied to the actor
(its own process group, and the kernel kills it when the actor's process dies: PR_SET_PDEATHSIG),
so a killed or crashed actor never leaves its server behind, and a restarted actor starts the same
command line again. Readiness is an HTTP probe of the process's own endpoint. The class is plain
Python (tested without Ray); `agentrl.cluster.ray_runtime` wraps it with `ray.remote`.

Credentials never travel through here by value: an actor's environment is the plan's (a Daytona
key is `DAYTONA_API_KEY_FILE`, a path), on top of the node's own environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import AgentRLError

_PR_SET_PDEATHSIG = 1


class ProcessFailed(AgentRLError):
    """A process of the plan exited or never became ready; the message names its log file."""


@dataclass(frozen=True)
class Readiness:
    """How to tell that a process serves: GET `url` answers 200 (and, for a router, lists
    `workers`, every one of them healthy)."""

    url: str
    workers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the plan as an actor starts it: what the supervisor passes to Ray, all of it
    (the credential test reads these)."""

    name: str
    role: str  # engine | router | trainer
    node: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    ready: Readiness | None = None
    drop_env: tuple[str, ...] = ()  # inherited variables the process must not see


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the actor's process dies, and a process group of its
    own (so a stop reaches its children too)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ProcessActor:
    """Starts `spec.argv` on construction; `status`, `wait_ready`, `stop`."""

    def __init__(self, spec: ProcessSpec, log_dir: str) -> None:
        self.spec = spec
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_dir) / f"{spec.name}.log"
        env = {k: v for k, v in os.environ.items() if k not in spec.drop_env}
        env.update(spec.env)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')}: {' '.join(spec.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(  # the plan's own command line
                list(spec.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=log_dir,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def status(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "pid": self.proc.pid,
            "actor_pid": os.getpid(),
            "returncode": self.proc.poll(),
            "host": socket.gethostname(),
        }

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the readiness probe passed; `ProcessFailed` if the process exits first or
        the probe keeps failing for `timeout_s`."""
        t0 = time.monotonic()
        ready = self.spec.ready
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ProcessFailed(
                    f"{self.spec.name} exited with {code} before it was ready; its log "
                    f"{self.log_path} ends:\n{self.log_tail()}"
                )
            if ready is None or _probe(ready):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise ProcessFailed(
                    f"{self.spec.name} did not answer {ready.url} within {timeout_s:.0f} s; its log "
                    f"{self.log_path} ends:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; the exit status."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # anything it left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode


def _probe(ready: Readiness) -> bool:
    try:
        with urllib.request.urlopen(ready.url, timeout=2) as r:
            if r.status != 200:
                return False
            if not ready.workers:
                return True
            body = json.loads(r.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return False
    healthy = {
        w.get("url", "").rstrip("/")
        for w in body.get("workers", [])
        if isinstance(w, dict) and w.get("is_healthy", True)
    }
    return healthy >= set(ready.workers)
