"""R3, rollout routing replay: every MoE router of the trainer takes the experts the engine chose
for each token (the samples' `routed_experts`) instead of its own top-k, and weights them with its
own scores (megatron-core's `RouterReplay`).

- A micro-batch's routes are packed like its tokens (`PackedRows.pack_tokens`: this CP rank's share
  under context parallelism), then, with sequence parallelism (TP > 1), cut to this TP rank's
  contiguous slice of the packed row, which is what its routers see.
- Padding, a row's last token and tokens the engine did not route get experts 0..k-1 (they reach
  no loss).
- Activation recompute (`recompute="full"`): a checkpointed layer's first forward runs without
  gradients and its recompute, in the backward pass, with them. Each micro-batch's routes are
  queued in forward order (`RouterReplay.set_target_indices`); a router called with gradients on
  replays the head of the queue (REPLAY_BACKWARD), which is its own micro-batch's, since
  backward passes run in forward order under every schedule (one stage, 1F1B, interleaved). The
  queues are emptied at the start of each schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.overrides import ConfigError
from agentrl.train.batch import MicroBatch
from agentrl.train.megatron.packing import PackedRows


class RouteReplay:
    def __init__(self, *, recompute: str, tp_size: int, tp_rank: int, device: torch.device) -> None:
        self.recompute_all = recompute == "full"  # "selective" recomputes attention, not routers
        self.tp_size, self.tp_rank, self.device = tp_size, tp_rank, device
        self._routers: dict[int, list[Any]] = {}  # each model chunk's RouterReplay instances

    def routers(self, model: Any) -> list[Any]:
        key = id(model)
        if key not in self._routers:
            modules = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]
            if self.recompute_all:
                for m in modules:
                    m.register_forward_pre_hook(_choose_action)
            self._routers[key] = [m.router_replay for m in modules]
        return self._routers[key]

    def start(self, models: list[Any]) -> None:
        """A schedule begins: no micro-batch's routes are queued."""
        for model in models:
            for router in self.routers(model):
                router.clear_indices()

    def set(self, model: Any, rows: PackedRows, mb: MicroBatch) -> None:
        """Queue micro-batch `mb`'s routes in every router of `model` (before its forward)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if mb.routed_experts is None:
            raise ConfigError(
                "trainer.megatron.routing_replay is on but the samples carry no routed_experts: the "
                "engine must return them (SGLang --enable-return-routed-experts)"
            )
        k = int(mb.routed_experts.shape[-1])
        fallback = torch.arange(k, dtype=torch.int32)
        packed = rows.pack_tokens(mb.routed_experts.cpu(), fallback)  # [T (this CP rank's), layers, k]
        if self.tp_size > 1:  # sequence parallelism: this rank's routers see its contiguous slice
            n = packed.shape[0] // self.tp_size
            packed = packed[self.tp_rank * n : (self.tp_rank + 1) * n]
        for router in self.routers(model):
            chosen = packed[:, router.layer_number - 1, :].long()
            chosen[(chosen < 0).any(-1)] = fallback.long()
            router.set_target_indices(chosen.to(self.device))
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def _choose_action(module: Any, args: Any) -> None:
    """Under full recompute: a router called with gradients on is recomputing (see the module)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    grad = torch.is_grad_enabled()
    module.router_replay.set_router_replay_action(
        RouterReplayAction.REPLAY_BACKWARD if grad else RouterReplayAction.REPLAY_FORWARD
    )
