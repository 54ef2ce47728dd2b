"""`build_parts(config)`: the components of a run, from its `RunConfig` alone.

Environment (by plugin name), tokenizer, policy and torch trainer, the engine (in process, or
SGLang servers over HTTP) and the weight transport. Recipes that need something else (another
trainer backend, a Ray placement) build their own `RunParts` and call the same loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agentrl.engine.build import EngineSpec, build_engine
from agentrl.errors import AgentRLError
from agentrl.models.source import check_model_source
from agentrl.rollout.environment import EnvContext, get_plugin
from agentrl.runtime.config import RunConfig
from agentrl.runtime.loop import RunParts


def engine_spec(cfg: RunConfig) -> EngineSpec:
    """The run's engine settings as the engine factory's spec (kind local: the policy is copied)."""
    e = cfg.engine
    return EngineSpec(
        kind=e.kind,
        model=Path(e.model) if e.model else None,
        urls=list(e.urls),
        router_url=e.router_url,
        tokenizer=Path(e.tokenizer or e.model) if (e.tokenizer or e.model) else None,
        api_key_env=None,
        api_key_file=e.api_key_file,
        device=e.device,
        max_batch=e.local_max_batch,
        logprob_mode=e.local_logprob_mode,
        request_timeout_s=e.request_timeout_s,
        control_timeout_s=e.control_timeout_s,
        connect_timeout_s=e.connect_timeout_s,
        retries=e.retries,
        on_version_mismatch=e.on_version_mismatch,
        flush_wait_s=e.flush_wait_s,
        enable_lora=cfg.sync.transport == "lora_adapter",
        routed_experts=e.return_routed_experts,
    )


def build_transport(cfg: RunConfig, engine: Any, trainer: Any = None) -> Any:
    from agentrl.train import weight_sync as ws

    s = cfg.sync
    if s.transport == "in_process":
        if cfg.engine.kind != "local":
            raise AgentRLError(
                "sync.transport=in_process needs engine.kind=local; use disk, tensor or distributed"
            )
        return ws.InProcessTransport([engine], timeout=s.timeout_s)
    if s.transport == "disk":
        directory = s.directory or str(cfg.out_dir / "weights")
        return ws.DiskTransport(
            [engine], directory, keep=s.keep, model_files_from=cfg.engine.model, timeout=s.timeout_s
        )
    if s.transport == "tensor":
        return ws.TensorTransport([engine], tp_size=s.tp_size, timeout=s.timeout_s)
    if s.transport == "lora_adapter":
        if trainer is None or not hasattr(trainer, "adapter_config"):
            raise AgentRLError("sync.transport=lora_adapter needs a trainer with trainer.lora.rank > 0")
        return ws.AdapterTransport(
            [engine], s.directory or str(cfg.out_dir / "adapters"), trainer.adapter_config(),
            keep=s.keep, timeout=s.timeout_s,
        )  # fmt: skip
    return ws.DistributedTransport(
        [engine],
        master_address=s.master_address,
        master_port=s.master_port,
        backend="nccl" if torch.cuda.is_available() else "gloo",
        timeout=s.timeout_s,
    )


def build_trainer(cfg: RunConfig, *, engine_policy: bool = True) -> tuple[Any, Any, Any]:
    """The trainer, the engine's policy (an in-process engine's model, else None; never without
    `engine_policy`) and the tokenizer. Every rank of a multi-rank trainer builds this part
    (`agentrl.runtime.ranks`); only the driver builds the rest."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.train.torch_backend import TorchTrainer

    if not cfg.engine.model:
        raise AgentRLError(
            "engine.model is not set: give the initial weights (a Hugging Face model directory)"
        )
    model_dir = check_model_source(cfg.engine.model, "engine.model")
    tok_dir = check_model_source(cfg.engine.tokenizer or cfg.engine.model, "engine.tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if cfg.trainer.backend == "megatron":
        # Needs Python >= 3.12 and megatron-core (docs/megatron.md). The initial weights: the
        # torch_dist checkpoint of trainer.megatron.init_checkpoint (what `prepare` converted; the
        # HF weights are then not read: engine.model gives config and tokenizer), else the HF
        # checkpoint, every rank reading only its own shard, one tensor at a time (a large MoE
        # model does not fit one host). Only an in-process engine needs the whole HF model.
        from transformers import AutoConfig

        from agentrl.train.megatron.checkpointing import init_checkpoint_dir
        from agentrl.train.megatron.hf_io import HFCheckpoint
        from agentrl.train.megatron.trainer import MegatronTrainer

        hf_config = AutoConfig.from_pretrained(model_dir)
        trainer: Any
        if cfg.trainer.megatron.init_checkpoint:
            init_checkpoint_dir(cfg.trainer.megatron.init_checkpoint)  # before any process group
            trainer = MegatronTrainer(hf_config, cfg.trainer, cfg.trainer.megatron)
        else:
            with HFCheckpoint(model_dir) as hf_state:
                trainer = MegatronTrainer(hf_config, cfg.trainer, cfg.trainer.megatron, hf_state=hf_state)
        policy = None
        if cfg.engine.kind == "local" and engine_policy:
            policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = TorchTrainer(policy, cfg.trainer, device=cfg.engine.device)
        policy = trainer.engine_model()
    return trainer, policy, tokenizer


def build_parts(cfg: RunConfig, built: tuple[Any, Any, Any] | None = None) -> RunParts:
    """Everything the training loop needs, built from the configuration (`built`: what
    `build_trainer` returned, when the trainer was built already)."""
    trainer, policy, tokenizer = built or build_trainer(cfg)
    engine, _ = build_engine(engine_spec(cfg), policy=policy, tokenizer=tokenizer)
    plugin = get_plugin(cfg.env["name"])
    env = plugin.build(
        plugin.Config.model_validate(cfg.env),
        EnvContext(
            tokenizer=tokenizer,
            seed=cfg.seed,
            out_dir=cfg.out_dir,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
        ),
    )
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[cfg.sync.dtype]
    transport = build_transport(cfg, engine, trainer)
    return RunParts(
        env=env,
        engine=engine,
        trainer=trainer,
        transport=transport,
        tokenizer=tokenizer,
        export_dtype=dtype,
        closers=[transport.aclose],
    )
