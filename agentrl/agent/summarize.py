"""Terminus-2's context summarisation (Harbor 0.25 `terminus_2.py`: `_summarize`,
`_check_proactive_summarization`, `_unwind_messages_to_free_tokens` and the context-overflow branch
of `_query_llm`), so that long episodes run, are scored and are trained on the way Harbor runs them.

- **Proactive**, before a turn: when the context limit minus the history's tokens (the pending
  prompt not counted) falls under `threshold` (8000), a full summary's handoff prompt replaces
  the pending prompt.
- **Reactive**, when the next prompt no longer fits: drop the newest user/assistant pairs until
  4000 tokens are free, then a full summary; failing that, a one-call short summary; failing that,
  the instruction and the last 1000 characters of the screen. The result is the next prompt.
- **A full summary** is three calls of the same model, none of which touches the history until
  the end: a summary (over the history), questions (a fresh conversation that sees the summary and
  the screen), answers (the history, the summary exchange and the questions). The history becomes
  the first message, the questions prompt and the questions; the handoff prompt carries the
  answers.

The prompt texts are Harbor's, character for character (a model trained here meets the same
handoff under Harbor). What differs, and why: a sub-call whose prompt does not fit the context
counts as the overflow Harbor's API would have raised (the same fallbacks follow); an engine failure
in a sub-call is infrastructure (never swallowed into a fallback, which would score it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

PROACTIVE_THRESHOLD = 8000
UNWIND_TARGET_FREE = 4000
SCREEN_TAIL_CHARS = 1000

SUMMARY_PROMPT = (
    "You are about to hand off your work to another AI agent.\n"
    "            Please provide a comprehensive summary of what you have\n"
    "            accomplished so far on this task:\n\n"
    "Original Task: {instruction}\n\n"
    "Based on the conversation history, please provide a detailed summary covering:\n"
    "1. **Major Actions Completed** - List each significant command you executed\n"
    "            and what you learned from it.\n"
    "2. **Important Information Learned** - A summary of crucial findings, file\n"
    "            locations, configurations, error messages, or system state discovered.\n"
    "3. **Challenging Problems Addressed** - Any significant issues you\n"
    "            encountered and how you resolved them.\n"
    "4. **Current Status** - Exactly where you are in the task completion process.\n\n\n"
    "Be comprehensive and detailed. The next agent needs to understand everything\n"
    "            that has happened so far in order to continue."
)
QUESTIONS_PROMPT = (
    "You are picking up work from a previous AI agent on this task:\n\n"
    "**Original Task:** {instruction}\n\n"
    "**Summary from Previous Agent:**\n{summary}\n\n"
    "**Current Terminal Screen:**\n{screen}\n\n"
    "Please begin by asking several questions (at least five, more if necessary)\n"
    "about the current state of the solution that are not answered in the summary\n"
    "from the prior agent. After you ask these questions you will be on your own,\n"
    "so ask everything you need to know."
)
ANSWERS_PREFACE = (
    "The next agent has a few questions for you, please answer each of them one by one in detail:\n\n"
)
HANDOFF_PREFACE = "Here are the answers the other agent provided.\n\n"
HANDOFF_SUFFIX = (
    "\n\nContinue working on this task from where the previous agent left off. You can no longer "
    "ask questions. Please follow the spec to interact with the terminal."
)
SHORT_PROMPT = (
    "Briefly continue this task: {instruction}\n\nCurrent state: {screen}\n\nNext steps (2-3 sentences):"
)
SHORT_HANDOFF = "{instruction}\n\nSummary: {reply}"
STATE_HANDOFF = "{instruction}\n\nCurrent state: {screen}"

Messages = list[dict[str, str]]


class ContextFull(Exception):
    """A prompt does not fit the context: what Harbor's API answers with a context-length error."""


@dataclass
class SubCall:
    """One summarisation call: its name, its token counts and, on the token path, its segment."""

    name: str  # summary | questions | answers | short
    prompt_tokens: int
    output_tokens: int
    segment: Any = None  # agentrl.agent.tokens.Segment (None for API models)
    prompt: str = ""  # the call's own last message (what it asked)
    reply: str = ""
    copied: int = 0  # messages of the agent's history it was sent before its prompt


@dataclass
class Summary:
    """What one summarisation did; the episode record keeps one per summarisation."""

    trigger: str  # proactive | reactive
    kind: str  # full (three calls) | short (fallback 1) | state (fallback 2) | instruction (empty history)
    before_turn: int  # the turn whose prompt it replaced
    index: int | None  # Harbor's summarization_count after it (full summaries count, even failed ones)
    dropped_messages: int  # reactive: messages unwound before summarising
    prompt: str  # the prompt that replaced the history's tail
    calls: list[SubCall] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "trigger": self.trigger,
            "kind": self.kind,
            "before_turn": self.before_turn,
            "index": self.index,
            "dropped_messages": self.dropped_messages,
            "prompt": self.prompt,
            "calls": [
                {
                    "name": c.name,
                    "prompt_tokens": c.prompt_tokens,
                    "output_tokens": c.output_tokens,
                    "prompt": c.prompt,
                    "reply": c.reply,
                    "copied": c.copied,
                }
                for c in self.calls
            ],
        }


class Summarizer:
    """Terminus-2's summarisation state for one episode.

    `call(name, messages)` runs one sub-call and returns `(reply_text, SubCall)`, raising
    `ContextFull` when `messages` do not fit; `count(messages)` is the tokens of a history (with
    whatever precedes it, a system message, counted by the caller); `screen()` is the terminal's
    visible pane."""

    def __init__(
        self,
        *,
        instruction: str,
        limit: int,
        threshold: int,
        call: Callable[[str, Messages], Awaitable[tuple[str, SubCall]]],
        count: Callable[[Messages], int],
        screen: Callable[[], Awaitable[str]],
    ) -> None:
        self.instruction = instruction
        self.limit = limit
        self.threshold = threshold
        self._ask = call
        self._count = count
        self._screen = screen
        self.count = 0  # Harbor's summarization_count
        self.summaries: list[Summary] = []

    async def _call(self, name: str, messages: Messages) -> tuple[str, SubCall]:
        """One sub-call, with what it asked and answered kept for the records (Harbor writes each
        as a trajectory of its own)."""
        text, sub = await self._ask(name, messages)
        sub.prompt, sub.reply, sub.copied = str(messages[-1]["content"]), text, len(messages) - 1
        return text, sub

    def wants_proactive(self, history: Messages) -> bool:
        return self.limit - self._count(history) < self.threshold

    async def proactive(self, head: Messages, history: Messages, before_turn: int) -> Messages | None:
        """The new conversation (head, the replaced history, the handoff prompt), or None when the
        summary could not be made (Harbor logs it and goes on with the pending prompt)."""
        summary = Summary("proactive", "full", before_turn, None, 0, "")
        try:
            replaced, prompt = await self._summarize(history, summary)
        except ContextFull:
            return None
        summary.index, summary.prompt = self.count, prompt
        self.summaries.append(summary)
        return head + replaced + [{"role": "user", "content": prompt}]

    async def reactive(self, head: Messages, history: Messages, before_turn: int) -> Messages:
        """The conversation to go on with once the next prompt does not fit."""
        kept = list(history)
        while len(kept) >= 2 and self.limit - self._count(kept) < UNWIND_TARGET_FREE:
            kept = kept[:-2]
        summary = Summary("reactive", "full", before_turn, None, len(history) - len(kept), "")
        replaced: Messages
        try:
            replaced, prompt = await self._summarize(kept, summary)
        except ContextFull:
            replaced = kept
            screen = (await self._screen())[-SCREEN_TAIL_CHARS:]
            try:
                text, sub = await self._call(
                    "short",
                    [
                        {
                            "role": "user",
                            "content": SHORT_PROMPT.format(instruction=self.instruction, screen=screen),
                        }
                    ],
                )
                summary.calls.append(sub)
                summary.kind, prompt = "short", SHORT_HANDOFF.format(instruction=self.instruction, reply=text)
            except ContextFull:
                summary.kind, prompt = (
                    "state",
                    STATE_HANDOFF.format(instruction=self.instruction, screen=screen),
                )
        summary.index, summary.prompt = self.count, prompt
        self.summaries.append(summary)
        return head + replaced + [{"role": "user", "content": prompt}]

    async def _summarize(self, history: Messages, summary: Summary) -> tuple[Messages, str]:
        """The replaced history and the handoff prompt (Harbor's `_summarize`)."""
        if not history:  # an empty chat: the instruction, no calls, not counted
            summary.kind = "instruction"
            return [], self.instruction
        self.count += 1
        asked = SUMMARY_PROMPT.format(instruction=self.instruction)
        text, sub = await self._call("summary", history + [{"role": "user", "content": asked}])
        summary.calls.append(sub)
        screen = await self._screen()
        questions_prompt = QUESTIONS_PROMPT.format(instruction=self.instruction, summary=text, screen=screen)
        questions, sub = await self._call("questions", [{"role": "user", "content": questions_prompt}])
        summary.calls.append(sub)
        exchange = [{"role": "user", "content": asked}, {"role": "assistant", "content": text}]
        answers, sub = await self._call(
            "answers", history + exchange + [{"role": "user", "content": ANSWERS_PREFACE + questions}]
        )
        summary.calls.append(sub)
        replaced = [
            history[0],
            {"role": "user", "content": questions_prompt},
            {"role": "assistant", "content": questions},
        ]
        return replaced, HANDOFF_PREFACE + answers + HANDOFF_SUFFIX
