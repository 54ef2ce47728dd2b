"""The Ray actors of a cluster run: each one owns one process of the resolved plan.

`ProcessActor` starts its command line (an SGLang server, the `smg` router, a trainer) when Ray
constructs it, and again when Ray restarts it (`max_restarts`): the process is tied to the actor
(its own process group, and the kernel kills it when the actor's process dies: PR_SET_PDEATHSIG),
so a killed or crashed actor never leaves its server behind, and a restarted actor starts the same
command line again. Readiness is an HTTP probe of the process's own endpoint. The class is plain
Python (tested without Ray); `agentrl.cluster.ray_runtime` wraps it with `ray.remote`.

An engine's spec names the router in front of it (`router_url`, `worker_url`): when Ray restarts
the actor, it first takes the worker off the router (`DELETE /workers/{id}`, waiting until the
router lists it no more) and only then starts the server, so a server on its launch weights gets
no rollout traffic; the trainer's fleet client registers it again once a weight update has
brought it to the fleet's version (`SGLangEngine.admit_workers`).

Credentials never travel through here by value: an actor's environment is the plan's (a Daytona
key is `DAYTONA_API_KEY_FILE`, a path), on top of the node's own environment; the run's engine key
is `ProcessSpec.key_file`, a path on the shared storage that the engines and the router read
through `agentrl.cluster.launch` and that probes and router calls read here.
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

from agentrl.cluster.launch import auth_headers
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
    router_url: str = ""  # engines: the router a restarted server leaves before it starts
    worker_url: str = ""  # engines: this server's URL as the router lists it
    key_file: str = ""  # the run's engine key (a path): probes and router calls send it


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the actor's process dies, and a process group of its
    own (so a stop reaches its children too)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ProcessActor:
    """Starts `spec.argv` on construction; `status`, `wait_ready`, `stop`."""

    def __init__(self, spec: ProcessSpec, log_dir: str, *, restarted: bool | None = None) -> None:
        self.spec = spec
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_dir) / f"{spec.name}.log"
        env = {k: v for k, v in os.environ.items() if k not in spec.drop_env}
        env.update(spec.env)
        if restarted is None:
            restarted = _restarted_by_ray()
        with open(self.log_path, "ab") as log:
            if restarted and spec.router_url and spec.worker_url:
                note = leave_router(spec.router_url, spec.worker_url, key_file=spec.key_file or None)
                log.write(f"\n=== restarted: {note}\n".encode())
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
            if ready is None or _probe(ready, self.spec.key_file or None):
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


def _restarted_by_ray() -> bool:
    """True in an actor that Ray constructs again after it died (`max_restarts`)."""
    try:
        import ray
    except ModuleNotFoundError:
        return False
    if not ray.is_initialized():
        return False
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not inside an actor
        return False


def _http_json(
    method: str, url: str, timeout: float = 5.0, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, None


def leave_router(
    router_url: str, worker_url: str, *, timeout_s: float = 60.0, key_file: str | None = None
) -> str:
    """Take `worker_url` off the router (smg: `GET /workers` for its id, `DELETE /workers/{id}`,
    then until the router lists it no more); what happened, in words. A router that does not
    answer within `timeout_s` is left as it is (a router that restarts registers its command
    line's workers anyway): the caller goes on."""
    router_url, worker_url = router_url.rstrip("/"), worker_url.rstrip("/")
    headers = auth_headers(key_file)
    deadline = time.monotonic() + timeout_s
    asked = False
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = _http_json("GET", f"{router_url}/workers", headers=headers)
        except (urllib.error.URLError, OSError) as e:
            last = f"router {router_url} unreachable: {e}"
            time.sleep(0.5)
            continue
        listed = {
            str(w.get("url", "")).rstrip("/"): str(w.get("id", ""))
            for w in (body.get("workers", []) if status == 200 and isinstance(body, dict) else [])
            if isinstance(w, dict)
        }
        if worker_url not in listed:
            return (
                f"{worker_url} is off the router {router_url}"
                if asked
                else f"{worker_url} was not on the router"
            )
        if not asked:
            with contextlib.suppress(urllib.error.URLError, OSError):
                status, _ = _http_json(
                    "DELETE", f"{router_url}/workers/{listed[worker_url]}", headers=headers
                )
                asked = status in (200, 202, 204, 404)
                last = f"DELETE answered {status}"
        time.sleep(0.3)
    return f"could not take {worker_url} off the router {router_url} within {timeout_s:.0f} s ({last})"


def _probe(ready: Readiness, key_file: str | None = None) -> bool:
    try:
        req = urllib.request.Request(ready.url, headers=auth_headers(key_file))
        with urllib.request.urlopen(req, timeout=2) as r:
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
