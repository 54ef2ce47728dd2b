"""GRPO advantages: each sample's reward relative to the other samples of its prompt's group."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[object] | torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages, one per sample.

    For sample i in group g with rewards r_g (n_g samples):
        A_i = r_i - mean(r_g)                              (normalize_std=False)
        A_i = (r_i - mean(r_g)) / (std(r_g) + eps)         (normalize_std=True)
    std is the unbiased sample std. A single-sample group has no spread to compare against: its
    std is taken as 0, so A_i = 0. A zero-variance group (all rewards equal) gets A_i = 0 exactly,
    never a 0/0.
    """
    rewards = rewards.to(torch.float64)
    if rewards.dim() != 1 or len(group_ids) != rewards.shape[0]:
        raise ValueError(
            f"rewards must be 1-D with one group id each; got {tuple(rewards.shape)} and {len(group_ids)} ids"
        )
    keys = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    index: dict[object, int] = {}
    gid = torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)
    n_groups = len(index)
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, rewards) / count.clamp(min=1)
    centered = rewards - mean[gid]
    if not normalize_std:
        return centered.to(torch.float32)
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, centered**2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    # Round-off can leave a tiny nonzero residue in a constant group; it must give exactly 0.
    centered = torch.where(std[gid] > 0, centered, torch.zeros_like(centered))
    return (centered / (std[gid] + eps)).to(torch.float32)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_{b,t} = A_b * mask_{b,t}: every trained token of a sequence shares its advantage."""
    return advantages[:, None].to(mask.device, torch.float32) * mask.to(torch.float32)
