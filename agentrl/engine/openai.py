"""`OpenAIChatEngine`: evaluate API models through an OpenAI-compatible `/v1/chat/completions`.

Text-in/text-out. API models take messages, not token ids, and return no usable log-probs, so this
engine cannot produce training samples. The agent loop uses it through `chat(messages, sampling)`:
when an episode runs without a tokenizer renderer, the loop keeps the conversation as a message
list, sends the whole list every turn, and appends the reply and the observation as messages
(see `agentrl.agent.loop._ChatSession`). Episodes run this way are scored by the verifier as usual
(evaluation), but yield no token segments.

The API key is read from the environment variable the user names, at request time; it is never
logged, put in an error message, or kept in the object's repr.
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from agentrl.engine.base import Engine, EngineBadRequest, EngineError, Generation, SamplingParams

# Statuses where the request was rejected before any completion was produced; re-sending only costs
# another attempt (a chat completion has no side effects).
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class _Retry(Exception):
    pass


class OpenAIChatEngine(Engine):
    """Client for an OpenAI-compatible chat API (OpenAI, vLLM, SGLang's `/v1`, ...)."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key_env: str | None = "OPENAI_API_KEY",
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 4,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        base = base_url.rstrip("/")
        self.url = base + "/chat/completions" if base.endswith("/v1") else base + "/v1/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self.retries = max(1, retries)
        self.extra_body = dict(extra_body or {})
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"OpenAIChatEngine(url={self.url!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    def _headers(self) -> dict[str, str]:
        if not self.api_key_env:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise EngineError(
                f"environment variable {self.api_key_env} is not set: export the API key there",
                cause="engine_auth",
            )
        return {"Authorization": f"Bearer {key}"}

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        raise EngineBadRequest(
            "OpenAIChatEngine is text-in/text-out: run the agent without a tokenizer renderer so the "
            "loop calls chat(messages, sampling); token ids cannot be sent to a chat API"
        )

    async def chat(self, messages: list[dict[str, str]], sampling: SamplingParams) -> tuple[str, str]:
        """Send the conversation; return (reply text, finish reason "stop" | "length")."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens,
            **self.extra_body,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.top_k != -1:
            body["top_k"] = sampling.top_k  # not OpenAI's; vLLM and SGLang accept it
        reply = await self._post(body)
        try:
            choice = reply["choices"][0]
            text = choice["message"].get("content") or ""
            finish = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise EngineError(f"{self.url}: reply has no choices[0].message: {str(reply)[:300]}") from e
        return text, "length" if finish == "length" else "stop"

    async def _post(self, body: dict[str, Any]) -> Any:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        headers = self._headers()
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_Retry),
                stop=stop_after_attempt(self.retries),
                wait=wait_random_exponential(multiplier=0.5, max=20.0),
                reraise=True,
            ):
                with attempt:
                    return await self._post_once(body, headers)
        except _Retry as e:
            raise EngineError(
                f"{e} (gave up after {self.retries} attempts)", cause="engine_unavailable"
            ) from None
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _post_once(self, body: dict[str, Any], headers: dict[str, str]) -> Any:
        assert self._session is not None
        try:
            async with self._session.post(self.url, json=body, headers=headers) as resp:
                status = resp.status
                text = await resp.text()
                if status == 200:
                    return await resp.json(content_type=None)
        except aiohttp.ClientConnectorError as e:
            raise _Retry(f"cannot connect to {self.url}: {e}") from None
        except TimeoutError:
            raise EngineError(
                f"{self.url} timed out after {self.timeout.total} s", cause="engine_timeout"
            ) from None
        except aiohttp.ClientError as e:
            raise EngineError(f"{self.url} failed: {type(e).__name__}", cause="engine_http") from None
        if status in _RETRY_STATUSES:
            raise _Retry(f"{self.url} answered {status}: {text[:200]}")
        if status in (401, 403):
            raise EngineError(
                f"{self.url} refused the API key from {self.api_key_env} (HTTP {status})", cause="engine_auth"
            )
        if status == 400:
            raise EngineBadRequest(f"{self.url} rejected the request: {text[:300]}")
        raise EngineError(f"{self.url} answered HTTP {status}: {text[:300]}", cause=f"engine_http_{status}")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
