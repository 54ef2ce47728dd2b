"""GSPO (sequence-level ratio) against a brute-force reference written as explicit Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algo import LossConfig, broadcast_to_tokens, grpo_loss
from agentrl.algo.losses import grpo_terms

torch.set_default_dtype(torch.float64)


def batch(seed: int, b: int = 5, t: int = 9, spread: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + torch.randn(b, t, generator=g) * spread
    roll = old + torch.randn(b, t, generator=g) * 0.3
    adv = torch.randn(b, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    mask[1] = 0.0  # a row with nothing to train
    mask[2, :] = 0.0
    mask[2, 4] = 1.0  # a row of one trained token
    return logp, old, roll, adv, mask


def ref_gspo(logp, old, roll, adv, mask, eps_lo, eps_hi, tis_low, tis_high, use_tis):
    """sum_b sum_t a_{b,t} w_{b,t} max(-A_b s_b, -A_b clip(s_b)), a the token mean's weights,
    s_b = exp(mean over trained t of logp - old), w the token TIS weight clamp(exp(old - roll))."""
    b, t = len(logp), len(logp[0])
    n_tok = sum(sum(row) for row in mask)
    total = 0.0
    clipped = rows = 0
    ratios = []
    for i in range(b):
        n = sum(mask[i])
        if not n:
            continue
        log_s = sum((logp[i][j] - old[i][j]) * mask[i][j] for j in range(t)) / n
        s = math.exp(log_s)
        ratios.append(s)
        a = adv[i]
        u, c = -a * s, -a * min(max(s, 1 - eps_lo), 1 + eps_hi)
        pg = max(u, c)
        rows += 1
        clipped += c > u
        for j in range(t):
            if mask[i][j]:
                w = min(max(math.exp(old[i][j] - roll[i][j]), tis_low), tis_high) if use_tis else 1.0
                total += pg * w / n_tok
    return total, clipped / rows, ratios


@pytest.mark.parametrize("use_tis", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_gspo_loss_and_its_gradient_match_the_reference(seed, use_tis):
    logp, old, roll, adv, mask = batch(seed)
    cfg = LossConfig(objective="gspo", eps_clip=0.02, eps_clip_high=0.03, use_tis=use_tis)
    lp = logp.clone().requires_grad_(True)
    got, metrics = grpo_loss(lp, old, roll, broadcast_to_tokens(adv, mask), mask, cfg)
    got.backward()
    want, frac, ratios = ref_gspo(
        logp.tolist(), old.tolist(), roll.tolist(), adv.tolist(), mask.tolist(), 0.02, 0.03, 0.5, 2.0, use_tis
    )
    assert got.item() == pytest.approx(want, rel=1e-6)  # the aggregation weights are fp32
    assert metrics["seq_clip_frac"].item() == pytest.approx(frac)
    assert metrics["seq_ratio_mean"].item() == pytest.approx(sum(ratios) / len(ratios))
    assert metrics["seq_ratio_max"].item() == pytest.approx(max(ratios))
    assert metrics["seq_ratio_min"].item() == pytest.approx(min(ratios))
    # The gradient by central differences of the reference, at every position.
    h = 1e-6
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            up, down = logp.clone(), logp.clone()
            up[i, j] += h
            down[i, j] -= h
            args = (old.tolist(), roll.tolist(), adv.tolist(), mask.tolist(), 0.02, 0.03, 0.5, 2.0, use_tis)
            fd = (ref_gspo(up.tolist(), *args)[0] - ref_gspo(down.tolist(), *args)[0]) / (2 * h)
            assert lp.grad[i, j].item() == pytest.approx(fd, rel=1e-5, abs=1e-8), (i, j)


def test_the_reference_seeds_clip_some_sequences_and_not_others():
    fracs = []
    for seed in range(6):
        logp, old, roll, adv, mask = batch(seed)
        fracs.append(ref_gspo(logp.tolist(), old.tolist(), roll.tolist(), adv.tolist(), mask.tolist(),
                              0.02, 0.03, 0.5, 2.0, True)[1])  # fmt: skip
    assert sum(0 < f < 1 for f in fracs) >= 3, fracs


def test_one_ratio_per_sequence_moves_every_token_together():
    """A sequence whose ratio is clipped gives no gradient to any of its tokens, even a token whose
    own ratio is inside the range (the per-token clip would train it)."""
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.0, 1.0, 2.0]])).requires_grad_(True)  # mean log-ratio ln2 / 3
    mask = torch.ones(1, 3)
    adv = torch.ones(1, 3)
    gspo = LossConfig(objective="gspo", eps_clip=0.1, eps_clip_high=0.1, use_tis=False)
    loss, _ = grpo_loss(logp, old, old, adv, mask, gspo)
    loss.backward()
    assert logp.grad.abs().max().item() == 0.0
    grpo = LossConfig(eps_clip=0.1, eps_clip_high=0.1, use_tis=False)
    lp2 = logp.detach().clone().requires_grad_(True)
    grpo_loss(lp2, old, old, adv, mask, grpo)[0].backward()
    assert lp2.grad[0, 0] < 0 and lp2.grad[0, 2] == 0


def test_gspo_equals_grpo_when_every_sequence_has_one_token():
    logp, old, roll, adv, _ = batch(3)
    mask = torch.zeros_like(logp)
    mask[:, 2] = 1.0
    adv_tok = broadcast_to_tokens(adv, mask)
    a = grpo_loss(logp, old, roll, adv_tok, mask, LossConfig(objective="gspo"))[0]
    b = grpo_loss(logp, old, roll, adv_tok, mask, LossConfig())[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-9)


def test_gspo_refuses_to_be_computed_a_chunk_at_a_time():
    logp, old, roll, adv, mask = batch(0)
    terms, _ = grpo_terms(old, roll, broadcast_to_tokens(adv, mask), mask, LossConfig(objective="gspo"))
    flat = terms.map(lambda x: x.reshape(-1))
    flat.loss(logp.reshape(-1), None, LossConfig(objective="gspo"))  # all positions: fine
    with pytest.raises(ValueError, match="all of a micro-batch's positions"):
        flat.loss(logp.reshape(-1)[:10], None, LossConfig(objective="gspo"), slice(0, 10))


def test_unknown_objective_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="grpo, gspo"):
        LossConfig(objective="dapo")  # type: ignore[arg-type]
