"""Answer extraction from a model's response, as the DAPO recipe reads it.

DAPO's prompt asks for a last line `Answer: $Answer`; its reference scorer (verl's
`reward_score/math_dapo.py`) looks only at the last 300 characters of a response and takes the last
`Answer:` line there. Models trained on other data write `\\boxed{...}` instead, so when no `Answer:`
line exists the last `\\boxed{}` counts; a boxed expression on the `Answer:` line is unwrapped.
Extraction only finds the answer text: whether it equals the ground truth is for `math-verify`
(`envs.dapo_math.verify`), not for hand-written normalisation here.
"""

from __future__ import annotations

import re

# The reference scorer's window: "The longest answer in MATH-500 has 159 characters".
ANSWER_WINDOW_CHARS = 300

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_BOXED = ("\\boxed{", "\\fbox{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, or None."""
    start = max(text.rfind(tag) for tag in _BOXED)
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced: the response was cut inside the box


def _strip_math_delimiters(text: str) -> str:
    text = text.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            return text[len(left) : -len(right)].strip()
    return text


def extract_answer(response: str, *, window: int | None = ANSWER_WINDOW_CHARS) -> str | None:
    """The answer a response gives: its last `Answer:` line (a `\\boxed{}` on it unwrapped), else its
    last `\\boxed{}`; None when it gives neither. Only the last `window` characters are read."""
    text = response[-window:] if window else response
    lines = _ANSWER_LINE.findall(text)
    if lines:
        line = lines[-1].strip()
        boxed = last_boxed(line)
        answer = boxed if boxed is not None else _strip_math_delimiters(line)
        answer = answer.rstrip(" .")
        return answer or None
    boxed = last_boxed(text)
    return boxed or None
