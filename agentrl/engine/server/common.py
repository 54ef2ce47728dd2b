"""What every part of the SGLang-compatible server shares: the SGLang version it matches, which
sampling fields it handles or refuses, its error answers and the model-update lock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

SGLANG_VERSION = "0.5.16"

# sampling_params keys SGLang 0.5.16 accepts, with the value that means "feature off". A non-default
# value of a feature this server lacks is refused; keys outside this table are a TypeError on SGLang.
_INERT_SAMPLING = {
    "min_new_tokens": 0,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop_regex": None,
    "ignore_eos": False,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
    "stream_interval": None,
}
_HANDLED_SAMPLING = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "sampling_seed",
    "n",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
}
_UNSUPPORTED_TOP_LEVEL = {
    "input_embeds": None,
    "stream": False,
    "return_hidden_states": False,
    "return_indexer_topk": False,
    "custom_logit_processor": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "session_params": None,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
}
_DEFAULT_MAX_NEW_TOKENS = 128


log = logging.getLogger("agentrl.engine.server")


def lora_not_enabled(name: str) -> str:
    """SGLang's refusal of a request naming an adapter on a server without --enable-lora."""
    return (
        f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
        "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
    )


class _BadRequest(Exception):
    """A request SGLang answers with HTTP 400 `{"error": {"message": ...}}`."""


class _Fatal(Exception):
    """What kills a real SGLang server (see the module docstring)."""


class _ModelUpdateLock:
    """SGLang's reader/writer `model_update_lock`: generations read, unpaused updates write; a
    waiting writer holds new readers back."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writing and not self._readers)
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _validation_error(message: str) -> web.Response:
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


# --- OpenAI-compatible request shapes (SGLang 0.5.16 `entrypoints/openai/protocol.py`) ------------

# `_GenericMessageRole`, normalised case-insensitively; "user" is its own model
# (`ChatCompletionMessageUserParam`, `Literal["user"]`), so only lower-case "user" passes.
