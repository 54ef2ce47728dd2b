"""Supervised warm start on recorded trajectories (`agentrl sft`).

The trajectories are episode records (see `agentrl.episode.run`), typically harvested by driving each
task's reference solution through the real agent loop, so the model learns the agent's own action
format on exactly the token layout it will see in RL. The loss is the mean negative log-likelihood
of assistant tokens only (loss mask 1); prompts and observations are context.

A warm start for RL can stop at a skill instead of a step count (`SFTConfig.target`): a small model
memorising a few trajectories goes from never reproducing them to always within a handful of steps
(the demo's tiny model: 0.03 -> 0.93 between steps 42 and 66), so a fixed count lands anywhere on
that cliff depending on the random init. `reference_pass` measures, in one forward pass per
trajectory, the probability that the policy sampling at the run's temperature reproduces each
trajectory's assistant tokens exactly; it tracks a sampled pass rate closely and, since other
replies may pass too, sits at or below it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch  # this module is the trainer's: it is only imported where torch is installed

from agentrl.episode.sample import Sample


@dataclass
class SFTConfig:
    steps: int = 100
    """The most optimizer steps (all of them when `target` is None)."""
    lr: float = 1e-3
    batch_size: int = 8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    target: float | None = None
    """Stop once `reference_pass` (mean over the samples) reaches this."""
    temperature: float = 1.0
    """The sampling temperature `target` is measured at (the run's)."""
    target_samples: int | None = None
    """Measure `target` on this many of the samples (a fixed, seeded draw); None: all of them."""
    target_every: int = 1
    """Measure `target` every this many steps (and at the last)."""
    target_floor: float | None = None
    """With `target`: also wait until every task's reference pass (its samples' mean) reaches
    this, so that RL starts with some success on every task (a task at 0 gives it no signal)."""


def _padded(batch: list[Sample], device: str) -> tuple[Any, Any, Any]:
    width = max(len(s.tokens) for s in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.float32)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
        attn[i, : len(s.tokens)] = 1
        mask[i, s.prompt_length : len(s.tokens)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    return ids.to(device), mask.to(device), attn.to(device)


def _token_logprobs(model: Any, ids: Any, attn: Any, temperature: float = 1.0) -> Any:
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def sft_loss(model: Any, batch: list[Sample], device: str = "cpu") -> Any:
    """Mean NLL over loss-masked tokens of a right-padded batch."""
    ids, mask, attn = _padded(batch, device)
    logp = _token_logprobs(model, ids, attn)
    target_mask = mask[:, 1:]
    return -(logp * target_mask).sum() / target_mask.sum().clamp(min=1.0)


@torch.no_grad()
def reference_pass(model: Any, samples: list[Sample], temperature: float, device: str = "cpu") -> list[float]:
    """Per sample: the probability that `model`, sampling at `temperature` (no top-k or top-p), replies
    with exactly the sample's assistant tokens, given its prompt and observations."""
    was_training = model.training
    model.eval()
    out = []
    for s in samples:
        ids, mask, attn = _padded([s], device)
        logp = _token_logprobs(model, ids, attn, temperature)
        out.append(math.exp(float((logp * mask[:, 1:]).sum())))
    model.train(was_training)
    return out


def run_sft(
    model: Any, samples: list[Sample], config: SFTConfig, *, device: str = "cpu", log: Any = print
) -> list[float]:
    """Train `model` in place; returns the loss per step (fewer than `config.steps` when `config.target`
    was reached first)."""
    if not samples:
        raise ValueError("no SFT samples: harvest trajectories first (recipes/local_tbench2.py prepare)")
    if config.target is not None and not 0.0 < config.target <= 1.0:
        raise ValueError(f"SFT target {config.target} is not a probability in (0, 1]")
    if config.target_floor is not None and (config.target is None or not 0.0 < config.target_floor <= 1.0):
        raise ValueError(
            f"SFT target_floor {config.target_floor} needs a target and must be a probability in (0, 1]"
        )
    if config.target_every < 1 or (config.target_samples is not None and config.target_samples < 1):
        raise ValueError(
            f"SFT target_every ({config.target_every}) and target_samples ({config.target_samples}) must be at least 1"
        )
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    losses: list[float] = []
    order: list[Sample] = []
    probe = samples
    if config.target_samples is not None and config.target_samples < len(samples):
        probe = random.Random(config.seed + 1).sample(samples, config.target_samples)
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
        reached: float | None = None
        last = step == config.steps - 1
        done = False
        floor: float | None = None
        if config.target is not None and ((step + 1) % config.target_every == 0 or last):
            passes = reference_pass(model, probe, config.temperature, device)
            reached = sum(passes) / len(passes)
            done = reached >= config.target
            if config.target_floor is not None:
                by_task: dict[str | None, list[float]] = {}
                for s, p in zip(probe, passes, strict=True):
                    by_task.setdefault(s.task_id, []).append(p)
                floor = min(sum(v) / len(v) for v in by_task.values())
                done = done and floor >= config.target_floor
        if log is not None and (step % config.log_every == 0 or last or done):
            extra_text = "" if reached is None else f"  reference pass {reached:.3f}"
            extra_text += "" if floor is None else f" (least task {floor:.3f})"
            log(f"sft step {step:4d}  loss {losses[-1]:.4f}{extra_text}")
        if done:
            if log is not None:
                log(
                    f"sft: reference pass {reached:.3f} >= target {config.target} after {step + 1} steps"
                    + ("" if floor is None else f", every task >= {config.target_floor}")
                )
            break
    else:
        if config.target is not None and log is not None:
            log(f"sft: target {config.target} not reached in {config.steps} steps")
    model.eval()
    return losses
