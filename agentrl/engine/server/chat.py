"""The OpenAI-compatible endpoints of the SGLang-compatible server (`/v1/models`,
`/v1/chat/completions`), checked as SGLang's `serving_chat.py` checks them."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError, field_validator, model_validator

from agentrl.engine.base import EngineBadRequest, SamplingParams
from agentrl.engine.server.common import (
    _BadRequest,
    _validation_error,
    lora_not_enabled,
)

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


class OpenAIEndpoints:
    """`/v1/models` and `/v1/chat/completions` of `EngineServer`."""

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
            "lora_path": _chat_lora(req),
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
        lora = _chat_lora(req)
        if lora and self.engine.lora is None:
            return lora_not_enabled(lora)
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


def _chat_lora(req: _ChatRequest) -> str | None:
    """The adapter a chat request names: `model` "base:adapter" first (SGLang's
    `serving_base._parse_model_parameter`), else `lora_path` (a list: its first name)."""
    adapter = req.model.split(":", 1)[1].strip() if ":" in req.model else None
    lora = adapter or req.lora_path
    if isinstance(lora, list):
        lora = next((a for a in lora if a), None)
    return lora or None
