"""Episodes as segment lists: advantages once per episode, loss denominators counting each episode
once, minibatches of whole episodes."""

from __future__ import annotations

import pytest

from agentrl.episode.sample import Status
from agentrl.train.batch import build_batch, episode_chunks, loss_weights, training_samples
from tests.conftest import make_episode


def test_a_split_episode_counts_once_in_its_group_advantages() -> None:
    # Rewards [1, 0, 0, 0], the passing episode split into 3 segments by its chat template.
    group = [make_episode("g", reward=1.0, sample_index=0, segments=3)] + [
        make_episode("g", reward=0.0, sample_index=i) for i in (1, 2, 3)
    ]
    samples = training_samples([group])
    assert len(samples) == 6
    assert [s.advantage for s in samples[:3]] == pytest.approx([1.5, 1.5, 1.5], abs=1e-5)
    assert [s.advantage for s in samples[3:]] == pytest.approx([-0.5, -0.5, -0.5], abs=1e-5)
    assert len({s.episode_id for s in samples[:3]}) == 1


def test_groups_are_normalised_separately_and_untrainable_episodes_are_left_out() -> None:
    a = [make_episode("a", reward=r, sample_index=i) for i, r in enumerate([1.0, 0.0])]
    b = [make_episode("b", reward=1.0, sample_index=i) for i in range(2)]
    failed = make_episode("b", reward=None, sample_index=2, status=Status.FAILED_INFRA)
    samples = training_samples([a, [*b, failed]])
    assert [s.advantage for s in samples] == pytest.approx([0.7071, -0.7071, 0.0, 0.0], abs=1e-3)


def test_seq_mean_weights_each_episode_once_whatever_its_segments() -> None:
    group = [
        make_episode("g", reward=1.0, sample_index=0, segments=3),
        make_episode("g", reward=0.0, sample_index=1),
    ]
    samples = training_samples([group])
    w = loss_weights(samples, "seq_mean_token_mean")
    per_episode = {}
    for s, x in zip(samples, w, strict=True):
        per_episode[s.episode_id] = per_episode.get(s.episode_id, 0.0) + x * sum(s.loss_mask)
    assert list(per_episode.values()) == pytest.approx([0.5, 0.5])
    tok = loss_weights(samples, "token_mean")
    assert sum(x * sum(s.loss_mask) for s, x in zip(samples, tok, strict=True)) == pytest.approx(1.0)


def test_minibatches_never_cut_an_episode() -> None:
    group = [make_episode("g", reward=float(i % 2), sample_index=i, segments=1 + i % 3) for i in range(6)]
    samples = training_samples([group])
    chunks = episode_chunks(samples, 4)
    assert sorted(i for c in chunks for i in c) == list(range(len(samples)))
    for c in chunks:
        ids = {samples[i].episode_id for i in c}
        for other in chunks:
            if other is not c:
                assert not ids & {samples[i].episode_id for i in other}


def test_the_batch_carries_each_segments_episode_advantage_on_its_tokens() -> None:
    group = [
        make_episode("g", reward=1.0, sample_index=0, segments=2),
        make_episode("g", reward=0.0, sample_index=1),
    ]
    samples = training_samples([group])
    batch = build_batch(samples, aggregation="token_mean", max_tokens_per_micro_batch=1000)
    mb = batch.micro_batches[0]
    for r, i in enumerate(mb.sample_indices):
        s = samples[i]
        trained = mb.loss_mask[r] > 0
        assert mb.advantages[r][trained].tolist() == pytest.approx([s.advantage] * int(trained.sum()))
    assert float((mb.loss_weights * mb.loss_mask).sum()) == pytest.approx(1.0)
    assert batch.num_loss_seqs == 2
