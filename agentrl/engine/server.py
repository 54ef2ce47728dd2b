"""An SGLang-compatible HTTP server around `LocalEngine` (`agentrl engine serve`).

Request and response shapes follow SGLang 0.5.16's `http_server.py` / `io_struct.py` (restated in
the project's SGLang reference), so the same client code talks to this server and to a real SGLang
worker. What is served:

- `POST|PUT /generate`: `input_ids` (1-D, or 2-D for a batch) or `text`, `sampling_params`,
  `rid`, `return_logprob`, `logprob_start_len`, `return_text_in_logprobs`,
  `return_prompt_token_ids`; `n > 1` samples. Logprob entries are `[logprob, token_id, text|null]`.
  Aborted requests answer 200 with `finish_reason.type == "abort"` and the partial tokens.
  A client that disconnects aborts its request.
- `GET /health`, `/health_generate`, `/model_info` (+ `/get_model_info`), `/server_info`
  (+ `/get_server_info`), `/v1/loads`; `/get_weight_version` answers 404 as 0.5.16 does.
- `GET|POST /flush_cache` (text/plain; 400 while requests run), `POST /abort_request`,
  `/pause_generation`, `/continue_generation`, `/update_weight_version`.
- `POST /update_weights_from_disk`: a directory of safetensors (see `LocalEngine.load_from_disk`).
- `POST /update_weights_from_tensor`: SGLang sends pickled tensors (`MultiprocessingSerializer`),
  which would let any client run code here. This server accepts a safe subset instead: each
  `serialized_named_tensors` entry is the base64 of a safetensors file (names as in the model's
  `state_dict()`), `load_format` absent or `"safetensors"`; see `agentrl.engine.tensors`. Anything
  else is refused with SGLang's `{"success": false, "message": ...}` (HTTP 400).
- `POST /init_weights_update_group`, `/update_weights_from_distributed`: no NCCL group can exist
  here; both answer 400 with `success: false` and a message modelled on the assertion SGLang
  raises when no group is set up.

Not served: streaming (`"stream": true` is refused with 400), multimodal inputs, penalties,
constrained decoding, LoRA; each is refused with a 400 that names the field.

Weight versions: SGLang's are strings ("default" until set); this engine's are integers, so a
`weight_version` must be an integer string. An update without `weight_version` keeps the version,
as on SGLang.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.engine.base import EngineBadRequest, Generation, SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.tensors import deserialize_named_tensors, serialize_named_tensors

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


class _BadRequest(Exception):
    """A request SGLang answers with HTTP 400 `{"error": {"message": ...}}`."""


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _validation_error(message: str) -> web.Response:
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


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
    ) -> None:
        self.engine = engine
        self.model_path = str(model_path)
        self.host = host
        self.port = port
        self.served_model_name = served_model_name or (Path(self.model_path).name or "default")
        self._runner: web.AppRunner | None = None
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
        if self.port == 0:
            self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=512 * 1024 * 1024)
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
        return app

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
        gen = await self.engine.generate(prompt, sampling, rid=rid)
        meta: dict[str, Any] = {"id": rid, "finish_reason": self._finish(gen)}
        waiting_abort = gen.meta.get("message") == "Abort in waiting queue"
        if not waiting_abort:
            meta["prompt_tokens"] = len(prompt)
        meta["weight_version"] = str(gen.weight_version)
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
                "tp_size": 1,
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
        waiting = self.engine.num_requests - running
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
        self.engine.abort(str(body.get("rid") or ""), abort_all=bool(body.get("abort_all")))
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
            self.engine.abort(abort_all=True)
        self.engine.weight_version = version
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": str(version)}
        )

    async def _apply_update(self, body: dict[str, Any], load: Any) -> web.Response:
        try:
            version = self._version(body.get("weight_version"))
            if body.get("abort_all_requests"):
                self.engine.abort(abort_all=True)
            await load(version)
        except (_BadRequest, EngineBadRequest) as e:
            return web.json_response(
                {"success": False, "message": str(e), "num_paused_requests": 0}, status=400
            )
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            if not body.get("model_path"):
                return _validation_error("model_path is required")
        except _BadRequest as e:
            return _validation_error(str(e))

        async def load(version: int) -> None:
            await self.engine.load_from_disk(body["model_path"], weight_version=version)

        return await self._apply_update(body, load)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _validation_error(str(e))
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries or not all(isinstance(x, str) for x in entries):
            return _validation_error("serialized_named_tensors must be a non-empty list of base64 strings")

        async def load(version: int) -> None:
            if body.get("load_format") not in (None, "safetensors"):
                raise _BadRequest(
                    f"load_format {body['load_format']!r} is not accepted here: send base64 safetensors "
                    "with load_format null or 'safetensors'"
                )
            # One entry per TP rank on SGLang; this server is one rank.
            tensors = await asyncio.to_thread(deserialize_named_tensors, entries[0])
            await self.engine.load_state_dict(tensors, weight_version=version)

        return await self._apply_update(body, load)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        message = (
            "Failed to init parameter update group: agentrl's local engine server cannot join an NCCL "
            "process group; use /update_weights_from_disk or /update_weights_from_tensor"
        )
        return web.json_response({"success": False, "message": message}, status=400)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _validation_error(str(e))
        for key in ("names", "dtypes", "shapes"):
            if key not in body:
                return _validation_error(f"{key} is required")
        group = body.get("group_name") or "weight_update_group"
        message = (
            f"Failed to update parameter online: Group {group} not in []. Please call "
            "init_weights_update_group first. The full weights of the ModelRunner are partially "
            "updated. Please discard the whole weights."
        )
        return web.json_response({"success": False, "message": message}, status=400)


async def serve(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    device: str = "cpu",
    logprob_mode: str = "processed",
    cpu_threads: int | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Load a model directory and serve it until cancelled."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise EngineBadRequest(f"--model {path} is not a directory (it must hold a transformers model)")
    model = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
    engine = LocalEngine(model, tokenizer, device=device, logprob_mode=logprob_mode, cpu_threads=cpu_threads)
    try:
        async with EngineServer(engine, model_path=str(path), host=host, port=port) as server:
            print(f"agentrl engine serving {path} at {server.url}", flush=True)
            if ready is not None:
                ready.set()
            await asyncio.Event().wait()
    finally:
        await engine.aclose()
