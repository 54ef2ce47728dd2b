"""`build_engine` for SGLang fleets: the router for generation, worker URLs for control, or both."""

from __future__ import annotations

import pytest

from agentrl.engine.build import build_engine
from agentrl.errors import AgentRLError
from agentrl.runtime.build import engine_spec
from agentrl.runtime.config import RunConfig


def _cfg(**engine: object) -> RunConfig:
    return RunConfig.model_validate({"engine": {"kind": "sglang", **engine}})


async def test_a_router_with_its_workers_named_is_accepted_and_both_are_used() -> None:
    engine, _ = build_engine(
        engine_spec(_cfg(router_url="http://127.0.0.1:30000", urls=["http://127.0.0.1:30001"])),
        tokenizer=object(),
    )
    assert engine.router_url == "http://127.0.0.1:30000"
    assert engine._workers == ["http://127.0.0.1:30001"]  # control calls go to the workers
    await engine.aclose()


def test_an_sglang_engine_without_any_url_says_what_to_set() -> None:
    with pytest.raises(AgentRLError, match=r"engine\.urls.*engine\.router_url"):
        build_engine(engine_spec(_cfg()), tokenizer=object())
