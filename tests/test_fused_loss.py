"""`fused_token_loss` (gradients made in forward) on its CPU path, against autograd through the
naive softmax formula. The Triton path is checked on a GPU by tests/test_fused_loss_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from agentrl.algo.fused_loss import fused_token_loss, vocab_parallel_token_loss
from tests.test_fused_logprobs import _free_port, inputs, naive


def ppo_terms(shape, seed):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    old = torch.randn(shape, generator=g, dtype=torch.float64) - 3
    weight = torch.rand(shape, generator=g, dtype=torch.float64)
    return adv, old, weight


def ppo(lp, ent, adv, old, weight):
    """A PPO-clip token loss with an entropy bonus: nonlinear in logp, as the trainers' is."""
    r = torch.exp(lp - old)
    loss = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.28))
    if ent is not None:
        loss = loss - 0.01 * ent
    return weight * loss


def flat_loss(adv, old, weight):
    fa, fo, fw = adv.reshape(-1), old.reshape(-1), weight.reshape(-1)
    return lambda lp, ent, sl: ppo(lp, ent, fa[sl], fo[sl], fw[sl])


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_loss_logprobs_and_gradients_equal_autograd_of_the_naive_formula(with_entropy, temperature):
    h, w, y, _, _ = inputs(1, lead=(3, 700), vocab=37)  # several chunks, the last one short
    adv, old, weight = ppo_terms(y.shape, 2)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    res = fused_token_loss(
        h1, w1, y, flat_loss(adv, old, weight), temperature=temperature, with_entropy=with_entropy, chunk=500
    )
    (res.loss * 0.5).backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = naive(h2, w2, y, temperature)
    want = ppo(lp, ent if with_entropy else None, adv, old, weight).sum()
    (want * 0.5).backward()
    torch.testing.assert_close(res.loss, want.detach(), rtol=1e-12, atol=0)
    assert res.logp.shape == y.shape
    torch.testing.assert_close(res.logp, lp.detach(), rtol=0, atol=1e-12)
    if with_entropy:
        assert res.entropy is not None
        torch.testing.assert_close(res.entropy, ent.detach(), rtol=0, atol=1e-12)
    else:
        assert res.entropy is None
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-10)


def test_the_token_loss_sees_each_position_once_in_chunks_of_the_flattened_positions():
    h, w, y, _, _ = inputs(3, lead=(2, 9), vocab=11)
    seen: list[slice] = []

    def loss(lp, ent, sl):
        seen.append(sl)
        assert lp.shape == (sl.stop - sl.start,)
        return lp

    fused_token_loss(h, w, y, loss, chunk=5)
    assert seen == [slice(0, 5), slice(5, 10), slice(10, 15), slice(15, 18)]


def test_only_the_inputs_that_need_a_gradient_get_one():
    h, w, y, _, _ = inputs(4, vocab=13)
    hg = h.clone().requires_grad_()
    res = fused_token_loss(hg, w, y, lambda lp, ent, sl: -lp)
    res.loss.backward()
    h2 = h.clone().requires_grad_()
    (-naive(h2, w, y, 1.0)[0].sum()).backward()
    torch.testing.assert_close(hg.grad, h2.grad, rtol=0, atol=1e-12)
    assert w.grad is None


def test_a_loss_that_ignores_the_log_probs_gives_zero_gradients():
    h, w, y, _, _ = inputs(5, vocab=13)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    res = fused_token_loss(hg, wg, y, lambda lp, ent, sl: torch.ones_like(lp))
    assert res.loss.item() == y.numel()
    res.loss.backward()
    assert hg.grad is not None and wg.grad is not None
    assert not hg.grad.any() and not wg.grad.any()


def test_bad_arguments_are_refused_with_the_reason():
    h, w, y, _, _ = inputs(6, vocab=13)
    with pytest.raises(ValueError, match="one loss per position"):
        fused_token_loss(h, w, y, lambda lp, ent, sl: lp.sum())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        fused_token_loss(h, w, y, lambda lp, ent, sl: lp, temperature=0)
    with pytest.raises(ValueError, match="chunk must be a positive"):
        fused_token_loss(h, w, y, lambda lp, ent, sl: lp, chunk=0)
    with pytest.raises(ValueError, match="kernel='auto' to fall back"):
        fused_token_loss(h, w, y, lambda lp, ent, sl: lp, kernel="triton")


def _shard_worker(rank, world, port, data, out):
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        h, w, y, adv, old, weight, temperature = data
        rows = w.shape[0] // world
        h = h.clone().requires_grad_()
        shard = w[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        res = vocab_parallel_token_loss(
            h, shard, y, flat_loss(adv, old, weight), temperature=temperature, with_entropy=True, chunk=25
        )
        res.loss.backward()
        out[rank] = (res.loss.detach(), res.logp, h.grad, shard.grad)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_over_two_gloo_ranks_equals_the_unsharded_loss():
    """Two processes each hold half of W's rows; targets fall in both halves. Every rank has the
    whole loss, the log-probs and dL/dh; the shards' dL/dW stack to the unsharded one."""
    h, w, y, _, _ = inputs(7, lead=(2, 30), hid=8, vocab=40)
    adv, old, weight = ppo_terms(y.shape, 8)
    temperature = 0.9
    world = 2
    with mp.Manager() as manager:
        out = manager.dict()
        data = (h, w, y, adv, old, weight, temperature)
        mp.spawn(_shard_worker, args=(world, _free_port(), data, out), nprocs=world)
        results = [out[r] for r in range(world)]
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = naive(h2, w2, y, temperature)
    want = ppo(lp, ent, adv, old, weight).sum()
    want.backward()
    assert (y < 20).any() and (y >= 20).any()
    for loss, logp, dh, _ in results:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(logp, lp.detach(), rtol=0, atol=1e-10)
        torch.testing.assert_close(dh, h2.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(torch.cat([r[3] for r in results]), w2.grad, rtol=0, atol=1e-10)
