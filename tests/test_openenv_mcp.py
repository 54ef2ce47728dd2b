"""MCP environments as a protocol of the `openenv` plugin (`env.protocol=mcp`): a server built on
upstream's own MCP environment base class (`MCPEnvironment` over a FastMCP server, written here),
its tools listed and put in the prompt (through the chat template's `tools` where it renders
them), the model's tool calls sent as `call_tool` steps, the results as observations and the
environment's reward as the episode's."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.env_server.mcp_environment")
pytest.importorskip("fastmcp")

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State

from agentrl.agent.actions import ToolsFormat, parse_tool_calls
from agentrl.agent.loop import AgentConfig
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.sample import Status
from agentrl.rollout.environment import EnvContext
from envs.openenv import OpenEnvConfig, OpenEnvEnvironment
from tests.chat_tokenizer import GLM_STYLE_TEMPLATE, byte_tokenizer
from tests.test_openenv_consume import serve_app, upstream_app

# The GLM-style test template, plus the `tools` block a tool-calling template renders.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|system|>\n# Tools\n' }}{% for t in tools %}{{ t.function | tojson }}{{ '\n' }}"
    "{% endfor %}{% endif %}" + GLM_STYLE_TEMPLATE
)


class Arithmetic(MCPEnvironment):
    """Add two numbers with the `add` tool, then `submit` the sum: reward 1 when it is right."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("arithmetic")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def submit(answer: int) -> str:
            """Submit the final answer (ends the episode)."""
            return f"submitted {answer}"

        super().__init__(mcp)
        self._state = State()
        self.target = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self.target = int(kwargs.get("a", 0)) + int(kwargs.get("b", 0))
        self._state = State(episode_id=episode_id)
        return Observation(metadata={"ready": True})

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            observation.reward = 1.0 if action.arguments.get("answer") == self.target else 0.0
            observation.done = True
        return observation

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        raise ValueError(f"only MCP actions here, got {type(action).__name__}")

    @property
    def state(self) -> State:
        return self._state


@contextlib.contextmanager
def arithmetic_server() -> Iterator[str]:
    with serve_app(
        upstream_app(Arithmetic, CallToolAction, CallToolObservation, max_concurrent_envs=4, env_name="arith")
    ) as url:
        yield url


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


PLAYS = {
    "right": [call("add", a=2, b=3), call("submit", answer=5)],
    "wrong": [call("submit", answer=6)],
    "lost": [call("multiply", a=2, b=3), "I cannot do this."],  # an unknown tool, then no call: the end
    "glm": ["<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value><arg_key>b</arg_key><arg_value>3</arg_value></tool_call>",
            "<tool_call>submit<arg_key>answer</arg_key><arg_value>5</arg_value></tool_call>"],
}  # fmt: skip


def test_tool_calls_parse_in_both_syntaxes_and_unknown_tools_are_the_models_error() -> None:
    assert parse_tool_calls(call("add", a=1, b=2)) == ([("add", {"a": 1, "b": 2})], [])
    assert parse_tool_calls(PLAYS["glm"][0]) == ([("add", {"a": 2, "b": 3})], [])
    fmt = ToolsFormat([{"name": "add", "description": "Add.", "input_schema": {"type": "object"}}])
    assert json.loads(fmt.parse(call("add", a=1, b=2)).commands[0].keystrokes) == {
        "name": "add",
        "arguments": {"a": 1, "b": 2},
    }
    assert "unknown tool 'mul'" in str(fmt.parse(call("mul")).error)
    assert fmt.parse("all done").task_complete
    assert '"name": "add"' in fmt.system_prompt


@pytest.mark.parametrize("template", ["tools", "plain"])
async def test_an_mcp_environment_is_driven_through_its_tools_and_scored_by_its_reward(
    tmp_path: Path, template: str
) -> None:
    tok = byte_tokenizer(TOOLS_TEMPLATE if template == "tools" else GLM_STYLE_TEMPLATE)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(
        json.dumps({"id": name, "instruction": "Add 2 and 3 with the tools, then submit the sum.", "reset": {"a": 2, "b": 3}}) + "\n"
        for name in PLAYS
    ))  # fmt: skip

    def player(session_id: str | None, turn: int, _: list[int]) -> str:
        play = PLAYS[str(session_id).split(":")[1]]
        return play[min(turn, len(play) - 1)]

    with arithmetic_server() as url:
        config = OpenEnvConfig(
            url=url, protocol="mcp", rows_file=str(rows), agent=AgentConfig(max_turns=4, max_new_tokens=200)
        )
        env = OpenEnvEnvironment(config, EnvContext(tokenizer=tok, seed=0, out_dir=tmp_path, temperature=1.0))
        runner = env.runner(ScriptedEngine(player, tok), run_id="mcp")
        episodes = {r["id"]: await runner.run(r, group_id=r["id"], sample_index=0) for r in env.rows("train")}

    right = episodes["right"]
    assert (right.reward, right.status, right.end_reason) == (1.0, Status.COMPLETED, "done")
    (seg,) = right.segments
    prompt = tok.decode(seg.tokens[: seg.prompt_length])
    assert '"name": "add"' in prompt and '"name": "submit"' in prompt  # the tools, in the prompt
    assert ("# Tools" in prompt) == (template == "tools")  # through the template where it renders tools
    later = tok.decode(seg.tokens[seg.prompt_length :])
    assert "\n5" in later and "submitted 5" not in later  # add's result observed; submit ended it
    assert (episodes["glm"].reward, episodes["glm"].status) == (1.0, Status.COMPLETED)
    assert (episodes["wrong"].reward, episodes["wrong"].end_reason) == (0.0, "done")
    lost = episodes["lost"]
    assert (lost.reward, lost.status, lost.end_reason) == (0.0, Status.COMPLETED, "task_complete")
    assert "unknown tool 'multiply'" in tok.decode(lost.segments[0].tokens)


async def test_a_short_rollout_on_an_mcp_environment_scores_every_episode(tmp_path: Path) -> None:
    """The rollout manager over the MCP runner: two groups of four, every episode scored by the
    environment's reward, none lost or retried."""
    from agentrl.rollout import RolloutConfig, RolloutManager

    tok = byte_tokenizer(TOOLS_TEMPLATE)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(
        json.dumps({"id": f"{a}+{b}", "instruction": f"Add {a} and {b}, then submit the sum.", "reset": {"a": a, "b": b}}) + "\n"
        for a, b in ((2, 3), (4, 4))
    ))  # fmt: skip

    def player(session_id: str | None, turn: int, ids: list[int]) -> str:
        import re

        a, b = map(int, re.findall(r"Add (\d+) and (\d+)", tok.decode(ids))[-1])
        right = int(str(session_id).split(":")[-2]) % 2 == 0  # even sample indices answer right
        return call("submit", answer=a + b if right else a + b + 1)

    with arithmetic_server() as url:
        config = OpenEnvConfig(
            url=url, protocol="mcp", rows_file=str(rows), agent=AgentConfig(max_turns=2, max_new_tokens=200)
        )
        env = OpenEnvEnvironment(config, EnvContext(tokenizer=tok, seed=0, out_dir=tmp_path, temperature=1.0))
        engine = ScriptedEngine(player, tok)
        rollout = RolloutConfig(batch_size=8, n_samples_per_prompt=4, max_in_flight=8, max_staleness=0)
        async with RolloutManager(
            env.runner(engine, run_id="mcp"), engine, env.rows("train"), rollout
        ) as manager:
            groups = await manager.get_batch(timeout=120)
    assert len(groups) == 2 and all(g.complete for g in groups)
    for group in groups:
        assert sorted(e.reward for e in group.episodes) == [0.0, 0.0, 1.0, 1.0]
        assert all(e.attempt == 0 for e in group.episodes)
    assert dict(manager.counters.failures) == {}
