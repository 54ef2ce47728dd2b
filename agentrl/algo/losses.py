"""GRPO policy loss with PPO clipping, truncated importance sampling, KL and entropy terms.

Notation per token (b, t) with trained-token mask m_{b,t} in {0, 1}:
    logp      log pi_theta(y_t)        the policy being trained (carries gradient)
    old_logp  log pi_old(y_t)          recomputed by the trainer before the update (no gradient)
    roll_logp log pi_rollout(y_t)      what the inference engine reported when sampling
    A         advantage, broadcast to tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from pydantic import ConfigDict

Aggregation = Literal["token_mean", "seq_mean_token_mean"]

# Bound on every log-ratio before it is exponentiated (Miles clamps at +-20 too): one token whose
# trainer and engine log-probs differ by ~88 nats would otherwise give an infinite ratio, an infinite
# loss, and NaN weights after the optimizer step. e^20 is still far outside any clip range.
LOG_RATIO_CLAMP = 20.0
TISLevel = Literal["token", "sequence", "geometric"]
TISMode = Literal["truncate", "mask"]
KLKind = Literal["k1", "k2", "k3"]


@dataclass(frozen=True)
class LossConfig:
    """Every loss knob. Defaults follow the GLM-5.2 RL recipe (clip 0.2 / 0.28, TIS 0.5 / 2.0)."""

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
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: choose one of {', '.join(allowed)}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar.

    token_mean:           L = sum_{b,t} m v / N_tok,           N_tok = sum m
    seq_mean_token_mean:  L = sum_b [sum_t m v / n_b] / N_seq,  n_b = sum_t m_{b,t}, over rows with n_b > 0;
                          N_seq = number of rows with n_b > 0 (a row with nothing to train does not dilute).
    `num_tokens` / `num_seqs` override the denominators so that micro-batches of one optimizer step
    sum to the loss of the whole step (gradient accumulation).
    """
    weights = aggregation_weights(mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, dtype=values.dtype)
    return (weights * values).sum()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip loss with an asymmetric clip range and an optional dual clip.

        r   = exp(logp - old_logp)
        L   = max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high))
        dual clip (c > 1), only where A < 0:  L = min(L, -c A)
    Returns (L [B, T], metrics): clip_frac = share of masked tokens where the clipped term won,
    dual_clip_frac = share where the dual clip bound was taken.
    """
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    loss = torch.maximum(pg1, pg2)
    m = mask.to(loss.dtype)
    metrics = {"clip_frac": _masked_mean((pg2 > pg1).to(loss.dtype), m).detach()}
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clip_frac"] = _masked_mean(dual.to(loss.dtype), m).detach()
    return loss, metrics


def tis_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    level: TISLevel = "token",
    mode: TISMode = "truncate",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights correcting for the rollout engine's policy differing from the trainer's.

        d_{b,t} = old_logp - rollout_logp  (masked tokens only)
        token:      w_{b,t} = exp(d_{b,t})
        sequence:   w_b = exp(sum_t m d)               (broadcast to the row's tokens)
        geometric:  w_b = exp(sum_t m d / n_b)         (per-token geometric mean)
        truncate:   w <- clamp(w, low, high)           (truncated IS)
        mask:       w <- w * 1[low <= w <= high]       (masked IS: out-of-range tokens/rows drop out)
    Detached (a weight, never a gradient path); 0 on untrained tokens.
    Metrics: mean / min / max of the raw weights on trained tokens, and the share clipped or masked.
    """
    m = mask.to(torch.float32)
    d = (old_logp.detach().float() - rollout_logp.detach().float()) * m
    c = LOG_RATIO_CLAMP
    if level == "token":
        raw = torch.exp(d.clamp(-c, c))
    elif level == "sequence":
        raw = torch.exp(d.sum(-1, keepdim=True).clamp(-c, c)).expand_as(d)
    elif level == "geometric":
        mean_d = d.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        raw = torch.exp(mean_d.clamp(-c, c)).expand_as(d)
    else:
        raise ValueError(f"tis_level={level!r}: choose token, sequence or geometric")
    outside = (raw < low) | (raw > high)
    if mode == "truncate":
        w = raw.clamp(low, high)
    elif mode == "mask":
        w = torch.where(outside, torch.zeros_like(raw), raw)
    else:
        raise ValueError(f"tis_mode={mode!r}: choose truncate or mask")
    w = (w * m).detach()
    sel = m > 0
    if sel.any():
        vals = raw[sel]
        stats = {"tis_mean": vals.mean(), "tis_min": vals.min(), "tis_max": vals.max()}
    else:
        zero = torch.zeros((), device=raw.device)
        stats = {"tis_mean": zero, "tis_min": zero, "tis_max": zero}
    stats["tis_clip_frac"] = _masked_mean(outside.float(), m)
    return w, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind = "k3") -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimators on tokens sampled from pi_theta, with x = ref_logp - logp:
    k1 = -x;   k2 = x^2 / 2;   k3 = exp(x) - x - 1  (unbiased, low variance, always >= 0)
    """
    x = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x**2
    if kind == "k3":
        return torch.exp(x) - x - 1
    raise ValueError(f"kl_kind={kind!r}: choose k1, k2 or k3")


def mismatch_kl(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Rollout-vs-trainer mismatch KL(pi_rollout || pi_old) on the sampled tokens (masked mean):
        mismatch_k1 = mean(rollout_logp - old_logp);   mismatch_kl = mean(k3) with x = old_logp - rollout_logp
    ~0 when engine and trainer compute the same distribution.
    """
    m = mask.to(torch.float32)
    x = (old_logp.detach().float() - rollout_logp.detach().float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "mismatch_k1": _masked_mean(-x, m),
        "mismatch_kl": _masked_mean(torch.exp(x) - x - 1, m),
    }


def aggregation_weights(
    mask: torch.Tensor,
    mode: Aggregation,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    token_weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`aggregate` as per-token weights a [B, T]: aggregate(v) = sum(a v) for every v.
    `token_weights` (computed outside, once per episode) replace the aggregation."""
    m = mask.to(dtype)
    if token_weights is not None:
        return token_weights.to(dtype) * m
    if mode == "token_mean":
        denom = m.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1)
        return m / denom
    if mode == "seq_mean_token_mean":
        n = m.sum(-1, keepdim=True)
        denom = (n > 0).sum().clamp(min=1) if num_seqs is None else max(num_seqs, 1)
        return m / n.clamp(min=1) / denom
    raise ValueError(f"aggregation={mode!r}: choose token_mean or seq_mean_token_mean")


@dataclass(frozen=True)
class TokenTerms:
    """What the GRPO objective needs per token besides the policy's own log-prob and entropy, all
    fixed before the policy's forward: l_t = a_t (w_t L^clip_t(logp_t) + kl_coef KL_t - entropy_coef H_t).
    Token t's loss depends on logp_t and H_t alone, so a chunk of tokens can be finished on its
    own (`agentrl.algo.fused_loss`)."""

    old_logp: torch.Tensor
    advantages: torch.Tensor
    tis: torch.Tensor | None  # TIS weights (detached), None when use_tis is off
    weight: torch.Tensor  # a: the aggregation's weights, 0 on untrained tokens
    ref_logp: torch.Tensor | None

    def map(self, fn: Any) -> TokenTerms:
        """The same terms with `fn` applied to every tensor (e.g. a shift and a flatten)."""
        return TokenTerms(
            old_logp=fn(self.old_logp),
            advantages=fn(self.advantages),
            tis=fn(self.tis) if self.tis is not None else None,
            weight=fn(self.weight),
            ref_logp=fn(self.ref_logp) if self.ref_logp is not None else None,
        )

    def loss(
        self, logp: torch.Tensor, entropy: torch.Tensor | None, config: LossConfig, index: Any = slice(None)
    ) -> torch.Tensor:
        """The weighted per-token losses a_t l_t of the positions `index` selects."""
        adv = self.advantages[index]
        pg, _ = policy_loss(
            logp, self.old_logp[index], adv, torch.ones_like(adv),
            eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high, dual_clip=config.dual_clip,
        )  # fmt: skip
        per_token = pg * self.tis[index] if self.tis is not None else pg
        if config.kl_coef:
            assert self.ref_logp is not None
            per_token = per_token + config.kl_coef * kl_penalty(logp, self.ref_logp[index], config.kl_kind)
        if config.entropy_coef:
            if entropy is None:
                raise ValueError(
                    "entropy_coef > 0 needs the per-token entropy (compute log-probs with_entropy=True)"
                )
            per_token = per_token - config.entropy_coef * entropy
        return self.weight[index] * per_token


def grpo_terms(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[TokenTerms, dict[str, torch.Tensor]]:
    """The per-token constants of `grpo_loss` (arguments as there), and the metrics that need no
    policy log-probs (TIS weights, rollout-vs-trainer mismatch)."""
    if config.kl_coef and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp (log-probs of the reference model)")
    metrics: dict[str, torch.Tensor] = {}
    tis = None
    if config.use_tis:
        tis, tis_stats = tis_weights(
            old_logp, rollout_logp, mask,
            low=config.tis_clip_low, high=config.tis_clip, level=config.tis_level, mode=config.tis_mode,
        )  # fmt: skip
        metrics.update(tis_stats)
    metrics.update(mismatch_kl(old_logp, rollout_logp, mask))
    weight = aggregation_weights(
        mask, config.aggregation, num_tokens=num_tokens, num_seqs=num_seqs, token_weights=token_weights
    )
    return TokenTerms(old_logp, advantages, tis, weight, ref_logp), metrics


def grpo_metrics(
    logp: torch.Tensor,
    terms: TokenTerms,
    mask: torch.Tensor,
    config: LossConfig,
    *,
    entropy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The metrics of the policy's log-probs (detached): clip fractions, the PG loss, KL, entropy."""
    m = mask.to(torch.float32)
    logp = logp.detach()
    pg, metrics = policy_loss(
        logp, terms.old_logp, terms.advantages, m,
        eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high, dual_clip=config.dual_clip,
    )  # fmt: skip
    metrics["pg_loss"] = (terms.weight * pg).sum()
    if config.kl_coef:
        assert terms.ref_logp is not None
        metrics["kl"] = _masked_mean(kl_penalty(logp, terms.ref_logp, config.kl_kind), m)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.detach(), m)
    return metrics


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    *,
    entropy: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full per-token objective, aggregated:

        l_{b,t} = w_{b,t} * L^clip_{b,t} + kl_coef * KL_{b,t} - entropy_coef * H_{b,t}
    with w the TIS weight (1 when `use_tis` is off). `advantages` is [B, T] (see broadcast_to_tokens).
    `token_weights` [B, T], when given, replaces the aggregation: loss = sum(token_weights * l), the
    denominators having been computed outside (once per episode, `agentrl.train.batch`).
    Returns (scalar loss, metrics of detached scalars).
    """
    terms, metrics = grpo_terms(
        old_logp, rollout_logp, advantages, mask, config,
        ref_logp=ref_logp, num_tokens=num_tokens, num_seqs=num_seqs, token_weights=token_weights,
    )  # fmt: skip
    metrics.update(grpo_metrics(logp, terms, mask, config, entropy=entropy))
    return terms.loss(logp, entropy, config).sum(), metrics
