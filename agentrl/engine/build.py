"""Engines by name, for command lines and recipes: `build_engine(EngineSpec(kind=...))`.

local     a transformers model in this process (`LocalEngine`)
sglang    SGLang workers (or a router) over HTTP (`SGLangEngine`), with a local tokenizer
openai    an OpenAI-compatible chat API (evaluation only: no tokens, no log-probs)
scripted  fixed replies (`ScriptedEngine`), e.g. a task's reference solution
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.engine.local import LocalEngine
from agentrl.engine.openai import OpenAIChatEngine
from agentrl.engine.scripted import ScriptedEngine
from agentrl.engine.sglang import SGLangEngine
from agentrl.errors import AgentRLError
from agentrl.models.source import check_model_source
from agentrl.models.tiny import tiny_model_dir

KINDS = ("local", "sglang", "openai", "scripted")


class EngineConfigError(AgentRLError):
    """The engine choice is incomplete or unknown."""


@dataclass
class EngineSpec:
    """Everything that picks and configures one engine; the only input of `build_engine`."""

    kind: str
    model: Path | None = None  # local / scripted: a transformers model directory (default: tiny)
    urls: list[str] = field(default_factory=list)  # sglang workers; openai: the base URL
    tokenizer: Path | None = None  # sglang: the tokenizer directory
    api_model: str | None = None  # openai: the served model's name
    # The variable that holds the API key; it is sent only when the variable is set.
    api_key_env: str | None = "OPENAI_API_KEY"
    scripted_replies: Sequence[str] = ()
    api_key_file: str | None = None  # sglang: a file that holds the key (a cluster run's)
    router_url: str | None = None  # sglang: a router for generation (`urls` then serve control)
    device: str = "cpu"  # local
    max_batch: int = 16  # local: requests batched per forward pass
    logprob_mode: str = "processed"  # local
    enable_lora: bool = False  # local: serve LoRA adapters by name (SGLang's --enable-lora)
    routed_experts: bool = False  # R3: every generation returns its routed experts
    # sglang HTTP behaviour (see `SGLangEngine`)
    request_timeout_s: float = 1800.0
    control_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    retries: int = 5
    on_version_mismatch: str = "flag"
    flush_wait_s: float = 60.0


def build_engine(spec: EngineSpec, *, policy: Any = None, tokenizer: Any = None) -> tuple[Any, Any]:
    """(engine, tokenizer or None). The tokenizer is None for chat APIs that take text.

    `policy` / `tokenizer`: objects the caller holds already (a training run's model, copied for
    the in-process engine, and its tokenizer); otherwise they are loaded from the spec's paths."""
    if spec.kind == "openai":
        if not spec.urls or not spec.api_model:
            raise EngineConfigError("the openai engine needs a base URL and an API model name")
        return OpenAIChatEngine(
            base_url=spec.urls[0], model=spec.api_model, api_key_env=spec.api_key_env
        ), None
    from transformers import AutoTokenizer

    if spec.kind == "sglang":
        if not spec.urls and not spec.router_url:
            raise EngineConfigError(
                "the sglang engine needs one or more worker URLs (engine.urls / --url), a router URL "
                "(engine.router_url), or both (the router for generation, the workers for control)"
            )
        if tokenizer is None and spec.tokenizer is None:
            raise EngineConfigError("the sglang engine needs a tokenizer directory")
        # The key in `api_key_env` when that variable is set (a keyed fleet), else none.
        key_env = spec.api_key_env if spec.api_key_env and os.environ.get(spec.api_key_env) else None
        engine = SGLangEngine(
            None if spec.router_url else list(spec.urls),
            router_url=spec.router_url,
            worker_urls=(spec.urls or None) if spec.router_url else None,
            request_timeout_s=spec.request_timeout_s,
            control_timeout_s=spec.control_timeout_s,
            connect_timeout_s=spec.connect_timeout_s,
            retries=spec.retries,
            api_key_env=key_env,
            api_key_file=spec.api_key_file,
            on_version_mismatch=spec.on_version_mismatch,  # type: ignore[arg-type]
            flush_wait_s=spec.flush_wait_s,
            routed_layers=_num_layers(spec) if spec.routed_experts else None,
        )
        return engine, tokenizer or AutoTokenizer.from_pretrained(str(spec.tokenizer))
    if spec.kind not in KINDS:
        raise EngineConfigError(f"unknown engine {spec.kind!r}: choose one of {', '.join(KINDS)}")
    if spec.kind == "local" and policy is not None:
        engine = LocalEngine(
            copy.deepcopy(policy).eval(),
            tokenizer,
            device=spec.device,
            max_batch=spec.max_batch,
            logprob_mode=spec.logprob_mode,
            enable_lora=spec.enable_lora,
            return_routed_experts=spec.routed_experts,
        )
        return engine, tokenizer

    model_dir = check_model_source(spec.model) if spec.model else tiny_model_dir()
    tok = tokenizer or AutoTokenizer.from_pretrained(str(model_dir))
    if spec.kind == "scripted":
        if not spec.scripted_replies:
            raise EngineConfigError("the scripted engine needs its replies")
        return ScriptedEngine(list(spec.scripted_replies), tok), tok
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    engine = LocalEngine(
        model, tok, device=spec.device, max_batch=spec.max_batch, logprob_mode=spec.logprob_mode,
        enable_lora=spec.enable_lora, return_routed_experts=spec.routed_experts,
    )  # fmt: skip
    return engine, tok


def _num_layers(spec: EngineSpec) -> int:
    """The model's decoder layer count (its config.json), which splits SGLang's routed experts."""
    import json

    for where in (spec.model, spec.tokenizer):
        if where is not None and (Path(where) / "config.json").is_file():
            return int(json.loads((Path(where) / "config.json").read_text())["num_hidden_layers"])
    raise EngineConfigError(
        "return_routed_experts needs the model's config.json (engine.model) for its layer count"
    )
