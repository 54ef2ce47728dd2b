"""The safe wire format for `update_weights_from_tensor` between agentrl's trainer and engines.

SGLang's own format is a pickle (`MultiprocessingSerializer`), and unpickling runs code, so agentrl's
engine server accepts this instead: each `serialized_named_tensors` entry is the base64 of a
safetensors file whose names are the model's `state_dict()` names.
"""

from __future__ import annotations

import base64
from typing import Any

from agentrl.engine.base import EngineBadRequest


def serialize_named_tensors(named_tensors: dict[str, Any]) -> str:
    """One `serialized_named_tensors` entry: base64 of a safetensors file."""
    from safetensors.torch import save

    blob = save({k: v.detach().contiguous().cpu() for k, v in named_tensors.items()})
    return base64.b64encode(blob).decode("ascii")


def deserialize_named_tensors(entry: str) -> dict[str, Any]:
    """Inverse of `serialize_named_tensors`; anything else raises `EngineBadRequest`."""
    from safetensors.torch import load

    try:
        return load(base64.b64decode(entry, validate=True))
    except Exception as e:  # any decoding failure means the payload is not the safe format
        raise EngineBadRequest(
            "serialized_named_tensors must be base64 safetensors (agentrl.engine.tensors."
            "serialize_named_tensors); pickled tensors are refused because unpickling runs code "
            f"({type(e).__name__})"
        ) from e
