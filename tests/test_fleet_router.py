"""The rollout manager drives two `agentrl engine serve` processes behind the real SGLang router
(`smg`, consistent hashing on `X-SMG-Routing-Key`): train steps with an in_place and an abort pause,
weight syncs by disk and by tensor with every server's version checked, then a worker killed
mid-step (the run goes on), and a turn that the router replays on a worker with other weights is
detected by the fleet client.

The router's main port answers 404 to control calls, so the fleet client sends pause, flush,
update and version reads to each worker directly, and only `/generate` through the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

TASK = Path(__file__).parent / "fixtures" / "sandbox_tasks" / "write-hello"


def _smg() -> str | None:
    here = Path(sys.executable).parent / "smg"
    return str(here) if here.exists() else shutil.which("smg")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _get(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r,
    ):
        body = await r.json() if r.content_type == "application/json" else await r.read()
        return r.status, body


async def _wait_for(check: Callable[[], Awaitable[bool]], what: str, timeout: float) -> None:
    """Poll `check` (an HTTP probe: nothing to wait on but the other process) until true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            if await check():
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout:.0f} s")


class Worker:
    """One `agentrl engine serve` process on a fixed port (restartable on the same port)."""

    def __init__(self, model_dir: Path, port: int) -> None:
        self.model_dir = model_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agentrl.cli",
            "engine",
            "serve",
            "--model",
            str(self.model_dir),
            "--port",
            str(self.port),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    async def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.returncode is not None:
            raise AssertionError(f"worker {self.url} exited with {self.proc.returncode}")
        return (await _get(f"{self.url}/health"))[0] == 200

    async def running(self) -> int:
        _, body = await _get(f"{self.url}/v1/loads")
        return sum(load["num_running_reqs"] for load in body["loads"])

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@contextlib.asynccontextmanager
async def fleet_behind_router(model_dir: Path) -> AsyncIterator[tuple[list[Worker], str]]:
    smg = _smg()
    assert smg is not None
    workers = [Worker(model_dir, _free_port()) for _ in range(2)]
    router_port = _free_port()
    router: asyncio.subprocess.Process | None = None
    try:
        await asyncio.gather(*(w.start() for w in workers))
        for w in workers:
            await _wait_for(w.healthy, f"{w.url} healthy", 60)
        router = await asyncio.create_subprocess_exec(
            smg,
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(router_port),
            "--worker-urls",
            *(w.url for w in workers),
            "--policy",
            "consistent_hashing",
            "--worker-startup-check-interval",
            "1",
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
            "--health-success-threshold",
            "1",
            "--cb-timeout-duration-secs",
            "1",
            "--log-level",
            "warn",
            # Its metrics listener defaults to 0.0.0.0:29000: a free loopback port instead, so
            # another router on this host (a run, a test beside this one) cannot stop it starting.
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(_free_port()),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        router_url = f"http://127.0.0.1:{router_port}"

        async def both_registered() -> bool:
            status, body = await _get(f"{router_url}/workers")
            healthy = {w["url"] for w in body.get("workers", []) if w.get("is_healthy", True)}
            return status == 200 and healthy >= {w.url for w in workers}

        await _wait_for(both_registered, "router with both workers", 30)
        yield workers, router_url
    finally:
        if router is not None and router.returncode is None:
            router.kill()
            await router.wait()
        for w in workers:
            await w.stop()


async def _manager_step(
    mgr: Any, trainer: Any, sync: Callable[[int], Awaitable[None]], mode: str, fleet: Any
) -> list[Any]:
    """The runtime's step, in one place: take a batch, advantages once per episode, a GRPO step
    of the torch trainer, then the weights out through the manager's pause/resume wrapper."""
    from agentrl.train.batch import training_samples

    groups = await mgr.get_batch(timeout=120)
    samples = training_samples([g.episodes for g in groups])
    if samples:
        await asyncio.to_thread(trainer.train_step, samples)
    version = fleet.weight_version + 1
    await mgr.update_weights(lambda: sync(version), mode=mode)
    return [ep for g in groups for ep in g.episodes if ep is not None]


@pytest.mark.skipif(_smg() is None, reason="smg (the SGLang router, `pip install smg`) is not installed")
async def test_rollout_manager_drives_two_servers_behind_the_sglang_router(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.agent.loop import AgentConfig
    from agentrl.agent.tokens import ChatRenderer
    from agentrl.engine.base import SamplingParams
    from agentrl.engine.sglang import SGLangEngine
    from agentrl.episode.run import EpisodeConfig, SandboxEpisodeRunner
    from agentrl.models.tiny import tiny_model_dir
    from agentrl.rollout.manager import RolloutConfig, RolloutManager
    from agentrl.testing.sandbox import FakeSandboxProvider
    from agentrl.train.config import TrainConfig
    from agentrl.train.torch_backend import TorchTrainer
    from agentrl.train.weight_sync import DiskTransport, TensorTransport

    model_dir = Path(tiny_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Weight decay moves every weight even in a step whose groups carry no signal.
    trainer = TorchTrainer(
        policy, TrainConfig(lr=1e-3, weight_decay=0.1, logprob_chunk_size=None), device="cpu"
    )
    async with fleet_behind_router(model_dir) as (workers, router_url):
        a, b = workers
        fleet = SGLangEngine(router_url=router_url, worker_urls=[a.url, b.url], retries=3)
        disk = DiskTransport([fleet], tmp_path / "weights", model_files_from=model_dir)
        tensor = TensorTransport([fleet])

        async def by_disk(version: int) -> None:
            await disk.push(trainer.export_weights(bucket_bytes=256 * 1024), version=version)

        async def by_tensor(version: int) -> None:
            await tensor.push(trainer.export_weights(bucket_bytes=256 * 1024), version=version)

        provider = FakeSandboxProvider(seed=0)
        # A random-init model never solves the task; alternate rewards so groups carry signal.
        provider.grader = lambda sb: float(int(sb.sandbox_id.rsplit("-", 1)[-1]) % 2)
        runner = SandboxEpisodeRunner(
            provider=provider,
            engine=fleet,
            renderer=ChatRenderer(tokenizer),
            run_id="fleet-router",
            config=EpisodeConfig(
                action_format="fenced-bash",
                agent=AgentConfig(
                    max_turns=2, max_new_tokens=12, min_turn_tokens=4, max_consecutive_malformed=2
                ),
                sampling=SamplingParams(temperature=1.0, max_new_tokens=12),
            ),
        )
        rows = [
            {"prompt": f"p{i}", "metadata": {"task_id": f"write-hello-{i}", "task_path": str(TASK)}}
            for i in range(64)
        ]
        config = RolloutConfig(
            batch_size=4,
            n_samples_per_prompt=2,
            max_in_flight=4,
            max_staleness=1,
            max_attempts=6,
            retry_backoff_s=0.05,
            episode_timeout_s=60,
        )
        try:
            assert await fleet.refresh_weight_version() == 0
            async with RolloutManager(runner, fleet, rows, config, seed=0) as mgr:
                # Step 1: in_place pause (no flush: requests are still held), weights by disk.
                await _manager_step(mgr, trainer, by_disk, "in_place", fleet)
                assert await fleet.weight_versions() == {a.url: 1, b.url: 1}
                # Step 2: abort pause (the manager flushes every worker), weights by tensor.
                await _manager_step(mgr, trainer, by_tensor, "abort", fleet)
                assert await fleet.weight_versions() == {a.url: 2, b.url: 2}
                head = trainer.model.lm_head.weight.detach().clone()

                # Step 3: worker a dies while it generates; the router replays its requests on b
                # and the fleet's control plane goes on with b alone.
                await _wait_for(lambda: _positive(a.running()), "a request running on worker a", 60)
                await a.kill()
                await _manager_step(mgr, trainer, by_tensor, "in_place", fleet)
                assert list(fleet.dead_workers) == [a.url]
                assert await fleet.weight_versions() == {b.url: 3}
                assert not torch.equal(head, trainer.model.lm_head.weight.detach())  # new weights went out

                # Worker a comes back with its launch weights (version 0); the router sends its
                # keys to it again. Then b dies in the middle of a turn: the router replays that
                # turn in full on a, whose weights are not the fleet's, and the client detects it.
                await a.start()
                await _wait_for(a.healthy, "worker a restarted", 60)
                await _wait_for(lambda: _routes_to(fleet, 0), "the router sending keys to a again", 30)
                async with _quiet(mgr):  # only the test's own turn runs while b dies
                    on_b = await _session_served_by(fleet, 3)
                    before = fleet.version_mismatches
                    long_turn = asyncio.create_task(
                        fleet.generate(
                            tokenizer.encode("count the files"),
                            SamplingParams(max_new_tokens=3000, seed=0),
                            session_id=on_b,
                            rid="long-turn",
                        )
                    )
                    await _wait_for(lambda: _positive(b.running()), "the long turn running on b", 30)
                    await b.kill()
                    # The router replays it on a; end it there (exact rid) instead of waiting for
                    # 3000 tokens: the partial answer still carries a's version.
                    await _wait_for(lambda: _positive(a.running()), "the replayed turn running on a", 30)
                    await fleet.abort("long-turn")
                    replayed = await asyncio.wait_for(long_turn, 60)
                assert replayed.finish_reason == "abort" and replayed.output_ids
                assert replayed.version_mismatch and replayed.weight_version == 0
                assert replayed.meta["expected_weight_version"] == 3
                assert fleet.version_mismatches == before + 1

                # The run goes on with a alone: the next sync puts a on the fleet's version.
                await _manager_step(mgr, trainer, by_disk, "abort", fleet)
                assert await fleet.weight_versions() == {a.url: 4}
                assert b.url in fleet.dead_workers and a.url not in fleet.dead_workers
        finally:
            await fleet.aclose()
            await provider.aclose()


async def _positive(count: Awaitable[int]) -> bool:
    return await count > 0


@contextlib.asynccontextmanager
async def _quiet(mgr: Any) -> AsyncIterator[None]:
    """Manager-facing: admission closed and no episode running, for the duration."""
    async with mgr.paused():

        async def idle() -> bool:
            return mgr.running == 0

        await _wait_for(idle, "the manager's running episodes to finish", 60)
        yield


async def _routes_to(fleet: Any, version: int) -> bool:
    try:
        await _session_served_by(fleet, version, tries=16)
    except AssertionError:
        return False
    return True


async def _session_served_by(fleet: Any, version: int, tries: int = 64) -> str:
    """A routing key the router sends to a worker serving `version` (the other serves another)."""
    from agentrl.engine.base import SamplingParams

    for i in range(tries):
        gen = await fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1), session_id=f"probe-{i}")
        if gen.weight_version == version:
            return f"probe-{i}"
    raise AssertionError(f"no routing key reached a worker on version {version}")


@pytest.mark.skipif(_smg() is None, reason="smg (the SGLang router, `pip install smg`) is not installed")
async def test_a_worker_set_aside_leaves_the_router_and_is_admitted_again_once_caught_up(
    tmp_path: Path,
) -> None:
    """An eval's worker (`set_aside`) is taken off the real router, so no routing key reaches it
    while the fleet moves to new weights without it; given back, it is registered with the router
    again only after the next push has put it on the fleet's version."""
    from transformers import AutoModelForCausalLM

    from agentrl.engine.base import SamplingParams
    from agentrl.engine.sglang import SGLangEngine
    from agentrl.models.tiny import tiny_model_dir
    from agentrl.train.config import TrainConfig
    from agentrl.train.torch_backend import TorchTrainer
    from agentrl.train.weight_sync import TensorTransport

    model_dir = Path(tiny_model_dir())
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = TorchTrainer(policy, TrainConfig(logprob_chunk_size=None), device="cpu")
    async with fleet_behind_router(model_dir) as (workers, router_url):
        a, b = workers
        fleet = SGLangEngine(router_url=router_url, worker_urls=[a.url, b.url], retries=3)
        tensor = TensorTransport([fleet])

        async def push(version: int) -> None:
            await fleet.pause("in_place")
            await tensor.push(trainer.export_weights(bucket_bytes=256 * 1024), version=version)
            await fleet.resume()

        try:
            assert await fleet.refresh_weight_version() == 0
            aside = await fleet.set_aside(1)
            assert aside.base_urls == [b.url]
            assert set(await fleet.routed_workers()) == {a.url}
            await push(1)
            assert await fleet.weight_versions() == {a.url: 1}
            for i in range(12):  # every routing key now lands on a, at version 1
                gen = await fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1), session_id=f"k{i}")
                assert gen.weight_version == 1 and not gen.version_mismatch
            gen = await aside.generate([1, 2, 3], SamplingParams(max_new_tokens=1), session_id="eval")
            assert gen.weight_version == 0

            await fleet.rejoin(aside)
            assert set(await fleet.routed_workers()) == {a.url}  # behind: not routed before a push
            await push(2)
            assert await fleet.weight_versions() == {a.url: 2, b.url: 2}

            async def both_routed() -> bool:  # smg registers a worker once its health check passes
                return set(await fleet.routed_workers()) == {a.url, b.url}

            await _wait_for(both_routed, "the caught-up worker back on the router", 30)
            assert await _routes_to(fleet, 2)
        finally:
            await fleet.aclose()
