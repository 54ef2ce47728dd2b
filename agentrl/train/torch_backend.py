"""The torch trainer backend (the `Trainer` protocol): GRPO + TIS updates of a transformers causal LM.

One `train_step(samples)`, on samples whose advantages were computed once per episode outside
(`agentrl.train.batch.training_samples`):
  1. split the samples into `num_minibatches` optimizer steps of whole episodes; each packs its
     samples into micro-batches under the token budget, with per-token loss weights;
  2. recompute old log-probs (and reference log-probs when a KL term is on) with the current
     weights, before any update, for every sample;
  3. per optimizer step, accumulate the micro-batches' gradients; a non-finite loss or gradient
     skips that step (counted in `skipped_nonfinite`, logged with its reason) and never reaches
     AdamW, so one bad token cannot write NaN into the weights;
  4. clip the gradient norm and step AdamW.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from agentrl.algo.losses import TokenTerms, grpo_metrics, on_policy_metrics
from agentrl.episode.sample import Sample
from agentrl.train.batch import MicroBatch, TrainBatch, add_loss_metrics, loss_terms, run_steps, step_batches
from agentrl.train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from agentrl.train.config import TrainConfig, lr_at
from agentrl.train.forward import model_logprobs, model_token_loss
from agentrl.train.lora import LoraError, adapter_config, adapter_weights, apply_lora, is_lora, merged_weights

log = logging.getLogger("agentrl.train")


class TorchTrainer:
    """Owns the policy model, its optimizer and the step counter.

    `ref_model` (frozen) is needed only when `config.loss.kl_coef > 0`.
    """

    def __init__(
        self,
        model: Any,
        config: TrainConfig,
        *,
        device: str | torch.device | None = None,
        ref_model: Any | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        want_bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and self.device.type == "cuda")
        # Weights and optimizer state stay fp32; bf16 is the compute dtype (autocast) on GPU.
        self.autocast_dtype = torch.bfloat16 if want_bf16 else None
        self.model = model.to(self.device, torch.float32)
        if config.lora.enabled:  # adapters on the projections; every other weight frozen
            self.model = apply_lora(self.model, config.lora)
        if config.loss.kl_coef and ref_model is None:
            raise ValueError("loss.kl_coef > 0 needs ref_model (a frozen copy of the initial policy)")
        self.ref_model = (
            ref_model.to(self.device).eval().requires_grad_(False) if ref_model is not None else None
        )
        if config.gradient_checkpointing:
            # transformers 5.x renamed the switch; older releases only have the first name.
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        cfg_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_token_id = (
            pad_token_id if pad_token_id is not None else (cfg_pad if isinstance(cfg_pad, int) else 0)
        )
        torch.manual_seed(config.seed)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.step = 0
        self.skipped_nonfinite = 0

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def logprobs(
        self, mb: MicroBatch, *, model: Any | None = None, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token log-probs [R, L] of a micro-batch under `model` (default: the policy)."""
        with self._autocast():
            return model_logprobs(
                model if model is not None else self.model,
                mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                chunk_size=self.config.logprob_chunk_size,
                temperature=self.config.temperature,
                with_entropy=with_entropy,
                impl=self.config.logprob_impl,
            )

    @torch.no_grad()
    def _fill_old(self, batch: TrainBatch) -> None:
        self.model.eval()
        for i, mb in enumerate(batch.micro_batches):
            mb = mb.to(self.device)
            batch.micro_batches[i] = mb
            if not self.config.on_policy:
                mb.old_logprobs = self.logprobs(mb)[0] * mb.loss_mask
            if self.ref_model is not None:
                mb.ref_logprobs = self.logprobs(mb, model=self.ref_model)[0] * mb.loss_mask

    def prepare(self, samples: Sequence[Sample]) -> tuple[list[TrainBatch], dict[str, float]]:
        """Filter, split into per-optimizer-step batches of whole episodes, recompute old log-probs."""
        batches, stats = step_batches(
            samples,
            num_minibatches=self.config.num_minibatches,
            aggregation=self.config.loss.aggregation,
            max_tokens_per_micro_batch=self.config.max_tokens_per_micro_batch,
            pad_token_id=self.pad_token_id,
        )
        for batch in batches:
            self._fill_old(batch)
        return batches, stats

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        want_entropy = self.config.loss.entropy_coef > 0
        sums: dict[str, float] = {}
        total = 0.0
        cfg = self.config
        # GSPO's sequence ratio mixes a row's positions: log-probs first, then the loss.
        impl = "chunked" if cfg.loss.objective == "gspo" else cfg.logprob_impl
        for mb in batch.micro_batches:
            terms, metrics = loss_terms(mb, batch, cfg)
            # Per-token terms in the head's order: the positions predicting tokens 1.., row by row.
            shifted = terms.map(lambda t: t[:, 1:].reshape(-1))

            def token_loss(
                lp: torch.Tensor, e: torch.Tensor | None, ix: slice, t: TokenTerms = shifted
            ) -> torch.Tensor:
                return t.loss(lp, e, cfg.loss, ix)

            with self._autocast():
                loss, logp, ent = model_token_loss(
                    self.model,
                    mb.input_ids,
                    token_loss,
                    attention_mask=mb.attention_mask,
                    position_ids=mb.position_ids,
                    chunk_size=cfg.logprob_chunk_size,
                    temperature=cfg.temperature,
                    with_entropy=want_entropy,
                    impl=impl,
                )
            if terms.old_logp is None:  # on-policy: what the old log-probs' metrics say, from logp
                metrics.update(
                    on_policy_metrics(logp * mb.loss_mask, mb.rollout_logprobs, mb.loss_mask, cfg.loss)
                )
            metrics.update(grpo_metrics(logp * mb.loss_mask, terms, mb.loss_mask, cfg.loss, entropy=ent))
            if not torch.isfinite(loss):
                return self._skip(f"non-finite loss {loss.item()} in a micro-batch of {mb.num_rows} rows")
            loss.backward()
            total += loss.item()
            add_loss_metrics(sums, metrics, mb.loss_mask.sum().item(), batch.num_loss_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        if not math.isfinite(float(grad_norm)):
            return self._skip(f"non-finite gradient norm {float(grad_norm)}")
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.config, self.step)
        self.optimizer.step()
        self.step += 1
        return {"loss": total, "grad_norm": float(grad_norm), "skipped": 0.0, **sums, **batch.stats}

    def _skip(self, reason: str) -> dict[str, float]:
        """Drop this optimizer step's gradient: nothing non-finite may reach AdamW's moments."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_nonfinite += 1
        log.error("optimizer step skipped: %s (%d skipped so far)", reason, self.skipped_nonfinite)
        return {"loss": float("nan"), "grad_norm": float("nan"), "skipped": 1.0}

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One rollout batch -> `num_minibatches` optimizer steps. Returns metrics of the last
        completed one plus totals; `skipped_steps` counts optimizer steps dropped as non-finite."""
        t0 = time.perf_counter()
        batches, stats = self.prepare(samples)
        metrics = run_steps(batches, self._update, stats)
        metrics["step"] = float(self.step)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["step_seconds"] = time.perf_counter() - t0
        return metrics

    def export_weights(
        self, dtype: torch.dtype | None = None, *, bucket_bytes: int = 512 * 2**20
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The policy's weights under their Hugging Face names, in buckets of at most
        `bucket_bytes` (a tensor larger than that goes alone), floating tensors cast to `dtype`."""
        named = merged_weights(self.model) if is_lora(self.model) else self.model.state_dict().items()
        return bucket_named_tensors(named, dtype=dtype, bucket_bytes=bucket_bytes)

    def export_adapter(self, dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The trained adapters alone, under PEFT's names, in one bucket (`sync.transport=lora_adapter`)."""
        if not is_lora(self.model):
            raise LoraError("export_adapter needs trainer.lora.rank > 0")
        return bucket_named_tensors(adapter_weights(self.model).items(), dtype=dtype, bucket_bytes=1 << 62)

    def adapter_config(self) -> dict[str, Any]:
        """The adapters' `adapter_config.json` (PEFT's own)."""
        if not is_lora(self.model):
            raise LoraError("adapter_config needs trainer.lora.rank > 0")
        return adapter_config(self.model)

    def engine_model(self) -> Any:
        """A model an in-process engine can serve: the policy itself, or with LoRA a plain copy with
        the adapters merged (its weight names are the Hugging Face ones `export_weights` gives)."""
        if not is_lora(self.model):
            return self.model
        return copy.deepcopy(self.model).merge_and_unload()

    def save(self, root: str | Path, *, buffer_state: dict[str, Any] | None = None) -> Path:
        """Checkpoint model, optimizer, step and the caller's buffer position under `root`."""
        return save_checkpoint(
            root,
            model=self.model,
            optimizer=self.optimizer,
            state=TrainState(
                step=self.step, buffer_state=dict(buffer_state or {}), config=self.config.to_dict()
            ),
        )

    def load(self, path: str | Path) -> TrainState:
        """Restore from a checkpoint directory (or a root holding `latest`); returns the saved state."""
        state = load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        self.step = state.step
        return state


def bucket_named_tensors(
    named: Any, *, dtype: torch.dtype | None = None, bucket_bytes: int = 512 * 2**20
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs -> buckets of bounded byte size, detached, floats cast to `dtype`."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
