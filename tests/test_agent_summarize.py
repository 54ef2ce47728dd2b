"""Terminus-2's context summarisation in the agent loop, against Harbor's rules (Harbor 0.25
`terminus_2.py`; `../shared/reference/harbor.md` 4.9): a small context forces a proactive and a
reactive summary, and every model call's conversation is read back from the tokens it was sent."""

from __future__ import annotations

import re

import pytest

from agentrl.agent import summarize as S
from agentrl.agent.actions import TerminusJSONFormat
from agentrl.agent.loop import AgentConfig, EndReason, run_agent
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.record import Recorder, read_record
from tests.chat_tokenizer import byte_tokenizer
from tests.test_agent_terminal import LineTerminal, TerminalSandbox, reply

INSTRUCTION = "Count the files."
_ROLE = re.compile(r"<\|(system|user|assistant|observation)\|>\n")


def conversation(text: str) -> list[tuple[str, str]]:
    """The messages a byte-tokenizer prompt spells (the open generation prompt dropped)."""
    parts = _ROLE.split(text)[1:]
    out = [
        (role, body.removesuffix("<|endoftext|>")) for role, body in zip(parts[::2], parts[1::2], strict=True)
    ]
    assert out[-1] == ("assistant", "")
    return out[:-1]


class Model:
    """Answers summarisation calls by what they ask, and terminal turns from `turns`; keeps
    every call's conversation."""

    def __init__(self, turns: list[str]) -> None:
        self.turns = list(turns)
        self.calls: list[tuple[str, list[tuple[str, str]]]] = []
        self.tok = byte_tokenizer()

    def __call__(self, session_id: str | None, k: int, input_ids: list[int]) -> str:
        messages = conversation(self.tok.decode(input_ids))
        last = messages[-1][1]
        for kind, marker, answer in (
            ("summary", "You are about to hand off your work", "SUMMARY-TEXT"),
            ("questions", "You are picking up work from a previous AI agent", "QUESTIONS-TEXT"),
            ("answers", "The next agent has a few questions for you", "ANSWERS-TEXT"),
            ("short", "Briefly continue this task:", "SHORT-TEXT"),
        ):
            if last.startswith(marker):
                self.calls.append((kind, messages))
                return answer
        self.calls.append(("turn", messages))
        return self.turns.pop(0)


async def _run(model: Model, terminal: LineTerminal, **config: object):  # type: ignore[no-untyped-def]
    tok = model.tok
    return await run_agent(
        engine=ScriptedEngine(model, tok),
        sandbox=TerminalSandbox(terminal),  # type: ignore[arg-type]
        renderer=ChatRenderer(tok),
        action_format=TerminusJSONFormat(),
        instruction=INSTRUCTION,
        config=AgentConfig(**{"max_turns": 8, "max_new_tokens": 1024, "summarize": True, **config}),
        sampling=SamplingParams(max_new_tokens=1024),
        session_id="s",
    )


def _tokens(model: Model, messages: list[tuple[str, str]]) -> int:
    renderer = ChatRenderer(model.tok)
    return len(renderer.encode(renderer.render([{"role": r, "content": c} for r, c in messages], False)))


def _ls(n: int) -> str:
    return reply([{"keystrokes": f"ls{n}\n", "duration": 0.0}])


def _terminal(chars: int) -> LineTerminal:
    return LineTerminal({f"ls{i}": f"out{i} " + "x" * chars for i in range(8)})


async def test_a_proactive_summary_replaces_the_history_and_the_pending_prompt_as_terminus_2_does() -> None:
    done = reply([], complete=True)
    model = Model([_ls(0), _ls(1), _ls(2), done, done])
    # Context 7000; a summary once fewer than 4000 tokens are free (the pending prompt not counted).
    run = await _run(model, _terminal(1200), max_total_tokens=7000, summarize_threshold=4000)
    assert run.end_reason is EndReason.TASK_COMPLETE
    kinds = [k for k, _ in model.calls]
    i = kinds.index("summary")  # before turn i, once the history has grown past 3000 tokens
    assert (
        i >= 2
        and kinds[:i] == ["turn"] * i
        and kinds[i : i + 4] == ["summary", "questions", "answers", "turn"]
    )
    first = model.calls[0][1]
    assert len(first) == 1 and first[0][0] == "user"  # Terminus-2's first prompt, no system message
    history = model.calls[i - 1][1] + [("assistant", _ls(i - 1))]  # turn i-1's prompt and reply
    # Harbor's rule: the history, the pending prompt not counted, left fewer than 4000 free.
    assert 7000 - _tokens(model, history) < 4000 <= 7000 - _tokens(model, model.calls[i - 1][1][:-1])
    # 1. The summary call: the whole history (the pending observation not in it), then the ask.
    summary_call = model.calls[i][1]
    assert summary_call[:-1] == history
    assert summary_call[-1] == ("user", S.SUMMARY_PROMPT.format(instruction=INSTRUCTION))
    # 2. The questions call: a fresh conversation with the summary and the visible screen.
    ((role, questions_prompt),) = model.calls[i + 1][1]
    assert role == "user" and questions_prompt.startswith("You are picking up work from a previous AI agent")
    assert (
        "**Summary from Previous Agent:**\nSUMMARY-TEXT\n\n**Current Terminal Screen:**\n" in questions_prompt
    )
    screen = questions_prompt.split("**Current Terminal Screen:**\n")[1].split("\n\nPlease begin")[0]
    assert f"out{i - 1} " in screen and screen.count("\n") <= 5  # the visible pane, not the scrollback
    # 3. The answers call: the history, the summary exchange, then the questions.
    assert model.calls[i + 2][1] == history + [
        ("user", S.SUMMARY_PROMPT.format(instruction=INSTRUCTION)),
        ("assistant", "SUMMARY-TEXT"),
        ("user", S.ANSWERS_PREFACE + "QUESTIONS-TEXT"),
    ]
    # The next turn: first message, questions prompt, questions, the handoff (no pending observation).
    assert model.calls[i + 3][1] == [
        first[0],
        ("user", questions_prompt),
        ("assistant", "QUESTIONS-TEXT"),
        ("user", S.HANDOFF_PREFACE + "ANSWERS-TEXT" + S.HANDOFF_SUFFIX),
    ]
    summary = run.summaries[0]
    assert (summary.trigger, summary.kind, summary.before_turn, summary.index) == ("proactive", "full", i, 1)
    assert [c.name for c in summary.calls] == ["summary", "questions", "answers"]
    assert all(c.prompt_tokens > 0 and c.output_tokens > 0 for c in summary.calls)
    # Training: one sample per stretch between summaries; the calls are not trained on.
    assert len(run.segments) == len(run.summaries) + 1
    assert sum(sum(s.loss_mask) for s in run.segments) == sum(
        len(model.tok.encode(t.model_text))
        for t in run.turns  # each reply and its eos
    )


async def test_the_summary_calls_are_trained_on_only_when_asked() -> None:
    done = reply([], complete=True)
    model = Model([_ls(0), _ls(1), _ls(2), done, done])
    run = await _run(
        model, _terminal(1200), max_total_tokens=7000, summarize_threshold=4000, train_on_summaries=True
    )
    n = len(run.summaries)
    assert n >= 1 and len(run.segments) == (n + 1) + 3 * n  # the turns' stretches, then the calls
    tail = run.segments[n + 1 :]
    assert [model.tok.decode(s.response_ids) for s in tail] == n * [
        f"{t}<|endoftext|>" for t in ("SUMMARY-TEXT", "QUESTIONS-TEXT", "ANSWERS-TEXT")
    ]
    assert all(set(s.loss_mask) == {1} for s in tail)


async def test_an_overflowing_prompt_unwinds_to_4000_free_then_summarises() -> None:
    done = reply([], complete=True)
    model = Model([_ls(0), _ls(1), _ls(2), _ls(3), done, done])
    # No proactive summary (threshold 0): turn 4's prompt no longer leaves room for a reply.
    run = await _run(model, _terminal(1500), max_total_tokens=6500, summarize_threshold=0)
    assert run.end_reason is EndReason.TASK_COMPLETE
    kinds = [k for k, _ in model.calls]
    assert kinds[kinds.index("summary") :][:4] == ["summary", "questions", "answers", "turn"]
    summary = run.summaries[0]
    assert summary.trigger == "reactive" and summary.kind == "full" and summary.dropped_messages % 2 == 0
    assert summary.dropped_messages > 0
    summary_call = model.calls[kinds.index("summary")][1][:-1]
    assert 6500 - _tokens(model, summary_call) >= S.UNWIND_TARGET_FREE  # unwound until 4000 were free
    assert len(summary_call) % 2 == 0 and summary_call[0] == model.calls[0][1][0]


async def test_without_summaries_the_episode_ends_at_the_budget() -> None:
    model = Model([_ls(0), _ls(1), _ls(2), _ls(3)])
    run = await _run(model, _terminal(1500), max_total_tokens=6500, summarize=False)
    assert run.end_reason is EndReason.TOKEN_BUDGET and run.summaries == []


# --- the fallbacks, on the summariser itself ------------------------------------------------------


def _summarizer(fits: set[str], screen: str = "S" * 1500) -> tuple[S.Summarizer, list[str]]:
    asked: list[str] = []

    async def call(name: str, messages: S.Messages) -> tuple[str, S.SubCall]:
        asked.append(name)
        if name not in fits:
            raise S.ContextFull(name)
        return f"<{name}>", S.SubCall(name, 10, 2)

    async def pane() -> str:
        return screen

    summarizer = S.Summarizer(
        instruction="do it",
        limit=10_000,
        threshold=0,
        call=call,
        count=lambda messages: sum(len(m["content"]) for m in messages),
        screen=pane,
    )
    return summarizer, asked


HISTORY = [
    {"role": "user", "content": "first"},
    {"role": "assistant", "content": "a" * 3000},
    {"role": "user", "content": "o" * 3000},
    {"role": "assistant", "content": "b" * 100},
]


async def test_a_summary_that_does_not_fit_falls_back_to_a_short_one_then_to_the_screen() -> None:
    summarizer, asked = _summarizer({"short"})
    new = await summarizer.reactive([], HISTORY, 4)
    assert asked == ["summary", "short"]
    # unwound by pairs until 4000 of 10000 are free: [first, a*3000] (3005 used)
    assert new == HISTORY[:2] + [{"role": "user", "content": "do it\n\nSummary: <short>"}]
    (summary,) = summarizer.summaries
    assert (summary.kind, summary.dropped_messages, summary.index) == ("short", 2, 1)  # a failed full counts

    summarizer, asked = _summarizer(set(), screen="0123456789" * 150)
    new = await summarizer.reactive([], HISTORY, 4)
    assert asked == ["summary", "short"]
    assert new[-1] == {"role": "user", "content": "do it\n\nCurrent state: " + ("0123456789" * 150)[-1000:]}
    assert summarizer.summaries[0].kind == "state"


async def test_an_empty_history_hands_over_the_instruction_without_a_call() -> None:
    summarizer, asked = _summarizer({"summary", "questions", "answers"})
    head = [{"role": "system", "content": "sys"}]
    assert await summarizer.proactive(head, [], 0) == head + [{"role": "user", "content": "do it"}]
    assert asked == [] and summarizer.count == 0 and summarizer.summaries[0].kind == "instruction"


async def test_a_proactive_summary_that_does_not_fit_keeps_the_conversation() -> None:
    summarizer, asked = _summarizer(set())
    assert await summarizer.proactive([], HISTORY, 2) is None
    assert asked == ["summary"] and summarizer.summaries == [] and summarizer.count == 1


def test_summaries_are_recorded_before_the_turn_they_replaced(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rec = Recorder(tmp_path / "r.jsonl")
    rec.write("header", {"task_id": "t"})
    rec.write("summary", S.Summary("reactive", "short", 3, 1, 2, "p", [S.SubCall("short", 5, 1)]).to_dict())
    rec.write("turn", {"index": 3})
    rec.close()
    record = read_record(tmp_path / "r.jsonl")
    assert record.summaries == [
        {
            "trigger": "reactive",
            "kind": "short",
            "before_turn": 3,
            "index": 1,
            "dropped_messages": 2,
            "prompt": "p",
            "calls": [
                {
                    "name": "short",
                    "prompt_tokens": 5,
                    "output_tokens": 1,
                    "prompt": "",
                    "reply": "",
                    "copied": 0,
                }
            ],
        }
    ]


@pytest.mark.parametrize("prompt", [S.SUMMARY_PROMPT, S.QUESTIONS_PROMPT, S.SHORT_PROMPT])
def test_the_prompts_have_harbors_placeholders_only(prompt: str) -> None:
    names = set(re.findall(r"{(\w+)}", prompt))
    assert names <= {"instruction", "summary", "screen"} and "instruction" in names


async def test_the_unwinding_counts_a_system_message_once() -> None:
    head = [{"role": "system", "content": "s" * 2000}]

    async def call(name: str, messages: S.Messages) -> tuple[str, S.SubCall]:
        return f"<{name}>", S.SubCall(name, 1, 1)

    async def pane() -> str:
        return ""

    summarizer = S.Summarizer(
        instruction="do it",
        limit=10_000,
        threshold=0,
        call=call,
        # as the agent loop wires it: the count of a history includes what precedes it
        count=lambda messages: sum(len(m["content"]) for m in head + messages),
        screen=pane,
    )
    await summarizer.reactive(head, HISTORY, 4)
    # 2000 + 6105 leaves 1895 free: one pair goes; 2000 + 3005 leaves 4995 (>= 4000)
    assert summarizer.summaries[0].dropped_messages == 2 and summarizer.summaries[0].kind == "full"
