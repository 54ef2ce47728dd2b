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
- LoRA (`--enable-lora`, as SGLang's; `agentrl.engine.lora`): `POST /load_lora_adapter`
  (`lora_name`, `lora_path`: a PEFT adapter directory) and `/unload_lora_adapter` (`lora_name`)
  answer `{"success", "error_message", "loaded_adapters": {name: path}}`, 400 on failure (LoRA not
  enabled, a name already loaded, a rank above `--max-lora-rank`, a file that is not an adapter);
  `/generate`'s `lora_path` (a name, or one per prompt) and chat's `model` "base:adapter" or
  `lora_path` pick the adapter a request runs with; without `--enable-lora` they are refused.
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
import hmac
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.engine.base import EngineBadRequest, Generation, SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.routes import encode_routes
from agentrl.engine.server.chat import OpenAIEndpoints
from agentrl.engine.server.common import (
    _DEFAULT_MAX_NEW_TOKENS,
    _HANDLED_SAMPLING,
    _INERT_SAMPLING,
    _UNSUPPORTED_TOP_LEVEL,
    SGLANG_VERSION,
    _BadRequest,
    _error,
    _Fatal,
    _ModelUpdateLock,
    _validation_error,
    log,
    lora_not_enabled,
)
from agentrl.engine.server.control import ControlPlane
from agentrl.engine.weight_group import WeightGroup


class EngineServer(OpenAIEndpoints, ControlPlane):
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
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
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
            loras = self._loras(body.get("lora_path"), len(prompts))
            jobs = [(p, r, loras[i]) for i, p in enumerate(prompts) for r in rids[i * n : (i + 1) * n]]
            results = await asyncio.gather(
                *(self._one(p, sampling, r, {**body, "lora_path": lora}, sp, start) for p, r, lora in jobs)
            )
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

    def _loras(self, value: Any, batch: int) -> list[str | None]:
        """Each prompt's adapter (`lora_path`: one name, or one per prompt, null for the base)."""
        if value is None:
            return [None] * batch
        names = [value] * batch if isinstance(value, str) else value
        if not isinstance(names, list) or len(names) != batch:
            raise _BadRequest("lora_path must be a string or a list with one entry per prompt")
        if any(n is not None and not isinstance(n, str) for n in names):
            raise _BadRequest("lora_path entries must be adapter names (strings) or null")
        named = next((n for n in names if n), None)
        if named and self.engine.lora is None:
            raise _BadRequest(lora_not_enabled(named))
        return [n or None for n in names]

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
            gen = await self.engine.generate(
                prompt, sampling, rid=rid, lora=body.get("lora_path"),
                routed_experts=bool(body.get("return_routed_experts")),
            )  # fmt: skip
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
                # with the request's adapter, as SGLang scores the prompt with it
                lps = await self.engine.prompt_logprobs(prompt, lora=body.get("lora_path"))
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
        if gen.routed_experts is not None:  # SGLang: base64 int32 [input + output - 1, layers, top_k]
            meta["routed_experts"] = encode_routes(gen.routed_experts)
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
    enable_lora: bool = False,
    max_lora_rank: int | None = None,
    max_loaded_loras: int | None = None,
    lora_paths: dict[str, str] | None = None,
    enable_return_routed_experts: bool = False,
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
    engine = LocalEngine(
        model, tokenizer, device=device, logprob_mode=logprob_mode, cpu_threads=cpu_threads,
        enable_lora=enable_lora or bool(lora_paths), max_lora_rank=max_lora_rank, max_loaded_loras=max_loaded_loras,
        return_routed_experts=enable_return_routed_experts,
    )  # fmt: skip
    for name, adapter in (lora_paths or {}).items():  # SGLang's --lora-paths NAME=PATH, loaded at start
        await engine.load_lora_adapter(name, adapter)
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
