"""Action parsers: each format's happy path, Harbor's JSON parser rules, and never raising."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.agent.actions import FORMATS, FencedBashFormat, TerminusJSONFormat, ToolCallFormat, get_format


def test_terminus_json_full_reply() -> None:
    text = json.dumps(
        {
            "analysis": "a",
            "plan": "p",
            "commands": [{"keystrokes": "ls\n", "duration": 0.1}, {"keystrokes": "cat x\n", "duration": 99}],
            "task_complete": "yes",
        }
    )
    a = TerminusJSONFormat().parse(text)
    assert not a.malformed and a.task_complete
    assert [c.keystrokes for c in a.commands] == ["ls\n", "cat x\n"]
    assert a.commands[1].duration == 60.0  # capped like Terminus-2


def test_terminus_json_extra_text_is_a_warning_not_an_error() -> None:
    a = TerminusJSONFormat().parse('Sure! ```json\n{"analysis": "", "plan": "", "commands": []}\n```')
    assert not a.malformed and a.commands == []
    assert any("before" in w for w in a.warnings) and any("after" in w for w in a.warnings)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("no json here", "No valid JSON"),
        ('{"analysis": "x", "plan": "y"}', "Missing required fields: commands"),
        ('{"analysis": "x", "plan": "y", "commands": "ls"}', "must be an array"),
        ('{"analysis": "x", "plan": "y", "commands": [{"duration": 1}]}', "keystrokes"),
        ('{"analysis": "x", "plan": "y", "commands": [], }', "Invalid JSON"),
    ],
)
def test_terminus_json_errors(text: str, error: str) -> None:
    a = TerminusJSONFormat().parse(text)
    assert a.malformed and error in (a.error or "")
    assert "parsing errors" in TerminusJSONFormat().error_observation(a)


def test_terminus_json_truncated_object_is_auto_corrected() -> None:
    a = TerminusJSONFormat().parse('{"analysis": "x", "plan": "y", "commands": [{"keystrokes": "ls\\n"}]')
    assert not a.malformed and a.commands[0].keystrokes == "ls\n"
    assert a.warnings[0].startswith("AUTO-CORRECTED")


def test_terminus_complete_with_broken_commands_is_complete() -> None:
    a = TerminusJSONFormat().parse('{"analysis": "", "plan": "", "commands": 5, "task_complete": true}')
    assert a.task_complete and not a.malformed


def test_tool_call_formats() -> None:
    f = ToolCallFormat()
    hermes = f.parse('ok <tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}</tool_call>')
    assert [c.keystrokes for c in hermes.commands] == ["ls -la"]
    glm = f.parse("<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>echo hi</arg_value>\n</tool_call>")
    assert [c.keystrokes for c in glm.commands] == ["echo hi"]
    assert f.parse("All done.").task_complete
    assert f.parse('<tool_call>{"name": "python", "arguments": {}}</tool_call>').malformed
    assert f.parse("<tool_call>{oops").malformed


def test_fenced_bash() -> None:
    f = FencedBashFormat()
    assert [c.keystrokes for c in f.parse("run:\n```bash\nls\npwd\n```").commands] == ["ls\npwd\n"]
    assert f.parse("TASK_COMPLETE").task_complete
    assert f.parse("hmm").malformed
    assert f.parse("```bash\nls").malformed


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_render_then_parse_round_trips(name: str) -> None:
    f = get_format(name)
    cmds = ["echo 'a b' > /app/x.txt", "cat /app/x.txt"]
    parsed = f.parse(f.render(cmds, task_complete=False))
    assert [c.keystrokes.rstrip("\n") for c in parsed.commands] == cmds
    done = f.parse(f.render([], task_complete=True))
    assert done.task_complete and not done.commands


def test_unknown_format_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        get_format("xml")


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(sorted(FORMATS)),
    st.one_of(
        st.text(max_size=300),
        st.text(alphabet='{}[]":,\\ntrueflsakyoscmdpn<>/_ `', max_size=200),
    ),
)
def test_parsers_never_raise_and_errors_have_no_commands(name: str, text: str) -> None:
    a = get_format(name).parse(text)
    if a.malformed:
        assert a.commands == [] and isinstance(a.error, str) and a.error
        assert isinstance(get_format(name).error_observation(a), str)
    for c in a.commands:
        assert isinstance(c.keystrokes, str) and c.duration <= 60
