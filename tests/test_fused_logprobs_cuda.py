"""The fused LM-head kernels (Triton) against an fp32 computation from the same bf16 inputs.

Skipped without CUDA and Triton; run on the GPU machine. Bounds: log-probs and entropy within 1e-5
of fp32 with promoted accumulation (`TileConfig(promote=4)`), within 1.5e-5 of exact (fp64) with the
default tiles at GLM-5.2's hidden width, within 1e-4 of exact without promotion (the tensor cores'
truncating accumulation); a bf16 gradient within twice the error
of the fp32 reference's own rounding to bf16 (the best any bf16 gradient can be); an fp32 weight
gradient (fp32 master weights under bf16 autocast) within 3e-4 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch

from agentrl.algo.fused_logprobs import (
    TileConfig,
    _triton_stats,
    fused_kernel_available,
    fused_logprobs,
)
from agentrl.algo.logprobs import chunk_grads, chunk_stats
from agentrl.train.forward import model_logprobs
from tests.test_train_models import tiny_base  # noqa: F401

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not fused_kernel_available("cuda"), reason="needs CUDA and Triton"
)

LOADS = ["tma", "ptr"]


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """The fp32 reference must not run on TF32 tensor cores."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def make(seed, n=1000, hid=512, vocab=5003, scale=0.1):
    """bf16 inputs whose logits have standard deviation scale * sqrt(hid)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hid, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(vocab, hid, device="cuda", generator=g) * scale).to(torch.bfloat16)
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)
    return h, w, y, g_lp, g_ent


def reference(h, w, y, g_lp, g_ent, temperature, with_entropy):
    """fp32 log-probs, entropy and gradients of the bf16 inputs."""
    hf, wf = h.float(), w.float()
    zy, lse, ez = chunk_stats(hf, wf, y, chunk_size=256, temperature=temperature, with_entropy=True)
    dh, dw = chunk_grads(
        hf,
        wf,
        y,
        lse,
        ez if with_entropy else None,
        g_lp,
        g_ent if with_entropy else None,
        chunk_size=256,
        temperature=temperature,
        mm_dtype=torch.float32,
        need_h=True,
        need_w=True,
    )
    return zy - lse, lse - ez, dh, dw


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


def run(h, w, y, g_lp, g_ent, temperature, with_entropy, tiles):
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    lp, ent = fused_logprobs(
        h, w, y, temperature=temperature, with_entropy=with_entropy, kernel="triton", tiles=tiles
    )
    if with_entropy:
        torch.autograd.backward([lp, ent], [g_lp, g_ent])
    else:
        lp.backward(g_lp)
    return lp.detach(), (ent.detach() if ent is not None else None), h.grad, w.grad


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize(("with_entropy", "temperature"), [(False, 1.0), (True, 0.7)])
def test_triton_logprobs_entropy_and_gradients_match_fp32(load, with_entropy, temperature):
    h, w, y, g_lp, g_ent = make(0)
    tiles = TileConfig(load=load, vocab_chunk=1024, promote=4)  # five vocabulary slices, the last partial
    lp, ent, dh, dw = run(h, w, y, g_lp, g_ent, temperature, with_entropy, tiles)
    ref_lp, ref_ent, ref_dh, ref_dw = reference(h, w, y, g_lp, g_ent, temperature, with_entropy)
    assert (lp - ref_lp).abs().max().item() <= 1e-5
    if with_entropy:
        assert ent is not None and (ent - ref_ent).abs().max().item() <= 1e-5
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    assert rel(dh, ref_dh) <= 2 * rel(ref_dh.bfloat16(), ref_dh)
    assert rel(dw, ref_dw) <= 2 * rel(ref_dw.bfloat16(), ref_dw)
    again = run(h, w, y, g_lp, g_ent, temperature, with_entropy, tiles)
    assert torch.equal(again[0], lp) and torch.equal(again[2], dh) and torch.equal(again[3], dw)


def test_fp32_master_weight_under_autocast_gets_an_fp32_gradient_within_3e4():
    h, w, y, g_lp, g_ent = make(1)
    w32 = w.float().requires_grad_()
    hh = h.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, ent = fused_logprobs(hh, w32, y, temperature=0.8, with_entropy=True, kernel="triton")
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    _, _, ref_dh, ref_dw = reference(h, w, y, g_lp, g_ent, 0.8, True)
    assert w32.grad is not None and w32.grad.dtype == torch.float32
    assert rel(w32.grad, ref_dw) <= 3e-4
    assert rel(hh.grad, ref_dh) <= 2 * rel(ref_dh.bfloat16(), ref_dh)


@pytest.mark.parametrize("load", LOADS)
def test_a_vocabulary_shard_gives_the_torch_shard_statistics(load):
    """Targets outside the shard (the other ranks' rows) contribute no target logit."""
    h, w, y, _, _ = make(2)
    start, rows = 1500, 2000
    shard = w[start : start + rows]
    local = y - start
    in_range = (local >= 0) & (local < rows)
    assert in_range.any() and (~in_range).any()
    zy, lse, ez = _triton_stats(h, shard, local, 1.0, True, TileConfig(load=load, promote=4))
    want = chunk_stats(
        h.float(),
        shard.float(),
        local.clamp(0, rows - 1),
        chunk_size=256,
        temperature=1.0,
        with_entropy=True,
        in_range=in_range,
    )
    for got, ref in zip((zy, lse, ez), want, strict=True):
        assert ref is not None and (got - ref).abs().max().item() <= 1e-5


def exact_logprobs(h, w, y):
    z = h.double() @ w.double().t()
    return z.gather(1, y[:, None])[:, 0] - torch.logsumexp(z, dim=1)


def test_default_tiles_keep_logprobs_within_1p5e5_of_exact_at_glm52_width():
    """Hidden 6,144 and logits of standard deviation ~1.6, GLM-5.2's head (benchmarks/RESULTS.md:
    9.3e-6 over 16,384 tokens), against fp64; without promotion the tensor cores' truncating
    accumulation alone is several times that."""
    h, w, y, _, _ = make(5, n=1024, hid=6144, vocab=20000, scale=0.02)
    exact = exact_logprobs(h, w, y)
    lp, _ = fused_logprobs(h, w, y, kernel="triton")
    assert (lp.double() - exact).abs().max().item() <= 1.5e-5
    raw, _ = fused_logprobs(h, w, y, kernel="triton", tiles=TileConfig(promote=0))
    assert (raw.double() - exact).abs().max().item() > (lp.double() - exact).abs().max().item()


def test_persistent_and_one_tile_per_program_kernels_agree_bit_for_bit():
    """Same tile arithmetic either way; partial tiles at both ends (the bulk copies clip dz's
    stores at T and V)."""
    h, w, y, g_lp, g_ent = make(6, n=1000, vocab=5003)
    got = [
        run(h, w, y, g_lp, g_ent, 0.9, True, TileConfig(vocab_chunk=1024, persistent=p))
        for p in (True, False)
    ]
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


def test_unpromoted_tiles_keep_logprobs_within_1e4_of_exact():
    """The truncation error grows with the hidden size and the logits' magnitude: here logits of
    standard deviation ~2.3 over a 2,048-wide hidden state (GLM-5.2's 6,144 measured 5.8e-5)."""
    h, w, y, _, _ = make(4, hid=2048, scale=0.05)
    lp, ent = fused_logprobs(h, w, y, with_entropy=True, kernel="triton", tiles=TileConfig(promote=0))
    z = h.double() @ w.double().t()
    lse = torch.logsumexp(z, dim=1)
    exact_lp = z.gather(1, y[:, None])[:, 0] - lse
    exact_ent = lse - (torch.softmax(z, dim=1) * z).sum(1)
    assert ent is not None
    assert (lp - exact_lp).abs().max().item() <= 1e-4
    assert (ent - exact_ent).abs().max().item() <= 1e-4


def test_batched_non_contiguous_hidden_states_give_per_position_results():
    h, w, y, _, _ = make(3, n=2 * 301)
    big = h.view(2, 301, -1)
    hidden = big[:, :-1]  # as model_logprobs slices the decoder's output
    lp, _ = fused_logprobs(hidden, w, y.view(2, 301)[:, 1:], kernel="triton")
    flat, _ = fused_logprobs(hidden.reshape(-1, h.shape[1]), w, y.view(2, 301)[:, 1:].reshape(-1))
    assert lp.shape == (2, 300) and torch.equal(lp.reshape(-1), flat)


def test_model_logprobs_on_cuda_defaults_to_the_fused_kernel(tiny_base):  # noqa: F811
    model = copy.deepcopy(tiny_base).to("cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), device="cuda")
    with torch.no_grad():
        auto, _ = model_logprobs(model, ids)
        fused, _ = model_logprobs(model, ids, impl="fused")
        chunked, _ = model_logprobs(model, ids, impl="chunked")
    assert torch.equal(auto, fused)
    # The chunked path rounds its logits to bf16; the fused kernel keeps them in fp32.
    assert (auto - chunked).abs().max().item() < 0.1
