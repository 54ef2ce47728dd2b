"""An adversarial client against `agentrl env serve`: a thousand sessions at once, payloads over every
limit, malformed frames, floods and reset storms. Each gets a clear answer, nothing holds more
sandboxes than the cap, and the server still runs a normal episode afterwards. Bounded in count and
time: every step has a limit and the test stops by itself."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("openenv.core.env_server")

import httpx
from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.test_openenv_server import HELLO, ask, eventually, fake_server, ws_url

KIB = 1024
LIMITS = {
    "max_command_bytes": 8 * KIB,
    "max_file_bytes": 8 * KIB,
    "max_message_chars": 16 * KIB,
    "max_frame_bytes": 64 * KIB,
}
SESSIONS = 1000  # opened at once against a cap of 4


async def still_serves(url: str) -> None:
    """The server answers and scores a normal episode."""
    async with httpx.AsyncClient(trust_env=False) as http:
        assert (await http.get(f"{url}/health")).json()["status"] == "healthy"
    async with GenericEnvClient(base_url=url) as env:
        await env.reset(task_id="hello-file")
        await env.step({"action_type": "exec", "command": HELLO})
        assert (await env.step({"action_type": "evaluate"})).reward == 1.0


@pytest.mark.slow
async def test_a_thousand_sessions_at_once_get_capacity_reached_and_the_cap_holds() -> None:
    with fake_server(max_sessions=4, **LIMITS) as (url, server, provider):

        async def one(i: int) -> tuple[str, Any]:
            try:
                ws = await connect(ws_url(url), proxy=None, open_timeout=30)
            except Exception as exc:  # the handshake itself refused: counted, must not happen
                return "handshake_failed", repr(exc)
            try:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 3.0))
            except TimeoutError:
                return "accepted", ws  # a session: the server waits for its first message
            except ConnectionClosed:
                return "closed_silently", None
            await ws.close()
            return frame["data"]["code"], frame["data"]["message"]

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(SESSIONS))), 120)
        counts = Counter(kind for kind, _ in results)
        assert counts["accepted"] == 4 and counts["CAPACITY_REACHED"] == SESSIONS - 4, counts
        message = next(m for k, m in results if k == "CAPACITY_REACHED")
        assert "at capacity: 4/4 sessions" in message
        accepted = [ws for kind, ws in results if kind == "accepted"]
        resets = [await ask(ws, {"type": "reset", "data": {"task_id": "hello-file"}}) for ws in accepted]
        assert all(r["type"] == "observation" for r in resets)
        assert provider.live_sandboxes() == 4 and server.hub.sandboxes == 4
        for ws in accepted:
            await ws.close()
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)
        await still_serves(url)


async def test_payloads_over_every_limit_are_refused_in_words_and_the_session_goes_on() -> None:
    with fake_server(**LIMITS) as (url, server, provider):
        async with connect(ws_url(url), proxy=None, max_size=None) as ws:
            await ask(ws, {"type": "reset", "data": {"task_id": "hello-file"}})
            # A command over the command limit but inside a message: an observation saying so.
            big = await ask(
                ws, {"type": "step", "data": {"action_type": "exec", "command": "x" * (10 * KIB)}}
            )
            obs = big["data"]["observation"]
            assert (
                obs["info"]["cause"] == "command_too_large"
                and "10240 bytes: the limit is 8192" in obs["error"]
            )
            assert len(json.dumps(big)) < 4 * KIB  # the payload is never echoed back
            content = await ask(
                ws,
                {
                    "type": "step",
                    "data": {"action_type": "write_file", "file_path": "/a", "content": "y" * (9 * KIB)},
                },
            )
            assert content["data"]["observation"]["info"]["cause"] == "content_too_large"
            # A message over the message limit: an error frame, nothing echoed, the session stays.
            huge = await ask(
                ws, {"type": "step", "data": {"action_type": "exec", "command": "z" * (40 * KIB)}}
            )
            assert huge["type"] == "error" and huge["data"]["code"] == "VALIDATION_ERROR"
            assert "this server takes messages of up to 16384" in huge["data"]["message"]
            assert len(json.dumps(huge)) < 1 * KIB
            # Nested deeper than a parser can follow, binary frames: the same.
            for levels in (900, 8000):  # within Python's parser, and beyond it
                nested: dict[str, Any] = {
                    "action_type": "exec",
                    "metadata": {"x": "[" * levels + "]" * levels},
                }
                await ws.send(
                    json.dumps({"type": "step", "data": nested}).replace('"[', "[").replace(']"', "]")
                )
                deep = json.loads(await asyncio.wait_for(ws.recv(), 10))
                assert (
                    deep["type"] == "error" and "nested more than 32 levels deep" in deep["data"]["message"]
                )
            await ws.send(b"\x00\x01binary")
            assert "binary frames are not accepted" in json.loads(await ws.recv())["data"]["message"]
            ran = await ask(ws, {"type": "step", "data": {"action_type": "exec", "command": HELLO}})
            assert ran["data"]["observation"]["success"]
            assert (await ask(ws, {"type": "step", "data": {"action_type": "evaluate"}}))["data"][
                "reward"
            ] == 1.0
        # A frame over the hard cap ends that connection (1009) and nothing else.
        async with connect(ws_url(url), proxy=None, max_size=None) as ws:
            await ask(ws, {"type": "reset", "data": {"task_id": "hello-file"}})
            with pytest.raises(ConnectionClosed) as closed:
                await ask(ws, {"type": "step", "data": {"action_type": "exec", "command": "w" * (100 * KIB)}})
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)

        # HTTP: a body streamed without a declared length is cut at the limit as well.
        async def chunks() -> Any:
            for _ in range(100):
                yield b"x" * KIB

        async with httpx.AsyncClient(trust_env=False) as http:
            resp = await http.post(f"{url}/tbench2/tasks", content=chunks())
        assert resp.status_code == 413
        await still_serves(url)


async def test_floods_and_reset_storms_stay_within_one_sandbox_per_session() -> None:
    with fake_server(max_sessions=2, **LIMITS) as (url, server, provider):
        async with connect(ws_url(url), proxy=None) as ws:
            # 200 messages without waiting for answers: each is answered, in order.
            reset = json.dumps({"type": "reset", "data": {"task_id": "hello-file"}})
            for i in range(200):
                await ws.send(reset if i % 2 == 0 else json.dumps({"type": "state"}))
            kinds = [json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] for _ in range(200)]
            assert kinds == ["observation", "state"] * 100
            assert provider.live_sandboxes() <= 1 and server.hub.sandboxes <= 1
            assert provider.created == 100  # every reset replaced the previous episode's sandbox
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)
        # Connections that come and go mid-reset, many times over: nothing is left behind.
        for _ in range(20):
            ws = await connect(ws_url(url), proxy=None)
            await ws.send(json.dumps({"type": "reset", "data": {"task_id": "hello-file"}}))
            ws.transport.abort()
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)
        await still_serves(url)
