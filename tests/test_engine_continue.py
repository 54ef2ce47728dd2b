"""`generate_to_end`: the one partial-rollout loop every environment uses (agent, DAPO-math,
OpenEnv), and how it tells an engine that hangs from the caller's own time limit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from agentrl.engine.base import (
    Engine,
    EngineAborted,
    EngineError,
    Generation,
    SamplingParams,
    generate_to_end,
)


class PieceEngine(Engine):
    """Answers each call with the next scripted piece: a Generation, an exception, or "hang"."""

    def __init__(self, pieces: Sequence[Generation | BaseException | str]) -> None:
        self.pieces = list(pieces)
        self.calls: list[tuple[list[int], int]] = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        self.calls.append((list(input_ids), sampling.max_new_tokens))
        piece = self.pieces.pop(0)
        if piece == "hang":
            await asyncio.sleep(3600)
        if isinstance(piece, BaseException):
            raise piece
        assert isinstance(piece, Generation)
        return piece


async def test_aborted_pieces_continue_from_their_tokens_on_the_new_weights() -> None:
    engine = PieceEngine(
        [
            Generation([5, 6], [-0.1, -0.2], "abort", weight_version=1),
            EngineAborted("aborted before any token"),
            Generation([7], [-0.3], "stop", weight_version=2, version_mismatch=True),
        ]
    )
    out = await generate_to_end(
        engine, [1, 2], SamplingParams(max_new_tokens=10), session_id="s", timeout_s=5
    )
    assert out.output_ids == [5, 6, 7] and out.logprobs == [-0.1, -0.2, -0.3]
    assert out.versions == [1, 2] and out.finish_reason == "stop" and out.version_mismatches == 1
    # each piece continues from the context plus what came before, with the budget that is left
    assert engine.calls == [([1, 2], 10), ([1, 2, 5, 6], 8), ([1, 2, 5, 6], 8)]


async def test_a_budget_used_up_by_aborted_pieces_ends_as_length() -> None:
    engine = PieceEngine([Generation([5, 6, 7], [-0.1] * 3, "abort", weight_version=1)])
    out = await generate_to_end(engine, [1], SamplingParams(max_new_tokens=3), session_id=None, timeout_s=5)
    assert out.finish_reason == "length" and out.output_ids == [5, 6, 7] and len(engine.calls) == 1


async def test_an_engine_that_hangs_is_an_engine_failure_not_the_callers_timeout() -> None:
    engine = PieceEngine(["hang"])
    with pytest.raises(EngineError) as info:
        await generate_to_end(engine, [1], SamplingParams(), session_id="s", timeout_s=0.05)
    assert info.value.cause == "engine_timeout"
    # the same hang with the caller's deadline ending first is the caller's time limit
    engine = PieceEngine(["hang"])
    with pytest.raises(TimeoutError):
        await generate_to_end(
            engine, [1], SamplingParams(), session_id="s", timeout_s=60, deadline=time.monotonic() + 0.05
        )
    # a deadline already past raises without calling the engine
    engine = PieceEngine([])
    with pytest.raises(TimeoutError):
        await generate_to_end(
            engine, [1], SamplingParams(), session_id="s", timeout_s=60, deadline=time.monotonic() - 1
        )
    assert engine.calls == []


async def test_engine_errors_pass_through_unchanged() -> None:
    engine = PieceEngine([EngineError("down", cause="engine_unavailable")])
    with pytest.raises(EngineError) as info:
        await generate_to_end(engine, [1], SamplingParams(), session_id="s", timeout_s=5)
    assert info.value.cause == "engine_unavailable"


async def _agent_with_hanging_engine(**config: object):  # type: ignore[no-untyped-def]
    from agentrl.agent.actions import FencedBashFormat
    from agentrl.agent.loop import AgentConfig, run_agent
    from agentrl.agent.tokens import ChatRenderer
    from agentrl.testing.sandbox import FakeSandbox
    from tests.chat_tokenizer import byte_tokenizer

    tok = byte_tokenizer()

    class NoSandbox(FakeSandbox):
        def __init__(self) -> None:  # the engine never answers: no command ever runs
            pass

    return await run_agent(
        engine=PieceEngine(["hang"]),
        sandbox=NoSandbox(),
        renderer=ChatRenderer(tok),
        action_format=FencedBashFormat(),
        instruction="x",
        config=AgentConfig(**{"terminal": "commands", **config}),  # type: ignore[arg-type]
        sampling=SamplingParams(max_new_tokens=64),
        session_id="s",
    )


async def test_an_agent_whose_engine_hangs_ends_with_an_engine_error_never_a_scored_timeout() -> None:
    from agentrl.agent.loop import EndReason

    run = await _agent_with_hanging_engine(engine_timeout_s=0.05)
    assert run.end_reason is EndReason.ENGINE_ERROR
    assert isinstance(run.infra_error, EngineError) and run.infra_error.cause == "engine_timeout"
    # the agent's own wall clock ending while the engine works is the agent's time limit
    run = await _agent_with_hanging_engine(engine_timeout_s=60, wall_clock_s=0.05)
    assert run.end_reason is EndReason.TIMEOUT and run.infra_error is None
