"""`RunConfig`: every setting of a training run in one typed, nested object.

One override syntax everywhere: `--set section.field=value` (dotted; the value is JSON when it
parses as JSON, else a string: `--set trainer.lr=3e-5`, `--set env.agent.max_turns=5`,
`--set engine.urls='["http://h:30000"]'`), applied on top of the defaults and of an optional
file (`--config run.toml|.json|.yaml`). `--dry-run` prints the resolved object: every value the
run uses, nothing hidden in code.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentrl.errors import AgentRLError
from agentrl.overrides import ConfigError, apply_overrides, load_file
from agentrl.rollout import environment as environments
from agentrl.rollout.manager import RolloutConfig
from agentrl.train.config import TrainConfig
from agentrl.train.megatron.settings import MegatronSettings


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SamplingSettings(_Section):
    """Sampling of rollouts and evals; the trainer's log-probs use the same temperature."""

    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1: off")


class EngineSettings(_Section):
    """The inference engine(s) the rollouts talk to."""

    kind: Literal["local", "sglang"] = Field(
        "local", description="local: the policy in this process; sglang: SGLang servers over HTTP."
    )
    model: str | None = Field(None, description="Initial weights (a Hugging Face model directory).")
    tokenizer: str | None = Field(None, description="Tokenizer directory (default: `model`).")
    urls: list[str] = Field(default_factory=list, description="SGLang worker URLs (kind=sglang).")
    router_url: str | None = Field(None, description="SGLang router URL (kind=sglang; data plane).")
    api_key_file: str | None = Field(
        None,
        description="kind=sglang: a file holding the servers' and router's API key (sent as "
        "'Authorization: Bearer'); cluster runs point it at the run's engine key.",
    )
    device: str = Field("cpu", description="Device of the local engine and torch trainer.")
    local_max_batch: int = Field(16, ge=1, description="kind=local: requests batched per forward pass.")
    local_logprob_mode: Literal["processed", "original"] = Field(
        "processed",
        description="kind=local: log-probs after temperature (SGLang's default) or of the raw logits.",
    )
    request_timeout_s: float = Field(1800.0, description="kind=sglang: one /generate call.")
    control_timeout_s: float = Field(120.0, description="kind=sglang: one control call (pause, update...).")
    connect_timeout_s: float = 10.0
    retries: int = Field(
        5, ge=1, description="kind=sglang: re-sends of a request that was provably not served."
    )
    on_version_mismatch: Literal["flag", "raise"] = Field(
        "flag",
        description="kind=sglang: a generation answered under an unexpected weight version (a replay on "
        "a server that missed an update) is counted (flag) or retried as an engine error (raise).",
    )
    return_routed_experts: bool = Field(
        False,
        description="R3: every generation returns the experts each token was routed to (SGLang servers "
        "need --enable-return-routed-experts); the samples carry them for trainer.megatron.routing_replay.",
    )
    flush_wait_s: float = Field(
        60.0, description="kind=sglang: how long a busy server's cache flush is retried."
    )


class SyncSettings(_Section):
    """How new weights reach the engines after every rollout step (one version per step)."""

    transport: Literal["in_process", "disk", "tensor", "distributed", "lora_adapter"] = Field(
        "in_process",
        description="lora_adapter: the trainer's LoRA adapters alone, loaded by name on engines with "
        "LoRA enabled (trainer.lora.rank > 0); with LoRA and any other transport the merged weights go.",
    )
    pause_mode: Literal["abort", "in_place", "retract"] = Field(
        "abort",
        description="abort: in-flight turns are re-sent on the new weights; in_place: they continue "
        "on the new weights over the old KV cache (no cache flush in this mode).",
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(None, description="Cast floats (None: as trained).")
    directory: str | None = Field(
        None,
        description="Disk and lora_adapter transports: where versions are written (default "
        "<out>/weights, <out>/adapters); every engine must read it.",
    )
    bucket_mb: int = Field(512, gt=0)
    keep: int = Field(2, ge=1, description="Disk and lora_adapter transports: newest versions kept on disk.")
    timeout_s: float = Field(600.0, gt=0, description="Each engine call of a push.")
    tp_size: int | None = Field(
        None,
        ge=1,
        description="Tensor transport: payloads per server, one per TP rank (None: ask the servers).",
    )
    master_address: str = "127.0.0.1"
    master_port: int = 29555


class EvalSettings(_Section):
    """pass@k with fixed seeds through the shared evaluator (`agentrl.eval.passk`)."""

    before: bool = True
    after: bool = True
    every: int = Field(0, ge=0, description="Also every N steps (0: never in between).")
    mode: Literal["auto", "aside", "pause"] = Field(
        "auto",
        description=(
            "Evals in between: 'aside' runs them on `aside_servers` engine servers taken out of the "
            "fleet at that step's weights while training goes on (needs a fleet of more servers); "
            "'pause' stops admitting training episodes and training until the eval is done; 'auto' "
            "sets aside where the engine can, else pauses."
        ),
    )
    aside_servers: int = Field(1, ge=1, description="mode aside: servers the eval takes out of the fleet.")
    samples_per_row: int = Field(16, ge=1)
    ks: list[int] = Field(default_factory=lambda: [1])
    concurrency: int = Field(4, ge=1)
    max_attempts: int = Field(3, ge=1)
    max_unscored_fraction: float = Field(
        0.5, ge=0, le=1, description="Fail an eval with more unscored episodes than this (infra down)."
    )


class CheckpointSettings(_Section):
    every: int = Field(0, ge=0, description="Save every N steps (0: only at the end).")
    resume: bool = Field(False, description="Continue from <out>/checkpoints/latest when it exists.")


@dataclass
class TrainerSettings(TrainConfig):
    """`TrainConfig` plus the backend that runs it: "torch" (`TorchTrainer`, a transformers model)
    or "megatron" (`MegatronTrainer`, glm_moe_dsa models on megatron-core, Python >= 3.12; its
    layout in `megatron`, see docs/megatron.md)."""

    backend: Literal["torch", "megatron"] = "torch"
    megatron: MegatronSettings = field(default_factory=MegatronSettings)


DEFAULT_BATCH_SIZE = 16


class RunConfig(_Section):
    """A training run: environment, engine, rollout, trainer, weight sync, eval, checkpoints."""

    out: str = Field("runs/run", description="Run directory: metrics, records, checkpoints, evals.")
    seed: int = 0
    steps: int = Field(32, ge=1, description="Rollout steps (one weight version each).")
    batch_timeout_s: float = Field(900.0, gt=0, description="Longest wait for one batch of groups.")
    torch_threads: int = Field(2, ge=1)
    records_keep: int = Field(
        20000, ge=0, description="Keep the newest N episode records under <out>/records (0: keep all)."
    )
    env: dict[str, Any] = Field(default_factory=lambda: {"name": environments.DEFAULT_ENV})
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    rollout: RolloutConfig = Field(default_factory=lambda: RolloutConfig(batch_size=DEFAULT_BATCH_SIZE))
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    sync: SyncSettings = Field(default_factory=SyncSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    sinks: list[Literal["wandb", "tensorboard"]] = Field(
        default_factory=list,
        description="Also send metrics to W&B / TensorBoard (each installed separately, never required; "
        "agentrl.dashboard.sinks). metrics.jsonl is always written.",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value: Any) -> dict[str, Any]:
        """Validated by the named plugin's own Config, so its defaults show in --dry-run."""
        data = value.model_dump() if isinstance(value, BaseModel) else dict(value)
        data.setdefault("name", environments.DEFAULT_ENV)
        try:
            return environments.resolve_config(data).model_dump()
        except (ValidationError, AgentRLError) as exc:
            raise ValueError(f"env ({data.get('name')}): {exc}") from None

    @model_validator(mode="before")
    @classmethod
    def _rollout_defaults(cls, data: Any) -> Any:
        """`--set rollout.x=...` alone keeps the section's other defaults (batch_size included)."""
        if isinstance(data, dict) and isinstance(data.get("rollout"), dict):
            data["rollout"] = {"batch_size": DEFAULT_BATCH_SIZE, **data["rollout"]}
        return data

    @model_validator(mode="before")
    @classmethod
    def _temperature(cls, data: Any) -> Any:
        """The trainer's log-probs must use the sampling temperature: one setting, not two."""
        if not isinstance(data, dict):
            return data
        sampling = data.get("sampling") or {}
        t = (
            sampling.get("temperature")
            if isinstance(sampling, dict)
            else getattr(sampling, "temperature", None)
        )
        trainer = data.get("trainer")
        given = trainer.get("temperature") if isinstance(trainer, dict) else None
        if t is not None and given is not None and float(given) != float(t):
            raise ValueError(
                f"trainer.temperature={given} differs from sampling.temperature={t}: the trainer's "
                "log-probs must use the rollouts' temperature; set sampling.temperature only"
            )
        return data

    @model_validator(mode="after")
    def _derived(self) -> RunConfig:
        if self.trainer.temperature != self.sampling.temperature:
            self.trainer.temperature = self.sampling.temperature
        if self.trainer.megatron.routing_replay and not self.engine.return_routed_experts:
            raise ValueError(
                "trainer.megatron.routing_replay replays the engine's routes: set "
                "engine.return_routed_experts=true (and start SGLang with --enable-return-routed-experts)"
            )
        if self.sync.transport == "lora_adapter" and not self.trainer.lora.enabled:
            raise ValueError(
                "sync.transport=lora_adapter sends the trainer's LoRA adapters: set trainer.lora.rank > 0, "
                "or choose another transport"
            )
        return self

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve(
    model: type[RunConfig],
    *,
    defaults: dict[str, Any] | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
) -> Any:
    """defaults <- file <- --set overrides, validated into `model` (a RunConfig or a subclass)."""
    data = copy.deepcopy(defaults or {})
    if config_file is not None:
        data = _merge(data, load_file(config_file))
    apply_overrides(data, overrides)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors()]
        raise ConfigError("invalid run configuration:\n" + "\n".join(lines)) from None
    except AgentRLError as exc:  # a section's own check (e.g. RolloutConfig's) in its constructor
        raise ConfigError(f"invalid run configuration: {exc}") from None
