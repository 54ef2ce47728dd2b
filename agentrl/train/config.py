"""`TrainConfig`: every knob of the torch trainer backend in one dataclass."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict

from agentrl.algo.config import LossConfig, on_policy_applies

# Linear projections of attention and MLP (dense layers and shared experts) in the model families
# agentrl trains: grouped-query attention (q/k/v/o_proj) and MLA (q_a/q_b/kv_a/kv_b/o_proj). The
# routed experts of transformers' MoE blocks are fused 3-D parameters, not Linear modules, and the
# LM head and embeddings are never adapted. A name no module has is ignored; none matching is an error.
DEFAULT_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


@dataclass
class LoraConfig:
    """`rank` 0 trains every weight (no LoRA). `alpha` scales the update by alpha / rank."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = field(default_factory=lambda: DEFAULT_TARGETS)

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        problems = []
        if self.rank < 0:
            problems.append(f"rank must be >= 0 (0: no LoRA), got {self.rank}")
        if self.alpha <= 0:
            problems.append(f"alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            problems.append("targets is empty: name the projection modules to adapt")
        if problems:
            raise ValueError("trainer.lora: " + "; ".join(problems))

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class TrainConfig:
    """Optimizer, batching and loss settings of one trainer.

    `max_tokens_per_micro_batch` bounds rows x padded length of each forward pass (see
    `agentrl.train.batch.pack`); micro-batches of one optimizer step accumulate gradients.
    `num_minibatches` splits each `train_step`'s samples into that many optimizer steps, all
    measured against the same recomputed old log-probs (so PPO clipping has something to clip).
    `dtype` "auto" trains fp32 on CPU and bf16 autocast over fp32 weights on GPU.
    `logprob_impl` picks how token log-probs come out of the LM head (`agentrl.train.forward`):
    "auto" runs the fused kernel where it applies (CUDA, bf16/fp16 products) and the chunked torch
    passes elsewhere, "fused" and "chunked" force one; `logprob_chunk_size` is the chunked path's
    positions per chunk (None: all logits at once).
    `lora` (rank > 0) trains low-rank adapters instead of every weight (`agentrl.train.lora`).
    """

    # Unknown keys in a run configuration are errors, not silently dropped settings.
    __pydantic_config__ = ConfigDict(extra="forbid")

    lr: float = 1e-6
    lr_warmup_steps: int = 0
    """Optimizer steps over which the learning rate rises linearly to `lr` (Megatron's
    `--lr-warmup-iters`): Adam's first updates move every weight by about `lr` whatever the
    gradient's size, which a small or freshly fine-tuned model feels as noise."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    max_tokens_per_micro_batch: int = 16384
    num_minibatches: int = 1
    normalize_adv_std: bool = True
    logprob_chunk_size: int | None = 1024
    logprob_impl: Literal["auto", "fused", "chunked"] = "auto"
    old_logprobs: Literal["auto", "recompute", "on_policy"] = "auto"
    """Where the PPO ratio's and TIS weights' old log-probs come from. "recompute": a forward pass
    over the batch before the update. "on_policy": the update's own log-probs, detached (exact when
    the batch gets one optimizer step, `num_minibatches` 1: the old policy is the policy), which
    spares that forward, about a quarter of the step. "auto": on_policy where it is exact (one
    minibatch, GRPO with token-level TIS or none), else recompute."""
    temperature: float = 1.0
    gradient_checkpointing: bool = False
    dtype: str = "auto"
    seed: int = 0
    loss: LossConfig = field(default_factory=LossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        if isinstance(self.lora, dict):
            self.lora = LoraConfig(**self.lora)
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        problems = []
        if self.lr <= 0:
            problems.append(f"lr must be > 0 (got {self.lr})")
        if self.max_tokens_per_micro_batch <= 0:
            problems.append(f"max_tokens_per_micro_batch must be > 0 (got {self.max_tokens_per_micro_batch})")
        if self.lr_warmup_steps < 0:
            problems.append(f"lr_warmup_steps must be >= 0 (got {self.lr_warmup_steps})")
        if self.num_minibatches < 1:
            problems.append(f"num_minibatches must be >= 1 (got {self.num_minibatches})")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size <= 0:
            problems.append("logprob_chunk_size must be > 0, or None to compute all logits at once")
        if self.old_logprobs not in ("auto", "recompute", "on_policy"):
            problems.append(f"old_logprobs={self.old_logprobs!r}: choose auto, recompute or on_policy")
        elif self.old_logprobs == "on_policy" and (
            self.num_minibatches > 1 or not on_policy_applies(self.loss)
        ):
            problems.append(
                "old_logprobs='on_policy' needs num_minibatches 1 and objective grpo with token-level TIS "
                f"(got {self.num_minibatches}, {self.loss.objective}, {self.loss.tis_level}): use auto or recompute"
            )
        if self.logprob_impl not in ("auto", "fused", "chunked"):
            problems.append(f"logprob_impl={self.logprob_impl!r}: choose auto, fused or chunked")
        if self.temperature <= 0:
            problems.append(
                f"temperature must be > 0: the sampling temperature of the rollouts (got {self.temperature})"
            )
        if self.dtype not in ("auto", "float32", "bfloat16"):
            problems.append(f"dtype={self.dtype!r}: choose auto, float32 or bfloat16")
        if problems:
            raise ValueError("TrainConfig: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def on_policy(self) -> bool:
        """Whether the update uses its own log-probs as the old ones (`old_logprobs`)."""
        if self.old_logprobs == "auto":
            return self.num_minibatches == 1 and on_policy_applies(self.loss)
        return self.old_logprobs == "on_policy"


def lr_at(config: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (counted from 0): linear warmup, then constant."""
    if config.lr_warmup_steps <= 0:
        return config.lr
    return config.lr * min(1.0, (step + 1) / config.lr_warmup_steps)
