"""The supervised warm start: the loss on assistant tokens, and a warm start that stops at a skill
(`SFTConfig.target`) instead of a step count."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from agentrl.episode.sample import Sample  # noqa: E402
from agentrl.train.sft import SFTConfig, reference_pass, run_sft  # noqa: E402


class Bigram(torch.nn.Module):
    """A next-token table: logits depend on the previous token only (enough to memorise a reply)."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(vocab, vocab))

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


def _sample(tokens: list[int], prompt_length: int) -> Sample:
    reply = len(tokens) - prompt_length
    return Sample(
        prompt_id="0",
        tokens=tokens,
        prompt_length=prompt_length,
        loss_mask=[1] * reply,
        rollout_logprobs=[0.0] * reply,
        reward=1.0,
        task_id="t",
    )


def test_reference_pass_is_the_probability_of_sampling_the_reply_at_the_temperature() -> None:
    model = Bigram()
    with torch.no_grad():
        model.table.copy_(torch.randn(16, 16))
    s = _sample([1, 2, 3, 4, 5], prompt_length=2)
    for temperature in (1.0, 0.7):
        probs = torch.softmax(model.table.detach() / temperature, dim=-1)
        want = float(probs[2, 3] * probs[3, 4] * probs[4, 5])  # the reply's tokens given each previous one
        assert reference_pass(model, [s], temperature) == pytest.approx([want], rel=1e-5)


def test_a_masked_token_is_context_not_part_of_the_reply() -> None:
    model = Bigram()
    with torch.no_grad():
        model.table.copy_(torch.randn(16, 16))
    s = _sample([1, 2, 3, 4, 5], prompt_length=2)
    s.loss_mask = [1, 0, 1]  # token 4 is an observation
    probs = torch.softmax(model.table.detach(), dim=-1)
    assert reference_pass(model, [s], 1.0)[0] == pytest.approx(float(probs[2, 3] * probs[4, 5]), rel=1e-5)


def test_sft_stops_once_the_target_is_reached_and_not_before() -> None:
    samples = [_sample([1, 2, 3, 4, 5], 2), _sample([1, 6, 7, 8, 9], 2)]
    model = Bigram()
    losses = run_sft(model, samples, SFTConfig(steps=500, lr=0.05, batch_size=2, target=0.5), log=None)
    assert 1 < len(losses) < 500
    passes = reference_pass(model, samples, 1.0)
    assert sum(passes) / 2 >= 0.5
    # one step fewer would not have reached it: replay the same run to that point
    model2 = Bigram()
    run_sft(model2, samples, SFTConfig(steps=len(losses) - 1, lr=0.05, batch_size=2), log=None)
    assert sum(reference_pass(model2, samples, 1.0)) / 2 < 0.5


def test_without_a_target_every_step_runs_and_a_target_outside_0_1_is_refused() -> None:
    samples = [_sample([1, 2, 3], 1)]
    assert len(run_sft(Bigram(), samples, SFTConfig(steps=7, lr=0.01, batch_size=1), log=None)) == 7
    with pytest.raises(ValueError, match="not a probability"):
        run_sft(Bigram(), samples, SFTConfig(steps=7, target=1.5), log=None)
    assert math.isclose(SFTConfig().temperature, 1.0)


def test_a_sparse_target_check_stops_on_a_multiple_of_its_period_measured_on_its_subset() -> None:
    samples = [_sample([1, 2, 3, 4, 5], 2), _sample([1, 6, 7, 8, 9], 2), _sample([1, 10, 11, 12, 13], 2)]
    config = SFTConfig(steps=500, lr=0.05, batch_size=3, target=0.5, target_every=7, target_samples=2)
    model = Bigram()
    losses = run_sft(model, samples, config, log=None)
    assert len(losses) % 7 == 0 and len(losses) < 500
    # the subset is a fixed, seeded draw of two samples, and it is what reached the target
    import random

    probe = random.Random(config.seed + 1).sample(samples, 2)
    assert sum(reference_pass(model, probe, 1.0)) / 2 >= 0.5
    with pytest.raises(ValueError, match="at least 1"):
        run_sft(Bigram(), samples, SFTConfig(steps=3, target=0.5, target_every=0), log=None)


def test_a_floor_waits_for_the_slowest_task_too() -> None:
    """Two tasks, one learnt faster: the mean target alone stops while the slow one is near 0;
    with a floor, SFT goes on until every task's reference pass reaches it."""
    fast = [_sample([1, 2, 3], 1) for _ in range(3)]
    slow = [_sample([5, 6, 7, 8, 9, 10, 11], 1)]  # no context shared with the fast task
    for s in fast:
        s.task_id = "fast"
    slow[0].task_id = "slow"
    samples = fast + slow
    mean_only = Bigram()
    n_mean = len(
        run_sft(mean_only, samples, SFTConfig(steps=500, lr=0.05, batch_size=4, target=0.3), log=None)
    )
    floored = Bigram()
    config = SFTConfig(steps=500, lr=0.05, batch_size=4, target=0.3, target_floor=0.3)
    n_floor = len(run_sft(floored, samples, config, log=None))
    assert reference_pass(mean_only, slow, 1.0)[0] < 0.3 and n_floor > n_mean
    assert reference_pass(floored, slow, 1.0)[0] >= 0.3
    with pytest.raises(ValueError, match="needs a target"):
        run_sft(Bigram(), samples, SFTConfig(steps=3, target_floor=0.1), log=None)
