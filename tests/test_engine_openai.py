"""OpenAIChatEngine against an in-test OpenAI-compatible HTTP server on 127.0.0.1."""

from __future__ import annotations

import pytest
from aiohttp import web

from agentrl.engine.base import EngineBadRequest, EngineError, SamplingParams
from agentrl.engine.openai import OpenAIChatEngine

KEY = "sk-test-secret-123"


@pytest.fixture
async def api(monkeypatch):
    state = {"bodies": [], "fail": 0, "status": 503}

    async def chat(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        state["bodies"].append(body)
        if state["fail"]:
            state["fail"] -= 1
            return web.json_response({"error": {"message": "busy"}}, status=state["status"])
        last = body["messages"][-1]["content"]
        finish = "length" if body["max_tokens"] < 5 else "stop"
        content = None if last == "empty" else f"echo {last}"
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": finish,
                    }
                ],
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    monkeypatch.setenv("TEST_API_KEY", KEY)
    engine = OpenAIChatEngine(
        base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1",
        model="m1",
        api_key_env="TEST_API_KEY",
        retries=3,
    )
    yield engine, state
    await engine.aclose()
    await runner.cleanup()


async def test_chat_sends_messages_and_sampling_and_maps_finish(api) -> None:
    engine, state = api
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    text, finish = await engine.chat(
        msgs, SamplingParams(temperature=0.3, max_new_tokens=64, seed=2, stop=("END",))
    )
    assert (text, finish) == ("echo hi", "stop")
    body = state["bodies"][0]
    assert body["model"] == "m1" and body["messages"] == msgs and body["temperature"] == 0.3
    assert body["max_tokens"] == 64 and body["seed"] == 2 and body["stop"] == ["END"] and "top_k" not in body
    assert await engine.chat([{"role": "user", "content": "x"}], SamplingParams(max_new_tokens=2)) == (
        "echo x",
        "length",
    )
    assert await engine.chat([{"role": "user", "content": "empty"}], SamplingParams()) == ("", "stop")


async def test_busy_answers_are_retried_then_reported(api) -> None:
    engine, state = api
    state["fail"] = 2
    assert (await engine.chat([{"role": "user", "content": "a"}], SamplingParams()))[0] == "echo a"
    state["fail"] = 5
    with pytest.raises(EngineError) as info:
        await engine.chat([{"role": "user", "content": "a"}], SamplingParams())
    assert info.value.cause == "engine_unavailable"


async def test_the_key_never_appears_in_errors_or_repr(api, monkeypatch) -> None:
    engine, _ = api
    monkeypatch.setenv("TEST_API_KEY", "sk-wrong-key-456")
    with pytest.raises(EngineError) as info:
        await engine.chat([{"role": "user", "content": "a"}], SamplingParams())
    assert info.value.cause == "engine_auth" and "sk-wrong" not in str(info.value)
    assert "TEST_API_KEY" in str(info.value) and KEY not in repr(engine)
    monkeypatch.delenv("TEST_API_KEY")
    with pytest.raises(EngineError, match="TEST_API_KEY is not set"):
        await engine.chat([{"role": "user", "content": "a"}], SamplingParams())


async def test_token_generation_is_refused_with_a_pointer_to_chat(api) -> None:
    engine, _ = api
    with pytest.raises(EngineBadRequest, match="chat"):
        await engine.generate([1, 2], SamplingParams())
