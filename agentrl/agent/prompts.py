"""The first prompt of the terminal path, shaped like Harbor's Terminus-2: no system message, one
user message holding the whole template with `{instruction}` and `{terminal_state}` filled in by
`str.format` (literal braces doubled).

agentrl's template follows the sections of Harbor's `templates/terminus-json-plain.txt`
(`shared/reference/harbor.md` 4.5) in its own words. To train on Harbor's exact text, point
`agent.prompt_template` at that file of an installed `harbor` package (`harbor_template_path()`
finds it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from agentrl.errors import AgentRLError

TERMINUS_JSON_TEMPLATE = """\
You are an AI assistant that solves command-line tasks in a Linux environment. You receive a task \
description and the output of the commands run so far, and you answer with batches of shell commands.

Answer with JSON of this shape:

{{
  "analysis": "What the terminal output shows: what is done, and what is still missing.",
  "plan": "The next steps: which commands you send and what you expect each one to do.",
  "commands": [
    {{
      "keystrokes": "ls -la\\n",
      "duration": 0.1
    }},
    {{
      "keystrokes": "cd project\\n",
      "duration": 0.1
    }}
  ],
  "task_complete": true
}}

Required fields:
- "analysis": your reading of the current situation
- "plan": your next steps
- "commands": an array of command objects to run

Optional fields:
- "task_complete": true when the task is done (false when left out)

A command object has:
- "keystrokes": the exact keystrokes to type into the terminal (required)
- "duration": how many seconds to wait before the next command is sent (1.0 when left out)

The keystrokes are sent verbatim, so write them exactly as they should be typed:
- End every command with a newline (\\n), or it is typed but not run.
- Special keys use tmux names, sent as a keystroke of their own:
  - C-c for Ctrl+C
  - C-d for Ctrl+D

Pick durations to match the command: about 0.1 seconds for immediate ones (cd, ls, echo, cat), \
1.0 for ordinary ones (gcc, find, rustc), longer for slow ones (make, a long python3 script, wget). \
A short wait is better than a long one: you can always wait again with \
{{"keystrokes": "", "duration": 10.0}}. Never wait more than 60 seconds; poll instead.

Notes:
- Each command's keystrokes are sent exactly as written
- Add no whitespace before or after the keystrokes unless the command needs it
- Text before or after the JSON is tolerated, with a warning
- The JSON must be valid: escape quotes and special characters inside strings
- The commands array may be empty when you only want to wait

Task Description:
{instruction}

Current terminal state:
{terminal_state}
"""


def harbor_template_path() -> Path | None:
    """Harbor's own `terminus-json-plain.txt`, when a `harbor` package is importable here."""
    spec = importlib.util.find_spec("harbor")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = (
        Path(next(iter(spec.submodule_search_locations)))
        / "agents/terminus_2/templates/terminus-json-plain.txt"
    )
    return path if path.is_file() else None


def initial_prompt(instruction: str, terminal_state: str, template_path: str | None = None) -> str:
    template = TERMINUS_JSON_TEMPLATE
    if template_path is not None:
        try:
            template = Path(template_path).read_text(encoding="utf-8")
        except OSError as exc:
            raise AgentRLError(f"agent.prompt_template={template_path!r} cannot be read: {exc}") from exc
    try:
        return template.format(instruction=instruction, terminal_state=terminal_state)
    except (KeyError, IndexError, ValueError) as exc:
        raise AgentRLError(
            f"agent.prompt_template: {exc!r}; the template may only use {{instruction}} and "
            "{terminal_state} (double other braces)"
        ) from exc
