"""`agentrl engine serve`'s OpenAI-compatible endpoints, as SGLang 0.5.16 serves them
(`entrypoints/openai/serving_chat.py`, `protocol.py`, `http_server.py`): the chat template applied
with the model's tokenizer, token ids and log-probs the SGLang way, SGLang's errors, and a request
log that never holds a prompt."""

from __future__ import annotations

import json
import logging
import math

import aiohttp
import pytest

pytest.importorskip("torch")

from agentrl.engine.base import SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.openai import OpenAIChatEngine
from agentrl.engine.server import EngineServer
from agentrl.models.tiny import load_tiny

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List /app."}]


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture
async def server(tiny):
    model, tok = tiny
    async with EngineServer(LocalEngine(model, tok), model_path="/models/tiny", port=0) as srv:
        yield srv


async def _post(url: str, body: object, **kw: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        if "data" in kw:
            async with s.post(url, **kw) as r:  # type: ignore[arg-type]
                return r.status, json.loads(await r.read())
        async with s.post(url, json=body) as r:
            return r.status, json.loads(await r.read())


async def _get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, json.loads(await r.read())


async def test_models_lists_the_served_model_with_its_context_length(server) -> None:
    status, body = await _get(f"{server.url}/v1/models")
    assert status == 200 and body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "tiny" and card["owned_by"] == "sglang" and card["max_model_len"] == 4096
    status, one = await _get(f"{server.url}/v1/models/tiny")
    assert status == 200 and one["id"] == "tiny"
    status, missing = await _get(f"{server.url}/v1/models/gpt-4")
    assert status == 404 and missing["error"]["code"] == "model_not_found"


async def test_chat_applies_the_chat_template_and_returns_sglangs_shape(server, tiny) -> None:
    _, tok = tiny
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "return_prompt_token_ids": True,
    }
    status, reply = await _post(f"{server.url}/v1/chat/completions", body)
    assert status == 200, reply
    assert set(reply) == {"id", "object", "created", "model", "choices", "usage", "metadata"}
    assert reply["object"] == "chat.completion" and reply["model"] == "tiny"
    (choice,) = reply["choices"]
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert choice["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert set(choice["message"]) == {"role", "content", "reasoning_content", "tool_calls"}
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length") and choice["logprobs"] is None
    usage = reply["usage"]
    assert usage["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert reply["metadata"] == {"weight_version": "0"}


async def test_logprobs_token_ids_and_meta_info_come_back_the_sglang_way(server, tiny) -> None:
    _, tok = tiny
    body = {
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0.7,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 3,
        "return_meta_info": True,
        "return_token_ids": True,  # vLLM's name: SGLang ignores unknown fields, so does this server
    }
    status, reply = await _post(f"{server.url}/v1/chat/completions", body)
    assert status == 200, reply
    (choice,) = reply["choices"]
    meta = choice["meta_info"]
    ids = [entry[1] for entry in meta["output_token_logprobs"]]
    assert len(ids) == meta["completion_tokens"] == reply["usage"]["completion_tokens"]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    for c, (lp, _, _) in zip(content, meta["output_token_logprobs"], strict=True):
        assert c["logprob"] == lp and c["bytes"] == list(c["token"].encode())
        assert len(c["top_logprobs"]) == 3
        tops = [t["logprob"] for t in c["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        # the same distribution as the sampled token's log-prob (after temperature)
        assert tops[0] >= lp - 1e-4
        assert sum(math.exp(t) for t in tops) <= 1.0 + 1e-4
    # greedy: the top-1 entry is the chosen token, with the same log-prob
    body.update(temperature=0, seed=None)
    _, greedy = await _post(f"{server.url}/v1/chat/completions", body)
    for c in greedy["choices"][0]["logprobs"]["content"]:
        assert c["top_logprobs"][0]["token"] == c["token"]
        assert c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"], abs=1e-4)


async def test_input_ids_bypass_the_template_and_a_final_assistant_message_becomes_a_user_one(
    server, tiny
) -> None:
    _, tok = tiny
    ids = tok.encode("hello there", add_special_tokens=False)
    _, reply = await _post(
        f"{server.url}/v1/chat/completions",
        {"messages": MESSAGES, "input_ids": ids, "max_tokens": 2, "return_prompt_token_ids": True},
    )
    assert reply["choices"][0]["prompt_token_ids"] == ids
    msgs = [*MESSAGES, {"role": "assistant", "content": "partial"}]
    _, reply = await _post(
        f"{server.url}/v1/chat/completions",
        {"messages": msgs, "max_tokens": 2, "return_prompt_token_ids": True},
    )
    as_user = tok.apply_chat_template(
        [*MESSAGES, {"role": "user", "content": "partial"}], tokenize=False, add_generation_prompt=True
    )
    assert reply["choices"][0]["prompt_token_ids"] == tok.encode(as_user, add_special_tokens=False)


@pytest.mark.parametrize(
    ("body", "status", "err_type", "needle"),
    [
        ({"messages": []}, 400, "BadRequestError", "Messages cannot be empty."),
        ({"messages": [{"role": "User", "content": "x"}]}, 400, "Bad Request", "role"),
        ({"messages": "hi"}, 400, "Bad Request", "messages"),
        ({"messages": MESSAGES, "max_tokens": "many"}, 400, "Bad Request", "max_tokens"),
        (
            {"messages": MESSAGES, "max_tokens": 5000},
            400,
            "BadRequestError",
            "max_completion_tokens is too large",
        ),
        ({"messages": MESSAGES, "max_tokens": 4090}, 400, "BadRequestError", "Requested token count exceeds"),
        ({"messages": MESSAGES, "tool_choice": "required"}, 400, "BadRequestError", "Tools cannot be empty"),
        ({"messages": MESSAGES, "model": "tiny:adapter"}, 400, "BadRequestError", "LoRA adapter 'adapter'"),
        ({"messages": MESSAGES, "return_hidden_states": True}, 400, "BadRequestError", "hidden states"),
        ({"messages": MESSAGES, "stream": True}, 400, "BadRequestError", "stream"),
        ({"messages": MESSAGES, "frequency_penalty": 0.5}, 400, "BadRequest", "frequency_penalty"),
        ({"messages": MESSAGES, "regex": "a+"}, 400, "BadRequest", "regex"),
    ],
)
async def test_chat_refuses_what_sglang_refuses_in_its_envelope(
    server, body, status, err_type, needle
) -> None:
    got, reply = await _post(f"{server.url}/v1/chat/completions", body)
    assert got == status, reply
    assert reply["object"] == "error" and reply["code"] == status and reply["type"] == err_type
    assert needle in reply["message"]


async def test_a_body_that_is_not_json_is_refused_as_sglang_does(server) -> None:
    status, reply = await _post(
        f"{server.url}/v1/chat/completions", None, data=b"{}", headers={"Content-Type": "text/plain"}
    )
    assert status == 400 and "Unsupported Media Type" in reply["message"] and reply["type"] == "Bad Request"


async def test_requests_are_logged_without_their_contents(server, caplog) -> None:
    secret = "the secret prompt text"
    with caplog.at_level(logging.INFO, logger="agentrl.engine.server"):
        await _post(
            f"{server.url}/v1/chat/completions",
            {"messages": [{"role": "user", "content": secret}], "max_tokens": 2},
        )
        await _get(f"{server.url}/v1/models")
    lines = [r.getMessage() for r in caplog.records if r.name == "agentrl.engine.server"]
    assert any(line.startswith("POST /v1/chat/completions 200 ") and line.endswith("ms") for line in lines)
    assert any(line.startswith("GET /v1/models 200 ") for line in lines)
    assert not any(secret in line for line in lines)


async def test_the_openai_chat_engine_talks_to_it(server) -> None:
    engine = OpenAIChatEngine(base_url=server.url + "/v1", model="tiny", api_key_env=None)
    try:
        text, finish = await engine.chat(MESSAGES, SamplingParams(max_new_tokens=4, seed=1))
    finally:
        await engine.aclose()
    assert isinstance(text, str) and finish in ("stop", "length")
