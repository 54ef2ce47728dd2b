"""Action formats: how a model's reply becomes shell commands, and what it is told when the reply
cannot be parsed.

- `terminus-json`: Terminus-2's JSON (analysis, plan, commands[{keystrokes, duration}],
  task_complete), parsed like Harbor's `terminus_json_plain_parser` (first balanced object,
  required fields, warnings, the brace auto-fix).
- `tool-call`: one native `bash` tool. Accepts the Hermes/Qwen form
  `<tool_call>{"name": "bash", "arguments": {"command": ...}}</tool_call>` and the GLM form
  `<tool_call>bash<arg_key>command</arg_key><arg_value>...</arg_value></tool_call>`. A reply without a
  tool call ends the task (the usual tool-agent convention).
- `fenced-bash`: ```bash blocks; the reply `TASK_COMPLETE` (outside a block) ends the task.

A parse never raises: a malformed reply is an `ParsedAction` with `error` set, which the loop turns
into an observation telling the model what was wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

MAX_DURATION_S = 60.0


@dataclass(frozen=True)
class Command:
    keystrokes: str
    duration: float = 1.0


@dataclass
class ParsedAction:
    commands: list[Command] = field(default_factory=list)
    task_complete: bool = False
    error: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def malformed(self) -> bool:
        return self.error is not None


def _first_balanced_object(text: str) -> tuple[int, int] | None:
    """Span of the first balanced top-level {...}, string- and escape-aware."""
    depth = 0
    start = -1
    in_str = False
    escaped = False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"' and depth > 0:
            in_str = True
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                return start, i + 1
    return None


def _truthy(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


class TerminusJSONFormat:
    name = "terminus-json"
    observation_role = "user"

    system_prompt = (
        "You are an AI assistant tasked with solving command-line tasks in a Linux environment. "
        "You will be given a task description and the output from previously executed commands. "
        "Your goal is to solve the task by providing batches of shell commands.\n\n"
        "Format your response as JSON with the following structure:\n\n"
        '{\n  "analysis": "Analyze the current state based on the terminal output provided.",\n'
        '  "plan": "Describe your plan for the next steps.",\n'
        '  "commands": [\n    {\n      "keystrokes": "ls -la\\n",\n      "duration": 0.1\n    }\n  ],\n'
        '  "task_complete": true\n}\n\n'
        "Required fields: analysis, plan, commands (may be empty). Optional: task_complete "
        "(default false). Each command's keystrokes are run verbatim and must end with \\n; "
        "duration is in seconds (default 1.0, never above 60)."
    )

    def parse(self, text: str) -> ParsedAction:
        warnings: list[str] = []
        span = _first_balanced_object(text)
        candidate: str | None = None
        if span is None:
            opened = text.find("{")
            if opened >= 0:
                # Harbor's auto-fix (a): close the unbalanced braces of a truncated object.
                body = text[opened:]
                candidate = body + "}" * max(1, body.count("{") - body.count("}"))
                warnings.append("AUTO-CORRECTED: added missing closing braces; send complete JSON")
            else:
                return ParsedAction(error="No valid JSON found in response", warnings=warnings)
        else:
            if text[: span[0]].strip():
                warnings.append("Extra text detected before JSON object")
            if text[span[1] :].strip():
                warnings.append("Extra text detected after JSON object")
            candidate = text[span[0] : span[1]]
        try:
            data = json.loads(candidate)
        except json.JSONDecodeError as exc:
            preview = candidate if len(candidate) <= 200 else candidate[:100]
            return ParsedAction(error=f"Invalid JSON: {exc} | Content: {preview!r}", warnings=warnings)
        if not isinstance(data, dict):
            return ParsedAction(error="Response JSON must be an object", warnings=warnings)
        complete = _truthy(data.get("task_complete", False))
        missing = [k for k in ("analysis", "plan", "commands") if k not in data]
        if missing:
            if complete and "commands" in missing:
                return ParsedAction(task_complete=True, warnings=[*warnings, f"Missing fields: {missing}"])
            return ParsedAction(error=f"Missing required fields: {', '.join(missing)}", warnings=warnings)
        raw_commands = data["commands"]
        if not isinstance(raw_commands, list):
            if complete:
                return ParsedAction(task_complete=True, warnings=[*warnings, "commands is not an array"])
            return ParsedAction(error="Field 'commands' must be an array", warnings=warnings)
        commands: list[Command] = []
        for i, item in enumerate(raw_commands):
            if not isinstance(item, dict) or not isinstance(item.get("keystrokes"), str):
                if complete:
                    return ParsedAction(task_complete=True, warnings=[*warnings, f"command {i} invalid"])
                return ParsedAction(
                    error=f"Command {i} must be an object with a string 'keystrokes'", warnings=warnings
                )
            duration = item.get("duration", 1.0)
            if isinstance(duration, bool) or not isinstance(duration, int | float):
                warnings.append(f"Command {i}: missing or invalid duration, using 1.0")
                duration = 1.0
            keys = item["keystrokes"]
            if i < len(raw_commands) - 1 and keys and not keys.endswith("\n"):
                warnings.append(f"Command {i} should end with a newline")
            commands.append(Command(keys, min(float(duration), MAX_DURATION_S)))
        return ParsedAction(commands=commands, task_complete=complete, warnings=warnings)

    def render(self, commands: list[str], task_complete: bool, analysis: str = "", plan: str = "") -> str:
        """The reply a model should have written for these commands (SFT targets, scripted engines)."""
        return json.dumps(
            {
                "analysis": analysis,
                "plan": plan,
                "commands": [
                    {"keystrokes": c if c.endswith("\n") else c + "\n", "duration": 1.0} for c in commands
                ],
                "task_complete": task_complete,
            },
            ensure_ascii=False,
        )

    def error_observation(self, action: ParsedAction) -> str:
        text = f"Previous response had parsing errors:\nERROR: {action.error}"
        if action.warnings:
            text += "\nWARNINGS: " + "\n".join(f"- {w}" for w in action.warnings)
        return text + "\n\nPlease fix these issues and provide a proper JSON response."


_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_GLM = re.compile(
    r"<tool_call>\s*([A-Za-z_][\w-]*)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)</tool_call>",
    re.DOTALL,
)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class ToolCallFormat:
    name = "tool-call"
    observation_role = "tool"

    system_prompt = (
        "You are an AI assistant solving a task in a Linux terminal. You have one tool:\n"
        '{"name": "bash", "description": "Run a bash command and see its output.", '
        '"parameters": {"type": "object", "properties": {"command": {"type": "string"}}, '
        '"required": ["command"]}}\n'
        'Call it as <tool_call>{"name": "bash", "arguments": {"command": "..."}}</tool_call>. '
        "You may make several calls in one reply. When the task is done, reply without a tool call."
    )

    def parse(self, text: str) -> ParsedAction:
        commands: list[Command] = []
        errors: list[str] = []
        hermes = list(_HERMES.finditer(text))
        for m in hermes:
            try:
                call = json.loads(m.group(1))
            except json.JSONDecodeError as exc:
                errors.append(f"tool call is not valid JSON: {exc}")
                continue
            args = call.get("arguments") if isinstance(call, dict) else None
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = None
            if not isinstance(call, dict) or call.get("name") != "bash":
                errors.append(f"unknown tool {call.get('name') if isinstance(call, dict) else call!r}")
            elif not isinstance(args, dict) or not isinstance(args.get("command"), str):
                errors.append("bash needs a string argument 'command'")
            else:
                commands.append(Command(args["command"]))
        if not hermes:
            for m in _GLM.finditer(text):
                args = dict(_GLM_ARG.findall(m.group(2)))
                if m.group(1) != "bash":
                    errors.append(f"unknown tool {m.group(1)!r}")
                elif "command" not in args:
                    errors.append("bash needs an argument 'command'")
                else:
                    commands.append(Command(args["command"]))
        if errors:
            return ParsedAction(commands=[], error="; ".join(errors))
        if not commands:
            if "<tool_call>" in text:
                return ParsedAction(error="unterminated or malformed <tool_call> block")
            return ParsedAction(task_complete=True)
        return ParsedAction(commands=commands)

    def render(self, commands: list[str], task_complete: bool, analysis: str = "", plan: str = "") -> str:
        calls = "".join(
            "<tool_call>"
            + json.dumps({"name": "bash", "arguments": {"command": c.rstrip("\n")}})
            + "</tool_call>"
            for c in commands
        )
        return (analysis + "\n" if analysis else "") + calls if commands else (analysis or "Done.")

    def error_observation(self, action: ParsedAction) -> str:
        return f"Your tool call could not be parsed: {action.error}. {self.system_prompt.splitlines()[-1]}"


_FENCE = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.DOTALL)


class FencedBashFormat:
    name = "fenced-bash"
    observation_role = "user"
    done_marker = "TASK_COMPLETE"

    system_prompt = (
        "You are an AI assistant solving a task in a Linux terminal. Reply with the shell commands "
        "to run next inside one ```bash code block; you will see their output. When the task is "
        "done, reply with TASK_COMPLETE and no code block."
    )

    def parse(self, text: str) -> ParsedAction:
        blocks = [b for b in _FENCE.findall(text) if b.strip()]
        if blocks:
            return ParsedAction(commands=[Command(b) for b in blocks])
        if self.done_marker in text:
            return ParsedAction(task_complete=True)
        if "```" in text:
            return ParsedAction(error="unterminated code block")
        return ParsedAction(error="no ```bash code block and no TASK_COMPLETE")

    def render(self, commands: list[str], task_complete: bool, analysis: str = "", plan: str = "") -> str:
        if not commands:
            return self.done_marker
        blocks = "\n".join("```bash\n" + (c if c.endswith("\n") else c + "\n") + "```" for c in commands)
        return (analysis + "\n" if analysis else "") + blocks

    def error_observation(self, action: ParsedAction) -> str:
        return f"Your reply could not be used: {action.error}. {self.system_prompt.split('. ', 1)[1]}"


ActionFormat = TerminusJSONFormat | ToolCallFormat | FencedBashFormat

FORMATS: dict[str, type[TerminusJSONFormat] | type[ToolCallFormat] | type[FencedBashFormat]] = {
    TerminusJSONFormat.name: TerminusJSONFormat,
    ToolCallFormat.name: ToolCallFormat,
    FencedBashFormat.name: FencedBashFormat,
}


def get_format(name: str) -> ActionFormat:
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown action format {name!r}: choose one of {sorted(FORMATS)}") from None
