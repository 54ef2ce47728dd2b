"""A restarted engine actor stays off the router until a weight update has caught it up.

Against the real router (`smg`): `leave_router` takes a worker off it (smg drains it, then drops
it), a `ProcessActor` that Ray restarts does that before it starts its server, and the fleet client
(`SGLangEngine` with the router and every configured worker) registers the worker again once an
update has brought it to the fleet's version, never before.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SMG = (
    str(Path(sys.executable).parent / "smg")
    if (Path(sys.executable).parent / "smg").exists()
    else shutil.which("smg")
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SMG is None, reason="smg (the SGLang router, `pip install smg`) is not installed"),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listed(router: str) -> dict[str, bool]:
    with urllib.request.urlopen(f"{router}/workers", timeout=5) as r:
        return {w["url"]: w.get("is_healthy", True) for w in json.loads(r.read())["workers"]}


async def _until(check, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Poll `check` off the event loop (the servers it waits on answer from this loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if await asyncio.to_thread(check):
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout:.0f} s")


@contextlib.asynccontextmanager
async def _router(workers: list[str]) -> AsyncIterator[str]:
    port = _port()
    proc = subprocess.Popen(  # noqa: ASYNC220 (started once; nothing waits on it here)
        [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
         "--policy", "consistent_hashing", "--worker-startup-check-interval", "1",
         "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
         "--health-success-threshold", "1", "--log-level", "warn",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await _until(
            lambda: all(_listed(url).get(w) for w in workers), "the router with every worker healthy"
        )
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    from agentrl.models.tiny import load_tiny

    return load_tiny()


async def test_a_restarted_worker_rejoins_the_router_only_after_an_update(tiny, tmp_path: Path) -> None:
    from agentrl.cluster.actors import ProcessActor, ProcessSpec, leave_router
    from agentrl.engine.base import TensorWeights
    from agentrl.engine.local import LocalEngine
    from agentrl.engine.server import EngineServer
    from agentrl.engine.sglang import SGLangEngine
    from agentrl.engine.tensors import serialize_named_tensors
    from agentrl.train.weight_sync import TensorTransport

    model, tok = tiny
    engines = [LocalEngine(copy.deepcopy(model), tok) for _ in range(2)]
    async with EngineServer(engines[0], port=0) as a, EngineServer(engines[1], port=0) as b:
        async with _router([a.url, b.url]) as router:
            # A restarted actor leaves the router before its process starts (here: `true`).
            spec = ProcessSpec(
                "sglang-regular-1", "engine", 1, ("true",), router_url=router, worker_url=b.url
            )
            actor = await asyncio.to_thread(ProcessActor, spec, str(tmp_path), restarted=True)
            actor.stop()
            assert list(await asyncio.to_thread(_listed, router)) == [a.url]
            assert f"{b.url} is off the router" in (tmp_path / "sglang-regular-1.log").read_text()
            assert "was not on the router" in await asyncio.to_thread(leave_router, router, b.url)
            # A first start (not a restart) leaves the router alone.
            ProcessActor(spec, str(tmp_path), restarted=False).stop()

            fleet = SGLangEngine(router_url=router, worker_urls=[a.url, b.url], retries=1)
            try:
                assert await fleet.refresh_weight_version() == 0
                state = [(n, t.detach().clone() * 0.5) for n, t in model.state_dict().items()]
                # A middle bucket (the version stays 0) admits nobody: b is half-loaded.
                part = TensorWeights([serialize_named_tensors(state[:3])])
                await fleet.update_weights(part, weight_version=0)
                await asyncio.sleep(1.5)  # the router's health check runs every second
                assert list(await asyncio.to_thread(_listed, router)) == [a.url]
                transport = TensorTransport([fleet], tp_size=1)
                await transport.push([state[:3], state[3:]], version=1)
                await _until(lambda: _listed(router).get(b.url) is True, "b registered and healthy again")
                assert await fleet.weight_versions() == {a.url: 1, b.url: 1}
            finally:
                await fleet.aclose()
    for e in engines:
        await e.aclose()


def test_leave_router_gives_up_on_a_router_that_does_not_answer() -> None:
    from agentrl.cluster.actors import leave_router

    note = leave_router(f"http://127.0.0.1:{_port()}", "http://127.0.0.1:1", timeout_s=1.0)
    assert note.startswith("could not take http://127.0.0.1:1 off the router") and "unreachable" in note
