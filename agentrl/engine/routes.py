"""Routed experts (R3) on the wire, as SGLang sends them: `meta_info.routed_experts` is base64 of
the int32 array [tokens, layers, top_k] in C order (`managers/tokenizer_manager.py`); Miles decodes it
with `np.frombuffer(..., int32).reshape(len(tokens) - 1, num_layers, topk)`."""

from __future__ import annotations

from typing import Any

from agentrl.engine.base import EngineError


def encode_routes(routes: list[list[list[int]]]) -> str:
    """SGLang's `meta_info.routed_experts`: base64 of the int32 array [tokens, layers, top_k], C order."""
    import base64
    import struct

    flat = [e for token in routes for layer in token for e in layer]
    return base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode()


def decode_routes(text: str, tokens: int) -> list[list[list[int]]]:
    """`encode_routes`' inverse for `tokens` routed tokens; the layer and top-k sizes come from
    the array's length only up to their product, so the caller's model gives `layers`."""
    import base64
    import struct

    raw = base64.b64decode(text)
    flat = list(struct.unpack(f"<{len(raw) // 4}i", raw))
    if tokens <= 0 or len(flat) % tokens:
        raise ValueError(f"routed_experts of {len(flat)} values do not split over {tokens} tokens")
    per = len(flat) // tokens
    return [[flat[t * per : (t + 1) * per]] for t in range(tokens)]


def routes_of_reply(reply: dict[str, Any], tokens: int, layers: int) -> list[list[list[int]]]:
    """A /generate reply's `meta_info.routed_experts` as [tokens][layers][top_k]."""
    text = (reply.get("meta_info") or {}).get("routed_experts")
    if not isinstance(text, str):
        raise EngineError(
            "SGLang /generate returned no routed_experts although asked: start the servers with "
            "--enable-return-routed-experts",
            cause="engine_config",
        )
    try:
        flat = [t[0] for t in decode_routes(text, tokens)]
    except ValueError as exc:
        raise EngineError(f"SGLang /generate: {exc}", cause="engine_protocol") from None
    if any(len(row) % layers for row in flat):
        raise EngineError(f"SGLang routed_experts do not split over {layers} layers", cause="engine_protocol")
    k = len(flat[0]) // layers if flat else 0
    return [[row[i * k : (i + 1) * k] for i in range(layers)] for row in flat]
