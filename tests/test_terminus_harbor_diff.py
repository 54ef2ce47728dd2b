"""Terminus-2 fidelity, measured against the real `harbor` package.

Harbor 0.25 needs Python >= 3.12, so the test builds its own virtual environment with harbor
installed (cached under ~/.cache/agentrl, or $AGENTRL_CACHE_DIR) and runs a driver there once: the
driver feeds every generated reply through Harbor's own Terminus-2 agent loop
(`Terminus2._run_agent_loop`) with an in-memory LLM and terminal, and reports the keystrokes it
sent, their durations, whether the episode ended, the parser's error and warnings, and the next
prompt the LLM was given. The same replies go through `TerminusJSONFormat` here, as the agentrl
loop uses it (`parse`, `observation`, `error_observation`, `length_exceeded_observation`), and the
two are compared field by field.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentrl.agent.actions import TerminusErrorKind, TerminusJSONFormat, incremental_terminal_output

# Building the venv (first run only) and 2,000 replies through Harbor's loop take a minute or two.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HARBOR_REQUIREMENT = "harbor==0.25.0"
N_REPLIES = 2000
MIN_AGREEMENT = 0.99

# Runs inside the harbor venv. JSON lines in (one case each), JSON lines out.
DRIVER = r'''
import asyncio, importlib.metadata, json, logging, os, sys, tempfile
from pathlib import Path

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
logging.disable(logging.CRITICAL)

from harbor.agents.terminus_2.terminus_2 import Terminus2
from harbor.agents.terminus_2.tmux_session import TmuxSession
from harbor.llms.base import BaseLLM, LLMResponse, OutputLengthExceededError
from harbor.llms.chat import Chat
from harbor.models.agent.context import AgentContext

assert importlib.metadata.version("harbor") == sys.argv[1], importlib.metadata.version("harbor")


class Stop(BaseException):
    """Ends a scripted run; a BaseException, so Harbor's retries and handlers let it through."""


class ScriptedLLM(BaseLLM):
    def __init__(self, script, output_limit):
        super().__init__()
        self.script, self.output_limit, self.prompts = list(script), output_limit, []

    async def call(self, prompt, **kwargs):
        self.prompts.append(prompt)
        if not self.script:
            raise Stop()
        kind, text = self.script.pop(0)
        if kind == "length":
            raise OutputLengthExceededError("length", truncated_response=text)
        return LLMResponse(content=text)

    def get_model_context_limit(self):
        return 1_000_000

    def get_model_output_limit(self):
        return self.output_limit


class Terminal:
    def __init__(self, output):
        self.output, self.sent = output, []

    async def is_session_alive(self):
        return True

    async def send_keys(self, keys, block=False, min_timeout_sec=0.0, **kwargs):
        self.sent.append([keys, min_timeout_sec])

    async def get_incremental_output(self):
        return self.output


agent = Terminus2(logs_dir=Path(tempfile.mkdtemp()), model_name="openai/gpt-4o-mini")
agent._dump_trajectory = lambda: None


async def run_reply(case):
    script = [("reply", r) for r in case.get("before", [])] + [(case["mode"], case["reply"])]
    llm = ScriptedLLM(script, case.get("output_limit"))
    terminal = Terminal(case["terminal_output"])
    agent._llm, agent._session, agent._context = llm, terminal, AgentContext()
    agent._pending_completion, agent._trajectory_steps = False, []
    out = {"id": case["id"]}
    try:
        r = agent._parser.parse_response(case["reply"])
        out["parse"] = {"error": r.error, "warning": r.warning}
    except Exception as exc:
        out["parse_crash"] = repr(exc)
    try:
        await agent._run_agent_loop("START", Chat(llm), "")
        out["ended"] = True
    except Stop:
        out["ended"] = False
    except Exception as exc:
        out["loop_crash"] = repr(exc)
    n_before = len(case.get("before", []))
    out["sent"] = terminal.sent
    out["next_prompt"] = llm.prompts[n_before + 1] if len(llm.prompts) > n_before + 1 else None
    return out


async def run_incremental(case):
    session = object.__new__(TmuxSession)
    session._previous_buffer = case["previous"]

    async def capture_pane(capture_entire=False):
        return case["current"] if capture_entire else case["screen"]

    session.capture_pane = capture_pane
    return {"id": case["id"], "text": await session.get_incremental_output()}


async def main():
    for line in sys.stdin:
        case = json.loads(line)
        run = run_incremental if case["mode"] == "incremental" else run_reply
        print(json.dumps(await run(case)), flush=True)


asyncio.run(main())
'''


# --- The harbor environment -----------------------------------------------------------------------


_NO_REGISTRY = re.compile(
    r"No matching distribution|Could not find a version|NewConnectionError|Failed to establish|"
    r"Temporary failure in name resolution|Name or service not known|Network is unreachable",
)


def _harbor_python() -> Path:
    """The venv's interpreter, built once (`agentrl.train.megatron.venv.build`: scratch folder,
    renamed into place when complete)."""
    from agentrl.train.megatron import venv as venvs

    base = venvs.find_python312()
    if base is None:
        pytest.skip("no Python >= 3.12 found (python3.12 on PATH or under pyenv): harbor 0.25 needs it")
    target = venvs.cache_dir() / f"harbor-venv-{HARBOR_REQUIREMENT.split('==')[1]}"
    try:
        return venvs.build(target, [[HARBOR_REQUIREMENT]], base=base, pip_timeout=900)
    except venvs.VenvError as exc:
        if _NO_REGISTRY.search(str(exc)):
            pytest.skip(f"pip cannot reach a registry with {HARBOR_REQUIREMENT}: {str(exc)[-500:]}")
        raise AssertionError(str(exc)) from None


# --- Generated replies ----------------------------------------------------------------------------

_WORDS = [
    "ls",
    "the",
    "file",
    "config",
    "{braces}",
    'say "hi"',
    "back\\slash",
    "ünïcödé",
    "中文",
    "🙂",
    "$HOME",
]
_KEYS = [
    "ls -la\n",
    "cd /app\n",
    "cat file.txt",
    "",
    "C-c",
    "C-d",
    "echo '{\"a\": 1}' > x.json\n",
    'python3 -c "print(1)"\n',
    "vim notes.txt\n",
    ":wq\n",
    "printf 'a\\tb\\n'\n",
    "echo }\n",
    "echo {\n",
    'grep -r "plan": .\n',
    "\n",
    "   \n",
]
_DURATIONS: list[Any] = [
    0.1,
    1,
    1.0,
    5,
    30,
    59.9,
    60,
    61,
    120,
    1e9,
    0,
    -1,
    False,
    True,
    "1",
    "0.5",
    None,
    [1],
    {},
]
_COMPLETE: list[Any] = [
    True,
    False,
    "true",
    "True",
    "TRUE",
    " true",
    "true ",
    "yes",
    "1",
    "no",
    "false",
    1,
    0,
    None,
    [],
    [1],
    {},
]
_PROSE_BEFORE = [
    "Sure! Here is the next step:\n",
    "```json\n",
    "Let me check the files first.\n\n```json\n",
    'I will run "ls" now.\n',
    "The brace } is closed.\n",
    "Thinking: {not json}\n",
    "<think>I should list files</think>\n",
    "He said \"it's fine\n",
    "Path is C:\\new\\dir\n",
]
_PROSE_AFTER = [
    "\n```",
    "\n```\nLet me know.",
    "\nDone.",
    '\n{"note": "second object"}',
    "\nNext I will check {x}.",
    ' and a trailing quote "',
    "\n}",
]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 6)))


def _command(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.04:
        return rng.choice(["ls\n", 3, None, ["ls"]])
    cmd: dict[str, Any] = {}
    if rng.random() < 0.95:
        cmd["keystrokes"] = rng.choice(_KEYS) if rng.random() < 0.95 else rng.choice([1, None, ["ls"]])
    if rng.random() < 0.75:
        cmd["duration"] = rng.choice(_DURATIONS) if rng.random() < 0.6 else round(rng.uniform(0, 20), 2)
    if rng.random() < 0.08:
        cmd[rng.choice(["timeout", "wait", "note", "block"])] = 1
    if rng.random() < 0.03:
        cmd["cwd"] = "/app"
    if rng.random() < 0.004:
        cmd["ERROR: oops"] = 1
    if rng.random() < 0.2:
        items = list(cmd.items())
        rng.shuffle(items)
        cmd = dict(items)
    return cmd


def _reply_object(rng: random.Random) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    if rng.random() < 0.95:
        obj["analysis"] = _text(rng) if rng.random() < 0.96 else rng.choice([1, ["a"], None, {}])
    if rng.random() < 0.95:
        obj["plan"] = _text(rng) if rng.random() < 0.96 else rng.choice([2, ["p"], None])
    if rng.random() < 0.95:
        if rng.random() < 0.94:
            obj["commands"] = [_command(rng) for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 5]))]
        else:
            obj["commands"] = rng.choice(["ls\n", {"keystrokes": "ls\n"}, 5, None])
    if rng.random() < 0.5:
        obj["task_complete"] = rng.choice(_COMPLETE)
    if rng.random() < 0.05:
        obj["notes"] = "extra top-level field"
    if rng.random() < 0.15:
        items = list(obj.items())
        rng.shuffle(items)
        obj = dict(items)
    return obj


def _serialize(rng: random.Random, obj: dict[str, Any]) -> str:
    style = rng.random()
    if style < 0.4:
        return json.dumps(obj, ensure_ascii=rng.random() < 0.3)
    if style < 0.7:
        return json.dumps(obj, indent=rng.choice([2, 4]), ensure_ascii=False)
    if style < 0.8:
        return json.dumps(obj, separators=(",", ":"))
    if style < 0.9:
        return json.dumps(obj, indent="\t").replace("\n", "\r\n")
    return json.dumps(obj, separators=(" , ", " : "), indent=1)


def _break(rng: random.Random, text: str) -> str:
    how = rng.randrange(9)
    if how == 0:  # cut off mid-reply (an output limit)
        return text[: rng.randint(1, max(1, len(text) - 1))]
    if how == 1:  # cut right before the final braces
        return text.rstrip().rstrip("}")
    if how == 2:
        return re.sub(r"\]\s*([,}])", r"],\1", text, count=1)  # trailing comma
    if how == 3:
        return text.replace('"', "'")
    if how == 4:
        return text.replace("true", "True").replace("false", "False")
    if how == 5:
        return text.replace("\\n", "\n", 1)  # a raw newline inside a string
    if how == 6:
        return text.replace(",", "", 1)
    if how == 7:
        return text.replace("}", "", 1)
    return text + "}"


def _reply(rng: random.Random) -> str:
    text = _serialize(rng, _reply_object(rng))
    roll = rng.random()
    if roll < 0.25:
        text = _break(rng, text)
    if rng.random() < 0.08:  # several objects
        text += rng.choice(["\n", "\n\n", " "]) + _serialize(rng, _reply_object(rng))
    if rng.random() < 0.3:
        text = rng.choice(_PROSE_BEFORE) + text
    if rng.random() < 0.3:
        text += rng.choice(_PROSE_AFTER)
    if rng.random() < 0.03:
        text = rng.choice(["", "I am done.", "```bash\nls\n```", "{", "}", "{}", '{"commands": []}', "null"])
    if rng.random() < 0.02:
        big = rng.choice([str(10**400), "1e400", "-1e400", "NaN", "Infinity", "9" * 5000])
        text = '{"analysis": "", "plan": "", "commands": [{"keystrokes": "ls\\n", "duration": ' + big + "}]}"
    return text


def _terminal_output(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.6:
        return "New Terminal Output:\n" + "\n".join(
            f"root@box:/app# {rng.choice(_KEYS).strip()}" for _ in range(3)
        )
    if roll < 0.7:
        return "Current Terminal Screen:\n"
    unit = rng.choice(["x", "é", "中", "🙂", "ab\n", "ünï\n"])
    size = rng.choice([9_999, 10_000, 10_001, 10_003, 12_345, 40_000])
    body = (unit * size)[: size // len(unit.encode())]
    return "New Terminal Output:\n" + body


_COMPLETE_NOW = json.dumps({"analysis": "", "plan": "", "commands": [], "task_complete": True})


def _cases(n: int, seed: int = 19) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        case: dict[str, Any] = {"id": i, "reply": _reply(rng), "terminal_output": _terminal_output(rng)}
        roll = rng.random()
        if roll < 0.12:
            case["mode"], case["before"] = "reply", [_COMPLETE_NOW]  # a completion is pending
        elif roll < 0.2:
            case["mode"], case["output_limit"] = "length", rng.choice([None, 4096])
        else:
            case["mode"] = "reply"
        cases.append(case)
    return cases


def _incremental_cases(start: int) -> list[dict[str, Any]]:
    screen = "root@box:/app# "
    pairs = [
        (None, "a\nb\n", screen),
        ("root@box:/app# ", "root@box:/app# ls\nfile\nroot@box:/app# ", screen),
        ("line1\nroot@box:/app# ", "line1\nroot@box:/app# ls\nfile\nroot@box:/app# ", screen),
        ("  x\ny  \n\n", "  x\ny\nz\n", screen),
        ("gone\n", "something else\n", screen),
        ("same\n", "same\n", screen),
        ("same\n\n", "same\n   \n", screen),
        ("", "", screen),
        ("", "anything\n", screen),
        ("a\nb", "zz\na\nb\nc", screen),
        ("中文\n🙂", "中文\n🙂 next\n", screen),
    ]
    return [
        {"id": start + k, "mode": "incremental", "previous": p, "current": c, "screen": s}
        for k, (p, c, s) in enumerate(pairs)
    ]


# --- Comparison -----------------------------------------------------------------------------------


def _kind_of_harbor_error(error: str) -> str | None:
    prefixes = {
        "No valid JSON found": TerminusErrorKind.NO_JSON,
        "Invalid JSON": TerminusErrorKind.INVALID_JSON,
        "Missing required fields": TerminusErrorKind.MISSING_FIELDS,
        "Field 'commands' must be an array": TerminusErrorKind.COMMANDS_NOT_ARRAY,
        "Command ": TerminusErrorKind.BAD_COMMAND,
    }
    if not error:
        return None
    return next((str(kind) for prefix, kind in prefixes.items() if error.startswith(prefix)), "unknown")


def _unordered_unknown_fields(text: str | None) -> str | None:
    """Harbor lists a command's unknown keys from a set, so their order varies with the hash seed."""
    if text is None:
        return None
    return re.sub(
        r"(Command \d+: Unknown fields: )([^\n]*)",
        lambda m: m.group(1) + ", ".join(sorted(m.group(2).split(", "))),
        text,
    )


def _same_duration(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@dataclass
class Outcome:
    kind: str | None  # error kind; "harbor_crash" when Harbor raised
    sent: list[tuple[str, float]]
    ended: bool
    warnings: str | None  # the parser's warning string, "- a\n- b"
    next_prompt: str | None


def _harbor_outcome(case: dict[str, Any], result: dict[str, Any]) -> Outcome:
    if case["mode"] == "length":  # the parse only contributes warnings to the prompt (crash or not)
        return Outcome(None, result["sent"], result.get("ended", False), None, result["next_prompt"])
    if "parse_crash" in result or "loop_crash" in result:
        return Outcome(TerminusErrorKind.HARBOR_CRASH, [], False, None, None)
    parse = result["parse"]
    kind = _kind_of_harbor_error(parse["error"])
    if kind is None and "ERROR:" in parse["warning"]:
        kind = TerminusErrorKind.WARNING_SAYS_ERROR
    return Outcome(
        kind,
        [(k, d) for k, d in result["sent"]],
        result["ended"],
        parse["warning"],
        result["next_prompt"],
    )


def _our_outcome(case: dict[str, Any]) -> Outcome:
    """One turn of the agentrl loop as it should use the format."""
    fmt = TerminusJSONFormat()
    if case["mode"] == "length":
        prompt = fmt.length_exceeded_observation(case["reply"], case.get("output_limit"))
        return Outcome(None, [], False, None, prompt)
    action = fmt.parse(case["reply"])
    if action.error_kind == TerminusErrorKind.HARBOR_CRASH:
        return Outcome(action.error_kind, [], False, None, None)
    warnings = "\n".join(f"- {w}" for w in action.warnings)
    pending = bool(case.get("before"))
    sent = [] if action.malformed else [(c.keystrokes, c.duration) for c in action.commands]
    ended = not action.malformed and action.task_complete and pending
    prompt = None if ended else fmt.observation(action, case["terminal_output"], pending_completion=pending)
    return Outcome(action.error_kind, sent, ended, warnings, prompt)


def _differences(ours: Outcome, theirs: Outcome) -> list[str]:
    diffs = []
    if ours.kind != theirs.kind:
        diffs.append("error kind")
    if ours.kind == TerminusErrorKind.HARBOR_CRASH or theirs.kind == TerminusErrorKind.HARBOR_CRASH:
        return diffs
    same_sent = len(ours.sent) == len(theirs.sent) and all(
        a[0] == b[0] and _same_duration(a[1], b[1]) for a, b in zip(ours.sent, theirs.sent, strict=True)
    )
    if not same_sent:
        diffs.append("commands")
    if ours.ended != theirs.ended:
        diffs.append("completion")
    if _unordered_unknown_fields(ours.warnings) != _unordered_unknown_fields(theirs.warnings):
        diffs.append("warnings")
    if _unordered_unknown_fields(ours.next_prompt) != _unordered_unknown_fields(theirs.next_prompt):
        diffs.append("next prompt")
    return diffs


@pytest.fixture(scope="module")
def harbor_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    python = _harbor_python()
    cases = _cases(N_REPLIES) + _incremental_cases(N_REPLIES)
    driver = tmp_path_factory.mktemp("harbor") / "driver.py"
    driver.write_text(DRIVER)
    proc = subprocess.run(
        [str(python), str(driver), HARBOR_REQUIREMENT.split("==")[1]],
        input="".join(json.dumps(c) + "\n" for c in cases),
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["id"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert len(results) == len(cases), f"the driver answered {len(results)} of {len(cases)} cases"
    return cases, results


def test_terminus_json_agrees_with_harbor_on_generated_replies(
    harbor_run: tuple[list[dict[str, Any]], dict[int, dict[str, Any]]],
) -> None:
    cases, results = harbor_run
    replies = [c for c in cases if c["mode"] != "incremental"]
    assert len(replies) >= 1500
    mismatches: list[tuple[dict[str, Any], list[str], Outcome, Outcome]] = []
    by_field: dict[str, int] = {}
    for case in replies:
        theirs = _harbor_outcome(case, results[case["id"]])
        ours = _our_outcome(case)
        diffs = _differences(ours, theirs)
        for d in diffs:
            by_field[d] = by_field.get(d, 0) + 1
        if diffs:
            mismatches.append((case, diffs, ours, theirs))
    kinds: dict[str, int] = {}
    for case in replies:
        k = (
            "output too long"
            if case["mode"] == "length"
            else str(_harbor_outcome(case, results[case["id"]]).kind)
        )
        kinds[k] = kinds.get(k, 0) + 1
    rate = len(mismatches) / len(replies)
    print(f"\n{len(replies)} replies, by Harbor's outcome (None: no error): {kinds}")
    print(f"mismatch rate {rate:.2%} ({len(mismatches)}), by field: {by_field}")
    for case, diffs, ours, theirs in mismatches[:8]:
        print(f"--- case {case['id']} ({case['mode']}): {diffs}\nreply: {case['reply'][:300]!r}")
        print(f"ours:   {ours}\nharbor: {theirs}"[:2000])
    assert 1 - rate >= MIN_AGREEMENT, f"agreement {1 - rate:.2%} < {MIN_AGREEMENT:.0%}"


def test_incremental_terminal_output_agrees_with_harbor(
    harbor_run: tuple[list[dict[str, Any]], dict[int, dict[str, Any]]],
) -> None:
    cases, results = harbor_run
    for case in (c for c in cases if c["mode"] == "incremental"):
        ours = incremental_terminal_output(case["previous"], case["current"], case["screen"])
        assert ours == results[case["id"]]["text"], case
