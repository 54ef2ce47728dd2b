"""The batch format every trainer backend consumes, and packing under a token budget.

Packing layout (chosen for correctness on every attention backend): a micro-batch is a set of
right-padded rows, one sequence per row, with position ids restarting at 0 in each row and an
attention mask that hides the padding. Pad-free concatenation of several sequences into one row
is only correct where the attention kernel honours sequence boundaries (flash-attention varlen
through `position_ids`); with SDPA or eager attention on CPU it would let sequences attend to each
other. Memory of a padded micro-batch is rows x longest row, so that is what the budget counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.algo.advantages import grpo_advantages
from agentrl.algo.losses import Aggregation, TokenTerms, grpo_terms, on_policy_terms
from agentrl.episode.sample import Episode, Sample
from agentrl.train.config import TrainConfig


@dataclass
class MicroBatch:
    """One forward pass: [R, L] tensors aligned with `input_ids` (entry t describes token t).

    `loss_mask[r, t]` is 1 on trained (generated) tokens; `rollout_logprobs` and `advantages` are
    0 elsewhere. `loss_weights[r, t]` is the token's weight in the optimizer step's loss (the
    aggregation's denominators, computed once per episode: the step's loss is the sum over every
    micro-batch of weight x per-token loss). `sample_indices[r]` is the index of row r's sample in
    the step's sample list.
    `old_logprobs` / `ref_logprobs` are filled by the trainer before the update.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_weights: torch.Tensor
    sample_indices: list[int]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    # [R, L, num_layers, top_k] int: the engine's experts for token t of row r (-1 where it routed
    # none: padding, the row's last token, dense layers); None unless every sample carries them.
    routed_experts: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> MicroBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return MicroBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            loss_mask=self.loss_mask.to(device),
            rollout_logprobs=self.rollout_logprobs.to(device),
            advantages=self.advantages.to(device),
            loss_weights=self.loss_weights.to(device),
            sample_indices=self.sample_indices,
            old_logprobs=move(self.old_logprobs),
            ref_logprobs=move(self.ref_logprobs),
            routed_experts=move(self.routed_experts),
        )


@dataclass
class TrainBatch:
    """The micro-batches of one optimizer step and the denominators that make them add up.

    The loss of the step is the sum over micro-batches of each one's loss computed with
    `num_loss_tokens` / `num_loss_seqs` as denominators, so gradient accumulation gives the same
    gradient as one pass over all rows.
    """

    micro_batches: list[MicroBatch]
    num_loss_tokens: int
    num_loss_seqs: int
    num_samples: int
    stats: dict[str, float] = field(default_factory=dict)


def pack(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped into bins of padded cost rows x longest <= max_tokens.

    Items are placed longest first, so a bin's first item is its longest and adding an item costs
    (rows + 1) x first. A sequence longer than `max_tokens` gets a bin of its own (it cannot be split).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    longest: list[int] = []
    for i in order:
        for b, members in enumerate(bins):
            if (len(members) + 1) * longest[b] <= max_tokens:
                members.append(i)
                break
        else:
            bins.append([i])
            longest.append(lengths[i])
    return bins


def training_samples(
    groups: Sequence[Sequence[Episode | None]], *, normalize_std: bool = True
) -> list[Sample]:
    """The segments to train on, each carrying its episode's GRPO advantage.

    Advantages are computed once per episode, over the trainable episodes of its group, and copied
    to every segment of the episode: an episode that a history-rewriting template split into three
    segments counts once in its group's mean and std, not three times (Miles does the same).
    Example: rewards [1, 0, 0, 0] give +1.5 / -0.5 whatever the number of segments.
    """
    episodes: list[Episode] = []
    group_of: list[int] = []
    for g, group in enumerate(groups):
        for e in group:
            if e is not None and e.trainable:
                episodes.append(e)
                group_of.append(g)
    if not episodes:
        return []
    rewards = torch.tensor([float(e.reward) for e in episodes])  # type: ignore[arg-type]
    adv = grpo_advantages(rewards, group_of, normalize_std=normalize_std).tolist()
    out: list[Sample] = []
    for k, (e, a) in enumerate(zip(episodes, adv, strict=True)):
        eid = f"{e.prompt_id}/{e.sample_index}#{k}"
        for seg in e.trainable_segments:
            seg.advantage = float(a)
            seg.episode_id = eid
            seg.reward = e.reward
            out.append(seg)
    return out


def episode_chunks(samples: Sequence[Sample], n: int) -> list[list[int]]:
    """Split sample indices into at most `n` consecutive chunks of whole episodes (of about equal
    episode counts): the segments of one episode always land in the same optimizer step."""
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        key = s.episode_id or f"#{i}"
        if key not in members:
            order.append(key)
            members[key] = []
        members[key].append(i)
    n = max(1, min(n, len(order)))
    bounds = [round(k * len(order) / n) for k in range(n + 1)]
    return [[i for key in order[a:b] for i in members[key]] for a, b in itertools.pairwise(bounds)]


def loss_weights(samples: Sequence[Sample], aggregation: Aggregation) -> list[float]:
    """Per-sample weight of each trained token in one optimizer step's loss.

    token_mean:           1 / N_tok, N_tok the trained tokens of the step: every token counts once,
                          so an episode weighs its token count however it was segmented.
    seq_mean_token_mean:  1 / (N_ep * n_e), n_e the trained tokens of the sample's episode (all its
                          segments together) and N_ep the episodes of the step: each episode counts
                          once, whatever the number of its segments.
    """
    tokens = [sum(s.loss_mask) for s in samples]
    if aggregation == "token_mean":
        total = max(sum(tokens), 1)
        return [1.0 / total] * len(samples)
    if aggregation == "seq_mean_token_mean":
        per_ep: dict[str, int] = {}
        keys = [s.episode_id or f"#{i}" for i, s in enumerate(samples)]
        for key, n in zip(keys, tokens, strict=True):
            per_ep[key] = per_ep.get(key, 0) + n
        n_ep = max(sum(1 for v in per_ep.values() if v > 0), 1)
        return [1.0 / (n_ep * max(per_ep[k], 1)) for k in keys]
    raise ValueError(f"aggregation={aggregation!r}: choose token_mean or seq_mean_token_mean")


def _rows(samples: Sequence[Sample], weights: Sequence[float], indices: list[int], pad_id: int) -> MicroBatch:
    width = max(len(samples[i].tokens) for i in indices)
    n = len(indices)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    roll = torch.zeros((n, width), dtype=torch.float32)
    adv = torch.zeros((n, width), dtype=torch.float32)
    wts = torch.zeros((n, width), dtype=torch.float32)
    for r, i in enumerate(indices):
        s = samples[i]
        length, p = len(s.tokens), s.prompt_length
        ids[r, :length] = torch.tensor(s.tokens, dtype=torch.long)
        attn[r, :length] = 1
        pos[r, :length] = torch.arange(length)
        if length > p:
            m = torch.tensor(s.loss_mask, dtype=torch.float32)
            # Token 0 has no context to be predicted from; a response never starts there in practice.
            if p == 0:
                m[0] = 0.0
            mask[r, p:length] = m
            roll[r, p:length] = torch.tensor(s.rollout_logprobs, dtype=torch.float32) * m
            adv[r, p:length] = float(s.advantage or 0.0) * m
            wts[r, p:length] = float(weights[i]) * m
    routes = None
    if all(samples[i].routed_experts is not None for i in indices):
        first = samples[indices[0]].routed_experts or [[[]]]
        layers, k = len(first[0]), len(first[0][0])
        routes = torch.full((n, width, layers, k), -1, dtype=torch.int32)
        for r, i in enumerate(indices):
            given = samples[i].routed_experts or []
            if given:
                routes[r, : len(given)] = torch.tensor(given, dtype=torch.int32)
    return MicroBatch(ids, attn, pos, mask, roll, adv, wts, list(indices), routed_experts=routes)


def build_batch(
    samples: Sequence[Sample],
    *,
    aggregation: Aggregation = "token_mean",
    max_tokens_per_micro_batch: int,
    pad_token_id: int = 0,
) -> TrainBatch:
    """Samples of one optimizer step (checked, trainable, `advantage` set) -> packed micro-batches
    with the step's per-token loss weights."""
    if not samples:
        raise ValueError("no samples to train on")
    for s in samples:
        s.check()
        if not s.tokens:
            raise ValueError(f"sample {s.prompt_id}/{s.sample_index} has no tokens")
        if s.advantage is None:
            raise ValueError(
                f"sample {s.prompt_id}/{s.sample_index} has no advantage: compute advantages once per "
                "episode first (agentrl.train.batch.training_samples)"
            )
    weights = loss_weights(samples, aggregation)
    bins = pack([len(s.tokens) for s in samples], max_tokens_per_micro_batch)
    micro = [_rows(samples, weights, sorted(b), pad_token_id) for b in bins]
    n_tok = int(sum(int(mb.loss_mask.sum().item()) for mb in micro))
    n_seq = len({s.episode_id or f"#{i}" for i, s in enumerate(samples) if any(s.loss_mask)})
    padded = sum(mb.padded_tokens for mb in micro)
    real = sum(len(s.tokens) for s in samples)
    return TrainBatch(
        micro_batches=micro,
        num_loss_tokens=n_tok,
        num_loss_seqs=n_seq,
        num_samples=len(samples),
        stats={"num_micro_batches": float(len(micro)), "pad_fraction": 1.0 - real / max(padded, 1)},
    )


def groups_from_samples(samples: Sequence[Sample]) -> list[list[Episode]]:
    """Loose samples (dumps, records, single-turn tests) -> GRPO groups of episodes: samples sharing
    `prompt_id` form a group, and segments sharing (`prompt_id`, `sample_index`) one episode."""
    groups: dict[str, dict[int, Episode]] = {}
    for s in samples:
        eps = groups.setdefault(s.prompt_id, {})
        ep = eps.get(s.sample_index)
        if ep is None:
            eps[s.sample_index] = Episode(
                segments=[s],
                reward=s.reward,
                status=s.status,
                prompt_id=s.prompt_id,
                sample_index=s.sample_index,
                task_id=s.task_id,
            )
        else:
            ep.segments.append(s)
    return [list(g.values()) for g in groups.values()]


def with_advantages(samples: Sequence[Sample], *, normalize_std: bool = True) -> list[Sample]:
    """Loose samples -> the trainable ones with per-episode GRPO advantages set (train-only replays
    of dumped samples, probes, tests); rollouts go through `training_samples` directly."""
    return training_samples(groups_from_samples(samples), normalize_std=normalize_std)


# --- the optimizer-step loop every trainer backend shares ------------------------------------------


def step_batches(
    samples: Sequence[Sample],
    *,
    num_minibatches: int,
    aggregation: Aggregation,
    max_tokens_per_micro_batch: int,
    pad_token_id: int,
) -> tuple[list[TrainBatch], dict[str, float]]:
    """A rollout batch -> one `TrainBatch` of whole episodes per optimizer step, and the rollout
    batch's statistics. Samples that cannot train (infra failures, no reward) are dropped and
    counted; none left is an error."""
    trainable = [s for s in samples if s.trainable]
    if not trainable:
        raise ValueError(
            f"none of the {len(samples)} samples can train (infra failures or missing rewards): "
            "check the rollout's failure counts"
        )
    batches = [
        build_batch(
            [trainable[i] for i in chunk],
            aggregation=aggregation,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            pad_token_id=pad_token_id,
        )
        for chunk in episode_chunks(trainable, num_minibatches)
    ]
    rewards = torch.tensor([float(s.reward) for s in trainable])  # type: ignore[arg-type]
    adv = torch.tensor([float(s.advantage or 0.0) for s in trainable])
    stats = {
        "num_samples": float(len(trainable)),
        "num_episodes": float(len({s.episode_id for s in trainable})),
        "num_dropped": float(len(samples) - len(trainable)),
        "reward_mean": rewards.mean().item(),
        "adv_abs_mean": adv.abs().mean().item(),
    }
    return batches, stats


def add_loss_metrics(
    sums: dict[str, float], metrics: dict[str, Any], n_tokens: float, step_tokens: int
) -> None:
    """Fold one micro-batch's loss metrics into the step's: `_min` / `_max` metrics by min / max,
    the rest token-weighted (a metric of the step is its mean over the step's loss tokens);
    `pg_loss` is left out (the step's loss is the sum of the micro-batches' losses)."""
    if n_tokens == 0:
        return
    for k, v in metrics.items():
        x = float(v)
        if k.endswith("_min"):
            sums[k] = min(sums.get(k, x), x)
        elif k.endswith("_max"):
            sums[k] = max(sums.get(k, x), x)
        elif k != "pg_loss":
            sums[k] = sums.get(k, 0.0) + x * n_tokens / max(step_tokens, 1)


def run_steps(
    batches: Sequence[TrainBatch], update: Callable[[TrainBatch], dict[str, float]], stats: dict[str, float]
) -> dict[str, float]:
    """Run `update` (one optimizer step, `skipped` = 1.0 when it dropped a non-finite step) on each
    batch. Returns the last completed step's metrics (a skipped one's when none completed), the
    rollout statistics and `skipped_steps`."""
    metrics: dict[str, float] = {}
    skipped = 0
    for batch in batches:
        m = update(batch)
        if m["skipped"]:
            skipped += 1
            if not metrics:
                metrics = m
        else:
            metrics = m
    metrics = {**metrics, **stats, "skipped_steps": float(skipped)}
    return metrics


def loss_terms(
    mb: MicroBatch, batch: TrainBatch, cfg: TrainConfig
) -> tuple[TokenTerms, dict[str, torch.Tensor]]:
    """A micro-batch's loss terms: from its recomputed old log-probs, or on-policy (`old_logprobs`;
    their metrics come after the forward)."""
    common = dict(
        ref_logp=mb.ref_logprobs,
        num_tokens=batch.num_loss_tokens,
        num_seqs=batch.num_loss_seqs,
        token_weights=mb.loss_weights,
    )
    if cfg.on_policy:
        return on_policy_terms(mb.rollout_logprobs, mb.advantages, mb.loss_mask, cfg.loss, **common), {}
    assert mb.old_logprobs is not None
    return grpo_terms(mb.old_logprobs, mb.rollout_logprobs, mb.advantages, mb.loss_mask, cfg.loss, **common)
