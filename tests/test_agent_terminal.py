"""The agent loop on the terminal path (Terminus-2 into a terminal session), against a small
in-test terminal: what is sent, how long it waits, what the model is shown, when the episode ends,
and what is recorded and replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.agent.actions import TerminusJSONFormat
from agentrl.agent.loop import AgentConfig, EndReason, run_agent
from agentrl.agent.prompts import TERMINUS_JSON_TEMPLATE, initial_prompt
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.errors import AgentRLError
from agentrl.sandbox.base import SandboxError
from tests.chat_tokenizer import byte_tokenizer

PROMPT = "$ "


class LineTerminal:
    """A terminal that echoes typed text and runs a line on Enter through `programs`."""

    def __init__(self, programs: dict[str, str] | None = None) -> None:
        self.lines = [PROMPT]
        self.programs = programs or {}
        self.sent: list[tuple[str, float]] = []
        self.closed = False

    async def send_keys(self, keys: str, *, duration: float = 0.0) -> None:
        self.sent.append((keys, duration))
        if keys == "C-c":
            self.lines[-1] += "^C"
            self.lines.append(PROMPT)
            return
        for ch in keys:
            if ch == "\n":
                command = self.lines[-1][len(PROMPT) :]
                out = self.programs.get(command, f"bash: {command}: command not found" if command else "")
                self.lines += [*([out] if out else []), PROMPT]
            else:
                self.lines[-1] += ch

    async def capture(self, *, history: bool = False) -> str:
        return "\n".join(self.lines if history else self.lines[-5:]) + "\n"

    async def is_idle(self) -> bool:
        return True

    async def is_alive(self) -> bool:
        return not any(line.endswith("exit") for line in self.lines)

    async def close(self) -> None:
        self.closed = True


class TerminalSandbox:
    sandbox_id = "terminal-sandbox"

    def __init__(self, terminal: LineTerminal) -> None:
        self.terminal = terminal
        self.exec_calls: list[str] = []

    async def open_terminal(self, *, width: int = 160, height: int = 40) -> LineTerminal:
        return self.terminal

    async def exec(self, cmd: str, **kwargs: object) -> object:  # the terminal path never uses it
        self.exec_calls.append(cmd)
        raise AssertionError("exec on the terminal path")


def reply(commands: list[dict], complete: bool = False) -> str:
    return json.dumps({"analysis": "a", "plan": "p", "commands": commands, "task_complete": complete})


async def run(script: list[str], terminal: LineTerminal, **config: object):  # type: ignore[no-untyped-def]
    tok = byte_tokenizer()
    return await run_agent(
        engine=ScriptedEngine(script, tok),
        sandbox=TerminalSandbox(terminal),  # type: ignore[arg-type]
        renderer=ChatRenderer(tok),
        action_format=TerminusJSONFormat(),
        instruction="Say hello.",
        config=AgentConfig(**{"max_turns": 6, "max_new_tokens": 2048, "max_total_tokens": 65536, **config}),
        sampling=SamplingParams(max_new_tokens=2048),
        session_id="s",
    )


async def test_keystrokes_go_to_the_terminal_and_its_output_comes_back() -> None:
    terminal = LineTerminal({"echo hi": "hi"})
    result = await run(
        [
            reply([{"keystrokes": "echo hi\n", "duration": 0.1}, {"keystrokes": "C-c", "duration": 0.2}]),
            reply([], complete=True),
            reply([], complete=True),
        ],
        terminal,
    )
    assert result.mode == "tmux" and result.end_reason is EndReason.TASK_COMPLETE
    assert terminal.sent == [("echo hi\n", 0.1), ("C-c", 0.2)]
    first = result.turns[0]
    assert first.terminal_output.startswith("New Terminal Output:\n")
    assert "$ echo hi\nhi\n$ ^C" in first.terminal_output and first.observation == first.terminal_output
    # Terminus-2 asks for a confirmation of the first task_complete, and ends on the second.
    assert "Are you sure you want to mark the task as complete?" in result.turns[1].observation
    assert len(result.turns) == 3 and terminal.closed


async def test_the_first_prompt_is_terminus2s_one_user_message() -> None:
    terminal = LineTerminal()
    result = await run([reply([], complete=True), reply([], complete=True)], terminal)
    assert result.initial_state == "Current Terminal Screen:\n$ \n"
    text = byte_tokenizer().decode(result.segments[0].prompt_ids)
    # No system message: the conversation opens with the user turn holding the whole template.
    assert text.startswith("<|user|>\n" + initial_prompt("Say hello.", result.initial_state))


async def test_a_reply_cut_at_the_token_limit_runs_nothing() -> None:
    terminal = LineTerminal()
    long = reply([{"keystrokes": "echo " + "x" * 300 + "\n", "duration": 0.1}])
    result = await run([long, reply([], True), reply([], True)], terminal, max_new_tokens=64)
    assert terminal.sent == [] and result.turns[0].action["error"]
    assert result.turns[0].observation.startswith(
        "ERROR!! NONE of the actions you just requested were performed"
    )


async def test_durations_nan_and_negative_do_not_wait() -> None:
    terminal = LineTerminal()
    text = '{"analysis": "a", "plan": "p", "commands": [{"keystrokes": "ls\\n", "duration": -5}], "task_complete": false}'
    await run([text, reply([], True), reply([], True)], terminal)
    assert terminal.sent == [("ls\n", 0.0)]


async def test_the_terminal_failing_to_open_is_infra() -> None:
    class NoTerminal(TerminalSandbox):
        async def open_terminal(self, *, width: int = 160, height: int = 40) -> LineTerminal:
            raise SandboxError("tmux is not installed in this image")

    tok = byte_tokenizer()
    result = await run_agent(
        engine=ScriptedEngine([reply([], True)], tok),
        sandbox=NoTerminal(LineTerminal()),  # type: ignore[arg-type]
        renderer=ChatRenderer(tok),
        action_format=TerminusJSONFormat(),
        instruction="x",
        config=AgentConfig(),
        sampling=SamplingParams(),
        session_id="s",
    )
    assert result.end_reason is EndReason.SANDBOX_ERROR and "tmux" in str(result.infra_error)


def test_terminal_mode_and_template_are_checked() -> None:
    with pytest.raises(AgentRLError, match=r"agent\.terminal"):
        AgentConfig(terminal="pty")
    assert AgentConfig(terminal="commands").mode_for(TerminusJSONFormat()) == "commands"
    assert "{instruction}" in TERMINUS_JSON_TEMPLATE and "{terminal_state}" in TERMINUS_JSON_TEMPLATE


def test_a_custom_template_is_used_and_checked(tmp_path: Path) -> None:
    good = tmp_path / "t.txt"
    good.write_text("Do {instruction} on {terminal_state} ({{literal}})")
    assert initial_prompt("X", "S", str(good)) == "Do X on S ({literal})"
    bad = tmp_path / "bad.txt"
    bad.write_text("Do {task}")
    with pytest.raises(AgentRLError, match="only use"):
        initial_prompt("X", "S", str(bad))


async def test_exit_ends_the_session_and_the_episode_is_still_verified(tmp_path: Path) -> None:
    """Terminus-2 stops when the agent ends its shell; what it did before is graded."""
    from agentrl.episode.run import EpisodeConfig, run_episode
    from agentrl.tasks.task import load_task
    from agentrl.testing.sandbox import FakeSandboxProvider
    from tests.conftest import BUNDLED_TASKS

    provider = FakeSandboxProvider(grader=lambda sb: 1.0 if "/app/hello.txt" in sb.files else 0.0)
    provider.on(r"echo .* > /app/hello.txt", lambda sb, cmd, m: sb.files.__setitem__("/app/hello.txt", b"hi"))
    tok = byte_tokenizer()
    script = [
        reply(
            [
                {"keystrokes": "echo hi > /app/hello.txt\n", "duration": 0.1},
                {"keystrokes": "exit\n", "duration": 0.1},
            ]
        ),
        reply([], complete=True),
    ]
    result = await run_episode(
        load_task(BUNDLED_TASKS / "hello-file"),
        provider=provider,
        engine=ScriptedEngine(script, tok),
        renderer=ChatRenderer(tok),
        config=EpisodeConfig(
            action_format="terminus-json",
            agent=AgentConfig(max_turns=4, max_new_tokens=2048, max_total_tokens=65536),
        ),
        run_id="exit",
        record_dir=tmp_path,
    )
    assert result.run is not None and result.run.mode == "tmux"
    assert result.run.end_reason is EndReason.SESSION_ENDED and len(result.run.turns) == 1
    assert result.episode.reward == 1.0  # graded: the file was written before `exit`
    sent = [c["keystrokes"] for c in result.run.turns[0].action["commands"]]
    assert sent == ["echo hi > /app/hello.txt\n", "exit\n"]
    assert "root@sandbox:" in result.run.initial_state  # the fake terminal's prompt opened the run
