"""LoRA in the torch trainer against brute-force references: the merged weights are W + (alpha / r)
B A computed by hand, the adapters' gradients are the chain rule of the full weight's gradient, only
adapters change and are checkpointed, and what the engines get is the merged model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from agentrl.algo import LossConfig
from agentrl.train.checkpoint import CheckpointError
from agentrl.train.config import TrainConfig
from agentrl.train.lora import LoraConfig, LoraError, adapter_weights, apply_lora, merged_weights
from agentrl.train.torch_backend import TorchTrainer
from tests.test_train_models import make_samples, policy, tiny_base  # noqa: F401

pytest.importorskip("peft")

LORA = LoraConfig(rank=4, alpha=8.0)


def _trainer(model, lora=LORA, **kw):
    cfg = TrainConfig(lr=kw.pop("lr", 1e-2), weight_decay=0.0, lora=lora, adam_eps=1.0, **kw)
    return TorchTrainer(model, cfg, device="cpu")


def _randomise_b(model, seed: int = 0) -> None:
    """B starts at 0 (the adapted model is the base model); a random B makes every check bite."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _lora_pairs(model):
    """owner module name -> (base weight, A, B, scale), read from the parameters by hand."""
    params = dict(model.get_base_model().named_parameters())
    out = {}
    for name, a in params.items():
        if name.endswith("lora_A.default.weight"):
            owner = name[: -len(".lora_A.default.weight")]
            b = params[f"{owner}.lora_B.default.weight"]
            out[owner] = (params[f"{owner}.base_layer.weight"], a, b, LORA.alpha / LORA.rank)
    return out


def test_merged_weights_are_w_plus_scaled_b_a_and_every_other_weight_as_is(tiny_base):  # noqa: F811
    base = dict(copy.deepcopy(tiny_base).float().state_dict())
    model = apply_lora(copy.deepcopy(tiny_base).float(), LORA)
    _randomise_b(model)
    merged = dict(merged_weights(model))
    assert set(merged) == set(base)  # Hugging Face names, nothing added or lost
    pairs = _lora_pairs(model)
    assert pairs  # attention and MLP projections are adapted
    for name, w in merged.items():
        owner = name[: -len(".weight")]
        if owner in pairs:
            w0, a, b, scale = pairs[owner]
            assert torch.allclose(w, w0 + scale * b @ a, atol=1e-6), name
            assert not torch.equal(w, base[name])
        else:
            assert torch.equal(w, base[name]), name
    # peft's own merge agrees, and the model was not changed by reading it.
    theirs = copy.deepcopy(model).merge_and_unload().state_dict()
    assert all(torch.allclose(merged[k], theirs[k], atol=1e-6) for k in merged)
    assert all(".lora_A." in k or ".lora_B." in k or ".base_layer." in k or k in base
               for k in model.get_base_model().state_dict())  # fmt: skip


def test_adapter_gradients_are_the_chain_rule_of_the_full_weight_gradient(tiny_base):  # noqa: F811
    """dL/dB = s G A^T and dL/dA = s B^T G, G = dL/dW of the merged model at the same point."""
    samples = make_samples(tiny_base, seed=3)
    lora_model = apply_lora(copy.deepcopy(tiny_base).float(), LORA)
    _randomise_b(lora_model)
    full = copy.deepcopy(tiny_base).float()
    full.load_state_dict(dict(merged_weights(lora_model)))
    grads = {}
    for name, model in (("lora", lora_model), ("full", full)):
        # No clipping: the two models' gradient norms differ, so a clip would scale them apart.
        cfg = TrainConfig(lr=1e-3, grad_clip=1e9, loss=LossConfig(use_tis=False))
        t = TorchTrainer(model, cfg, device="cpu")
        (batch,), _ = t.prepare(samples)
        t.model.train()
        t.optimizer.step = lambda: None  # keep the gradients, take no step
        t._update(batch)
        grads[name] = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
    pairs = _lora_pairs(lora_model)
    for owner, (_, a, b, scale) in pairs.items():
        g_w = grads["full"][f"{owner}.weight"]
        g_a = grads["lora"][f"base_model.model.{owner}.lora_A.default.weight"]
        g_b = grads["lora"][f"base_model.model.{owner}.lora_B.default.weight"]
        assert torch.allclose(g_b, scale * g_w @ a.T, atol=1e-6, rtol=1e-4), owner
        assert torch.allclose(g_a, scale * b.T @ g_w, atol=1e-6, rtol=1e-4), owner
    # Nothing but adapters has a gradient.
    assert all("lora_" in n for n in grads["lora"])


def test_only_adapters_are_optimised_and_move(policy):  # noqa: F811
    samples = make_samples(policy, seed=4, rewards=[1, 0, 1, 0, 0, 1])
    t = _trainer(policy)
    trainable = [p for p in t.model.parameters() if p.requires_grad]
    opt = [p for g in t.optimizer.param_groups for p in g["params"]]
    assert len(opt) == len(trainable) and {id(p) for p in opt} == {id(p) for p in trainable}
    n_adapter = sum(p.numel() for p in trainable)
    n_all = sum(p.numel() for p in t.model.parameters())
    assert 0 < n_adapter < n_all / 10
    before = {k: v.clone() for k, v in t.model.get_base_model().state_dict().items()}
    m = t.train_step(samples)
    assert m["skipped"] == 0 and m["grad_norm"] > 0
    after = t.model.get_base_model().state_dict()
    for k, v in after.items():
        if "lora_" in k and "lora_A" not in k:
            assert not torch.equal(v, before[k]), k  # B moved off 0
        elif "lora_" not in k:
            assert torch.equal(v, before[k]), k  # the base never moves


def test_a_checkpoint_holds_the_adapters_only_and_resumes_exactly(tiny_base, tmp_path: Path):  # noqa: F811
    samples = make_samples(tiny_base, seed=5, rewards=[1, 0, 0, 1, 1, 0])
    a = _trainer(copy.deepcopy(tiny_base).float())
    a.train_step(samples)
    path = a.save(tmp_path / "ckpt")
    files = sorted(p.name for p in path.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "state.json"]
    assert (path / "adapter_model.safetensors").stat().st_size < 0.1 * 4 * sum(
        p.numel() for p in tiny_base.parameters()
    )
    b = _trainer(copy.deepcopy(tiny_base).float())
    b.load(tmp_path / "ckpt")
    ma, mb = a.train_step(samples), b.train_step(samples)
    assert mb["loss"] == ma["loss"] and mb["grad_norm"] == ma["grad_norm"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(adapter_weights(a.model).items(),
                                                            adapter_weights(b.model).items(), strict=True))  # fmt: skip
    # A full-weight trainer cannot take it, and says why.
    full = TorchTrainer(copy.deepcopy(tiny_base).float(), TrainConfig(), device="cpu")
    with pytest.raises(CheckpointError, match=r"saved with trainer\.lora\.rank > 0"):
        full.load(tmp_path / "ckpt")


def test_engines_get_the_merged_model(policy):  # noqa: F811
    t = _trainer(policy)
    _randomise_b(t.model)
    exported = {k: v for bucket in t.export_weights(bucket_bytes=1 << 16) for k, v in bucket}
    engine_model = t.engine_model()
    assert not hasattr(engine_model, "peft_config")
    own = engine_model.state_dict()
    assert set(exported) == set(own) and all(torch.allclose(exported[k], own[k]) for k in own)
    # The engine's copy generates what the adapted policy computes.
    ids = torch.tensor([[5, 9, 17, 3, 40]])
    with torch.no_grad():
        assert torch.allclose(engine_model(ids).logits, t.model(input_ids=ids).logits, atol=1e-5)


def test_bad_lora_settings_are_refused_with_the_way_out(policy):  # noqa: F811
    with pytest.raises(ValueError, match="rank must be >= 0"):
        LoraConfig(rank=-1)
    with pytest.raises(LoraError, match="match no Linear module"):
        apply_lora(policy, LoraConfig(rank=2, targets=("nonexistent",)))
    from agentrl.runtime.config import RunConfig, resolve

    with pytest.raises(Exception, match=r"set trainer\.lora\.rank > 0"):
        resolve(RunConfig, overrides=["sync.transport=lora_adapter"])
