"""The fused LM-head log-prob function's semantics, on its CPU path (the torch passes).

The Triton kernels themselves are checked on a GPU by tests/test_fused_logprobs_cuda.py; here the
same public functions run where CI runs, against autograd through the naive softmax formula.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.multiprocessing as mp

from agentrl.algo.fused_logprobs import fused_logprobs, vocab_parallel_logprobs
from agentrl.train.config import TrainConfig
from agentrl.train.forward import model_logprobs
from tests.test_train_models import tiny_base  # noqa: F401


def naive(hidden, weight, targets, temperature):
    """log_softmax through autograd: the formula the closed-form backward must reproduce."""
    logits = hidden @ weight.t() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    logp = lp.gather(-1, targets[..., None])[..., 0]
    entropy = -(lp.exp() * lp).sum(-1)
    return logp, entropy


def inputs(seed, lead=(2, 9), hid=8, vocab=50):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hid, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hid, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, lead, generator=g)
    g_lp = torch.randn(lead, generator=g, dtype=torch.float64)
    g_ent = torch.randn(lead, generator=g, dtype=torch.float64)
    return h, w, y, g_lp, g_ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_on_cpu_equal_the_softmax_formula(temperature):
    h, w, y, _, _ = inputs(0)
    lp, ent = fused_logprobs(h, w, y, temperature=temperature, with_entropy=True)
    want_lp, want_ent = naive(h, w, y, temperature)
    assert lp.shape == y.shape and ent is not None and ent.shape == y.shape
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradients_equal_autograd_of_the_naive_formula_for_random_upstream_gradients(
    with_entropy, temperature
):
    h, w, y, g_lp, g_ent = inputs(1, lead=(3, 700), vocab=37)  # more positions than one torch chunk
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fused_logprobs(h1, w1, y, temperature=temperature, with_entropy=with_entropy)
    want_lp, want_ent = naive(h2, w2, y, temperature)
    if with_entropy:
        torch.autograd.backward([lp, ent], [g_lp, g_ent])
        torch.autograd.backward([want_lp, want_ent], [g_lp, g_ent])
    else:
        assert ent is None
        lp.backward(g_lp)
        want_lp.backward(g_lp)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-10)


def test_an_unused_entropy_contributes_no_gradient():
    h, w, y, g_lp, _ = inputs(2)
    h1 = h.clone().requires_grad_()
    lp, _ent = fused_logprobs(h1, w, y, with_entropy=True)
    lp.backward(g_lp)
    h2 = h.clone().requires_grad_()
    want, _ = naive(h2, w, y, 1.0)
    want.backward(g_lp)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_backward_passes_gradcheck(with_entropy):
    h, w, y, _, _ = inputs(3, lead=(7,), hid=5, vocab=11)
    h.requires_grad_()
    w.requires_grad_()

    def f(h, w):
        lp, ent = fused_logprobs(h, w, y, temperature=0.8, with_entropy=with_entropy)
        return (lp, ent) if with_entropy else lp

    assert torch.autograd.gradcheck(f, (h, w))


def test_an_empty_sequence_gives_empty_outputs():
    lp, ent = fused_logprobs(
        torch.zeros(2, 0, 8), torch.zeros(5, 8), torch.zeros(2, 0, dtype=torch.long), with_entropy=True
    )
    assert lp.shape == (2, 0) and ent is not None and ent.shape == (2, 0)


def test_triton_kernel_on_cpu_tensors_is_refused_with_the_fallback_named():
    h, w, y, _, _ = inputs(4)
    with pytest.raises(ValueError, match="kernel='auto'"):
        fused_logprobs(h, w, y, kernel="triton")
    with pytest.raises(ValueError, match="choose auto, triton or torch"):
        fused_logprobs(h, w, y, kernel="cuda")  # type: ignore[arg-type]


def test_model_logprobs_fused_on_cpu_equals_the_chunked_path(tiny_base):  # noqa: F811
    model = copy.deepcopy(tiny_base).float()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, ea = model_logprobs(model, ids, impl="fused", with_entropy=True)
        b, eb = model_logprobs(model, ids, impl="chunked", chunk_size=4, with_entropy=True)
        c, _ = model_logprobs(model, ids)  # auto on CPU: the chunked path
    assert ea is not None and eb is not None
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(ea, eb, rtol=0, atol=1e-5)
    torch.testing.assert_close(c, b, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="choose auto, fused or chunked"):
        model_logprobs(model, ids, impl="triton")  # type: ignore[arg-type]


def test_train_config_rejects_an_unknown_logprob_impl():
    assert TrainConfig().logprob_impl == "auto"
    with pytest.raises(ValueError, match="logprob_impl='liger'"):
        TrainConfig(logprob_impl="liger")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shard_worker(rank, world, port, data, out):
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        h, w, y, g_lp, g_ent, temperature = data
        rows = w.shape[0] // world
        h = h.clone().requires_grad_()
        shard = w[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(h, shard, y, temperature=temperature, with_entropy=True)
        torch.autograd.backward([lp, ent], [g_lp, g_ent])
        out[rank] = (lp.detach(), ent.detach(), h.grad, shard.grad)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_over_two_gloo_ranks_equals_the_unsharded_formula():
    """Two processes each hold half of W's rows; targets fall in both halves. Log-probs, entropy
    and dL/dh agree with the unsharded formula on every rank; the shards' dL/dW stack to the full one."""
    h, w, y, g_lp, g_ent = inputs(6, lead=(2, 30), hid=8, vocab=40)
    temperature = 0.9
    world = 2
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(
            _shard_worker, args=(world, _free_port(), (h, w, y, g_lp, g_ent, temperature), out), nprocs=world
        )
        results = [out[r] for r in range(world)]
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    want_lp, want_ent = naive(h2, w2, y, temperature)
    torch.autograd.backward([want_lp, want_ent], [g_lp, g_ent])
    assert (y < 20).any() and (y >= 20).any()
    for lp, ent, dh, _ in results:
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-10)
        torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-10)
        torch.testing.assert_close(dh, h2.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(torch.cat([r[3] for r in results]), w2.grad, rtol=0, atol=1e-10)
