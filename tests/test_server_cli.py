"""`agentrl engine serve` as a real process: it serves the tiny model and stops cleanly on Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

import aiohttp
import pytest

pytest.importorskip("torch")

from agentrl.engine.base import SamplingParams, TensorWeights
from agentrl.engine.sglang import SGLangEngine
from agentrl.models.tiny import tiny_model_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_healthy(url: str, proc: asyncio.subprocess.Process, timeout: float = 90.0) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(int(timeout / 0.25)):
            if proc.returncode is not None:
                raise AssertionError(f"server exited early with {proc.returncode}")
            try:
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
    raise AssertionError("server did not become healthy")


@pytest.mark.slow
async def test_engine_serve_command_serves_and_stops_on_sigint() -> None:
    model_dir = tiny_model_dir()
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agentrl.cli",
        "engine",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # whatever this worker inherited
    )
    url = f"http://127.0.0.1:{port}"
    client = SGLangEngine(url, retries=2)
    try:
        await _wait_healthy(url, proc)
        gen = await client.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=3, seed=0))
        assert len(gen.output_ids) == 3 and gen.finish_reason == "length"
        info = (await client.model_info())[url]
        assert info["model_path"] == str(model_dir) and info["model_type"] == "glm_moe_dsa"
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        out = (await proc.stdout.read()).decode()
        assert f"at {url}" in out
    finally:
        await client.aclose()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow
async def test_engine_serve_exits_1_after_what_kills_sglang_a_tp2_payload_with_one_rank_entry() -> None:
    # --tp-size 2 simulates two TP ranks: a tensor update with one entry gives rank 1 an IndexError
    # in SGLang's scheduler (managers/tp_worker.py), and the server process dies.
    from agentrl.engine.base import EngineError
    from agentrl.engine.tensors import serialize_named_tensors

    torch = pytest.importorskip("torch")
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agentrl.cli",
        "engine",
        "serve",
        "--model",
        str(tiny_model_dir()),
        "--port",
        str(port),
        "--tp-size",
        "2",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    client = SGLangEngine(url, retries=2)
    try:
        await _wait_healthy(url, proc)
        assert await client.server_tp_sizes() == {url: 2}
        entry = serialize_named_tensors([("lm_head.weight", torch.zeros(3072, 256))])
        with pytest.raises(EngineError):
            await client.update_weights(TensorWeights([entry]), weight_version=1)
        assert await asyncio.wait_for(proc.wait(), 30) == 1
        assert b"IndexError" in await proc.stderr.read()
    finally:
        await client.aclose()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
