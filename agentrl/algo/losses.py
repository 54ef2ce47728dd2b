"""GRPO policy loss with PPO clipping, truncated importance sampling, KL and entropy terms, and
GSPO (the same objective on a sequence-level ratio).

Notation per token (b, t) with trained-token mask m_{b,t} in {0, 1}:
    logp      log pi_theta(y_t)        the policy being trained (carries gradient)
    old_logp  log pi_old(y_t)          recomputed by the trainer before the update (no gradient)
    roll_logp log pi_rollout(y_t)      what the inference engine reported when sampling
    A         advantage, broadcast to tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agentrl.algo.config import (
    LOG_RATIO_CLAMP,
    Aggregation,
    KLKind,
    LossConfig,
    TISLevel,
    TISMode,
    on_policy_applies,
)


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
    """What the objective needs per token besides the policy's own log-prob and entropy, all
    fixed before the policy's forward: l_t = a_t (w_t L^clip_t(log r_t) + kl_coef KL_t - entropy_coef H_t).
    On-policy terms (`on_policy_terms`: one optimizer step a rollout batch, so the old policy is the
    policy itself) have no `old_logp`: the policy's own log-probs, detached, stand for it (log r_t
    = 0 with logp_t's gradient, token-level TIS weights from logp_t and `rollout_logp`), which spares
    the old-log-prob forward.
    GRPO: log r_t = logp_t - old_logp_t, so token t's loss depends on logp_t and H_t alone and a
    chunk of tokens can be finished on its own (`agentrl.algo.fused_loss`). GSPO: log r_t is the
    mean of that over the trained tokens of t's row (`seq`), so every position is needed at once."""

    old_logp: torch.Tensor | None  # None: on-policy (the policy's own log-probs, detached)
    advantages: torch.Tensor
    tis: torch.Tensor | None  # TIS weights (detached), None when use_tis is off
    weight: torch.Tensor  # a: the aggregation's weights, 0 on untrained tokens
    ref_logp: torch.Tensor | None
    # GSPO only: each token's row, `num_seqs` (one past the last row) on untrained tokens.
    seq: torch.Tensor | None = None
    num_seqs: int = 0
    rollout_logp: torch.Tensor | None = None  # on-policy TIS: the weights are made per token

    def map(self, fn: Any) -> TokenTerms:
        """The same terms with `fn` applied to every tensor (e.g. a shift and a flatten)."""
        return TokenTerms(
            old_logp=fn(self.old_logp) if self.old_logp is not None else None,
            advantages=fn(self.advantages),
            tis=fn(self.tis) if self.tis is not None else None,
            weight=fn(self.weight),
            ref_logp=fn(self.ref_logp) if self.ref_logp is not None else None,
            seq=fn(self.seq) if self.seq is not None else None,
            num_seqs=self.num_seqs,
            rollout_logp=fn(self.rollout_logp) if self.rollout_logp is not None else None,
        )

    def log_ratio(self, logp: torch.Tensor, index: Any = slice(None)) -> torch.Tensor:
        """log r at the positions `index` selects: the token's own log-ratio (GRPO), or its row's
        mean log-ratio over trained tokens, differentiable in every token of the row (GSPO)."""
        d = logp - (self.old_logp[index] if self.old_logp is not None else logp.detach())
        if self.seq is None:
            return d
        ids = self.seq[index]
        if ids.numel() != self.seq.numel():
            raise ValueError(
                "gspo's sequence ratio needs all of a micro-batch's positions at once; it cannot be "
                "fused into the LM head chunk by chunk (the trainers use logprob_impl 'chunked' for it)"
            )
        mean = _row_means(d, ids, self.num_seqs)
        return mean[ids.reshape(-1)].reshape(d.shape)

    def loss(
        self, logp: torch.Tensor, entropy: torch.Tensor | None, config: LossConfig, index: Any = slice(None)
    ) -> torch.Tensor:
        """The weighted per-token losses a_t l_t of the positions `index` selects."""
        adv = self.advantages[index]
        log_r = self.log_ratio(logp, index)
        pg, _ = policy_loss(
            log_r, torch.zeros_like(log_r), adv, torch.ones_like(adv),
            eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high, dual_clip=config.dual_clip,
        )  # fmt: skip
        tis = self.tis[index] if self.tis is not None else None
        if self.rollout_logp is not None:  # on-policy: this token's weight from its own log-prob
            tis, _ = tis_weights(
                logp.detach(), self.rollout_logp[index], torch.ones_like(logp),
                low=config.tis_clip_low, high=config.tis_clip, level="token", mode=config.tis_mode,
            )  # fmt: skip
        per_token = pg * tis if tis is not None else pg
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


def _row_means(values: torch.Tensor, ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs + 1]: the mean of `values` over each row's positions (`ids`: the row of each
    position, num_seqs for positions of no row); the last entry is junk."""
    flat, idx = values.reshape(-1), ids.reshape(-1)
    sums = flat.new_zeros(num_seqs + 1).index_add(0, idx, flat)
    counts = flat.new_zeros(num_seqs + 1).index_add(0, idx, torch.ones_like(flat))
    return sums / counts.clamp(min=1)


def sequence_ids(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] long: b on row b's trained tokens, B elsewhere (GSPO's grouping of tokens)."""
    b = mask.shape[0]
    rows = torch.arange(b, device=mask.device).unsqueeze(-1).expand_as(mask)
    return torch.where(mask > 0, rows, torch.full_like(rows, b))


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
    seq = sequence_ids(mask) if config.objective == "gspo" else None
    terms = TokenTerms(
        old_logp, advantages, tis, weight, ref_logp, seq, mask.shape[0] if seq is not None else 0
    )
    return terms, metrics


def on_policy_terms(
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> TokenTerms:
    """`grpo_terms` for one optimizer step on the batch its policy made (no old log-probs: the
    policy's own stand for them). Its metrics need the policy's log-probs: `on_policy_metrics`
    after the forward. GRPO with token-level TIS only (a sequence-level weight mixes positions)."""
    if not on_policy_applies(config):
        raise ValueError(
            f"on-policy terms need objective grpo and token-level TIS (got {config.objective}, "
            f"{config.tis_level}): recompute the old log-probs"
        )
    if config.kl_coef and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp (log-probs of the reference model)")
    weight = aggregation_weights(
        mask, config.aggregation, num_tokens=num_tokens, num_seqs=num_seqs, token_weights=token_weights
    )
    return TokenTerms(
        None, advantages, None, weight, ref_logp, rollout_logp=rollout_logp if config.use_tis else None
    )


def on_policy_metrics(
    logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, config: LossConfig
) -> dict[str, torch.Tensor]:
    """The metrics `grpo_terms` makes from old log-probs, from the policy's own (on-policy)."""
    metrics: dict[str, torch.Tensor] = {}
    if config.use_tis:
        _, metrics = tis_weights(
            logp, rollout_logp, mask,
            low=config.tis_clip_low, high=config.tis_clip, level=config.tis_level, mode=config.tis_mode,
        )  # fmt: skip
    metrics.update(mismatch_kl(logp, rollout_logp, mask))
    return metrics


def grpo_metrics(
    logp: torch.Tensor,
    terms: TokenTerms,
    mask: torch.Tensor,
    config: LossConfig,
    *,
    entropy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The metrics of the policy's log-probs (detached): clip fractions, the PG loss, KL, entropy;
    with GSPO the sequence ratios' mean / min / max and the share of sequences clipped."""
    m = mask.to(torch.float32)
    logp = logp.detach()
    log_r = terms.log_ratio(logp)
    pg, metrics = policy_loss(
        log_r, torch.zeros_like(log_r), terms.advantages, m,
        eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high, dual_clip=config.dual_clip,
    )  # fmt: skip
    if terms.seq is not None:
        metrics.update(_sequence_metrics(log_r, terms, m, config))
    metrics["pg_loss"] = (terms.weight * pg).sum()
    if config.kl_coef:
        assert terms.ref_logp is not None
        metrics["kl"] = _masked_mean(kl_penalty(logp, terms.ref_logp, config.kl_kind), m)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.detach(), m)
    return metrics


def _sequence_metrics(
    log_r: torch.Tensor, terms: TokenTerms, mask: torch.Tensor, config: LossConfig
) -> dict[str, torch.Tensor]:
    assert terms.seq is not None
    trained = mask.sum(-1) > 0
    first = mask.argmax(-1)  # every token of a row carries the row's ratio: read it at the first
    ratio = torch.exp(
        log_r.gather(-1, first.unsqueeze(-1)).squeeze(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    )
    adv = terms.advantages.gather(-1, first.unsqueeze(-1)).squeeze(-1)
    clipped = ((adv > 0) & (ratio > 1 + config.eps_clip_high)) | ((adv < 0) & (ratio < 1 - config.eps_clip))
    if not trained.any():
        zero = torch.zeros((), device=mask.device)
        return {"seq_ratio_mean": zero, "seq_ratio_min": zero, "seq_ratio_max": zero, "seq_clip_frac": zero}
    r = ratio[trained]
    return {
        "seq_ratio_mean": r.mean(),
        "seq_ratio_min": r.min(),
        "seq_ratio_max": r.max(),
        "seq_clip_frac": clipped[trained].float().mean(),
    }


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
    with w the TIS weight (1 when `use_tis` is off) and L^clip on the token's ratio (GRPO) or its
    row's sequence ratio (GSPO, `config.objective`). `advantages` is [B, T] (see broadcast_to_tokens).
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
