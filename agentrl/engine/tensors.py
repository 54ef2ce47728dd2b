"""The safe wire format for `update_weights_from_tensor` between agentrl's trainer and engines.

SGLang's payload (`UpdateWeightsFromTensorReqInput.serialized_named_tensors`) is a list with one
entry per TP rank of the server (`managers/tp_worker.py` picks `serialized_named_tensors[tp_rank]`),
and each entry is `MultiprocessingSerializer.serialize(named_tensors)` of a LIST of `(name, tensor)`
pairs, which `model_runner.update_weights_from_tensor` iterates in order (`for name, tensor in
named_tensors`): names may repeat, order matters, and it is not a dict.

That serializer is a pickle, and unpickling runs code, so agentrl's engine server accepts this
instead, with the same structure: each entry is the base64 of a safetensors file holding the
tensors under the keys "0", "1", ... and the ordered list of names in its metadata. An entry
without that list (e.g. a safetensors dict keyed by names) is refused, as SGLang's model runner
would fail on a dict.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

from agentrl.engine.base import EngineBadRequest

NAMES_KEY = "agentrl_named_tensors"


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Any]]) -> str:
    """One `serialized_named_tensors` entry (one TP rank): base64 of a safetensors file of an
    ordered list of `(name, tensor)` pairs."""
    from safetensors.torch import save

    if isinstance(named_tensors, dict):
        raise TypeError("serialize_named_tensors takes a list of (name, tensor) pairs, as SGLang, not a dict")
    pairs = list(named_tensors)
    blob = save(
        {str(i): t.detach().contiguous().cpu() for i, (_, t) in enumerate(pairs)},
        metadata={NAMES_KEY: json.dumps([name for name, _ in pairs])},
    )
    return base64.b64encode(blob).decode("ascii")


def deserialize_named_tensors(entry: str) -> list[tuple[str, Any]]:
    """Inverse of `serialize_named_tensors`; anything else raises `EngineBadRequest`."""
    from safetensors.torch import load

    try:
        blob = base64.b64decode(entry, validate=True)
        tensors = load(blob)
        # The metadata sits in the JSON header after its 8-byte little-endian length.
        header_len = int.from_bytes(blob[:8], "little")
        metadata = json.loads(blob[8 : 8 + header_len]).get("__metadata__") or {}
    except Exception as e:  # any decoding failure means the payload is not the safe format
        raise EngineBadRequest(
            "serialized_named_tensors must be base64 safetensors (agentrl.engine.tensors."
            "serialize_named_tensors); pickled tensors are refused because unpickling runs code "
            f"({type(e).__name__})"
        ) from e
    if NAMES_KEY not in metadata:
        raise EngineBadRequest(
            "serialized_named_tensors entry is a dict of tensors, not a list of (name, tensor) pairs: "
            "SGLang's model runner iterates pairs (model_runner.update_weights_from_tensor); build "
            "entries with agentrl.engine.tensors.serialize_named_tensors"
        )
    names = json.loads(metadata[NAMES_KEY])
    if not isinstance(names, list) or len(names) != len(tensors):
        raise EngineBadRequest("serialized_named_tensors entry: the name list does not match the tensors")
    return [(str(name), tensors[str(i)]) for i, name in enumerate(names)]
