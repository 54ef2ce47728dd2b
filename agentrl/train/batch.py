"""The batch format every trainer backend consumes, and packing under a token budget.

Packing layout (chosen for correctness on every attention backend): a micro-batch is a set of
right-padded rows, one sequence per row, with position ids restarting at 0 in each row and an
attention mask that hides the padding. Pad-free concatenation of several sequences into one row
is only correct where the attention kernel honours sequence boundaries (flash-attention varlen
through `position_ids`); with SDPA or eager attention on CPU it would let sequences attend to each
other. Memory of a padded micro-batch is rows x longest row, so that is what the budget counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agentrl.algo import grpo_advantages
from agentrl.sample import Sample


@dataclass
class MicroBatch:
    """One forward pass: [R, L] tensors aligned with `input_ids` (entry t describes token t).

    `loss_mask[r, t]` is 1 on trained (generated) tokens; `rollout_logprobs` and `advantages` are
    0 elsewhere. `sample_indices[r]` is the index of row r's sample in the step's sample list.
    `old_logprobs` / `ref_logprobs` are filled by the trainer before the update.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    sample_indices: list[int]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

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
            sample_indices=self.sample_indices,
            old_logprobs=move(self.old_logprobs),
            ref_logprobs=move(self.ref_logprobs),
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


def sample_advantages(samples: Sequence[Sample], *, normalize_std: bool = True) -> torch.Tensor:
    """GRPO advantage per sample, groups keyed by `prompt_id`."""
    if any(s.reward is None for s in samples):
        raise ValueError("every sample needs a reward before training (filter with Sample.trainable)")
    rewards = torch.tensor([float(s.reward) for s in samples])  # type: ignore[arg-type]
    return grpo_advantages(rewards, [s.prompt_id for s in samples], normalize_std=normalize_std)


def _rows(
    samples: Sequence[Sample], advantages: Sequence[float], indices: list[int], pad_id: int
) -> MicroBatch:
    width = max(len(samples[i].tokens) for i in indices)
    n = len(indices)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    roll = torch.zeros((n, width), dtype=torch.float32)
    adv = torch.zeros((n, width), dtype=torch.float32)
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
            adv[r, p:length] = float(advantages[i]) * m
    return MicroBatch(ids, attn, pos, mask, roll, adv, list(indices))


def build_batch(
    samples: Sequence[Sample],
    advantages: Sequence[float] | torch.Tensor,
    *,
    max_tokens_per_micro_batch: int,
    pad_token_id: int = 0,
) -> TrainBatch:
    """Samples (already checked and trainable) -> packed micro-batches of one optimizer step."""
    if not samples:
        raise ValueError("no samples to train on")
    adv = advantages.tolist() if isinstance(advantages, torch.Tensor) else list(advantages)
    if len(adv) != len(samples):
        raise ValueError(f"{len(adv)} advantages for {len(samples)} samples")
    for s in samples:
        s.check()
        if not s.tokens:
            raise ValueError(f"sample {s.prompt_id}/{s.sample_index} has no tokens")
    bins = pack([len(s.tokens) for s in samples], max_tokens_per_micro_batch)
    micro = [_rows(samples, adv, sorted(b), pad_token_id) for b in bins]
    n_tok = int(sum(int(mb.loss_mask.sum().item()) for mb in micro))
    n_seq = int(sum(int((mb.loss_mask.sum(-1) > 0).sum().item()) for mb in micro))
    padded = sum(mb.padded_tokens for mb in micro)
    real = sum(len(s.tokens) for s in samples)
    return TrainBatch(
        micro_batches=micro,
        num_loss_tokens=n_tok,
        num_loss_seqs=n_seq,
        num_samples=len(samples),
        stats={"num_micro_batches": float(len(micro)), "pad_fraction": 1.0 - real / max(padded, 1)},
    )
