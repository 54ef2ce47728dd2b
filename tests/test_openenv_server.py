"""`agentrl env serve` on loopback with in-memory sandboxes, driven by the `openenv` package's own
clients: the upstream tbench2_env schema, the verifier's reward, classified failures, clear answers
to malformed actions, and the session lifecycle (capacity, disconnect, idle timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("openenv.core.env_server")

import httpx
from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from agentrl.openenv.config import ServeConfig
from agentrl.openenv.server import Server, run_in_thread
from agentrl.sandbox.base import SandboxPolicyError, SandboxTransportError
from agentrl.testing.sandbox import FakeSandbox, FakeSandboxProvider
from tests.conftest import BUNDLED_TASKS

HELLO = "echo 'Hello, world!' > /app/hello.txt"


def hello_grader(sb: FakeSandbox) -> float:
    return 1.0 if sb.files.get("/app/hello.txt") == b"Hello, world!\n" else 0.0


def fake_provider() -> FakeSandboxProvider:
    """hello-file's solution and verifier in memory, plus commands that break the sandbox."""

    def shell_killed(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> None:
        raise SandboxPolicyError("the shell was killed during the command", cause="shell_killed")

    def container_gone(sb: FakeSandbox, cmd: str, m: re.Match[str]) -> None:
        raise SandboxTransportError("the container is gone")

    provider = FakeSandboxProvider(grader=hello_grader)
    provider.on(r"^kill -9 \$\$$", shell_killed)
    provider.on(r"^vanish$", container_gone)
    return provider


@contextlib.contextmanager
def fake_server(
    provider: FakeSandboxProvider | None = None, **settings: Any
) -> Iterator[tuple[str, Server, FakeSandboxProvider]]:
    """A server in a thread of its own (as a remote one would be), on an in-memory backend."""
    provider = provider or fake_provider()
    config = ServeConfig(
        env={"name": "tbench2", "backend": "fake", "tasks": str(BUNDLED_TASKS), "max_solution_chars": 64},
        port=0,
        **settings,
    )
    with run_in_thread(config, provider=provider) as (url, server):
        yield url, server, provider


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.05)
    return check()


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


async def ask(ws: Any, message: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(message))
    return json.loads(await asyncio.wait_for(ws.recv(), 10))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Server, FakeSandboxProvider]]:
    with fake_server(max_sessions=4) as running:
        yield running


async def test_the_reference_solution_scores_one_and_doing_nothing_scores_zero(server) -> None:  # type: ignore[no-untyped-def]
    url, _, provider = server
    async with GenericEnvClient(base_url=url) as env:
        first = await env.reset(task_id="hello-file")
        assert "Hello, world!" in first.observation["instruction"]
        assert first.reward is None and not first.done
        assert first.observation["info"]["verifier_timeout_sec"] == 120.0
        ran = await env.step({"action_type": "exec", "command": HELLO})
        assert ran.observation["success"] and ran.observation["info"]["exit_code"] == 0
        scored = await env.step({"action_type": "evaluate"})
        assert (scored.reward, scored.done) == (1.0, True)
        assert scored.observation["info"]["outcome"] == "pass"
        # The next episode in the same session: a fresh sandbox, and nothing done scores 0.
        await env.reset(task_id="hello-file")
        scored = await env.step({"action_type": "evaluate"})
        assert (scored.reward, scored.done) == (0.0, True)
        assert scored.observation["info"]["outcome"] == "fail"
        assert "failure" not in scored.observation["info"]
    assert await eventually(lambda: provider.live_sandboxes() == 0)


def test_the_schema_is_upstream_tbench2_envs(server) -> None:  # type: ignore[no-untyped-def]
    url, _, _ = server
    schema = httpx.get(f"{url}/schema", trust_env=False).json()
    assert set(schema["action"]["properties"]) == {
        "metadata", "action_type", "command", "session_id", "block", "wait_seconds", "file_path", "content"
    }  # fmt: skip
    assert {
        "instruction",
        "output",
        "success",
        "error",
        "task_id",
        "task_path",
        "session_id",
        "action_type",
        "info",
    } <= set(schema["observation"]["properties"])
    assert {"task_id", "terminal_ready", "last_action_type", "last_command", "last_output"} <= set(
        schema["state"]["properties"]
    )
    tasks = httpx.post(f"{url}/tbench2/tasks", json={"split": "train"}, trust_env=False).json()["tasks"]
    assert "hello-file" in {t["task_id"] for t in tasks}


async def test_write_file_and_state(server) -> None:  # type: ignore[no-untyped-def]
    url, _, _ = server
    async with GenericEnvClient(base_url=url) as env:
        await env.reset(task_id="hello-file", episode_id="ep-1")
        wrote = await env.step(
            {"action_type": "write_file", "file_path": "/app/hello.txt", "content": "Hello, world!\n"}
        )
        assert wrote.observation["success"], wrote.observation
        state = await env.state()
        assert state["episode_id"] == "ep-1" and state["task_id"] == "hello-file" and state["terminal_ready"]
        assert state["step_count"] == 1 and state["last_action_type"] == "write_file"
        assert (await env.step({"action_type": "evaluate"})).reward == 1.0


async def test_malformed_and_untimely_actions_are_answered_in_words_and_the_session_goes_on(server) -> None:  # type: ignore[no-untyped-def]
    url, _, _ = server
    async with connect(ws_url(url), proxy=None) as ws:
        before = await ask(ws, {"type": "step", "data": {"action_type": "exec", "command": "true"}})
        assert before["data"]["observation"]["info"] == {"failure": "request", "cause": "not_reset"}
        assert "reset(task_id=...) first" in before["data"]["observation"]["error"]
        unknown = await ask(ws, {"type": "reset", "data": {"task_id": "no-such-task"}})
        assert "unknown task_id 'no-such-task'" in unknown["data"]["observation"]["error"]
        assert "hello-file" in unknown["data"]["observation"]["error"]
        path = await ask(ws, {"type": "reset", "data": {"task_path": "/etc"}})
        assert "task_path is not accepted" in path["data"]["observation"]["error"]
        extra = await ask(ws, {"type": "reset", "data": {"task_id": "hello-file", "colour": "red"}})
        assert "unknown reset parameter(s) 'colour'" in extra["data"]["observation"]["error"]
        assert (await ask(ws, {"type": "reset", "data": {"task_id": "hello-file"}}))["type"] == "observation"

        cases = {
            "extra field": {"action_type": "exec", "commnd": "ls"},
            "wrong type": {"action_type": "exec", "command": ["ls"]},
            "too long a name": {"action_type": "x" * 100},
        }
        for what, data in cases.items():
            answer = await ask(ws, {"type": "step", "data": data})
            assert answer["type"] == "error" and answer["data"]["code"] == "VALIDATION_ERROR", what
            assert answer["data"]["errors"], what
        answer = await ask(ws, {"type": "step", "data": {"action_type": "view", "session_id": "s"}})
        assert "unknown action_type 'view'" in answer["data"]["observation"]["error"]
        assert "run commands to completion" in answer["data"]["observation"]["error"]
        answer = await ask(
            ws, {"type": "step", "data": {"action_type": "exec", "command": "sleep 9", "block": False}}
        )
        assert answer["data"]["observation"]["info"]["cause"] == "non_blocking"
        answer = await ask(
            ws, {"type": "step", "data": {"action_type": "write_file", "file_path": "rel.txt"}}
        )
        assert answer["data"]["observation"]["info"]["cause"] == "bad_path"
        assert (await ask(ws, {"type": "nonsense"}))["data"]["code"] == "UNKNOWN_TYPE"
        await ws.send("{not json")
        assert json.loads(await ws.recv())["data"]["code"] == "INVALID_JSON"

        # None of it touched the episode: the solution still scores.
        ran = await ask(ws, {"type": "step", "data": {"action_type": "exec", "command": HELLO}})
        assert ran["data"]["observation"]["success"]
        scored = await ask(ws, {"type": "step", "data": {"action_type": "evaluate"}})
        assert scored["data"]["reward"] == 1.0
        late = await ask(ws, {"type": "step", "data": {"action_type": "exec", "command": "true"}})
        assert late["data"]["observation"]["info"]["cause"] == "episode_done"


async def test_a_command_that_breaks_its_sandbox_is_a_policy_outcome_and_a_dead_sandbox_is_infra(
    server,
) -> None:  # type: ignore[no-untyped-def]
    url, _, provider = server
    async with GenericEnvClient(base_url=url) as env:
        await env.reset(task_id="hello-file")
        broke = await env.step({"action_type": "exec", "command": "kill -9 $$"})
        assert broke.done and broke.reward == 0.0
        assert broke.observation["info"] == {"failure": "policy", "cause": "shell_killed"}
        await env.reset(task_id="hello-file")
        gone = await env.step({"action_type": "exec", "command": "vanish"})
        assert gone.done and gone.reward is None  # no reward at all, never a 0
        assert gone.observation["info"] == {"failure": "infra", "cause": "sandbox_transport"}
    assert await eventually(lambda: provider.live_sandboxes() == 0)


async def test_a_session_over_the_cap_is_told_capacity_reached() -> None:
    with fake_server(max_sessions=2) as (url, server, provider):
        async with GenericEnvClient(base_url=url) as a, GenericEnvClient(base_url=url) as b:
            await a.reset(task_id="hello-file")
            await b.reset(task_id="hello-file")
            with pytest.raises(RuntimeError, match="CAPACITY_REACHED"):
                async with GenericEnvClient(base_url=url) as c:
                    await c.reset(task_id="hello-file")
            assert provider.live_sandboxes() == 2
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)
        async with GenericEnvClient(base_url=url) as again:  # the places came back
            assert not (await again.reset(task_id="hello-file")).done


async def test_a_client_that_disconnects_mid_command_leaves_no_sandbox() -> None:
    with fake_server() as (url, server, provider):
        for abrupt in (False, True):
            ws = await connect(ws_url(url), proxy=None)
            await ask(ws, {"type": "reset", "data": {"task_id": "hello-file"}})
            assert provider.live_sandboxes() == 1
            await ws.send(
                json.dumps(
                    {
                        "type": "step",
                        "data": {
                            "action_type": "exec",
                            "command": "sleep 300",
                            "metadata": {"timeout_s": 600},
                        },
                    }
                )
            )
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            if abrupt:
                ws.transport.abort()  # no close frame: the TCP connection just ends
            else:
                await ws.close()
            # The step is cancelled at once, not left to run out its 300 s.
            assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0, 5.0)
            assert time.monotonic() - t0 < 5.0


async def test_an_idle_session_is_closed_with_its_sandbox_and_told_why() -> None:
    with fake_server(idle_timeout_s=1.0) as (url, server, provider):
        async with connect(ws_url(url), proxy=None) as ws:
            await ask(ws, {"type": "reset", "data": {"task_id": "hello-file"}})
            # A step longer than the idle limit is not idleness.
            slow = await ask(ws, {"type": "step", "data": {"action_type": "exec", "command": "sleep 2"}})
            assert slow["data"]["observation"]["success"]
            assert provider.live_sandboxes() == 1
            assert await eventually(lambda: provider.live_sandboxes() == 0, 5.0)
            with pytest.raises(ConnectionClosed) as closed:
                await ask(ws, {"type": "step", "data": {"action_type": "exec", "command": "true"}})
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4408
            assert "idle for 1s" in closed.value.rcvd.reason
        assert server.hub.sandboxes == 0


def test_stateless_http_episodes_are_refused_with_the_reason_and_mcp_answers_json_rpc(server) -> None:  # type: ignore[no-untyped-def]
    url, _, provider = server
    with httpx.Client(base_url=url, trust_env=False) as http:
        for path in ("/reset", "/step"):
            resp = http.post(path, json={"action": {"action_type": "exec", "command": "true"}})
            assert resp.status_code == 501 and "connect to /ws" in resp.json()["detail"]
        # MCP over HTTP: the tools, and JSON-RPC 2.0 errors for what is not a request.
        mcp = http.post("/mcp", json={"jsonrpc": "2.0", "method": "tools/list", "id": 1})
        assert mcp.status_code == 200 and mcp.json()["jsonrpc"] == "2.0" and mcp.json()["id"] == 1
        assert [t["name"] for t in mcp.json()["result"]["tools"]] == ["exec", "write_file", "evaluate"]
        assert mcp.json()["result"]["tools"][0]["inputSchema"]["required"] == ["command"]
        # A call outside any session has no episode: the session's refusal, in words.
        lone = http.post(
            "/mcp",
            json={"jsonrpc": "2.0", "method": "tools/call", "id": 2,
                  "params": {"name": "exec", "arguments": {"command": "true"}}},
        ).json()  # fmt: skip
        assert (
            lone["result"]["is_error"] and "reset(task_id=...) first" in lone["result"]["content"][0]["text"]
        )
        assert http.post("/mcp", json={}).json()["error"]["code"] == -32600
        bad = http.post("/mcp", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 200 and bad.json()["error"]["code"] == -32700
        big = http.post(
            "/tbench2/tasks", content=b"x" * (200 * 1024), headers={"content-type": "application/json"}
        )
        assert big.status_code == 413 and "limit" in big.json()["detail"]
        assert http.get("/health").json()["status"] == "healthy"
    assert provider.live_sandboxes() == 0


async def test_upstreams_mcp_tool_client_solves_a_task_over_http_mcp_sessions() -> None:
    """openenv 0.10's MCPToolClient (production mode, unmodified): `openenv/session/create` on
    POST /mcp, the reset over the WebSocket it attaches with that session id, `tools/list` and
    `tools/call` over POST /mcp; the reference solution scores 1, nothing scores 0, a refused call
    is the client's RuntimeError, and closing the client closes the session and its sandbox."""
    from openenv.core.mcp_client import MCPToolClient

    with fake_server() as (url, server, provider):
        async with MCPToolClient(base_url=url) as env:
            reset = await env.reset(task_id="hello-file")
            assert "Hello, world!" in reset.observation.instruction
            assert [t.name for t in await env.list_tools()] == ["exec", "write_file", "evaluate"]
            assert provider.live_sandboxes() == 1
            echoed = await env.call_tool("exec", command="echo hi")
            assert echoed["structured_content"]["success"] and echoed["content"][0]["text"].startswith("hi")
            assert (await env.call_tool("exec", command=HELLO))["structured_content"]["success"]
            with pytest.raises(RuntimeError, match="Tool not found"):
                await env.call_tool("rm_all")
            with pytest.raises(RuntimeError, match="shell"):
                await env.call_tool("exec", command="true", shell="zsh")
            scored = await env.call_tool("evaluate")
            assert (scored["reward"], scored["done"]) == (1.0, True)
            # Another episode in the same session, through the same calls: nothing done scores 0.
            await env.reset(task_id="hello-file")
            assert (await env.call_tool("evaluate"))["reward"] == 0.0
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)
        assert not server.app.mcp_sessions.idle_since  # closed by the client, forgotten by the guard


async def test_an_http_mcp_session_left_by_its_client_is_closed_once_idle_with_its_sandbox() -> None:
    """A client that opens a session, resets it over an attached WebSocket, then vanishes without
    `openenv/session/close`: while the WebSocket is attached or a call runs the session stays;
    idle_timeout_s after its last use it is closed through the package, with its sandbox."""
    with fake_server(idle_timeout_s=0.5) as (url, server, provider):
        async with httpx.AsyncClient(base_url=url, trust_env=False) as http:

            async def rpc(method: str, **params: Any) -> dict[str, Any]:
                body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
                return (await http.post("/mcp", json=body)).json()

            sid = (await rpc("openenv/session/create"))["result"]["session_id"]
            async with connect(ws_url(url) + f"?session_id={sid}") as ws:
                reset = await ask(ws, {"type": "reset", "data": {"task_id": "hello-file"}})
                assert reset["type"] == "observation"
                await asyncio.sleep(0.3)
                called = await rpc(
                    "tools/call", name="exec", arguments={"command": "echo hi"}, session_id=sid
                )
                assert called["result"]["content"][0]["text"].startswith("hi")
                await asyncio.sleep(0.3)  # attached: not idle, whatever the clock says
                assert provider.live_sandboxes() == 1 and sid in server.app.mcp_sessions.idle_since
            # Gone without a close: the guard closes it once idle, and the package its sandbox.
            assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)
            assert not server.app.mcp_sessions.idle_since
            gone = await rpc("tools/call", name="exec", arguments={"command": "true"}, session_id=sid)
            assert "Unknown session_id" in gone["error"]["message"]


def test_upstreams_validator_passes_our_server(server) -> None:  # type: ignore[no-untyped-def]
    """`openenv validate --url`, the installed package's own checks (`openenv/cli/_validation.py`)."""
    validation = pytest.importorskip("openenv.cli._validation")
    url, _, provider = server
    report = validation.validate_running_environment(url, timeout_s=10.0)
    failed = [c for c in report["criteria"] if not c["passed"]]
    assert report["passed"], failed
    assert {c["id"] for c in report["criteria"]} >= {"mcp_endpoint", "schema_endpoint", "health_endpoint"}
    assert provider.live_sandboxes() == 0


def test_serving_on_the_openenv_core_line_is_refused_with_the_way_back(monkeypatch) -> None:
    """openenv-core 0.3.0 (installed over the shared `openenv` module by upstream environment
    packages) has create_fastapi_app(env, action_cls, observation_cls, max_concurrent_envs,
    concurrency_config) only: a clear refusal naming the installed line, not a TypeError."""
    from openenv.core.env_server import http_server

    from agentrl.openenv import server as server_module

    def create_fastapi_app(
        env, action_cls, observation_cls, max_concurrent_envs=None, concurrency_config=None
    ):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    monkeypatch.setattr(http_server, "create_fastapi_app", create_fastapi_app)
    config = ServeConfig(env={"name": "tbench2", "backend": "fake", "tasks": str(BUNDLED_TASKS)}, port=0)
    with pytest.raises(server_module.OpenEnvVersionError) as refused:
        server_module.build_server(config, provider=fake_provider())
    message = str(refused.value)
    assert "openenv 0.10" in message and "env_name" in message and "--force-reinstall" in message
    assert server_module.openenv_line() in message  # which distribution is installed, with its version


async def test_the_terminal_is_served_as_mcp_tools_over_the_session(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The terminal's actions as MCP tools (exec, write_file, evaluate) over /ws: the `openenv`
    plugin's own `protocol=mcp` solves hello-file through them (reward 1), and MCP's errors answer
    an unknown tool or bad arguments. (Upstream's MCPToolClient calls them over POST /mcp: above.)"""
    import json as _json

    from openenv.core.generic_client import GenericEnvClient

    from agentrl.agent.loop import AgentConfig
    from agentrl.engine.scripted import ScriptedEngine
    from agentrl.episode.sample import Status
    from agentrl.rollout.environment import EnvContext
    from envs.openenv import OpenEnvConfig, OpenEnvEnvironment
    from tests.chat_tokenizer import byte_tokenizer

    def call(name: str, **arguments: Any) -> str:
        return "<tool_call>" + _json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"

    with fake_server() as (url, server, provider):
        async with GenericEnvClient(base_url=url) as raw:
            await raw.reset(task_id="hello-file")
            tools = (await raw.step({"type": "list_tools"})).observation["tools"]
            assert [t["name"] for t in tools] == ["exec", "write_file", "evaluate"]
            missing = (
                await raw.step({"type": "call_tool", "tool_name": "rm_all", "arguments": {}})
            ).observation
            assert missing["error"]["error_type"] == "tool_not_found"
            bad = {"type": "call_tool", "tool_name": "exec", "arguments": {"command": "true", "shell": "zsh"}}
            assert (await raw.step(bad)).observation["error"]["error_type"] == "invalid_args"
            echoed = (
                await raw.step(
                    {"type": "call_tool", "tool_name": "exec", "arguments": {"command": "echo hi"}}
                )
            ).observation
            assert echoed["result"]["content"][0]["text"].startswith("hi")

        rows = tmp_path / "rows.jsonl"
        rows.write_text(_json.dumps({"id": "hello-file", "reset": {"task_id": "hello-file"}}) + "\n")
        tok = byte_tokenizer()
        plays = [call("exec", command=HELLO), call("evaluate")]
        config = OpenEnvConfig(url=url, protocol="mcp", rows_file=str(rows), observation_field="instruction",
                               agent=AgentConfig(max_turns=4, max_new_tokens=256))  # fmt: skip
        env = OpenEnvEnvironment(config, EnvContext(tokenizer=tok, seed=0, out_dir=tmp_path, temperature=1.0))
        runner = env.runner(ScriptedEngine(lambda sid, turn, ids: plays[min(turn, 1)], tok), run_id="mcp")
        episode = await runner.run(env.rows("train")[0], group_id="hello-file", sample_index=0)
        assert (episode.reward, episode.status, episode.end_reason) == (1.0, Status.COMPLETED, "done")
        assert await eventually(lambda: provider.live_sandboxes() == 0 and server.hub.sandboxes == 0)
