"""The loss library against brute-force references written as explicit Python loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.algo import (
    LossConfig,
    aggregate,
    broadcast_to_tokens,
    chunked_logprobs,
    full_logprobs,
    grpo_advantages,
    grpo_loss,
    kl_penalty,
    mismatch_kl,
    policy_loss,
    tis_weights,
)

torch.set_default_dtype(torch.float64)


def rand_batch(seed: int, b: int = 4, t: int = 7, empty_row: bool = True):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + torch.randn(b, t, generator=g) * 0.4
    roll = old + torch.randn(b, t, generator=g) * 0.6
    adv = torch.randn(b, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    if empty_row:
        mask[1] = 0.0
    return logp, old, roll, adv, mask


# ---------- advantages ----------


def ref_advantages(rewards, groups, normalize):
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        a = r - mean
        if normalize:
            std = statistics.stdev(members) if len(members) > 1 else 0.0
            a = 0.0 if std == 0 else a / (std + 1e-6)
        out.append(a)
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0])), min_size=1, max_size=12
    ),
    st.booleans(),
)
def test_grpo_advantages_match_reference(rows, normalize):
    groups = [g for g, _ in rows]
    rewards = [r for _, r in rows]
    got = grpo_advantages(torch.tensor(rewards), groups, normalize_std=normalize)
    want = ref_advantages(rewards, groups, normalize)
    assert got.tolist() == pytest.approx(want, abs=1e-5)


def test_zero_variance_and_single_sample_groups_get_zero_advantage():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.3, 0.0, 1.0]), ["a", "a", "a", "b", "c", "c"])
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4] < 0 < adv[5]
    assert torch.isfinite(adv).all()


def test_broadcast_puts_the_sequence_advantage_on_masked_tokens_only():
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    got = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert got.tolist() == [[2.0, 0.0, 2.0], [0.0, 0.0, 0.0]]


# ---------- PPO clip ----------


def ref_policy_loss(logp, old, adv_tok, mask, eps_lo, eps_hi, dual):
    b, t = len(logp), len(logp[0])
    loss = [[0.0] * t for _ in range(b)]
    clipped = n = 0
    for i in range(b):
        for j in range(t):
            r = math.exp(logp[i][j] - old[i][j])
            a = adv_tok[i][j]
            u, c = -a * r, -a * min(max(r, 1 - eps_lo), 1 + eps_hi)
            v = max(u, c)
            if dual is not None and a < 0:
                v = min(v, -a * dual)
            loss[i][j] = v
            if mask[i][j]:
                n += 1
                clipped += c > u
    return loss, clipped / max(n, 1)


@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("seed", range(5))
def test_policy_loss_matches_reference(seed, dual):
    logp, old, _, adv, mask = rand_batch(seed)
    adv_tok = adv[:, None].expand_as(logp) * 3  # large advantages make the dual clip bind
    got, metrics = policy_loss(logp, old, adv_tok, mask, eps_clip=0.2, eps_clip_high=0.28, dual_clip=dual)
    want, frac = ref_policy_loss(
        logp.tolist(), old.tolist(), adv_tok.tolist(), mask.tolist(), 0.2, 0.28, dual
    )
    assert torch.allclose(got, torch.tensor(want), atol=1e-9)
    assert metrics["clip_frac"].item() == pytest.approx(frac)


def test_asymmetric_clip_bounds_ratio_differently_up_and_down():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    loss, _ = policy_loss(
        logp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), eps_clip=0.2, eps_clip_high=0.28
    )
    # A>0, r=1.5 -> clipped to 1.28; A<0, r=0.5 -> clipped to 0.8
    assert loss[0].tolist() == pytest.approx([-1.28, 0.8])


def test_clipped_tokens_carry_no_gradient():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_(True)
    loss, _ = policy_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2), eps_clip=0.2, eps_clip_high=0.28)
    loss.sum().backward()
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] < 0


# ---------- TIS ----------


def ref_tis(old, roll, mask, low, high, level, mode):
    b, t = len(old), len(old[0])
    raw = [[0.0] * t for _ in range(b)]
    for i in range(b):
        d = [(old[i][j] - roll[i][j]) if mask[i][j] else 0.0 for j in range(t)]
        n = sum(mask[i])
        for j in range(t):
            if level == "token":
                raw[i][j] = math.exp(d[j])
            elif level == "sequence":
                raw[i][j] = math.exp(sum(d))
            else:
                raw[i][j] = math.exp(sum(d) / n) if n else 1.0
    w = [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if not mask[i][j]:
                continue
            x = raw[i][j]
            if mode == "truncate":
                w[i][j] = min(max(x, low), high)
            else:
                w[i][j] = x if low <= x <= high else 0.0
    return w


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("seed", range(4))
def test_tis_weights_match_reference(level, mode, seed):
    _, old, roll, _, mask = rand_batch(seed)
    old.requires_grad_(True)
    w, stats = tis_weights(old, roll, mask, low=0.5, high=2.0, level=level, mode=mode)
    want = ref_tis(old.tolist(), roll.tolist(), mask.tolist(), 0.5, 2.0, level, mode)
    assert torch.allclose(w.double(), torch.tensor(want), rtol=1e-5, atol=1e-7)
    assert not w.requires_grad
    assert 0.0 <= stats["tis_clip_frac"].item() <= 1.0


def test_tis_truncates_token_weights_to_recipe_bounds():
    old = torch.log(torch.tensor([[0.9, 0.1, 0.5]]))
    roll = torch.log(torch.tensor([[0.1, 0.9, 0.5]]))
    w, stats = tis_weights(old, roll, torch.ones(1, 3), low=0.5, high=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 1.0])
    assert stats["tis_clip_frac"].item() == pytest.approx(2 / 3)
    assert stats["tis_max"].item() == pytest.approx(9.0)


def test_tis_scales_the_per_token_loss():
    logp, old, roll, adv, mask = rand_batch(3, empty_row=False)
    adv_tok = broadcast_to_tokens(adv, mask)
    base = LossConfig(use_tis=False, aggregation="token_mean")
    with_tis = LossConfig(aggregation="token_mean")
    l0, _ = grpo_loss(logp, old, roll, adv_tok, mask, base)
    l1, _ = grpo_loss(logp, old, roll, adv_tok, mask, with_tis)
    pg, _ = policy_loss(logp, old, adv_tok, mask, eps_clip=0.2, eps_clip_high=0.28)
    w, _ = tis_weights(old, roll, mask, low=0.5, high=2.0)
    assert l1.item() == pytest.approx(((pg * w * mask).sum() / mask.sum()).item())
    assert l0.item() == pytest.approx(((pg * mask).sum() / mask.sum()).item())
    assert l0.item() != pytest.approx(l1.item())


# ---------- KL, mismatch, aggregation ----------


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_reference(kind):
    logp, old, *_ = rand_batch(0)
    got = kl_penalty(logp, old, kind)
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            x = old[i, j].item() - logp[i, j].item()
            want = {"k1": -x, "k2": x * x / 2, "k3": math.exp(x) - x - 1}[kind]
            assert got[i, j].item() == pytest.approx(want)


def test_mismatch_kl_is_zero_when_engine_and_trainer_agree_and_positive_otherwise():
    _, old, roll, _, mask = rand_batch(1)
    assert mismatch_kl(old, old, mask)["mismatch_kl"].item() == 0.0
    m = mismatch_kl(old, roll, mask)
    xs = [old[i, j].item() - roll[i, j].item() for i in range(4) for j in range(7) if mask[i, j]]
    assert m["mismatch_kl"].item() == pytest.approx(sum(math.exp(x) - x - 1 for x in xs) / len(xs))
    assert m["mismatch_k1"].item() == pytest.approx(sum(-x for x in xs) / len(xs))


def ref_aggregate(v, mask, mode):
    if mode == "token_mean":
        n = sum(sum(r) for r in mask)
        return sum(v[i][j] * mask[i][j] for i in range(len(v)) for j in range(len(v[0]))) / max(n, 1)
    per_seq = []
    for i in range(len(v)):
        n = sum(mask[i])
        if n:
            per_seq.append(sum(v[i][j] * mask[i][j] for j in range(len(v[0]))) / n)
    return sum(per_seq) / max(len(per_seq), 1)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed", range(4))
def test_aggregation_matches_reference_with_empty_rows(mode, seed):
    logp, _, _, _, mask = rand_batch(seed)
    assert aggregate(logp, mask, mode).item() == pytest.approx(
        ref_aggregate(logp.tolist(), mask.tolist(), mode)
    )


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_aggregation_over_micro_batches_adds_up_to_the_whole(mode):
    logp, _, _, _, mask = rand_batch(5, b=6)
    whole = aggregate(logp, mask, mode)
    n_tok = mask.sum().item()
    n_seq = (mask.sum(-1) > 0).sum().item()
    parts = sum(
        aggregate(logp[k : k + 2], mask[k : k + 2], mode, num_tokens=n_tok, num_seqs=n_seq) for k in (0, 2, 4)
    )
    assert parts.item() == pytest.approx(whole.item())


def test_all_empty_batch_gives_zero_loss_not_nan():
    logp, old, roll, adv, _ = rand_batch(0)
    mask = torch.zeros_like(logp)
    loss, metrics = grpo_loss(logp, old, roll, broadcast_to_tokens(adv, mask), mask, LossConfig())
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in metrics.values())


def test_entropy_bonus_and_kl_enter_the_loss_with_their_signs():
    logp, old, roll, adv, mask = rand_batch(2, empty_row=False)
    adv_tok = broadcast_to_tokens(adv, mask)
    ent = torch.rand_like(logp)
    ref = logp - 0.3
    plain, _ = grpo_loss(logp, old, roll, adv_tok, mask, LossConfig())
    with_ent, m = grpo_loss(logp, old, roll, adv_tok, mask, LossConfig(entropy_coef=0.1), entropy=ent)
    with_kl, m2 = grpo_loss(logp, old, roll, adv_tok, mask, LossConfig(kl_coef=0.5), ref_logp=ref)
    mean = lambda x: ((x * mask).sum() / mask.sum()).item()  # noqa: E731
    assert with_ent.item() == pytest.approx(plain.item() - 0.1 * mean(ent))
    assert with_kl.item() == pytest.approx(plain.item() + 0.5 * mean(kl_penalty(logp, ref, "k3")))
    assert m["entropy"].item() == pytest.approx(mean(ent)) and m2["kl"].item() > 0


def test_bad_loss_settings_are_rejected_with_a_reason():
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="tis_level"):
        LossConfig(tis_level="bogus")  # type: ignore[arg-type]
    logp, old, roll, adv, mask = rand_batch(0)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, roll, broadcast_to_tokens(adv, mask), mask, LossConfig(kl_coef=0.1))


# ---------- chunked log-probs ----------


def ref_logprobs(hidden, weight, targets, temperature):
    logits = hidden @ weight.t() / temperature
    lp = torch.log_softmax(logits, -1)
    out_lp = torch.empty(targets.shape)
    out_ent = torch.empty(targets.shape)
    for i in range(targets.shape[0]):
        for j in range(targets.shape[1]):
            out_lp[i, j] = lp[i, j, targets[i, j]]
            out_ent[i, j] = -(lp[i, j].exp() * lp[i, j]).sum()
    return out_lp, out_ent


@pytest.mark.parametrize("chunk", [1, 3, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_match_full_softmax(chunk, temperature):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(2, 9, 8, generator=g)
    weight = torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (2, 9), generator=g)
    lp, ent = chunked_logprobs(
        hidden, weight, targets, chunk_size=chunk, temperature=temperature, with_entropy=True
    )
    want_lp, want_ent = ref_logprobs(hidden, weight, targets, temperature)
    assert torch.allclose(lp, want_lp.to(lp.dtype), atol=1e-5)
    assert torch.allclose(ent, want_ent.to(ent.dtype), atol=1e-5)


def test_chunked_logprob_gradients_equal_unchunked():
    g = torch.Generator().manual_seed(0)
    h1 = torch.randn(3, 11, 8, generator=g, requires_grad=True)
    w1 = torch.randn(40, 8, generator=g, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    w2 = w1.detach().clone().requires_grad_(True)
    y = torch.randint(0, 40, (3, 11), generator=g)
    coef = torch.randn(3, 11, generator=g)
    a, ea = chunked_logprobs(h1, w1, y, chunk_size=4, with_entropy=True)
    b, eb = full_logprobs(h2, w2, y, with_entropy=True)
    ((a + ea) * coef).sum().backward()
    ((b + eb) * coef).sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-6) and torch.allclose(w1.grad, w2.grad, atol=1e-6)


def test_chunked_logprobs_of_an_empty_sequence_are_empty():
    lp, ent = chunked_logprobs(
        torch.zeros(2, 0, 8), torch.zeros(5, 8), torch.zeros(2, 0, dtype=torch.long), with_entropy=True
    )
    assert lp.shape == (2, 0) and ent is not None and ent.shape == (2, 0)


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        chunked_logprobs(
            torch.zeros(1, 2, 4), torch.zeros(3, 4), torch.zeros(1, 2, dtype=torch.long), chunk_size=0
        )


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_logprob_backward_passes_gradcheck(with_entropy, temperature):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, 5, generator=g, requires_grad=True)
    w = torch.randn(11, 5, generator=g, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=g)

    def f(h, w):
        lp, ent = chunked_logprobs(h, w, y, chunk_size=3, temperature=temperature, with_entropy=with_entropy)
        return (lp, ent) if with_entropy else lp

    assert torch.autograd.gradcheck(f, (h, w))


def test_token_mean_cancels_a_groups_shared_prefix_and_seq_mean_does_not():
    """A group's replies share their first tokens (same context, so the same logits): under
    token_mean the advantages cancel there exactly, whatever the reply lengths; under
    seq_mean_token_mean a short failed reply pushes the shared prefix down harder than a long
    success pushes it up (why the demo uses token_mean)."""
    lengths = [12, 3, 3, 12]  # a long success and three failures, two of them short
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    adv = broadcast_to_tokens(grpo_advantages(rewards, ["g"] * 4), mask)
    prefix = 2
    grads = {}
    for mode in ("token_mean", "seq_mean_token_mean"):
        shared = torch.full((prefix,), -0.05, requires_grad=True)
        rest = torch.full((4, width - prefix), -0.5)
        logp = torch.cat([shared.expand(4, prefix), rest], dim=1)
        old = logp.detach()
        loss, _ = grpo_loss(logp, old, old, adv, mask, LossConfig(aggregation=mode, use_tis=False))
        loss.backward()
        grads[mode] = shared.grad
    assert grads["token_mean"].abs().max() < 1e-6  # float32 advantages
    # Gradient descent on the loss: a positive gradient lowers the shared tokens' log-probs.
    assert (grads["seq_mean_token_mean"] > 1e-3).all()
