"""Answer extraction and equivalence for the DAPO-math environment, on hand-picked cases.

Equivalence is math-verify's (in a killable worker process); these cases pin down what the
environment rewards: fractions, LaTeX forms, units, intervals, sets and wrong-but-close answers.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("math_verify")

from envs.dapo_math.answer import extract_answer, last_boxed
from envs.dapo_math.verify import MathVerifier, VerifierUnavailable, judge

# (response, extracted answer)
EXTRACTION = [
    ("So the sum is 12.\nAnswer: 12", "12"),
    ("Answer: 3\nWait, let me redo this.\nAnswer: 5", "5"),
    ("answer:   -7  ", "-7"),
    ("Thus ANSWER : 42.", "42"),
    ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
    ("Answer: \\boxed{17}", "17"),
    ("Answer: The answer is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
    ("We get $x = 4$, so \\boxed{4}", "4"),
    ("First \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
    ("\\boxed{(1, 2]}", "(1, 2]"),
    ("\\fbox{9}", "9"),
    ("Answer: \\( 2\\pi \\)", "2\\pi"),
    ("Answer: $$10$$", "10"),
    ("no final answer here", None),
    ("Answer:", None),
    ("cut off inside \\boxed{12", None),
    ("x" * 400 + "\nAnswer: 8", "8"),
    ("Answer: 1\n" + "y" * 400, None),  # the answer line is outside the last 300 characters
]


@pytest.mark.parametrize(("response", "expected"), EXTRACTION)
def test_extraction_reads_the_last_answer_line_else_the_last_box(response: str, expected: str | None) -> None:
    assert extract_answer(response) == expected


def test_last_boxed_keeps_nested_braces() -> None:
    assert last_boxed("\\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"
    assert last_boxed("nothing") is None


# (extracted answer, ground truth, equivalent?)
EQUIVALENCE = [
    # integers and numbers
    ("34", "34", True),
    ("034", "34", True),
    ("-3", "-3", True),
    ("6.0", "6", True),
    ("1,000", "1000", True),
    ("1{,}000", "1000", True),
    ("10000000000", "10^{10}", True),
    ("12", "13", False),
    ("120", "12", False),
    ("3", "-3", False),
    # fractions
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac12", "\\frac{1}{2}", True),
    ("\\dfrac{1}{2}", "1/2", True),
    ("\\frac{3}{2}", "1.5", True),
    ("3.5", "3\\frac{1}{2}", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", True),
    ("2/1", "1/2", False),
    ("-1/2", "1/2", False),
    # LaTeX forms
    ("\\frac{\\sqrt2}{2}", "\\sqrt{2}/2", True),
    ("\\sqrt{12}", "2\\sqrt{3}", True),
    ("1+x^2", "x^2+1", True),
    ("b+a", "a+b", True),
    ("\\pi", "\\pi", True),
    ("2\\pi", "\\pi", False),
    ("\\infty", "\\infty", True),
    ("x = 3", "3", True),
    ("\\text{B}", "B", True),
    ("A", "\\text{(A)}", True),
    ("\\left(\\frac{1}{2}\\right)", "\\frac{1}{2}", True),
    # units, degrees, percent, money
    ("10\\text{ cm}", "10", True),
    ("10 cm", "10", True),
    ("5 \\text{ meters}", "5", True),
    ("90", "90^\\circ", True),
    ("90^\\circ", "90", True),
    ("0.5", "50\\%", True),
    ("10", "\\$10", True),
    ("11 \\text{ cm}", "10", False),
    # intervals and sets
    ("(1,2]", "(1,2]", True),
    ("(1,2]", "[1,2)", False),
    ("[2, 5]", "[2,5]", True),
    ("(-\\infty,3)", "(-\\infty, 3)", True),
    ("(-\\infty,3]", "(-\\infty, 3)", False),
    ("\\{2,1\\}", "\\{1,2\\}", True),
    ("2,1", "1,2", True),
    ("(2,1)", "(1,2)", False),
    # wrong but close
    ("34.999", "35", False),
    ("0.3333", "\\frac{1}{3}", False),
    ("1/3", "0.333", False),
    ("3.14159", "\\pi", False),
    ("2.718", "e", False),
    ("\\sqrt{3}", "\\sqrt{2}", False),
    ("x^2-1", "x^2+1", False),
    ("99", "100", False),
]


@pytest.mark.parametrize(("answer", "gold", "equal"), EQUIVALENCE)
def test_equivalence_is_math_verify_on_boxed_answers(answer: str, gold: str, equal: bool) -> None:
    outcome, _ = judge(answer, gold)
    assert outcome == ("correct" if equal else "wrong"), (answer, gold, outcome)


def test_at_least_fifty_hand_picked_cases() -> None:
    assert len(EXTRACTION) + len(EQUIVALENCE) >= 50 and len(EQUIVALENCE) >= 50


def test_an_answer_that_does_not_parse_is_unparsed_not_an_error() -> None:
    assert judge("}{", "1")[0] == "unparsed"
    assert judge("1", "}{")[0] == "unparsed"


# Sympy evaluates this tower exactly, in C: no signal (math-verify's own alarm included) stops it.
HANGING = "7^{7^{7^{7}}} - 7^{7^{7^{7}}} + 7"


async def test_a_hanging_parse_is_killed_at_the_limit_and_scores_as_a_counted_timeout() -> None:
    verifier = MathVerifier(timeout_s=2.0, workers=1)
    try:
        assert (await verifier.check("7", "7")).correct  # the worker is up: the limit times the check only
        t0 = time.monotonic()
        verdict = await verifier.check(HANGING, "7")
        took = time.monotonic() - t0
        assert verdict.outcome == "timeout" and not verdict.correct
        assert took < 2.0 + 1.5, took
        # The killed worker is replaced: the next check gets a verdict.
        assert (await verifier.check("\\frac{1}{2}", "0.5")).correct
        assert verifier.counts == {"correct": 2, "timeout": 1}
    finally:
        await verifier.aclose()


async def test_a_worker_that_cannot_load_math_verify_is_an_infrastructure_failure(
    tmp_path, monkeypatch
) -> None:
    """A broken or missing math-verify stops the check with a typed error when the worker starts;
    no answer is scored (it used to start "ready" and score every answer as unparsed)."""
    fake = tmp_path / "math_verify"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('math_verify is broken here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get the parent's sys.path
    verifier = MathVerifier(timeout_s=5.0, workers=1)
    try:
        with pytest.raises(VerifierUnavailable, match="math_verify is broken here"):
            await verifier.check("7", "7")
        assert not verifier.counts
    finally:
        await verifier.aclose()


async def test_checks_run_concurrently_in_several_workers() -> None:
    verifier = MathVerifier(timeout_s=30.0, workers=2)
    try:
        verdicts = await asyncio.gather(*(verifier.check(str(i), str(i % 3)) for i in range(6)))
        assert [v.correct for v in verdicts] == [i % 3 == i for i in range(6)]
        assert verifier.counts["correct"] == 3 and verifier.counts["wrong"] == 3
    finally:
        await verifier.aclose()
