"""Engines by name, for command lines and recipes: `build_engine(EngineSpec(kind=...))`.

local     a transformers model in this process (`LocalEngine`)
sglang    SGLang workers (or a router) over HTTP (`SGLangEngine`), with a local tokenizer
openai    an OpenAI-compatible chat API (evaluation only: no tokens, no log-probs)
scripted  fixed replies (`ScriptedEngine`), e.g. a task's reference solution
"""

from __future__ import annotations

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
    kind: str
    model: Path | None = None
    urls: list[str] = field(default_factory=list)
    tokenizer: Path | None = None
    api_model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    scripted_replies: Sequence[str] = ()


def build_engine(spec: EngineSpec) -> tuple[Any, Any]:
    """(engine, tokenizer or None). The tokenizer is None for chat APIs that take text."""
    if spec.kind == "openai":
        if not spec.urls or not spec.api_model:
            raise EngineConfigError("the openai engine needs a base URL and an API model name")
        return OpenAIChatEngine(
            base_url=spec.urls[0], model=spec.api_model, api_key_env=spec.api_key_env
        ), None
    from transformers import AutoTokenizer

    if spec.kind == "sglang":
        if not spec.urls or spec.tokenizer is None:
            raise EngineConfigError(
                "the sglang engine needs one or more worker URLs and a tokenizer directory"
            )
        # The key in `api_key_env` when that variable is set (a keyed fleet), else none.
        key_env = spec.api_key_env if spec.api_key_env and os.environ.get(spec.api_key_env) else None
        engine = SGLangEngine(list(spec.urls), api_key_env=key_env)
        return engine, AutoTokenizer.from_pretrained(str(spec.tokenizer))
    if spec.kind not in KINDS:
        raise EngineConfigError(f"unknown engine {spec.kind!r}: choose one of {', '.join(KINDS)}")

    model_dir = check_model_source(spec.model) if spec.model else tiny_model_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if spec.kind == "scripted":
        if not spec.scripted_replies:
            raise EngineConfigError("the scripted engine needs its replies")
        return ScriptedEngine(list(spec.scripted_replies), tok), tok
    from transformers import AutoModelForCausalLM

    return LocalEngine(AutoModelForCausalLM.from_pretrained(str(model_dir)), tok), tok
