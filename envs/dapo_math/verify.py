"""Answer equivalence through `math-verify`, in worker processes that can be killed.

Symbolic parsing can hang on adversarial output: `7^{7^{7^{7}}} - 7^{7^{7^{7}}}` makes sympy build a
big integer in C, where no signal (math-verify's own `signal.alarm` time limit included) can stop
it. So every check runs in a separate process with a hard wall-clock limit: a check that runs over
is ended by killing its worker (a fresh one starts for the next check), and it scores as a wrong
answer with the outcome `timeout`, counted. A hang is a policy outcome (the response provoked it),
never an infrastructure failure; the same holds for a worker that dies inside a check.

The ground truth and the extracted answer are both read as the content of a `\\boxed{}` (so bare
LaTeX such as `\\frac12` or `(1,2]` parses), and compared with `math_verify.verify(gold, answer)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import signal
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from agentrl.errors import InfraError

Outcome = Literal["correct", "wrong", "unparsed", "no_answer", "timeout", "crashed"]
OUTCOMES: tuple[Outcome, ...] = ("correct", "wrong", "unparsed", "no_answer", "timeout", "crashed")


class VerifierUnavailable(InfraError):
    """The verifier's worker process cannot start (math-verify missing, no processes left)."""

    cause = "verifier"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    seconds: float = 0.0
    detail: str = ""

    @property
    def correct(self) -> bool:
        return self.outcome == "correct"


def _boxed(text: str) -> str:
    return "\\boxed{" + text + "}"


def judge(answer: str, gold: str) -> tuple[Outcome, str]:
    """math-verify's verdict on `answer` against `gold` (in the calling process: no time limit)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold_parsed = parse(_boxed(gold), extraction_config=configs)
    if not gold_parsed:
        return "unparsed", f"ground truth {gold!r} does not parse"
    parsed = parse(_boxed(answer), extraction_config=configs)
    if not parsed:
        return "unparsed", f"answer {answer!r} does not parse"
    return ("correct" if verify(gold_parsed, parsed) else "wrong"), str(parsed[0])


def _serve(conn: Connection) -> None:
    """Worker loop: (answer, gold) in, (outcome, detail) out, until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    import logging

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    # "ready" means a check can start now: math-verify is imported and its parsers are loaded, so
    # a worker's first check is timed like any other (not with the imports inside its limit).
    try:
        judge("1", "1")
    except Exception as exc:  # math-verify missing or broken: an infrastructure failure, said once
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", ""))
    while True:
        try:
            answer, gold = conn.recv()
        except EOFError:
            return
        try:
            conn.send(judge(answer, gold))
        except Exception as exc:  # math-verify raised: the answer is not a valid expression
            conn.send(("unparsed", f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.process: BaseProcess = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    async def receive(self, timeout: float) -> Any:
        """The next message, or TimeoutError; EOFError if the worker died."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = self.conn.fileno()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, wake)
        try:
            await asyncio.wait_for(ready, timeout)
        finally:
            loop.remove_reader(fd)
        return self.conn.recv()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
            self.process.join(5)
        with contextlib.suppress(Exception):
            self.conn.close()


class MathVerifier:
    """Checks answers against ground truths in up to `workers` processes, each check limited to
    `timeout_s` seconds. `counts` holds every verdict by outcome (including `no_answer`, which
    `record_no_answer` counts without starting a process)."""

    def __init__(self, *, timeout_s: float = 10.0, workers: int = 2, start_timeout_s: float = 120.0) -> None:
        if timeout_s <= 0 or workers < 1:
            raise ValueError("timeout_s must be > 0 and workers >= 1")
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.counts: Counter[str] = Counter()
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
        self._idle: list[_Worker] = []
        self._workers = workers
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._all: set[_Worker] = set()
        self._closed = False

    async def _start(self) -> _Worker:
        worker = _Worker(self._ctx)
        self._all.add(worker)
        try:
            status, detail = await worker.receive(self.start_timeout_s)  # "ready": math-verify loaded
        except (TimeoutError, EOFError, OSError) as exc:
            self._discard(worker)
            raise VerifierUnavailable(
                f"the math-verify worker did not start within {self.start_timeout_s:.0f}s ({exc!r}): "
                "is math-verify installed? pip install 'agentrl[math]'"
            ) from exc
        if status != "ready":
            self._discard(worker)
            raise VerifierUnavailable(
                f"the math-verify worker could not check an answer ({detail}): "
                "is math-verify installed? pip install 'agentrl[math]'"
            )
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._all.discard(worker)

    async def check(self, answer: str, gold: str) -> Verdict:
        """The verdict on one answer; never raises for anything the answer contains."""
        if self._closed:
            raise VerifierUnavailable("the verifier is closed")
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:  # one semaphore per event loop
            self._slots, self._loop = asyncio.Semaphore(self._workers), loop
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._start()
            t0 = loop.time()
            try:
                worker.conn.send((answer, gold))
                outcome, detail = await worker.receive(self.timeout_s)
            except TimeoutError:
                self._discard(worker)
                verdict = Verdict("timeout", loop.time() - t0, f"no verdict within {self.timeout_s:g}s")
            except (EOFError, OSError) as exc:  # the worker died inside the check (e.g. out of memory)
                self._discard(worker)
                verdict = Verdict("crashed", loop.time() - t0, repr(exc))
            except BaseException:  # cancelled mid-check: the worker's state is unknown
                self._discard(worker)
                raise
            else:
                self._idle.append(worker)
                verdict = Verdict(outcome, loop.time() - t0, detail)
        self.counts[verdict.outcome] += 1
        return verdict

    def record_no_answer(self) -> Verdict:
        self.counts["no_answer"] += 1
        return Verdict("no_answer")

    async def aclose(self) -> None:
        self._closed = True
        for worker in list(self._all):
            self._discard(worker)
        self._idle.clear()
