"""`LossConfig`: every knob of the policy loss, importable without torch (a run's settings are
checked and printed, `--dry-run`, where torch is not installed); the loss itself is `losses.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import ConfigDict

Aggregation = Literal["token_mean", "seq_mean_token_mean"]

# Bound on every log-ratio before it is exponentiated (Miles clamps at +-20 too): one token whose
# trainer and engine log-probs differ by ~88 nats would otherwise give an infinite ratio, an infinite
# loss, and NaN weights after the optimizer step. e^20 is still far outside any clip range.
LOG_RATIO_CLAMP = 20.0
TISLevel = Literal["token", "sequence", "geometric"]
TISMode = Literal["truncate", "mask"]
KLKind = Literal["k1", "k2", "k3"]
# grpo: PPO clip on each token's ratio exp(logp_t - old_logp_t).
# gspo: PPO clip on each sequence's ratio s_b = exp(mean_t m (logp - old_logp)) (Zheng et al. 2025,
# "Group Sequence Policy Optimization"; the GLM-4.5 bash launcher's `--advantage-estimator gspo`):
# every token of row b carries s_b, with its gradient through the mean, as Miles computes it.
Objective = Literal["grpo", "gspo"]


@dataclass(frozen=True)
class LossConfig:
    """Every loss knob. Defaults follow the GLM-5.2 RL recipe (clip 0.2 / 0.28, TIS 0.5 / 2.0).
    `objective="gspo"` clips the sequence ratio instead; its clip range is much narrower (the GLM-4.5
    launcher: eps_clip 1e-4, eps_clip_high 2e-4), and its loss mixes a row's positions, so the
    trainers compute it from log-probs first (not with the loss fused into the LM head)."""

    # Unknown keys in a run configuration are errors, not silently dropped settings.
    __pydantic_config__ = ConfigDict(extra="forbid")

    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip: float | None = None
    use_tis: bool = True
    tis_clip_low: float = 0.5
    tis_clip: float = 2.0
    tis_level: TISLevel = "token"
    tis_mode: TISMode = "truncate"
    kl_coef: float = 0.0
    kl_kind: KLKind = "k3"
    entropy_coef: float = 0.0
    aggregation: Aggregation = "token_mean"
    objective: Objective = "grpo"

    def __post_init__(self) -> None:
        if not (0 <= self.eps_clip < 1 and self.eps_clip_high >= 0):
            raise ValueError(
                f"eps_clip must be in [0, 1) and eps_clip_high >= 0; got {self.eps_clip}, {self.eps_clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(
                f"dual_clip must be > 1 (it bounds the loss of negative advantages), got {self.dual_clip}"
            )
        if not 0 <= self.tis_clip_low <= self.tis_clip:
            raise ValueError(f"need 0 <= tis_clip_low <= tis_clip, got {self.tis_clip_low}, {self.tis_clip}")
        for name, value, allowed in (
            ("tis_level", self.tis_level, get_args(TISLevel)),
            ("tis_mode", self.tis_mode, get_args(TISMode)),
            ("kl_kind", self.kl_kind, get_args(KLKind)),
            ("aggregation", self.aggregation, get_args(Aggregation)),
            ("objective", self.objective, get_args(Objective)),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: choose one of {', '.join(allowed)}")


def on_policy_applies(config: LossConfig) -> bool:
    """Whether on-policy terms (`agentrl.algo.losses.on_policy_terms`) can stand for recomputed
    old log-probs under this loss."""
    return config.objective == "grpo" and (not config.use_tis or config.tis_level == "token")
