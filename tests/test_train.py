"""The torch trainer backend: packing, the batch layout, GRPO steps, checkpoints."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.algo import LossConfig
from agentrl.episode.sample import Sample, Status
from agentrl.train.batch import build_batch, pack
from agentrl.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from agentrl.train.config import TrainConfig
from agentrl.train.torch_backend import TorchTrainer
from tests.test_train_models import make_samples, policy, response_logprobs, tiny_base  # noqa: F401


def ref_ffd(lengths, budget):
    """First-fit decreasing written out plainly."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins = []
    for i in order:
        placed = False
        for b in bins:
            rows = len(b) + 1
            longest = max(lengths[j] for j in b + [i])
            if rows * longest <= budget:
                b.append(i)
                placed = True
                break
        if not placed:
            bins.append([i])
    return bins


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=0, max_size=30), st.integers(1, 120))
def test_pack_is_first_fit_decreasing_under_the_padded_budget(lengths, budget):
    bins = pack(lengths, budget)
    assert bins == ref_ffd(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        cost = len(b) * max(lengths[i] for i in b)
        assert cost <= budget or len(b) == 1


def test_batch_layout_aligns_tokens_masks_and_logprobs(policy):  # noqa: F811
    samples = make_samples(policy, groups=1, per_group=3)
    adv = [0.5, -1.0, 2.0]
    for s, a in zip(samples, adv, strict=True):
        s.advantage = a
    batch = build_batch(samples, max_tokens_per_micro_batch=10_000, pad_token_id=0)
    assert len(batch.micro_batches) == 1
    mb = batch.micro_batches[0]
    for r, i in enumerate(mb.sample_indices):
        s = samples[i]
        n, p = len(s.tokens), s.prompt_length
        assert mb.input_ids[r, :n].tolist() == s.tokens
        assert mb.position_ids[r, :n].tolist() == list(range(n))
        assert mb.attention_mask[r].sum().item() == n
        assert mb.loss_mask[r, :p].sum() == 0 and mb.loss_mask[r, n:].sum() == 0
        assert mb.loss_mask[r, p:n].tolist() == [float(m) for m in s.loss_mask]
        assert mb.rollout_logprobs[r, p:n].tolist() == pytest.approx(s.rollout_logprobs)
        assert mb.advantages[r, p:n].tolist() == pytest.approx([adv[i] * m for m in s.loss_mask])
    assert batch.num_loss_tokens == sum(sum(s.loss_mask) for s in samples)


def test_corrupted_samples_are_rejected_before_training(policy):  # noqa: F811
    s = make_samples(policy, groups=1, per_group=1)[0]
    s.loss_mask = s.loss_mask[:-1]
    with pytest.raises(ValueError, match="loss_mask"):
        build_batch([s], max_tokens_per_micro_batch=100)


def _trainer(model, **kw):
    loss = kw.pop("loss", LossConfig())
    cfg = TrainConfig(lr=kw.pop("lr", 1e-3), weight_decay=0.0, loss=loss, **kw)
    return TorchTrainer(model, cfg, device="cpu")


def test_packed_and_unpacked_micro_batches_give_the_same_loss_and_update(tiny_base):  # noqa: F811
    samples = make_samples(tiny_base, groups=2, per_group=3, seed=1)
    for s in samples[::2]:  # a small engine mismatch so TIS weights are not all 1
        s.rollout_logprobs = [x - 0.3 * m for x, m in zip(s.rollout_logprobs, s.loss_mask, strict=True)]
    results = []
    for budget, agg in [
        (10_000, "token_mean"),
        (1, "token_mean"),
        (10_000, "seq_mean_token_mean"),
        (40, "seq_mean_token_mean"),
    ]:
        t = _trainer(
            copy.deepcopy(tiny_base).float(),
            max_tokens_per_micro_batch=budget,
            loss=LossConfig(aggregation=agg),
            # A large Adam eps makes the first update ~ lr * grad, so equal weights mean equal gradients
            # (with the default eps the first step is ~ lr * sign(grad), noisy where grad ~ 0).
            adam_eps=1.0,
        )
        m = t.train_step(samples)
        results.append(
            (
                agg,
                m,
                torch.cat([p.flatten() for p in t.model.parameters()]),
            )
        )
    for (agg_a, m_a, p_a), (agg_b, m_b, p_b) in (results[:2], results[2:]):
        assert agg_a == agg_b and m_a["num_micro_batches"] == 1 and m_b["num_micro_batches"] > 1
        assert m_b["loss"] == pytest.approx(m_a["loss"], rel=1e-5, abs=1e-7)
        assert m_b["grad_norm"] == pytest.approx(m_a["grad_norm"], rel=1e-4)
        assert (p_a - p_b).abs().max().item() < 1e-7
        # Step metrics do not depend on how the step was split either.
        for k in ("tis_mean", "tis_min", "tis_max", "tis_clip_frac", "mismatch_kl", "clip_frac"):
            assert m_b[k] == pytest.approx(m_a[k], rel=1e-5, abs=1e-7), k


def _sum_logp(model, samples):
    return [
        (response_logprobs(model, s) * torch.tensor(s.loss_mask, dtype=torch.float32)).sum().item()
        for s in samples
    ]


def test_grpo_step_raises_logprobs_of_positive_advantage_and_lowers_negative(policy):  # noqa: F811
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    samples = make_samples(policy, groups=2, per_group=3, seed=2, rewards=rewards)
    adv = [s.advantage for s in samples]
    assert all((a > 0) == (r == 1.0) for a, r in zip(adv, rewards, strict=True))
    before = _sum_logp(policy, samples)
    trainer = _trainer(policy, lr=3e-4)
    for _ in range(3):
        trainer.train_step(samples)
    after = _sum_logp(trainer.model, samples)
    for a, b0, b1 in zip(adv, before, after, strict=True):
        if a > 0:
            assert b1 > b0 + 1e-3, (a, b0, b1)
        else:
            assert b1 < b0 - 1e-3, (a, b0, b1)
    assert trainer.step == 3


def test_first_step_has_no_mismatch_and_no_clipping_when_engine_matches(policy):  # noqa: F811
    samples = make_samples(policy, seed=3)
    m = _trainer(policy).train_step(samples)
    assert m["mismatch_kl"] == pytest.approx(0.0, abs=1e-9)
    assert m["clip_frac"] == 0.0
    assert m["tis_mean"] == pytest.approx(1.0, abs=1e-5)


def test_minibatches_take_several_optimizer_steps_against_the_same_old_logprobs(policy):  # noqa: F811
    samples = make_samples(policy, groups=2, per_group=4, seed=4, rewards=[1, 0, 1, 0, 0, 1, 0, 1])
    trainer = _trainer(policy, lr=5e-2, num_minibatches=4, loss=LossConfig(eps_clip=0.01, eps_clip_high=0.01))
    m = trainer.train_step(samples)
    assert trainer.step == 4
    # After three big updates the last mini-batch's ratios have moved past a 1% clip range.
    assert m["clip_frac"] > 0


def test_the_lr_warms_up_linearly_per_optimizer_step_and_resumes_where_it_was(policy, tmp_path: Path):  # noqa: F811
    samples = make_samples(policy, groups=2, per_group=4, seed=4, rewards=[1, 0, 1, 0, 0, 1, 0, 1])
    trainer = _trainer(policy, lr=1e-3, num_minibatches=2, lr_warmup_steps=6)
    seen = [trainer.train_step(samples)["lr"] for _ in range(2)]
    assert seen == pytest.approx([2e-3 / 6, 4e-3 / 6])  # the last optimizer step of each: 2 and 4
    trainer.save(tmp_path / "ckpt")
    resumed = _trainer(copy.deepcopy(policy), lr=1e-3, num_minibatches=2, lr_warmup_steps=6)
    resumed.load(tmp_path / "ckpt")
    assert [resumed.train_step(samples)["lr"] for _ in range(2)] == pytest.approx([1e-3, 1e-3])
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        TrainConfig(lr_warmup_steps=-1)


def test_infra_failures_never_reach_the_loss(policy):  # noqa: F811
    samples = make_samples(policy, groups=1, per_group=3, rewards=[1.0, 0.0, 1.0], seed=5)
    samples[1].status = Status.FAILED_INFRA
    samples[1].reward = None
    m = _trainer(policy).train_step(samples)
    assert m["num_samples"] == 2 and m["num_dropped"] == 1
    with pytest.raises(ValueError, match="infra failures"):
        _trainer(policy).train_step([samples[1]])


def test_gradient_checkpointing_and_unchunked_logprobs_give_the_same_step(tiny_base):  # noqa: F811
    samples = make_samples(tiny_base, seed=6)
    a = _trainer(copy.deepcopy(tiny_base).float()).train_step(samples)
    b = _trainer(
        copy.deepcopy(tiny_base).float(), gradient_checkpointing=True, logprob_chunk_size=None
    ).train_step(samples)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_fused_loss_path_gives_the_step_of_the_chunked_path(tiny_base, aggregation):  # noqa: F811
    """logprob_impl="fused" makes the loss's gradients in the forward pass (`fused_token_loss`,
    its torch passes on CPU): the same loss, metrics and update as autograd through the chunked
    log-probs, with TIS, KL, an entropy bonus and several micro-batches."""
    samples = make_samples(tiny_base, seed=7)
    for s in samples[::2]:
        s.rollout_logprobs = [x - 0.3 * m for x, m in zip(s.rollout_logprobs, s.loss_mask, strict=True)]
    loss = LossConfig(aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01)
    out = []
    for impl in ("chunked", "fused"):
        model = copy.deepcopy(tiny_base).float()
        cfg = TrainConfig(
            lr=1e-3,
            weight_decay=0.0,
            loss=loss,
            adam_eps=1.0,
            logprob_impl=impl,
            max_tokens_per_micro_batch=40,
        )
        t = TorchTrainer(model, cfg, device="cpu", ref_model=copy.deepcopy(tiny_base).float())
        m = t.train_step(samples)
        out.append((m, torch.cat([p.flatten() for p in t.model.parameters()])))
    (m_a, p_a), (m_b, p_b) = out
    assert m_a["num_micro_batches"] > 1
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=1e-5, abs=1e-7)
    assert m_b["grad_norm"] == pytest.approx(m_a["grad_norm"], rel=1e-4)
    for k in ("kl", "entropy", "clip_frac", "tis_mean", "mismatch_kl"):
        assert m_b[k] == pytest.approx(m_a[k], rel=1e-5, abs=1e-7), k
    assert (p_a - p_b).abs().max().item() < 1e-7


@pytest.mark.parametrize(
    ("impl", "tis_mode"), [("chunked", "truncate"), ("fused", "truncate"), ("fused", "mask")]
)
def test_on_policy_old_logprobs_give_the_recomputed_step_with_one_forward_less(tiny_base, impl, tis_mode):  # noqa: F811
    """One optimizer step on the batch: the policy's own log-probs (detached) stand for the old
    ones. The same loss, metrics and update as recomputing them first, with TIS (weights clipped or
    masked), KL and an entropy bonus over several micro-batches; the policy's forward runs once per
    micro-batch instead of twice."""
    samples = make_samples(tiny_base, seed=8)
    for s in samples[::2]:
        s.rollout_logprobs = [x - 0.9 * m for x, m in zip(s.rollout_logprobs, s.loss_mask, strict=True)]
    loss = LossConfig(kl_coef=0.05, entropy_coef=0.01, tis_clip=1.5, tis_clip_low=0.5, tis_mode=tis_mode)
    out = []
    for mode in ("recompute", "on_policy"):
        model = copy.deepcopy(tiny_base).float()
        calls = []
        model.base_model.register_forward_hook(lambda *_, c=calls: c.append(1))  # the trunk, once a forward
        cfg = TrainConfig(
            lr=1e-3, weight_decay=0.0, loss=loss, adam_eps=1.0, logprob_impl=impl,
            max_tokens_per_micro_batch=40, old_logprobs=mode,
        )  # fmt: skip
        t = TorchTrainer(model, cfg, device="cpu", ref_model=copy.deepcopy(tiny_base).float())
        m = t.train_step(samples)
        out.append((m, torch.cat([p.flatten() for p in t.model.parameters()]), len(calls)))
    (m_a, p_a, calls_a), (m_b, p_b, calls_b) = out
    n = m_a["num_micro_batches"]
    assert n > 1 and (calls_a, calls_b) == (2 * n, n)
    assert m_a["tis_clip_frac"] > 0  # the weights were clipped (or masked) somewhere
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=1e-5, abs=1e-7)
    assert m_b["grad_norm"] == pytest.approx(m_a["grad_norm"], rel=1e-4)
    for k in ("kl", "entropy", "clip_frac", "tis_mean", "tis_min", "tis_max", "tis_clip_frac", "mismatch_kl"):
        assert m_b[k] == pytest.approx(m_a[k], rel=1e-5, abs=1e-7), k
    assert (p_a - p_b).abs().max().item() < 1e-6


def test_old_logprobs_auto_recomputes_where_on_policy_would_not_be_exact():
    assert TrainConfig().on_policy
    assert not TrainConfig(num_minibatches=2).on_policy
    assert not TrainConfig(loss=LossConfig(objective="gspo")).on_policy
    assert not TrainConfig(loss=LossConfig(tis_level="sequence")).on_policy
    assert not TrainConfig(old_logprobs="recompute").on_policy
    with pytest.raises(ValueError, match="num_minibatches 1"):
        TrainConfig(old_logprobs="on_policy", num_minibatches=2)


def test_kl_term_needs_a_reference_model(policy):  # noqa: F811
    with pytest.raises(ValueError, match="ref_model"):
        _trainer(policy, loss=LossConfig(kl_coef=0.1))
    ref = copy.deepcopy(policy)
    t = TorchTrainer(policy, TrainConfig(loss=LossConfig(kl_coef=0.1)), device="cpu", ref_model=ref)
    m = t.train_step(make_samples(policy, seed=7))
    assert m["kl"] == pytest.approx(0.0, abs=1e-9)


def test_config_rejects_bad_values_with_reasons():
    with pytest.raises(ValueError, match="lr must be > 0"):
        TrainConfig(lr=0)
    with pytest.raises(ValueError, match="temperature"):
        TrainConfig(temperature=0)
    assert TrainConfig(loss={"eps_clip": 0.1}).loss.eps_clip == 0.1  # type: ignore[arg-type]


def test_checkpoint_resume_continues_exactly(tiny_base, tmp_path: Path):  # noqa: F811
    samples = make_samples(tiny_base, seed=8)
    samples_b = make_samples(tiny_base, seed=9)
    a = _trainer(copy.deepcopy(tiny_base).float())
    a.train_step(samples)
    ckpt = a.save(tmp_path / "ckpt", buffer_state={"consumed": 6, "epoch": 0})
    a.train_step(samples_b)
    b = _trainer(copy.deepcopy(tiny_base).float())
    state = b.load(tmp_path / "ckpt")
    assert ckpt.name == "step-00000001" and state.step == 1 and b.step == 1
    assert state.buffer_state == {"consumed": 6, "epoch": 0}
    b.train_step(samples_b)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_a_failed_checkpoint_write_leaves_the_previous_one_as_latest(policy, tmp_path: Path):  # noqa: F811
    t = _trainer(policy)
    first = t.save(tmp_path)

    class Unsaveable(torch.optim.SGD):
        def state_dict(self):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        from agentrl.train.checkpoint import TrainState

        save_checkpoint(
            tmp_path,
            model=t.model,
            optimizer=Unsaveable(t.model.parameters(), lr=0.1),
            state=TrainState(step=5),
        )
    assert latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000000"]
    assert json.loads((first / "state.json").read_text())["step"] == 0


def test_loading_a_checkpoint_into_a_different_model_says_so(policy, tmp_path: Path):  # noqa: F811
    from transformers import Glm4Config, Glm4ForCausalLM

    t = _trainer(policy)
    path = t.save(tmp_path)
    other = Glm4ForCausalLM(
        Glm4Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8, pad_token_id=0, eos_token_id=1)
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="does not match"):
        load_checkpoint(path, model=other)
    with pytest.raises(CheckpointError, match="not a complete"):
        load_checkpoint(tmp_path / "nowhere", model=other)


def test_seeded_samples_are_deterministic(tiny_base):  # noqa: F811
    a = make_samples(tiny_base, seed=11)
    b = make_samples(tiny_base, seed=11)
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert isinstance(a[0], Sample) and random.Random(0).random() == random.Random(0).random()


@pytest.mark.slow
def test_bf16_autocast_keeps_fp32_weights_and_tracks_the_fp32_step(tiny_base):  # noqa: F811
    samples = make_samples(tiny_base, seed=12)
    full = _trainer(copy.deepcopy(tiny_base).float()).train_step(samples)
    t = _trainer(copy.deepcopy(tiny_base).float(), dtype="bfloat16")
    half = t.train_step(samples)
    assert t.autocast_dtype is torch.bfloat16
    assert all(p.dtype is torch.float32 for p in t.model.parameters())
    # The loss is a mean of A * w with A summing to 0 per group, so compare it on the advantage scale.
    assert half["loss"] == pytest.approx(full["loss"], abs=0.02 * full["adv_abs_mean"])
    assert half["grad_norm"] == pytest.approx(full["grad_norm"], rel=0.05)
    # bf16 compute against fp32 rollouts: a small, nonzero mismatch that the metric reports.
    assert 0 < half["mismatch_kl"] < 1e-2


def test_a_token_with_a_huge_engine_mismatch_gives_a_finite_loss_and_finite_weights(policy):  # noqa: F811
    samples = make_samples(policy, seed=13)
    # The engine reported e^-1000 for one sampled token: exp(old - rollout) would be infinite.
    samples[0].rollout_logprobs[0] = -1000.0
    trainer = _trainer(policy)
    m = trainer.train_step(samples)
    assert m["skipped_steps"] == 0 and torch.isfinite(torch.tensor(m["loss"]))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_non_finite_token_skips_the_optimizer_step_and_never_reaches_the_weights(policy):  # noqa: F811
    samples = make_samples(policy, seed=14)
    samples[0].rollout_logprobs[0] = float("nan")
    trainer = _trainer(policy)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    m = trainer.train_step(samples)
    assert m["skipped_steps"] == 1 and trainer.skipped_nonfinite == 1 and trainer.step == 0
    for b, p in zip(before, trainer.model.parameters(), strict=True):
        assert torch.equal(b, p)
    # AdamW holds no NaN moment either: the next clean step trains normally.
    m2 = trainer.train_step(make_samples(policy, seed=15))
    assert m2["skipped_steps"] == 0 and trainer.step == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_log_ratio_is_clamped_before_exp():
    from agentrl.algo.losses import LOG_RATIO_CLAMP, policy_loss, tis_weights

    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-200.0, 0.0]])
    loss, _ = policy_loss(
        logp, old, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), eps_clip=0.2, eps_clip_high=0.2
    )
    assert torch.isfinite(loss).all()
    w, stats = tis_weights(old, torch.tensor([[0.0, -500.0]]), torch.ones(1, 2), low=0.5, high=2.0)
    assert torch.isfinite(w).all() and stats["tis_max"].item() == pytest.approx(
        float(torch.exp(torch.tensor(LOG_RATIO_CLAMP)))
    )


def test_gspo_trains_with_the_same_step_whatever_logprob_impl_is_asked(tiny_base):  # noqa: F811
    """GSPO's sequence ratio mixes a row's positions, so the trainer computes it from log-probs
    even where the fused head was asked for: the same step either way, with its sequence metrics."""
    samples = make_samples(tiny_base, seed=8)
    for s in samples[::2]:
        s.rollout_logprobs = [x - 0.3 * m for x, m in zip(s.rollout_logprobs, s.loss_mask, strict=True)]
    loss = LossConfig(objective="gspo", eps_clip=1e-4, eps_clip_high=2e-4)
    out = []
    for impl in ("chunked", "fused"):
        model = copy.deepcopy(tiny_base).float()
        cfg = TrainConfig(
            lr=1e-3,
            weight_decay=0.0,
            loss=loss,
            adam_eps=1.0,
            logprob_impl=impl,
            max_tokens_per_micro_batch=40,
        )
        m = TorchTrainer(model, cfg, device="cpu").train_step(samples)
        out.append((m, torch.cat([p.flatten() for p in model.parameters()])))
    (m_a, p_a), (m_b, p_b) = out
    assert m_a["num_micro_batches"] > 1
    assert m_a["seq_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # first step: policy == old
    assert m_a["seq_clip_frac"] == 0.0
    assert m_a["grad_norm"] > 0
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=1e-6, abs=1e-9)
    assert (p_a - p_b).abs().max().item() == 0.0
