"""LoRA for the torch trainer: low-rank adapters on the attention and MLP projections (`peft`, the
`lora` extra), only the adapters trained, optimised and checkpointed.

    W' = W + (alpha / rank) B A        A: [rank, in], B: [out, rank], B = 0 at the start

What goes to the engines is the weight transport's choice (`sync.transport`):
  any transport   every weight under its Hugging Face name with the adapters folded in
                  (`merged_weights`): engines need no LoRA support
  lora_adapter    the adapters alone, as a PEFT adapter directory (`adapter_config.json` +
                  `adapter_model.safetensors`) the engines load by name (SGLang's `--enable-lora`
                  and `/load_lora_adapter`; `agentrl.train.weight_sync.AdapterTransport`); requests
                  name the adapter, so the engines' base weights never move.

`peft` is imported lazily: it is an optional extra and the rest of the trainer runs without it.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agentrl.engine.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from agentrl.train.config import DEFAULT_TARGETS, LoraConfig

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "LoraError", "apply_lora", "merged_weights"]


class LoraError(ValueError):
    """LoRA settings that cannot apply to this model."""


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise LoraError("trainer.lora needs peft: pip install 'agentrl[lora]'") from None
    return peft


def apply_lora(model: Any, config: LoraConfig) -> Any:
    """`model` with fresh adapters on `config.targets` (a peft `PeftModel`); only adapters train."""
    peft = _peft()
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    hit = sorted(set(config.targets) & names)
    if not hit:
        raise LoraError(
            f"trainer.lora.targets {list(config.targets)} match no Linear module of this model; "
            f"its projections are {sorted(names)}"
        )
    peft_config = peft.LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=hit, bias="none"
    )
    # On transformers 5, peft rewrites targets named like transformers 4's expert projections
    # (gate_proj / up_proj / down_proj) onto the fused expert parameters of known MoE types, so that
    # old adapters still load. Fresh adapters go exactly on the Linear modules named (the routed
    # experts stay frozen), so the model's type is hidden from that rewrite while they are injected.
    config = model.config
    model_type = config.__dict__.get("model_type")
    config.model_type = "agentrl_lora_target"
    try:
        with warnings.catch_warnings():  # transformers' deprecation of a name peft still reads
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, peft_config)
    finally:
        if model_type is None:
            del config.model_type
        else:
            config.model_type = model_type


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def causal_lm(model: Any) -> Any:
    """The transformers model under a LoRA wrapper (its adapted layers in place), else `model`."""
    return model.get_base_model() if is_lora(model) else model


def _lora_layers(model: Any) -> dict[str, Any]:
    peft = _peft()
    return {
        name: module
        for name, module in causal_lm(model).named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
    }


def merged_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the adapted model under its Hugging Face name, adapters folded in
    (W + scale B A); the model itself is not changed."""
    layers = _lora_layers(model)
    for name, tensor in causal_lm(model).state_dict().items():
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, tensor
            continue
        owner, _, leaf = name.partition(".base_layer.")
        if leaf == "weight":
            with torch.no_grad():
                delta = layers[owner].get_delta_weight("default")
            yield f"{owner}.weight", tensor + delta.to(tensor.dtype)
        else:
            yield f"{owner}.{leaf}", tensor


def adapter_weights(model: Any) -> dict[str, torch.Tensor]:
    """The adapters alone, under PEFT's file names (what `save_pretrained` writes)."""
    return dict(_peft().get_peft_model_state_dict(model))


def adapter_config(model: Any) -> dict[str, Any]:
    """The adapter's `adapter_config.json` (PEFT's own serialisation)."""
    config = model.peft_config["default"]
    out: dict[str, Any] = json.loads(json.dumps(config.to_dict(), default=_jsonable))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, set):
        return sorted(value)
    return str(value)


def write_adapter(model: Any, directory: Path, dtype: torch.dtype | None = None) -> None:
    """A PEFT adapter directory: `adapter_config.json` and `adapter_model.safetensors`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()).contiguous()
        for k, v in adapter_weights(model).items()
    }
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(model), indent=1, sort_keys=True))
