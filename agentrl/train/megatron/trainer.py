"""The Megatron trainer backend (the `Trainer` protocol) for `glm_moe_dsa` models.

Same contract as `TorchTrainer`: `train_step(samples)` on segments whose advantages were computed
once per episode outside, the batch format of `agentrl.train.batch` (whole episodes per optimizer
step, per-token loss weights), old log-probs recomputed before any update, the GRPO / PPO-clip /
TIS / KL losses of `agentrl.algo`, a non-finite loss or gradient skips the optimizer step.

What differs is the model side:
- the model is megatron-core's (`agentrl.train.megatron.model`), sharded over TP / PP / EP ranks;
- each micro-batch runs packed without padding (THD: one row of all its sequences, positions and
  attention restarting at every `cu_seqlens` boundary); its log-probs are scattered back into the
  batch's [rows, length] layout, so the loss sees exactly what the torch backend's sees;
- with context parallelism every sequence is split over the CP ranks in megatron's zigzag THD
  layout (`PackedRows`); DSA's all-gather CP attends over the whole sequence, and the per-token
  log-probs are all-gathered back before the loss, which every CP rank computes whole;
- token log-probs and entropy come from the vocabulary-parallel LM head
  (`agentrl.algo.vocab_parallel_logprobs`: no [T, V] logits, no gathered vocabulary);
- data-parallel ranks (world size / (TP x PP x CP)) share each optimizer step's micro-batches;
  on CUDA megatron's DDP and (distributed) optimizer reduce and step (`ddp="megatron"`); on a
  CPU the trainer's own path does (`ddp="local"`): gradients summed over DP x CP (expert weights
  over expert-DP ranks), then reduced over TP as megatron's `finalize_model_grads` does (sum for
  sequence-parallel weights, mean for the DSA indexer), and torch AdamW steps.

Every rank calls the same methods with the same samples (SPMD); `export_weights` yields full HF
tensors on every rank (only one of them needs to push them).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.algo.fused_logprobs import vocab_parallel_logprobs
from agentrl.algo.fused_loss import TokenLossResult, vocab_parallel_token_loss
from agentrl.algo.losses import TokenTerms, grpo_metrics, on_policy_metrics
from agentrl.episode.sample import Sample
from agentrl.overrides import ConfigError
from agentrl.train.batch import MicroBatch, TrainBatch, add_loss_metrics, loss_terms, run_steps, step_batches
from agentrl.train.clock import StepClock
from agentrl.train.config import TrainConfig, lr_at
from agentrl.train.lora import LoraError
from agentrl.train.megatron import convert, parallel
from agentrl.train.megatron.checkpointing import (
    _PREPARE_HINT,
    CheckpointMixin,
    InitCheckpointError,
    init_checkpoint_dir,
)
from agentrl.train.megatron.fp8 import quantize_named
from agentrl.train.megatron.lora import MegatronLora
from agentrl.train.megatron.model import build_model, layout_of, require_megatron, schedule_device_shim
from agentrl.train.megatron.packing import PackedRows, _GatherContextParallel
from agentrl.train.megatron.replay import RouteReplay
from agentrl.train.megatron.settings import MegatronSettings
from agentrl.train.torch_backend import bucket_named_tensors

log = logging.getLogger("agentrl.train.megatron")


class MegatronTrainer(CheckpointMixin):
    """Owns this rank's model shard (its pipeline stage's chunks), its optimizer and the step counter.

    `hf_config`: a transformers `GlmMoeDsaConfig`; the initial weights are `hf_state` (HF tensors,
    full, on every rank; each rank keeps its shard) or `settings.init_checkpoint` (a `torch_dist`
    checkpoint, `load_init_checkpoint`), at most one of them; neither keeps megatron's
    initialisation.
    `self.model` is this rank's first (usually only) model chunk; `self.chunks` all of them (one per
    virtual pipeline stage), unwrapped.
    """

    def __init__(
        self,
        hf_config: Any,
        config: TrainConfig,
        settings: MegatronSettings | None = None,
        *,
        hf_state: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        require_megatron()
        self.hf_config = hf_config
        self.config = config
        self.settings = settings or MegatronSettings()
        self.arch = convert.Arch.of(hf_config)
        if hf_config.vocab_size % self.settings.tp:
            raise ValueError(f"vocab_size {hf_config.vocab_size} is not divisible by tp={self.settings.tp}")
        cuda = torch.cuda.is_available()
        if config.lora.enabled and self.settings.ddp == "megatron":
            raise ConfigError(
                "trainer.lora with trainer.megatron.ddp='megatron': LoRA steps the adapters on the trainer's "
                "own reduction and AdamW (a few MB: nothing for megatron's buffers to save); use ddp='auto'"
            )
        self.megatron_ddp = not config.lora.enabled and (
            self.settings.ddp == "megatron" or (self.settings.ddp == "auto" and cuda)
        )
        if self.megatron_ddp and not cuda:
            raise ConfigError(
                "trainer.megatron.ddp='megatron' needs CUDA (megatron's gradient buffers and fused Adam live "
                "on the GPU): use ddp='local' (or 'auto') on a CPU"
            )
        if self.settings.optimizer_cpu_offload and not self.megatron_ddp:
            raise ConfigError("trainer.megatron.optimizer_cpu_offload needs megatron's DDP (a CUDA machine)")
        parallel.initialize(self.settings, seed=config.seed)
        torch.manual_seed(config.seed)
        from megatron.core import parallel_state as ps

        self.layout = layout_of(hf_config, self.settings)
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.chunks = self._build_chunks()
        self.model = self.chunks[0]
        if hf_state is not None and self.settings.init_checkpoint:
            raise ConfigError(
                "initial weights given twice (hf_state and trainer.megatron.init_checkpoint): give one"
            )
        if hf_state is not None:
            self.load_hf(hf_state)
        elif self.settings.init_checkpoint:
            self.load_init_checkpoint(self.settings.init_checkpoint)
        # The KL term's reference: a frozen copy of the initial weights, sharded like the policy.
        self.ref_chunks: list[Any] | None = None
        if config.loss.kl_coef:
            self.ref_chunks = self._build_chunks()
            for ref, chunk in zip(self.ref_chunks, self.chunks, strict=True):
                ref.load_state_dict(chunk.state_dict())
                ref.eval().requires_grad_(False)
        self.ref_model = self.ref_chunks[0] if self.ref_chunks else None
        self.tp_group = parallel.tp_group()
        self.tp_size = dist.get_world_size(self.tp_group)
        self.cp_group = ps.get_context_parallel_group()
        self.cp_size = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.replay = (
            RouteReplay(recompute=self.settings.recompute, tp_size=self.tp_size,
                        tp_rank=dist.get_rank(self.tp_group), device=self.device)
            if self.settings.routing_replay else None
        )  # fmt: skip
        self.pp_size = self.settings.pp
        self.last_stage = self.pp_rank == self.pp_size - 1
        # LoRA: adapters on the projections (`lora.py`), every weight of the model frozen.
        self.lora: MegatronLora | None = None
        if config.lora.enabled:
            for chunk in self.chunks:
                chunk.requires_grad_(False)
            self.lora = MegatronLora(
                self.chunks, self.arch, config.lora,
                tp_size=self.tp_size, tp_rank=dist.get_rank(self.tp_group), seed=config.seed,
            )  # fmt: skip
        # What the schedules run: megatron's DDP wrappers, or the bare chunks (local reduction).
        self.train_chunks: list[Any] = self.chunks
        self.step = 0  # before the optimizer: its first learning rate is `lr_at(config, 0)`
        self.skipped_nonfinite = 0
        self._clock: StepClock | None = None  # set for the length of a train_step
        self.optimizer: Any
        if self.megatron_ddp:
            self._megatron_optimizer()
        else:
            self.optimizer = torch.optim.AdamW(
                list(self._params()),
                lr=config.lr,
                betas=config.betas,
                eps=config.adam_eps,
                weight_decay=config.weight_decay,
            )

    def _build_chunks(self) -> list[Any]:
        vpp = self.settings.vpp or 1
        chunks = []
        for v in range(vpp):
            chunk = build_model(self.hf_config, self.settings, vp_stage=v if vpp > 1 else None)
            # The loss weights already normalise (per-token loss weights of the whole step):
            # megatron must neither divide the loss nor scale gradients by a micro-batch, DP or CP
            # count. Set before megatron's DDP wraps the chunk: its gradient scaling reads it.
            chunk.config.calculate_per_token_loss = True
            chunk.agentrl_stage_layers = convert.stage_layers(
                self.layout, v * self.settings.pp + self.pp_rank
            )
            if self.settings.params_dtype == "bfloat16":
                # megatron builds its linears in bf16 but torch norms in fp32 (its own training loop
                # casts the whole model with Float16Module); buffers (the router's expert bias) stay fp32.
                for p in chunk.parameters():
                    if p.dtype == torch.float32:
                        p.data = p.data.to(torch.bfloat16)
            chunks.append(chunk.to(self.device))
        return chunks

    def _megatron_optimizer(self) -> None:
        """megatron-core's DDP around every chunk and its optimizer over them (CUDA)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.settings.distributed_optimizer,
            check_for_nan_in_grad=False,  # a non-finite step is skipped, not raised
        )
        self.train_chunks = [
            DistributedDataParallel(
                config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
            )
            for i, chunk in enumerate(self.chunks)
        ]
        bf16 = self.settings.params_dtype == "bfloat16"
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=self.config.lr,
            weight_decay=self.config.weight_decay,
            adam_beta1=self.config.betas[0],
            adam_beta2=self.config.betas[1],
            adam_eps=self.config.adam_eps,
            clip_grad=float(self.config.grad_clip or 0.0),
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=self.settings.distributed_optimizer,
            optimizer_cpu_offload=self.settings.optimizer_cpu_offload,
            optimizer_offload_fraction=1.0 if self.settings.optimizer_cpu_offload else 0.0,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.train_chunks)
        for group in self.optimizer.param_groups:  # no scheduler: `lr_at` sets each step's lr
            group["lr"] = lr_at(self.config, self.step)

    def _params(self) -> Iterator[torch.nn.Parameter]:
        """What trains: the adapters with LoRA, else every weight of this rank's chunks."""
        if self.lora is not None:
            yield from self.lora.parameters()
            return
        for chunk in self.chunks:
            yield from chunk.parameters()

    # -- weights ---------------------------------------------------------------------------------

    def load_hf(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights with full HF tensors (each rank keeps its shard of its stage)."""
        with torch.no_grad():
            for chunk in self.chunks:
                convert.load_hf_into(
                    hf_state,
                    chunk,
                    stage_layers=chunk.agentrl_stage_layers,
                    arch=self.arch,
                )

    def load_init_checkpoint(self, path: str | Path) -> None:
        """Replace the weights with a `torch_dist` model checkpoint (`init_checkpoint_dir(path)`),
        e.g. the one `prepare` converted: each rank reads only its shards, and torch_dist reshards,
        so the checkpoint's TP / PP / EP need not be this trainer's. One load per model chunk: a
        chunk's sharded state dict names layers by their global numbers, so every virtual stage
        finds its layers in a checkpoint saved without virtual stages (and the other way round).
        Every tensor a chunk needs must be in the checkpoint with its shape, and every tensor of
        the checkpoint must be loaded by some chunk of some rank (a checkpoint of a larger model
        is refused, not silently cut); else `InitCheckpointError`."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        model_dir = init_checkpoint_dir(path)
        never_loaded: set[str] | None = None
        not_in_checkpoint: set[str] = set()
        for chunk in self.chunks:
            try:
                state, missing, unexpected = dist_checkpointing.load(
                    chunk.sharded_state_dict(), str(model_dir), strict=StrictHandling.RETURN_ALL
                )
            except Exception as exc:  # megatron's CheckpointingException, torch's CheckpointException
                raise InitCheckpointError(
                    f"trainer.megatron.init_checkpoint {model_dir} does not load into this model "
                    f"({type(exc).__name__}: {str(exc)[:2000]}): was it converted from the checkpoint of "
                    f"engine.model? {_PREPARE_HINT}"
                ) from exc
            # `missing`: checkpoint keys no rank asked for in this round (equal on every rank);
            # `unexpected`: keys this rank asked for that the checkpoint lacks (left unloaded).
            never_loaded = set(missing) if never_loaded is None else never_loaded & set(missing)
            not_in_checkpoint |= set(unexpected)
            chunk.load_state_dict(state, strict=False)
        lacking: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(lacking, sorted(not_in_checkpoint))
        absent = sorted({k for keys in lacking for k in keys})
        if absent or never_loaded:
            raise InitCheckpointError(
                f"trainer.megatron.init_checkpoint {model_dir} is not this model's checkpoint: it lacks "
                f"{len(absent)} tensors the model needs {absent[:8]} and has {len(never_loaded or ())} the "
                f"model has no place for {sorted(never_loaded or ())[:8]}; {_PREPARE_HINT}"
            )

    def hf_weights(self, layout: str = "transformers") -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF tensors, gathered over TP / EP ranks and, with pipeline stages, broadcast from
        the stage that holds them, so every rank yields every tensor; every rank must iterate it
        to the end together. `layout`: "transformers", the names and shapes of
        `GlmMoeDsaForCausalLM` (a layer's experts stacked: every EP rank holds all of that layer's
        experts at once while they are yielded); "checkpoint", one tensor per expert and projection
        as the checkpoint files name them, gathered one local expert slot at a time (at most EP
        experts' worth held at once: what a large model's export needs).
        (The state dict's tensors are detached: no grad-mode switch that a paused generator
        would leak into its caller's thread.)"""
        if layout not in ("transformers", "checkpoint"):
            raise ConfigError(f"export layout {layout!r}: use 'transformers' or 'checkpoint'")
        converted = "stacked" if layout == "transformers" else "checkpoint"

        def mine() -> Iterator[tuple[str, torch.Tensor]]:
            for i, chunk in enumerate(self.chunks):
                yield from convert.megatron_to_hf(
                    chunk,
                    stage_layers=chunk.agentrl_stage_layers,
                    arch=self.arch,
                    layout=converted,
                    fold=self.lora.fold(i) if self.lora is not None else None,
                )

        return parallel.from_every_stage(mine, self.pp_rank, self.pp_size, self.device)

    def export_adapter(self, dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The trained adapters alone, whole, under PEFT's names, in one bucket
        (`sync.transport=lora_adapter`); every rank iterates it together."""
        lora = self._lora("export_adapter")
        named = parallel.from_every_stage(
            lambda: lora.hf_adapters(self.tp_group, self.arch), self.pp_rank, self.pp_size, self.device
        )
        return bucket_named_tensors(named, dtype=dtype, bucket_bytes=1 << 62)

    def adapter_config(self) -> dict[str, Any]:
        """The adapters' `adapter_config.json` (PEFT's fields)."""
        return self._lora("adapter_config").adapter_config()

    def _lora(self, what: str) -> MegatronLora:
        if self.lora is None:
            raise LoraError(f"{what} needs trainer.lora.rank > 0")
        return self.lora

    def export_weights(
        self, dtype: torch.dtype | None = None, *, bucket_bytes: int = 512 * 2**20
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weights under their HF names and shapes (`settings.export_layout`), in buckets of at
        most `bucket_bytes`, floating tensors cast to `dtype`; with `settings.export_quantization`
        the decoder's linear weights as block FP8 plus their scales (the rest in `dtype`, bf16 by
        default)."""
        # The checkpoint layout streams experts one at a time from the shards (never a layer's
        # stacked experts: ~19 GB in bf16 per GLM-5.2 layer on every EP rank).
        named = self.hf_weights(self.settings.export_layout)
        if self.settings.export_quantization == "fp8_block128":
            named = quantize_named(named, dtype=dtype or torch.bfloat16)
            dtype = None  # already cast; the fp8 tensors keep their dtype
        return bucket_named_tensors(named, dtype=dtype, bucket_bytes=bucket_bytes)

    # -- forward ---------------------------------------------------------------------------------

    def _schedule(
        self,
        micro_batches: Sequence[MicroBatch],
        on_output: Any,
        *,
        chunks: list[Any],
        forward_only: bool,
        with_entropy: bool = False,
        terms: Callable[[int], TokenTerms] | None = None,
        clock: StepClock | None = None,
    ) -> None:
        """Run megatron's schedule (`get_forward_backward_func`: no pipelining, 1F1B, or interleaved
        over virtual stages) over packed micro-batches. On the last stage `on_output(i, logp,
        entropy)` gets micro-batch i's [R, L] log-probs and returns its loss (backpropagated
        unless `forward_only`). With `terms` (micro-batch i -> its GRPO token terms, [R, L]) the
        head makes the loss itself (`vocab_parallel_token_loss`: its gradients in the forward
        pass) and on_output gets a fourth argument, (this rank's loss to backpropagate, the loss
        over the CP group), to return the first of. `clock`: the `forward` and `backward` phases
        (a forward ends when its loss is made), `forward_backward` under a pipeline."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        real = len(micro_batches)
        if self.replay is not None:
            self.replay.start(chunks)
        if len(chunks) > 1:
            # The interleaved schedule runs groups of `pp` micro-batches: idle copies fill the last.
            fill = -(-max(real, self.pp_size) // self.pp_size) * self.pp_size - real
            micro_batches = [*micro_batches, *[_idle(micro_batches[0]) for _ in range(fill)]]
        cp = dict(multiple=self.tp_size, cp=self.cp_size, cp_rank=self.cp_rank)
        packed = [PackedRows(mb, **cp) for mb in micro_batches]
        if self.pp_size > 1 or self._ep_over_dp():
            common = self._common_length(max(rows.total for rows in packed))
            packed = [PackedRows(mb, length=common, **cp) for mb in micro_batches]
        temperature = self.config.temperature
        group = self.tp_group
        tp_size = self.tp_size
        cp_group = self.cp_group
        indexer_loss = bool(self.settings.dsa_indexer_loss_coeff)

        loss_config = self.config.loss

        def head(i: int, rows: PackedRows) -> Any:
            targets = rows.targets()

            def fn(hidden_states: torch.Tensor, output_layer: Any, **_: Any) -> Any:
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                if tp_size > 1:
                    # The LM head's dL/dh is all-reduced by vocab_parallel_logprobs itself, so the
                    # gather's backward must only split (not reduce-scatter) it.
                    hidden_states = gather_from_sequence_parallel_region(
                        hidden_states, tensor_parallel_output_grad=False, group=group
                    )
                if terms is not None:
                    # An idle filler is a copy of micro-batch 0 with nothing to train.
                    mine = terms(i if i < real else 0).map(rows.pack)
                    if i >= real:
                        mine = mine.map(torch.zeros_like)
                    return vocab_parallel_token_loss(
                        hidden_states[:, 0],
                        output_layer.weight,
                        targets,
                        lambda lp, ent, ix: mine.loss(lp, ent, loss_config, ix),
                        group=group,
                        temperature=temperature,
                        with_entropy=with_entropy,
                    )
                return vocab_parallel_logprobs(
                    hidden_states[:, 0],
                    output_layer.weight,
                    targets,
                    group=group,
                    temperature=temperature,
                    with_entropy=with_entropy,
                )

            return fn

        split_clock = clock if clock is not None and len(chunks) == 1 and self.pp_size == 1 else None
        if clock is not None and split_clock is None:
            clock.mark("forward_backward")

        def step_func(data: Iterator[int], model: Any) -> Any:
            i = next(data)
            if split_clock is not None:
                split_clock.mark("forward")
            rows = packed[i]
            if self.replay is not None:
                self.replay.set(model, rows, micro_batches[i])
            input_ids, position_ids = rows.model_inputs()
            out = model(
                input_ids,
                position_ids,
                None,
                packed_seq_params=rows.packed_seq_params(mark_padding=indexer_loss),
                output_processor=head(i, rows),
            )

            def loss_func(output: Any) -> Any:
                fused = None
                if isinstance(output, TokenLossResult):
                    # Each CP rank's loss is that of its own tokens; the step's is their sum.
                    local, logp, ent = output
                    shown = local.detach().clone()
                    if rows.cp > 1:
                        dist.all_reduce(shown, group=cp_group)
                    fused = (local, shown)
                else:
                    logp, ent = output
                if rows.cp > 1:  # every CP rank's tokens, in global packed order
                    logp = _GatherContextParallel.apply(logp, cp_group)[rows.gather_order]
                    if ent is not None:
                        ent = _GatherContextParallel.apply(ent, cp_group)[rows.gather_order]
                if i >= real:  # an idle filler: no loss, no gradient
                    loss = fused[0] if fused is not None else logp.sum() * 0
                else:
                    unpacked_ent = rows.unpack(ent) if ent is not None else None
                    extra = () if fused is None else (fused,)
                    loss = on_output(i, rows.unpack(logp), unpacked_ent, *extra)
                if split_clock is not None:
                    split_clock.mark("backward")
                # Three values: megatron neither divides the loss by the micro-batch count nor by a
                # token count (calculate_per_token_loss); the loss weights already do.
                return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

            return out, loss_func

        for chunk in chunks:
            cfg = _unwrap(chunk).config
            cfg.calculate_per_token_loss = True
            cfg.finalize_model_grads_func = None  # the trainer finalises after the schedule
            cfg.batch_p2p_comm = torch.cuda.is_available()  # gloo: plain isend / irecv
            cfg.grad_scale_func = None
            cfg.no_sync_func = (
                ([c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync)
                if hasattr(chunks[0], "no_sync")
                else None
            )
        n = len(packed)
        with schedule_device_shim(), self._tf32():
            get_forward_backward_func()(
                forward_step_func=step_func,
                data_iterator=[iter(range(n)) for _ in chunks] if len(chunks) > 1 else iter(range(n)),
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=n,
                seq_length=packed[0].total,  # the global packed length: megatron divides by CP (and TP)
                micro_batch_size=1,
                forward_only=forward_only,
            )

    def logprobs(
        self, mb: MicroBatch, *, model: Any = None, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token log-probs [R, L] of a micro-batch under the policy (or `model`: the reference
        chunks, or a one-chunk module); column 0 and padding are 0. Entropy, when asked, is
        aligned the same way. With pipeline stages every rank gets the last stage's values."""
        chunks = self.chunks if model is None else (model if isinstance(model, list) else [model])
        if model is self.ref_model and self.ref_chunks is not None:
            chunks = self.ref_chunks
        out: dict[str, torch.Tensor | None] = {}

        def keep(i: int, logp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
            out["logp"], out["ent"] = logp.detach(), (ent.detach() if ent is not None else None)
            return logp.sum() * 0

        with torch.no_grad():
            self._schedule(
                [mb.to(self.device)], keep, chunks=chunks, forward_only=True, with_entropy=with_entropy
            )
        logp = out.get("logp")
        ent = out.get("ent")
        if self.pp_size > 1:
            logp = self._from_last_stage(logp, mb.input_ids.shape)
            if with_entropy:
                ent = self._from_last_stage(ent, mb.input_ids.shape)
        assert logp is not None
        return logp, ent

    def _from_last_stage(self, t: torch.Tensor | None, shape: Any) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        buf = (
            t.contiguous()
            if t is not None
            else torch.empty(tuple(shape), dtype=torch.float32, device=self.device)
        )
        dist.broadcast(
            buf,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
        return buf

    def _ep_over_dp(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.get_expert_model_parallel_world_size() > 1 and ps.get_data_parallel_world_size() > 1

    def _common_length(self, n: int) -> int:
        """The longest packed micro-batch of this schedule over all ranks: pipeline stages pass
        activations of one shape, and megatron's all-gather token dispatcher gathers equal token
        counts from every expert-parallel rank."""
        t = torch.tensor(n, device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    @torch.no_grad()
    def _fill_old(self, batch: TrainBatch) -> None:
        """Old (and reference) log-probs of every micro-batch, before any update (last stage)."""
        for chunk in self.chunks:
            chunk.eval()
        batch.micro_batches = [mb.to(self.device) for mb in batch.micro_batches]

        def keep(field: str) -> Any:
            def fn(i: int, logp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
                mb = batch.micro_batches[i]
                setattr(mb, field, logp.detach() * mb.loss_mask)
                return logp.sum() * 0

            return fn

        if not self.config.on_policy:  # else the update's own log-probs stand for them
            self._schedule(batch.micro_batches, keep("old_logprobs"), chunks=self.chunks, forward_only=True)
        if self.ref_chunks is not None:
            self._schedule(
                batch.micro_batches, keep("ref_logprobs"), chunks=self.ref_chunks, forward_only=True
            )

    def prepare(self, samples: Sequence[Sample]) -> tuple[list[TrainBatch], dict[str, float]]:
        """Filter, split into per-optimizer-step batches of whole episodes, take this rank's share,
        recompute old log-probs."""
        batches, stats = step_batches(
            samples,
            num_minibatches=self.config.num_minibatches,
            aggregation=self.config.loss.aggregation,
            max_tokens_per_micro_batch=self.config.max_tokens_per_micro_batch,
            pad_token_id=0,
        )
        for batch in batches:
            batch.micro_batches = self._my_share(batch.micro_batches)
            self._mark("recompute")
            self._fill_old(batch)
            self._mark("batch")
        return batches, stats

    @contextlib.contextmanager
    def _tf32(self) -> Iterator[None]:
        """fp32 products on TF32 tensor cores for the length of a schedule (`MegatronSettings.tf32`)."""
        on = (
            self.settings.tf32 if self.settings.tf32 is not None else self.settings.params_dtype == "bfloat16"
        )
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = bool(on and self.device.type == "cuda")
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before

    def _mark(self, phase: str | None) -> None:
        if self._clock is not None:
            self._clock.mark(phase)

    def _my_share(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """This data-parallel rank's micro-batches (round robin). Every rank gets as many: a rank
        short of one runs an idle copy with nothing to train (zero masks and weights), because MoE
        token dispatch over expert-parallel ranks is a collective in every forward and backward.
        The loss weights are the whole step's, so the DP sum of gradients is the step's gradient."""
        from megatron.core import parallel_state as ps

        size = ps.get_data_parallel_world_size()
        if size == 1:
            return micro_batches
        rank = ps.get_data_parallel_rank()
        mine = micro_batches[rank::size]
        need = -(-len(micro_batches) // size)
        while len(mine) < need:
            mine.append(_idle(micro_batches[0]))
        return mine

    def _everywhere(self, value: torch.Tensor, op: Any) -> torch.Tensor:
        """`value` reduced over every rank (float64 on the model's device)."""
        t = value.detach().to(self.device, torch.float64).clone()
        if dist.get_world_size() > 1:
            dist.all_reduce(t, op=op)
        return t

    # -- update ----------------------------------------------------------------------------------

    def finalize_grads(self) -> None:
        """The local path's version of what megatron's DDP and `finalize_model_grads` do:
        gradients are summed over data-parallel and context-parallel ranks (expert weights over
        expert-DP ranks, which include the CP ranks:
        `allreduce=False`), then weights every TP rank holds are reduced over TP: summed under
        sequence parallelism (partial sums), averaged for the DSA indexer
        (`average_gradients_across_tp_domain`). Each pipeline stage reduces its own weights
        (the embeddings are untied: nothing crosses stages)."""
        from megatron.core import parallel_state as ps

        params = list(self._params())
        for group, expert in (
            (ps.get_data_parallel_group(with_context_parallel=True), False),
            (ps.get_expert_data_parallel_group(), True),
        ):
            if dist.get_world_size(group) == 1:
                continue
            grads = [
                p.grad for p in params if p.grad is not None and (not getattr(p, "allreduce", True)) == expert
            ]
            parallel.all_reduce_flat(grads, group)
        if self.tp_size == 1:
            return
        summed, averaged = [], []
        for p in params:
            if p.grad is None:
                continue
            if getattr(p, "average_gradients_across_tp_domain", False):
                averaged.append(p.grad)
            elif getattr(p, "sequence_parallel", False):
                summed.append(p.grad)
        for grads, op in ((summed, dist.ReduceOp.SUM), (averaged, dist.ReduceOp.AVG)):
            if not grads:
                continue
            parallel.all_reduce_flat(grads, self.tp_group, mean=op == dist.ReduceOp.AVG)

    def grad_norm(self) -> float:
        """Global L2 norm of the (finalized) local-path gradient: TP-sharded weights counted on
        every rank, TP-replicated ones once, every pipeline stage's, expert weights over the
        expert model-parallel ranks that hold them (as megatron's clip_grad_norm splits them)."""
        from megatron.core import parallel_state as ps

        first = ps.get_tensor_model_parallel_rank() == 0
        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        expert = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._params():
            if p.grad is None:
                continue
            if not getattr(p, "allreduce", True):
                expert += p.grad.double().pow(2).sum()
            elif getattr(p, "tensor_model_parallel", False) or first:
                dense += p.grad.double().pow(2).sum()
        dist.all_reduce(dense, group=ps.get_model_parallel_group())
        dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return float((dense + expert).sqrt())

    def _zero_grads(self) -> None:
        if self.megatron_ddp:
            for chunk in self.train_chunks:
                chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        for chunk in self.chunks:
            chunk.train()
        self._zero_grads()
        want_entropy = self.config.loss.entropy_coef > 0
        sums: dict[str, float] = {}
        losses: list[torch.Tensor] = []

        cfg = self.config

        @functools.cache
        def made(i: int) -> tuple[TokenTerms, dict[str, torch.Tensor]]:
            """Micro-batch i's token terms (on the last stage, which has its old log-probs)."""
            return loss_terms(batch.micro_batches[i], batch, cfg)

        # The loss straight from the LM head (gradients made in its forward pass) unless the
        # configuration asks for log-probs first ("chunked") or the loss mixes a row's positions
        # (GSPO's sequence ratio: a row may also be split over CP ranks).
        fused_head = cfg.logprob_impl != "chunked" and cfg.loss.objective != "gspo"

        def loss_of(
            i: int,
            logp: torch.Tensor,
            ent: torch.Tensor | None,
            fused: tuple[torch.Tensor, torch.Tensor] | None = None,
        ) -> torch.Tensor:
            mb = batch.micro_batches[i]
            terms, pre = made(i)
            logp = logp * mb.loss_mask
            if terms.old_logp is None:  # on-policy: the old log-probs' metrics, from logp
                pre = on_policy_metrics(logp.detach(), mb.rollout_logprobs, mb.loss_mask, cfg.loss)
            metrics = {**pre, **grpo_metrics(logp, terms, mb.loss_mask, cfg.loss, entropy=ent)}
            if fused is not None:
                loss, shown = fused
            else:  # what `grpo_loss` computes, from the terms already made
                loss = terms.loss(logp, ent, cfg.loss).sum()
                shown = loss.detach()
            losses.append(shown)
            add_loss_metrics(sums, metrics, mb.loss_mask.sum().item(), batch.num_loss_tokens)
            return loss

        self._schedule(
            batch.micro_batches,
            loss_of,
            chunks=self.train_chunks,
            forward_only=False,
            with_entropy=want_entropy,
            terms=(lambda i: made(i)[0]) if fused_head else None,
            clock=self._clock,
        )
        self._mark("loss_metrics")
        total = float(sum(float(x) for x in losses))
        # Every rank decides together (the loss lives on the last pipeline stage).
        if not bool(self._everywhere(torch.tensor(float(math.isfinite(total))), dist.ReduceOp.MIN)):
            return self._skip(f"non-finite loss in a micro-batch of a step of {len(batch.micro_batches)}")
        total, sums = self._reduce_metrics(total, sums)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.config, self.step)
        self._mark("optimizer")
        if self.megatron_ddp:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads(self.train_chunks, None)
            # One flag for every gradient, read once (not one wait for the device per parameter).
            flags = [torch.isfinite(g).all() for g in self._main_grads()]
            finite = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool)
            if not bool(self._everywhere(finite.float(), dist.ReduceOp.MIN)):
                return self._skip("non-finite gradient")
            ok, grad_norm, _ = self.optimizer.step()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            if not ok:
                return self._skip(f"megatron's optimizer refused the step (gradient norm {grad_norm})")
        else:
            self.finalize_grads()
            grad_norm = self.grad_norm()
            if not math.isfinite(grad_norm):
                return self._skip(f"non-finite gradient norm {grad_norm}")
            if self.config.grad_clip and grad_norm > self.config.grad_clip:
                scale = self.config.grad_clip / (grad_norm + 1e-6)
                for p in self._params():
                    if p.grad is not None:
                        p.grad.mul_(scale)
            self.optimizer.step()
        self.step += 1
        self._mark("batch")
        return {"loss": total, "grad_norm": grad_norm, "skipped": 0.0, **sums, **batch.stats}

    def _main_grads(self) -> list[torch.Tensor]:
        """Megatron DDP's gradients: its contiguous buffers, else each parameter's `main_grad`."""
        buffers = [
            b.grad_data
            for chunk in self.train_chunks
            for b in (*getattr(chunk, "buffers", ()), *getattr(chunk, "expert_parallel_buffers", ()))
            if getattr(b, "grad_data", None) is not None
        ]
        if buffers:
            return buffers
        return [p.main_grad for p in self._params() if getattr(p, "main_grad", None) is not None]  # type: ignore[attr-defined]

    def _reduce_metrics(self, total: float, sums: dict[str, float]) -> tuple[float, dict[str, float]]:
        """The step's loss and metrics over every data-parallel rank's micro-batches (a TP group
        computes the same values on each of its ranks), then from the last pipeline stage (where
        the loss is computed) to every stage."""
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        size = dist.get_world_size(group)
        if size > 1:
            everyone: list[Any] = [None] * size
            dist.all_gather_object(everyone, sorted(sums), group=group)
            names = sorted({k for ks in everyone for k in ks})
            out: dict[str, float] = {}
            for suffix, op, fill in (
                ("_min", dist.ReduceOp.MIN, math.inf),
                ("_max", dist.ReduceOp.MAX, -math.inf),
                ("", dist.ReduceOp.SUM, 0.0),
            ):
                chosen = [k for k in names if k.endswith(suffix) and k not in out]
                if suffix == "":
                    chosen = [*chosen, "__loss__"]
                values = torch.tensor(
                    [total if k == "__loss__" else sums.get(k, fill) for k in chosen], dtype=torch.float64
                ).to(self.device)
                dist.all_reduce(values, op=op, group=group)
                out.update(zip(chosen, values.tolist(), strict=True))
            total, sums = out.pop("__loss__"), out
        if self.pp_size > 1:
            box: list[Any] = [(total, sums)]
            dist.broadcast_object_list(
                box,
                src=ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
            total, sums = box[0]
        return total, sums

    def _skip(self, reason: str) -> dict[str, float]:
        """Drop this optimizer step's gradient: nothing non-finite may reach Adam's moments.
        Every rank decides together (the decision is reduced over all ranks)."""
        self._zero_grads()
        self.skipped_nonfinite += 1
        log.error("optimizer step skipped: %s (%d skipped so far)", reason, self.skipped_nonfinite)
        return {"loss": float("nan"), "grad_norm": float("nan"), "skipped": 1.0}

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One rollout batch -> `num_minibatches` optimizer steps (as `TorchTrainer.train_step`).
        Metrics `time_<phase>_s`: this rank's `batch`, `recompute` (old and reference log-probs),
        `forward`, `backward`, `loss_metrics` and `optimizer` time (`StepClock`)."""
        t0 = time.perf_counter()
        self._clock = StepClock(self.device)
        self._mark("batch")
        try:
            batches, stats = self.prepare(samples)
            metrics = run_steps(batches, self._update, stats)
            self._mark(None)
            metrics.update({f"time_{k}_s": v for k, v in self._clock.seconds().items()})
        finally:
            self._clock = None
        metrics["step"] = float(self.step)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["step_seconds"] = time.perf_counter() - t0
        return metrics

    # -- checkpoints -----------------------------------------------------------------------------


def _unwrap(chunk: Any) -> Any:
    return getattr(chunk, "module", chunk)


def _idle(mb: MicroBatch) -> MicroBatch:
    """A copy of `mb` with nothing to train: it runs the same forward and backward (collectives
    included) and contributes zero to the loss and the gradient."""
    zero = torch.zeros_like(mb.loss_mask)
    return MicroBatch(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        loss_mask=zero,
        rollout_logprobs=zero,
        advantages=zero,
        loss_weights=zero,
        sample_indices=[],
    )
