"""An SGLang-compatible HTTP server around `LocalEngine` (`agentrl engine serve`).

Request and response shapes follow SGLang 0.5.16's `http_server.py` / `io_struct.py` (restated in
the project's SGLang reference), so the same client code talks to this server and to a real SGLang
worker. What is served:

- `POST|PUT /generate`: `input_ids` (1-D, or 2-D for a batch) or `text`, `sampling_params`,
  `rid`, `return_logprob`, `logprob_start_len`, `return_text_in_logprobs`,
  `return_prompt_token_ids`; `n > 1` samples. Logprob entries are `[logprob, token_id, text|null]`.
  Aborted requests answer 200 with `finish_reason.type == "abort"` and the partial tokens.
  A client that disconnects aborts its request.
- OpenAI-compatible (SGLang 0.5.16's `entrypoints/openai/serving_chat.py`, `protocol.py`):
  `GET /v1/models` (+ `/v1/models/{model}`) and `POST /v1/chat/completions`, non-streaming. The
  chat template is applied with the model's tokenizer (`apply_chat_template(..., tokenize=False,
  add_generation_prompt=True)`, then encoded without special tokens when the tokenizer would add
  them); a last assistant message becomes a user message unless `continue_final_message`; text
  parts of a list content are joined with spaces (a template that takes strings). Token ids and
  log-probs the SGLang way: `logprobs` (+ `top_logprobs`) gives `choice.logprobs.content`,
  `return_prompt_token_ids` gives `choice.prompt_token_ids`, `return_meta_info` gives
  `choice.meta_info` (the native `output_token_logprobs` `[logprob, id, text]`, whose ids are the
  completion's token ids); `input_ids` bypasses the template. Unknown fields are ignored, as
  SGLang's pydantic request model ignores them (vLLM's `return_token_ids` included). Errors use
  SGLang's envelope `{"object": "error", "message", "type", "param", "code"}`: a malformed body or a
  wrong type is 400 "Bad Request", a non-JSON content type too, SGLang's own checks
  (`Messages cannot be empty.`, `max_completion_tokens is too large`, context length, LoRA not
  enabled, ...) are 400 "BadRequestError". Sampling defaults for unset fields come from the model's
  `generation_config` (SGLang's `--sampling-defaults model`).
- `GET /health`, `/health_generate`, `/model_info` (+ `/get_model_info`), `/server_info`
  (+ `/get_server_info`), `/v1/loads`; `/get_weight_version` answers 404 as 0.5.16 does.
- `GET|POST /flush_cache` (text/plain; 400 while requests run), `POST /abort_request`,
  `/pause_generation`, `/continue_generation`, `/update_weight_version`.
- `POST /update_weights_from_disk`: a directory of safetensors (see `LocalEngine.load_from_disk`).
- `POST /update_weights_from_tensor`: one `serialized_named_tensors` entry per TP rank, each a
  serialized list of `(name, tensor)` pairs (SGLang: `managers/tp_worker.py`,
  `model_runner_components/weight_updater.py`). SGLang's serializer is a pickle, which would let any
  client run code here, so each entry must be agentrl's safe encoding of the same list
  (`agentrl.engine.tensors`); a pickle is refused with `{"success": false, ...}` (HTTP 400).
- `POST /init_weights_update_group`, `/update_weights_from_distributed`,
  `/destroy_weights_update_group`: a real process group (gloo on CPU, NCCL on GPU;
  `agentrl.engine.weight_group`): each simulated TP rank joins as `rank_offset + tp_rank`, and an
  update receives each named tensor in order by `broadcast(src=0)`.

Simulated tensor parallelism (`tp_size`, `agentrl engine serve --tp-size N`): the model is one copy,
but the server behaves as N ranks where the protocol can tell: `/server_info` says `tp_size: N`,
a tensor update needs N entries (each rank loads its own; they must agree here), and a weight-update
group has N members.

Fatal errors (as strict as SGLang 0.5.16, where these kill the server): SGLang's scheduler process
runs every weight update; an exception there reaches `run_scheduler_process`'s handler
(`managers/scheduler.py`: "Scheduler hit an exception", then SIGQUIT to the server process), so the
server dies, the call that caused it gets no answer, and every in-flight request is lost. This
server models that faithfully: it stops serving (`dead` holds the reason, `died` is set), drops the
connection of the fatal call and of every in-flight request instead of answering, and stops
listening, so clients see what they would see from a dead SGLang server (a broken connection, then
connection refused); `agentrl engine serve` then exits with status 1. The cases:
- an update with `flush_cache: true` (SGLang's default) while a request is running or queued,
  e.g. after an `in_place` pause: `scheduler_components/weight_updater.py`
  `flush_cache_after_weight_update` asserts that `Scheduler.flush_cache` succeeded, and that
  refuses unless the scheduler is fully idle;
- a tensor update with fewer entries than TP ranks: `tp_worker.py` indexes
  `serialized_named_tensors[tp_rank]` (IndexError on the ranks without one);
- `update_weights_from_distributed` before `init_weights_update_group`: the model runner's
  `assert group_name in self._model_update_group`, outside its try block;
- a tensor `load_format` SGLang does not know (the weight updater raises for it, uncaught).

Not served: streaming (`"stream": true` is refused with 400, on /generate and on chat), multimodal
inputs, penalties, constrained decoding (`regex`, `ebnf`, `response_format` schemas, a required
or named `tool_choice`), tool-call parsing, LoRA; each is refused with a 400 that names the field.

Auth (`api_key`, SGLang's `--api-key`): every path but /health*, /metrics* and OPTIONS requests needs
`Authorization: Bearer <key>`, else 401 `{"error": "Unauthorized"}` (`EngineServer._auth`).

Request logging: one INFO line per request on the `agentrl.engine.server` logger (method, path,
status, milliseconds), never a prompt or a completion.

Weight versions: SGLang's are strings ("default" until set); this engine's are integers, so a
`weight_version` must be an integer string. An update without `weight_version` keeps the version,
as on SGLang. A response's `meta_info.weight_version` is read when the response is built, so a
request paused in place across a weight load reports the new version.

Model-update lock (SGLang's `tokenizer_manager.model_update_lock`): every `/generate` holds a reader
lock; an update that arrives while generation is not paused takes the writer lock, so it waits for
the requests in flight and holds new ones back; while paused it runs at once.

Abort: `/abort_request` aborts only the request whose rid is exactly the one given (0.5.16's
`tokenizer_manager.py` `abort_request` drops an rid that is not a live request's own before the
scheduler's prefix match), or every request with `abort_all`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError, field_validator, model_validator

from agentrl.engine.base import EngineBadRequest, EngineError, Generation, SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.tensors import deserialize_named_tensors, serialize_named_tensors
from agentrl.engine.weight_group import WeightGroup

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
    "return_routed_experts": False,
    "return_indexer_topk": False,
    "lora_path": None,
    "custom_logit_processor": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "session_params": None,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
}
_DEFAULT_MAX_NEW_TOKENS = 128

__all__ = ["EngineServer", "serialize_named_tensors", "serve"]

log = logging.getLogger("agentrl.engine.server")


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
_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder")
# ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS: used when neither the request nor the model's
# generation_config sets one.
_CHAT_SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


class _ChatMessage(BaseModel):
    role: str
    content: str | list[Any] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, v: Any) -> str:
        if v == "user":
            return v
        if isinstance(v, str):
            if v.lower() not in _GENERIC_ROLES:
                allowed = ", ".join(repr(r) for r in _GENERIC_ROLES)
                raise ValueError(f"'role' must be one of {allowed} (case-insensitive).")
            return v.lower()
        raise ValueError("'role' must be a string")

    @model_validator(mode="after")
    def _user_content(self) -> _ChatMessage:
        if self.role == "user" and self.content is None:
            raise ValueError("a user message needs content")
        return self


class _ChatRequest(BaseModel):
    """The fields of SGLang's ChatCompletionRequest this server reads; the rest are ignored, as
    SGLang's pydantic model ignores unknown fields."""

    messages: list[_ChatMessage]
    model: str = "default"
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    return_hidden_states: bool = False
    return_routed_experts: bool = False
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False
    reasoning_effort: str | float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    regex: str | None = None
    ebnf: str | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    continue_final_message: bool = False
    skip_special_tokens: bool = True
    lora_path: str | list[str | None] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    custom_params: dict[str, Any] | None = None
    input_ids: list[int] | None = None
    rid: str | list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        values = dict(values)
        # set_tool_choice_default
        if values.get("tool_choice") is None:
            values["tool_choice"] = "none" if values.get("tools") is None else "auto"
        # normalize_reasoning_inputs: an effort sets the templates' thinking switches
        effort = values.get("reasoning_effort")
        if effort is not None:
            ctk = values.get("chat_template_kwargs")
            ctk = dict(ctk) if isinstance(ctk, dict) else {}
            ctk.setdefault("thinking", effort != "none")
            ctk.setdefault("enable_thinking", effort != "none")
            values["chat_template_kwargs"] = ctk
        return values


def _openai_error(message: str, err_type: str = "BadRequestError", status: int = 400) -> web.Response:
    """SGLang's ErrorResponse (`serving_base.create_error_response`)."""
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return web.json_response(body, status=status)


def _flatten_content(content: Any) -> str:
    """A list content for a template that takes strings: its text parts joined with spaces
    (SGLang `process_content_for_template_format`, format "string"; other parts are dropped)."""
    if not isinstance(content, list):
        return "" if content is None else content
    return " ".join(
        str(c.get("text", ""))
        for c in content
        if isinstance(c, dict) and c.get("type") in ("text", "input_text")
    )


class EngineServer:
    """The aiohttp application and its lifecycle. Use as `async with EngineServer(...) as srv`."""

    def __init__(
        self,
        engine: LocalEngine,
        *,
        model_path: str = "",
        host: str = "127.0.0.1",
        port: int = 30000,
        served_model_name: str | None = None,
        tp_size: int = 1,
        api_key: str | None = None,
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.engine = engine
        self.model_path = str(model_path)
        self.host = host
        self.port = port
        self.tp_size = tp_size
        self._auth_value = f"Bearer {api_key}" if api_key else None
        self.served_model_name = served_model_name or (Path(self.model_path).name or "default")
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._lock = _ModelUpdateLock()
        self._groups: dict[str, list[WeightGroup]] = {}
        self.dead: str | None = None
        self.died = asyncio.Event()
        self.app = self._build_app()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> EngineServer:
        # handler_cancellation: a client that disconnects cancels its handler, aborting the request.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self._site = site
        if self.port == 0:
            self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stopping is not None:
            await self._stopping
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=512 * 1024 * 1024, middlewares=[self._log_requests, self._auth, self._dead_gate]
        )
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/get_weight_version", "/weight_version"):
            r.add_get(path, self.weight_version_deprecated)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/v1/models", self.list_models)
        r.add_get("/v1/models/{model:.*}", self.retrieve_model)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        return app

    # --- request log and the dead state (see the module docstring) -----------------------------

    @web.middleware
    async def _log_requests(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """One line per request: method, path, status, latency; never the body (prompts stay out
        of the log)."""
        start = time.monotonic()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            log.info(
                "%s %s %d %.1fms", request.method, request.path, status, (time.monotonic() - start) * 1000
            )

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """SGLang's `--api-key` (sglang/srt/utils `add_api_key_middleware`; with no admin key the
        later `decide_request_auth` of sglang/srt/utils/auth.py decides the same): OPTIONS and
        paths under /health and /metrics pass; everything else needs `Authorization: Bearer <key>`,
        else 401 `{"error": "Unauthorized"}`. The header must read exactly "Bearer <key>" (the
        older check's string equality, the stricter of the two)."""
        if (
            self._auth_value is None
            or request.method == "OPTIONS"
            or request.path.startswith(("/health", "/metrics"))
            or hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), self._auth_value.encode()
            )
        ):
            return await handler(request)
        return web.json_response({"error": "Unauthorized"}, status=401)

    @web.middleware
    async def _dead_gate(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self.dead is None:
            try:
                response = await handler(request)
            except _Fatal as e:
                self._die(str(e))
            else:
                if self.dead is None:
                    return response
        # A dead server answers nothing: drop the connection.
        if request.transport is not None:
            request.transport.close()
        raise web.HTTPServiceUnavailable()  # never delivered: the connection is gone

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        print(
            f"agentrl engine server: fatal, as SGLang's scheduler would die: {reason}",
            file=sys.stderr,
            flush=True,
        )
        self.engine.abort_requests(abort_all=True)
        self.died.set()
        if self._site is not None:
            # Stop listening now: later connections are refused, as by a dead process. Awaited in
            # __aexit__.
            self._stopping = asyncio.get_running_loop().create_task(self._site.stop())

    # --- data plane ----------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        start = time.time()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _validation_error(f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return _validation_error("request body must be a JSON object")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            return _validation_error("sampling_params must be an object (lists are not supported here)")
        unknown = set(sp) - _HANDLED_SAMPLING - set(_INERT_SAMPLING)
        if unknown:
            # SGLang 0.5.16 raises an uncaught TypeError here: plain-text HTTP 500.
            return web.Response(status=500, text="Internal Server Error")
        try:
            prompts, batched = self._prompts(body)
            sampling, n = self._sampling(sp)
            for key, off in _UNSUPPORTED_TOP_LEVEL.items():
                if body.get(key, off) not in (off, None, False, 0):
                    raise _BadRequest(f"{key} is not supported by agentrl's local engine server")
            rid = body.get("rid")
            rids = self._rids(rid, len(prompts), n)
            jobs = [(p, r) for i, p in enumerate(prompts) for r in rids[i * n : (i + 1) * n]]
            results = await asyncio.gather(*(self._one(p, sampling, r, body, sp, start) for p, r in jobs))
        except (_BadRequest, EngineBadRequest) as e:
            return _error(str(e))
        if batched or n > 1:
            return web.json_response(results)
        return web.json_response(results[0])

    def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        ids = body.get("input_ids")
        if ids is None:
            text = body.get("text")
            if text is None:
                raise _BadRequest("Either text, input_ids or input_embeds should be provided.")
            tok = self.engine.tokenizer
            if tok is None:
                raise _BadRequest("text prompts need the server's tokenizer; send input_ids")
            texts = [text] if isinstance(text, str) else list(text)
            return [tok.encode(t, add_special_tokens=False) for t in texts], not isinstance(text, str)
        if not isinstance(ids, list):
            raise _BadRequest("input_ids must be a list of token ids")
        if not ids:
            raise _BadRequest("input_ids cannot be empty.")
        batched = isinstance(ids[0], list)
        rows = ids if batched else [ids]
        for row in rows:
            if not isinstance(row, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in row
            ):
                raise _BadRequest("input_ids must be a list of ints (or a list of such lists)")
            if not row:
                raise _BadRequest("input_ids cannot be empty.")
        return rows, batched

    def _sampling(self, sp: dict[str, Any]) -> tuple[SamplingParams, int]:
        for key, off in _INERT_SAMPLING.items():
            if sp.get(key, off) not in (off, None):
                raise _BadRequest(f"sampling_params.{key} is not supported by agentrl's local engine server")
        max_new = sp.get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS)
        if max_new is None:
            max_new = self.engine.context_length
        stop = sp.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        n = sp.get("n", 1) or 1
        try:
            sampling = SamplingParams(
                temperature=float(1.0 if sp.get("temperature") is None else sp["temperature"]),
                top_p=float(1.0 if sp.get("top_p") is None else sp["top_p"]),
                top_k=int(-1 if sp.get("top_k") is None else sp["top_k"]),
                max_new_tokens=int(max_new),
                stop=stop,
                stop_token_ids=tuple(int(i) for i in sp.get("stop_token_ids") or ()),
                seed=None if sp.get("sampling_seed") is None else int(sp["sampling_seed"]),
            )
        except (TypeError, ValueError) as e:
            raise _BadRequest(f"bad sampling_params: {e}") from e
        if not isinstance(n, int) or n < 1:
            raise _BadRequest(f"sampling_params.n must be a positive integer, got {n!r}")
        return sampling, n

    def _rids(self, rid: Any, batch: int, n: int) -> list[str]:
        total = batch * n
        if n > 1 or rid is None:
            return [uuid.uuid4().hex for _ in range(total)]
        if isinstance(rid, list):
            if len(rid) != batch:
                raise _BadRequest("The rid should be a list with the same length as the batch size")
            return [str(r) for r in rid]
        return [str(rid)] if batch == 1 else [f"{rid}_{i}" for i in range(batch)]

    async def _one(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        rid: str,
        body: dict[str, Any],
        sp: dict[str, Any],
        start: float,
    ) -> dict[str, Any]:
        ctx = self.engine.context_length
        if sp.get("max_new_tokens") is not None and len(prompt) + sampling.max_new_tokens > ctx:
            raise _BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {len(prompt) + sampling.max_new_tokens} tokens: {len(prompt)} "
                f"tokens from the input messages and {sampling.max_new_tokens} tokens for the completion. "
                "Please reduce the number of tokens in the input messages or the completion to fit "
                "within the limit."
            )
        want_lp = bool(body.get("return_logprob"))
        with_text = bool(body.get("return_text_in_logprobs"))
        start_len = body.get("logprob_start_len", -1)
        if start_len is None:
            start_len = -1
        if want_lp and start_len > len(prompt):
            raise _BadRequest(
                f"logprob_start_len ({start_len}) is larger than the input length ({len(prompt)})."
            )
        async with self._lock.read():
            gen = await self.engine.generate(prompt, sampling, rid=rid)
        meta: dict[str, Any] = {"id": rid, "finish_reason": self._finish(gen)}
        waiting_abort = gen.meta.get("message") == "Abort in waiting queue"
        if not waiting_abort:
            meta["prompt_tokens"] = len(prompt)
        # Read now, as SGLang reads it when building the response (`tokenizer_manager.py`).
        meta["weight_version"] = str(self.engine.weight_version)
        if not waiting_abort:
            meta["num_retractions"] = 0
        if want_lp:
            meta["input_token_logprobs"] = []
            if start_len >= 0 and not waiting_abort:
                lps = await self.engine.prompt_logprobs(prompt)
                entries = [None, *lps][start_len:]
                meta["input_token_logprobs"] = [
                    [None if j == 0 else lp, tok, self._piece(tok) if with_text else None]
                    for j, (lp, tok) in enumerate(zip(entries, prompt[start_len:], strict=True))
                ]
            meta["output_token_logprobs"] = [
                [lp, tok, self._piece(tok) if with_text else None]
                for lp, tok in zip(gen.logprobs, gen.output_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(gen.output_ids)
        if not waiting_abort:
            meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(gen.output_ids)
        if not waiting_abort:
            meta["cached_tokens"] = 0
            meta["cached_tokens_details"] = None
        meta["e2e_latency"] = time.time() - start
        meta["response_sent_to_client_ts"] = time.time()
        out: dict[str, Any] = {}
        if self.engine.tokenizer is not None:
            out["text"] = self._text(gen, sp)
        out["output_ids"] = gen.output_ids
        out["meta_info"] = meta
        if body.get("return_prompt_token_ids"):
            out["prompt_token_ids"] = prompt
        return out

    @staticmethod
    def _finish(gen: Generation) -> dict[str, Any]:
        if gen.finish_reason == "stop":
            return {"type": "stop", "matched": gen.meta.get("matched")}
        if gen.finish_reason == "length":
            return {"type": "length", "length": gen.meta.get("length", len(gen.output_ids))}
        if gen.meta.get("message") == "Abort in waiting queue":
            return {"type": "abort", "message": "Abort in waiting queue"}
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}

    def _piece(self, token: int) -> str:
        return self.engine.tokenizer.decode([token], skip_special_tokens=False)

    def _text(self, gen: Generation, sp: dict[str, Any]) -> str:
        tok = self.engine.tokenizer
        ids = gen.output_ids
        matched = gen.meta.get("matched")
        trim = not sp.get("no_stop_trim", False)
        if trim and gen.finish_reason == "stop" and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = tok.decode(ids, skip_special_tokens=sp.get("skip_special_tokens", True))
        if trim and gen.finish_reason == "stop" and isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text

    # --- OpenAI-compatible endpoints -----------------------------------------------------------

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.engine.context_length,
        }

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card(self.served_model_name)]})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.served_model_name:
            error = {
                "message": f"The model '{name}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return web.json_response({"error": error}, status=404)
        return web.json_response(self._model_card(name))

    async def chat_completions(self, request: web.Request) -> web.Response:
        """SGLang's `/v1/chat/completions` (non-streaming): validate, apply the chat template,
        generate through the same path as `/generate`, answer in SGLang's shape."""
        start = time.time()
        media = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
        if media != "application/json":
            return _validation_error("Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _validation_error(f"JSON decode error: {e}")
        try:
            req = _ChatRequest.model_validate(body)
        except ValidationError as e:
            return _validation_error(str(e))
        message = self._chat_check(req)
        if message:
            return _openai_error(message)
        try:
            prompt = self._chat_prompt(req)
            sp = self._chat_sampling(req)
            sampling, n = self._sampling(sp)
        except _BadRequest as e:
            return _openai_error(str(e), "BadRequest")
        native = {
            "return_logprob": req.logprobs,
            "logprob_start_len": -1,
            "return_text_in_logprobs": True,
            "return_prompt_token_ids": req.return_prompt_token_ids,
        }
        if isinstance(req.rid, list):
            return _openai_error("The rid should be a string for a single chat request", "BadRequest")
        rids = self._rids(req.rid, 1, n)
        try:
            results = await asyncio.gather(*(self._one(prompt, sampling, r, native, sp, start) for r in rids))
            top = req.top_logprobs or 0
            tops = (
                await asyncio.gather(
                    *(self._top_logprobs(prompt, r["output_ids"], top, sampling) for r in results)
                )
                if req.logprobs and top > 0
                else [None] * len(results)
            )
        except (_BadRequest, EngineBadRequest) as e:
            return _openai_error(str(e))
        choices = []
        for index, (ret, top_lists) in enumerate(zip(results, tops, strict=True)):
            meta = ret["meta_info"]
            if top_lists is not None:
                meta["output_top_logprobs"] = top_lists
            finish = meta["finish_reason"]
            choice: dict[str, Any] = {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": ret.get("text") or "",
                    "reasoning_content": None,
                    "tool_calls": None,
                },
                "logprobs": self._choice_logprobs(meta) if req.logprobs else None,
                "finish_reason": finish["type"] if finish else None,
                "matched_stop": finish.get("matched") if finish else None,
            }
            if req.return_prompt_token_ids:
                choice["prompt_token_ids"] = ret.get("prompt_token_ids")
            if req.return_meta_info:
                choice["meta_info"] = meta
            choices.append(choice)
        completion = sum(r["meta_info"].get("completion_tokens", 0) for r in results)
        prompt_tokens = results[0]["meta_info"].get("prompt_tokens", 0)
        return web.json_response(
            {
                "id": results[0]["meta_info"]["id"],
                "object": "chat.completion",
                "created": int(start),
                "model": req.model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "total_tokens": prompt_tokens + completion,
                    "completion_tokens": completion,
                    "prompt_tokens_details": None,
                    "reasoning_tokens": sum(r["meta_info"].get("reasoning_tokens", 0) for r in results),
                },
                "metadata": {"weight_version": results[0]["meta_info"]["weight_version"]},
            }
        )

    def _chat_check(self, req: _ChatRequest) -> str | None:
        """SGLang's `_validate_request`, then what its tokenizer manager refuses on a server with
        no LoRA, hidden states or custom logit processors: a message, or None."""
        if not req.messages:
            return "Messages cannot be empty."
        choice = req.tool_choice
        if isinstance(choice, str) and choice.lower() == "required" and not req.tools:
            return "Tools cannot be empty if tool choice is set to required."
        if choice is not None and not isinstance(choice, str):
            if not req.tools:
                return "Tools cannot be empty if tool choice is set to a specific tool."
            name = (choice.get("function") or {}).get("name")
            if not any((t.get("function") or {}).get("name") == name for t in req.tools):
                return f"Tool '{name}' not found in tools list."
        max_out = req.max_completion_tokens or req.max_tokens
        ctx = self.engine.context_length
        if max_out and max_out > ctx:
            return (
                f"max_completion_tokens is too large: {max_out}."
                f"This model supports at most {ctx} completion tokens."
            )
        if req.stream:
            return "stream is not supported by agentrl's local engine server: send stream=false"
        adapter = req.model.split(":", 1)[1].strip() if ":" in req.model else None
        lora = adapter or req.lora_path
        if lora:
            first = lora if isinstance(lora, str) else next((a for a in lora if a), None)
            return (
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server "
                "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        if req.return_hidden_states:
            return (
                "The server is not configured to return the hidden states. "
                "Please set `--enable-return-hidden-states` to enable this feature."
            )
        if req.custom_logit_processor:
            return (
                "The server is not configured to enable custom logit processor. "
                "Please set `--enable-custom-logit-processor` to enable this feature."
            )
        if req.return_routed_experts:
            return "return_routed_experts is not supported by agentrl's local engine server"
        if req.tools and (choice == "required" or isinstance(choice, dict)):
            return f"tool_choice={choice!r} needs constrained decoding, which agentrl's local engine server lacks"
        if req.response_format and req.response_format.get("type") in (
            "json_schema",
            "json_object",
            "structural_tag",
        ):
            return "response_format (constrained decoding) is not supported by agentrl's local engine server"
        return None

    def _chat_prompt(self, req: _ChatRequest) -> list[int]:
        """The prompt's token ids: `input_ids` as given, else the chat template's rendering."""
        if req.input_ids is not None:
            if not req.input_ids:
                raise _BadRequest("input_ids cannot be empty.")
            return list(req.input_ids)
        tok = self.engine.tokenizer
        if tok is None:
            raise _BadRequest("chat messages need the server's tokenizer; send input_ids")
        messages = []
        for m in req.messages:
            msg = {k: v for k, v in m.model_dump().items() if v is not None}
            msg["content"] = _flatten_content(m.content)
            messages.append(msg)
        prefix = None
        if messages and messages[-1]["role"] == "assistant" and isinstance(req.messages[-1].content, str):
            if req.continue_final_message:
                prefix = messages.pop()["content"]
            else:
                messages[-1] = {"role": "user", "content": messages[-1]["content"]}
        kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        try:
            rendered = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, tools=tools, **kwargs
            )
        except Exception as e:  # jinja2 errors, raise_exception in a template: SGLang's 400
            raise _BadRequest(str(e)) from e
        specials = {"add_special_tokens": False} if tok.encode("") else {}
        ids = list(tok.encode(rendered, **specials))
        if prefix:
            extra = list(tok.encode(prefix))
            if extra and extra[0] == getattr(tok, "bos_token_id", None):
                extra = extra[1:]
            ids += extra
        return ids

    def _chat_sampling(self, req: _ChatRequest) -> dict[str, Any]:
        """`ChatCompletionRequest.to_sampling_params`: request value, else the model's
        generation_config, else OpenAI's default; refused where this server lacks the feature."""
        config = getattr(getattr(self.engine, "model", None), "generation_config", None)
        model_defaults = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}

        def get(name: str) -> Any:
            value = getattr(req, name)
            if value is None:
                value = model_defaults.get(name)
            return _CHAT_SAMPLING_DEFAULTS[name] if value is None else value

        unsupported = {
            "frequency_penalty": req.frequency_penalty != 0.0,
            "presence_penalty": req.presence_penalty != 0.0,
            "min_p": get("min_p") != 0.0,
            "repetition_penalty": get("repetition_penalty") != 1.0,
            "min_tokens": req.min_tokens != 0,
            "regex": req.regex is not None,
            "ebnf": req.ebnf is not None,
            "stop_regex": bool(req.stop_regex),
            "ignore_eos": req.ignore_eos,
            "logit_bias": bool(req.logit_bias),
            "custom_params": bool(req.custom_params),
        }
        for name, used in unsupported.items():
            if used:
                source = " (from the model's generation_config)" if getattr(req, name, None) is None else ""
                raise _BadRequest(f"{name}{source} is not supported by agentrl's local engine server")
        sp: dict[str, Any] = {
            "temperature": get("temperature"),
            "top_p": get("top_p"),
            "top_k": get("top_k"),
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "n": req.n,
            "no_stop_trim": req.no_stop_trim,
            "skip_special_tokens": req.skip_special_tokens,
            "sampling_seed": req.seed,
        }
        # `max_completion_tokens or max_tokens`: None (or 0) means up to the rest of the context.
        sp["max_new_tokens"] = req.max_completion_tokens or req.max_tokens or None
        return sp

    def _choice_logprobs(self, meta: dict[str, Any]) -> dict[str, Any]:
        """`choice.logprobs` from the native meta_info (`_process_response_logprobs`)."""
        tops = meta.get("output_top_logprobs")
        content = []
        for i, (lp, _, text) in enumerate(meta.get("output_token_logprobs") or []):
            token = text or ""
            top = [
                {"token": t or "", "bytes": list((t or "").encode("utf-8")), "logprob": tlp}
                for tlp, _, t in ((tops[i] if tops else None) or [])
            ]
            content.append(
                {"token": token, "bytes": list(token.encode("utf-8")), "logprob": lp, "top_logprobs": top}
            )
        return {"content": content}

    async def _top_logprobs(
        self, prompt: list[int], output_ids: list[int], k: int, sampling: SamplingParams
    ) -> list[list[list[Any]]]:
        """Per output position, the k most likely tokens as `[logprob, id, text]`, from the same
        distribution as the sampled token's log-prob (SGLang: after temperature, before top-k/p).
        One forward pass over prompt + output, queued on the engine's worker thread."""
        if not output_ids:
            return []
        engine = self.engine

        def run() -> list[list[tuple[float, int]]]:
            import torch

            with torch.no_grad():
                ids = torch.tensor([prompt + output_ids[:-1]], device=engine.device)
                logits = engine.model(ids).logits[0, len(prompt) - 1 :].float()
            greedy = sampling.temperature < 1e-6 or engine.logprob_mode == "original"
            logp = torch.log_softmax(logits if greedy else logits / sampling.temperature, -1)
            values, indices = torch.topk(logp, min(k, logp.shape[-1]), -1)
            return [
                list(zip(v.tolist(), i.tolist(), strict=True)) for v, i in zip(values, indices, strict=True)
            ]

        rows = await asyncio.get_running_loop().run_in_executor(engine._executor, run)
        return [[[lp, tid, self._piece(tid)] for lp, tid in row] for row in rows]

    # --- health and info -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if await self.engine.health() else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        # As SGLang: a 1-token greedy request on input_ids [0], 20 s to produce anything.
        probe = SamplingParams(temperature=0.0, max_new_tokens=1)
        try:
            async with asyncio.timeout(20):
                await self.engine.generate([0], probe, rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
        except (TimeoutError, EngineBadRequest):
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.model.config
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": str(self.engine.weight_version),
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", ""),
                "architectures": list(getattr(config, "architectures", None) or []),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "served_model_name": self.served_model_name,
                "host": self.host,
                "port": self.port,
                "tp_size": self.tp_size,
                "dp_size": 1,
                "context_length": self.engine.context_length,
                "weight_version": str(self.engine.weight_version),
                "load_balance_method": "round_robin",
                "disaggregation_mode": "null",
                "device": self.engine.device,
                "status": "paused" if self.engine.paused else "ready",
                "max_total_num_tokens": self.engine.context_length,
                "max_req_input_len": self.engine.context_length - 7,
                "max_running_requests": 1,
                "internal_states": [{}],
                "version": f"agentrl-local (SGLang {SGLANG_VERSION} API)",
            }
        )

    async def weight_version_deprecated(self, request: web.Request) -> web.Response:
        body = {
            "object": "error",
            "message": f"'{request.path}' is deprecated. Please use '/model_info' to get the weight version.",
            "type": "404",
            "param": None,
            "code": 404,
        }
        return web.json_response(body, status=404)

    async def loads(self, request: web.Request) -> web.Response:
        running = sum(1 for r in self.engine._requests.values() if r.submitted)
        waiting = 0  # requests held at the pause gate are not in a scheduler queue on SGLang either
        return web.json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": SGLANG_VERSION,
                "loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting}],
            }
        )

    # --- control plane -------------------------------------------------------------------------

    async def flush_cache(self, request: web.Request) -> web.Response:
        timeout = float(request.query.get("timeout", 0) or 0)
        if not await self.engine.wait_idle(timeout):
            return web.Response(status=400, text="Flush cache failed.\n", content_type="text/plain")
        await self.engine.flush_cache()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n",
            content_type="text/plain",
        )

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _BadRequest(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        return body

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _error(str(e))
        # Exact rids only (0.5.16 tokenizer_manager.py abort_request); empty rid without abort_all
        # is ignored there too.
        self.engine.abort_requests(str(body.get("rid") or "") or None, abort_all=bool(body.get("abort_all")))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            await self.engine.pause(mode=body.get("mode") or "abort")
        except (_BadRequest, EngineBadRequest) as e:
            return _error(str(e))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _version(self, value: Any) -> int:
        if value is None:
            return self.engine.weight_version
        try:
            return int(str(value))
        except ValueError:
            raise _BadRequest(
                f"weight_version {value!r}: agentrl engines number weight versions; send an integer string"
            ) from None

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            if body.get("new_version") is None:
                raise _BadRequest("new_version is required")
            version = self._version(body["new_version"])
        except _BadRequest as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if body.get("abort_all_requests", True):
            self.engine.abort_requests(abort_all=True)
        self.engine.weight_version = version
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": str(version)}
        )

    async def _apply_update(
        self, body: dict[str, Any], load: Callable[[int], Awaitable[None]], *, ok: str, fail: str
    ) -> web.Response:
        """The shared path of every update_weights_* call (SGLang `tokenizer_control_mixin.py` and
        `scheduler_components/weight_updater.py`): abort first if asked; while not paused take the
        writer lock (wait for in-flight requests); load; then flush the cache if `flush_cache`
        (default true), which is fatal while a request is running or queued."""
        try:
            version = self._version(body.get("weight_version"))
        except _BadRequest as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if body.get("abort_all_requests"):
            self.engine.abort_requests(abort_all=True)
        lock = contextlib.nullcontext() if self.engine.paused else self._lock.write()
        async with lock:
            try:
                await load(version)
            except (_BadRequest, EngineBadRequest, EngineError) as e:
                return web.json_response({"success": False, "message": f"{fail}: {e}"}, status=400)
            if body.get("flush_cache", True) and self.engine.busy:
                raise _Fatal(
                    "AssertionError: Cache flush failed after updating weights (an update with "
                    "flush_cache=true while requests are running or queued, e.g. after an in_place "
                    "pause; SGLang 0.5.16 scheduler_components/weight_updater.py "
                    "flush_cache_after_weight_update). Send flush_cache=false after an in_place pause."
                )
        message = ok
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            if not body.get("model_path"):
                return _validation_error("model_path is required")
        except _BadRequest as e:
            return _validation_error(str(e))

        async def load(version: int) -> None:
            await self.engine.load_from_disk(body["model_path"], weight_version=version)

        response = await self._apply_update(
            body, load, ok="Succeeded to update model weights.", fail="Failed to update weights"
        )
        # 0.5.16's disk update answers (UpdateWeightFromDiskReqOutput) also carry num_paused_requests.
        payload = json.loads(response.body)  # type: ignore[arg-type]
        return web.json_response({**payload, "num_paused_requests": 0}, status=response.status)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _validation_error(str(e))
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries or not all(isinstance(x, str) for x in entries):
            return _validation_error("serialized_named_tensors must be a non-empty list of base64 strings")
        fmt = body.get("load_format")
        if fmt not in (None, "direct", "flattened_bucket"):
            raise _Fatal(f"Unknown load_format={fmt}: the scheduler dies (SGLang weight_updater.py)")
        if fmt == "flattened_bucket":
            return web.json_response(
                {
                    "success": False,
                    "message": "load_format 'flattened_bucket' is not served by agentrl's server",
                },
                status=400,
            )
        if len(entries) < self.tp_size:
            raise _Fatal(
                f"IndexError: serialized_named_tensors has {len(entries)} entries for {self.tp_size} TP "
                "ranks (SGLang managers/tp_worker.py indexes it by tp_rank): send one entry per TP rank"
            )
        if len(entries) > self.tp_size:
            # SGLang would silently ignore the extra entries; a client that sends them has the TP
            # size wrong, so refuse instead of loading what may be the wrong shard.
            return web.json_response(
                {
                    "success": False,
                    "message": f"serialized_named_tensors has {len(entries)} entries but this server has "
                    f"tp_size {self.tp_size}: send exactly one entry per TP rank",
                },
                status=400,
            )

        async def load(version: int) -> None:
            ranks = [await asyncio.to_thread(deserialize_named_tensors, e) for e in entries]
            # Each rank loads its own entry; this server holds one copy of the model, so every
            # rank's entry must carry the same tensors.
            for r, pairs in enumerate(ranks[1:], start=1):
                same = len(pairs) == len(ranks[0]) and all(
                    n == n0 and t.shape == t0.shape and bool((t == t0).all())
                    for (n, t), (n0, t0) in zip(pairs, ranks[0], strict=True)
                )
                if not same:
                    raise _BadRequest(
                        f"TP rank {r}'s entry differs from rank 0's; this server holds one copy"
                    )
            await self.engine.load_state_dict(dict(ranks[0]), weight_version=version)

        return await self._apply_update(body, load, ok="Success", fail="Failed to update weights from tensor")

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            for key in ("master_address", "master_port", "rank_offset", "world_size"):
                if key not in body:
                    return _validation_error(f"{key} is required")
            group = str(body.get("group_name") or "weight_update_group")
            backend = str(body.get("backend") or "nccl")
            if self.engine.device == "cpu" and backend == "nccl":
                raise _BadRequest("backend 'nccl' needs a GPU; this server runs on CPU: use 'gloo'")
            if group in self._groups:
                raise _BadRequest(f"group {group!r} already exists")
            # Each TP rank joins as rank_offset + tp_rank (weight_updater.py init_weights_update_group).
            members = await asyncio.gather(
                *(
                    asyncio.to_thread(
                        WeightGroup,
                        master_address=str(body["master_address"]),
                        master_port=int(body["master_port"]),
                        rank=int(body["rank_offset"]) + tp_rank,
                        world_size=int(body["world_size"]),
                        group_name=group,
                        backend=backend,
                        timeout_s=float(body.get("timeout_s") or 300.0),
                    )
                    for tp_rank in range(self.tp_size)
                )
            )
        except (_BadRequest, EngineBadRequest, RuntimeError, ValueError, TypeError) as e:
            message = f"Failed to initialize custom process group: {e}."
            return web.json_response({"success": False, "message": message}, status=400)
        self._groups[group] = list(members)
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _validation_error(str(e))
        members = self._groups.pop(str(body.get("group_name") or "weight_update_group"), None)
        if members is None:
            return web.json_response(
                {"success": False, "message": "The group to be destroyed does not exist."}, status=400
            )
        for m in members:
            m.destroy()
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _validation_error(str(e))
        for key in ("names", "dtypes", "shapes"):
            if key not in body:
                return _validation_error(f"{key} is required")
        group = str(body.get("group_name") or "weight_update_group")
        members = self._groups.get(group)
        if members is None:
            raise _Fatal(
                f"AssertionError: Group {group} not in {list(self._groups)}. Please call "
                "`init_weights_update_group` first. (model_runner_components/weight_updater.py)"
            )
        if body.get("load_format") not in (None,):
            return web.json_response(
                {"success": False, "message": f"load_format {body['load_format']!r} is not served here"},
                status=400,
            )

        def receive(member: WeightGroup) -> list[tuple[str, Any]]:
            import torch

            out = []
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, str(dtype)), device=self.engine.device)
                member.broadcast(tensor, src=0)
                out.append((str(name), tensor))
            return out

        async def load(version: int) -> None:
            try:
                received = await asyncio.gather(*(asyncio.to_thread(receive, m) for m in members))
            except (RuntimeError, ValueError, TypeError, AttributeError) as e:
                raise _BadRequest(str(e)) from e
            await self.engine.load_state_dict(dict(received[0]), weight_version=version)

        return await self._apply_update(
            body,
            load,
            ok="Succeeded to update parameter online.",
            fail="Failed to update parameter online; the full weights of the ModelRunner are partially "
            "updated. Please discard the whole weights",
        )


async def serve(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    device: str = "cpu",
    logprob_mode: str = "processed",
    cpu_threads: int | None = None,
    tp_size: int = 1,
    served_model_name: str | None = None,
    ready: asyncio.Event | None = None,
    api_key: str | None = None,
) -> str | None:
    """Load a model directory and serve it until cancelled (returns None) or until a fatal error
    kills it as it would kill SGLang (returns the reason)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise EngineBadRequest(f"--model {path} is not a directory (it must hold a transformers model)")
    model = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
    engine = LocalEngine(model, tokenizer, device=device, logprob_mode=logprob_mode, cpu_threads=cpu_threads)
    try:
        async with EngineServer(
            engine,
            model_path=str(path),
            host=host,
            port=port,
            tp_size=tp_size,
            served_model_name=served_model_name,
            api_key=api_key,
        ) as server:
            print(f"agentrl engine serving {path} at {server.url}", flush=True)
            if ready is not None:
                ready.set()
            await server.died.wait()
            return server.dead
    finally:
        await engine.aclose()
