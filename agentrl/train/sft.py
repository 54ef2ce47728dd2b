"""Supervised warm start on recorded trajectories (`agentrl sft`).

The trajectories are episode records (see `agentrl.episode.run`), typically harvested by driving each
task's reference solution through the real agent loop, so the model learns the agent's own action
format on exactly the token layout it will see in RL. The loss is the mean negative log-likelihood
of assistant tokens only (loss mask 1); prompts and observations are context.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from agentrl.episode.sample import Sample


@dataclass
class SFTConfig:
    steps: int = 100
    lr: float = 1e-3
    batch_size: int = 8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10


def sft_loss(model: Any, batch: list[Sample], device: str = "cpu") -> Any:
    """Mean NLL over loss-masked tokens of a right-padded batch."""
    import torch

    width = max(len(s.tokens) for s in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.float32)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
        attn[i, : len(s.tokens)] = 1
        mask[i, s.prompt_length : len(s.tokens)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    ids, mask, attn = ids.to(device), mask.to(device), attn.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    target_mask = mask[:, 1:]
    return -(logp * target_mask).sum() / target_mask.sum().clamp(min=1.0)


def run_sft(
    model: Any, samples: list[Sample], config: SFTConfig, *, device: str = "cpu", log: Any = print
) -> list[float]:
    """Train `model` in place; returns the loss per step."""
    import torch

    if not samples:
        raise ValueError("no SFT samples: harvest trajectories first (recipes/local_tbench2.py prepare)")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    losses: list[float] = []
    order: list[Sample] = []
    for step in range(config.steps):
        if len(order) < config.batch_size:
            extra = list(samples)
            rng.shuffle(extra)
            order += extra * max(1, config.batch_size // len(extra) + 1)
        batch, order = order[: config.batch_size], order[config.batch_size :]
        loss = sft_loss(model, batch, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if log is not None and (step % config.log_every == 0 or step == config.steps - 1):
            log(f"sft step {step:4d}  loss {losses[-1]:.4f}")
    model.eval()
    return losses
