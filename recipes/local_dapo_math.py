"""The embedded math demo: a tiny GLM-family model learns synthetic arithmetic in the DAPO-Math-17k
row format, on a CPU, through the same runtime as the terminal demo.

    python recipes/local_dapo_math.py prepare   # tiny model, synthetic rows, a short SFT warm start
    python recipes/local_dapo_math.py train     # fully async GRPO + TIS, pass@1 before and after
    python recipes/local_dapo_math.py eval      # pass@k of any model or engine on the eval rows
    python recipes/local_dapo_math.py download  # DAPO-Math-17k and AIME-2024 from the Hugging Face hub

A thin script over a config file: the run's settings are recipes/configs/local_dapo_math.yaml
(which `agentrl train run` reads too); this file adds the demo's data and warm start (`prepare`) and
calls the library runtime; the environment is the `dapo_math` plugin. Settings: `--set
trainer.lr=1e-4`, `--config run.toml` (on top of the file), `--dry-run` (docs/math_demo.md).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
from pathlib import Path
from typing import Any

import typer
from pydantic import Field, model_validator
from rich.console import Console

from agentrl.cli import train as runtime_cli
from agentrl.overrides import load_file
from agentrl.runtime.config import RunConfig, _Section

app = typer.Typer(no_args_is_help=True, add_completion=False)
console = Console()


class PrepareSettings(_Section):
    """The demo's data and warm start: synthetic arithmetic rows, a random-init tiny model with
    single-digit tokens, and a short SFT on reference replies worked in columns, stopped once the
    model reproduces them with a set probability."""

    kinds: list[tuple[str, int, int]] = Field(
        default_factory=lambda: [("+", 2, 1)],
        description="Problem kinds: (operator, digits of a, digits of b).",
    )
    sft_problems: int = Field(600, ge=1, description="Synthetic problems whose reference reply SFT sees.")
    rl_problems: int = Field(600, ge=1, description="Of those, the problems RL trains on.")
    held_out: bool = Field(
        True,
        description="true: eval_problems new problems of the same kinds, disjoint from every SFT and RL "
        "problem (needs a family larger than sft_problems + eval_problems); false: the eval set is the "
        "RL problems (pass@1 on what RL trains on, as in the terminal demo).",
    )
    eval_problems: int = Field(64, ge=1, description="Held-out eval problems (held_out=true).")
    sft_steps: int = Field(400, ge=1, description="The most SFT steps.")
    sft_target: float | None = Field(
        0.2,
        gt=0,
        le=1,
        description="Stop SFT once the probability of sampling the reference replies exactly, at the run's "
        "temperature, averages this over 64 of the SFT problems (measured every 10 steps); null: "
        "all sft_steps.",
    )
    sft_lr: float = 2e-3
    sft_batch_size: int = 32


class MathDemoConfig(RunConfig):
    prepare: PrepareSettings = Field(default_factory=PrepareSettings)

    @model_validator(mode="after")
    def _model(self) -> MathDemoConfig:
        if self.engine.model is None:
            self.engine.model = str(self.out_dir / "sft")
        return self

    @model_validator(mode="before")
    @classmethod
    def _data_files(cls, data: Any) -> Any:
        """The data files `prepare` writes default to the run directory, wherever `out` points."""
        if isinstance(data, dict):
            out = Path(str(data.get("out") or cls.model_fields["out"].default))
            env = dict(data.get("env") or {})
            env.setdefault("train_file", str(out / "train.jsonl"))
            env.setdefault("eval_file", str(out / "eval.jsonl"))
            data = {**data, "env": env}
        return data


# The demo's run settings live in a config file (docs/math_demo.md says why each is what it is);
# `--config` and `--set` go on top of it.
RUN_CONFIG = Path(__file__).resolve().parent / "configs" / "local_dapo_math.yaml"
DEFAULTS: dict[str, Any] = load_file(RUN_CONFIG)


def configure(config: Path | None, overrides: list[str] | None, dry_run: bool) -> MathDemoConfig | None:
    return runtime_cli.configure(MathDemoConfig, DEFAULTS, config, overrides, dry_run)  # type: ignore[no-any-return]


SET, CONFIG, DRY = runtime_cli.SET, runtime_cli.CONFIG, runtime_cli.DRY


@app.command()
def prepare(set_: list[str] = SET, config: Path = CONFIG, dry_run: bool = DRY) -> None:
    """Tiny model with single-digit tokens; synthetic train and held-out eval rows; SFT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.models.tiny import tiny_math_model_dir
    from agentrl.rollout.environment import EnvContext
    from agentrl.tasks.rows import write_jsonl
    from agentrl.train.sft import SFTConfig, run_sft
    from envs.dapo_math import MathConfig, MathEnvironment
    from envs.dapo_math.synthetic import arithmetic_rows, sft_samples, statement

    cfg = configure(config, set_, dry_run)
    if cfg is None:
        return
    out, p = cfg.out_dir, cfg.prepare
    out.mkdir(parents=True, exist_ok=True)
    kinds = tuple(tuple(k) for k in p.kinds)
    sft_rows = arithmetic_rows(p.sft_problems, seed=cfg.seed, kinds=kinds)  # type: ignore[arg-type]
    rl_rows = random.Random(cfg.seed + 10_000).sample(sft_rows, min(p.rl_problems, len(sft_rows)))
    eval_rows = rl_rows
    if p.held_out:
        seen = {statement(r) for r in sft_rows}
        eval_rows = arithmetic_rows(p.eval_problems, seed=cfg.seed + 20_000, kinds=kinds, exclude=seen)  # type: ignore[arg-type]
    write_jsonl(cfg.env["train_file"], rl_rows)
    write_jsonl(cfg.env["eval_file"], eval_rows)
    where = "held-out" if p.held_out else "(the RL problems)"
    console.print(
        f"{len(sft_rows)} SFT problems, {len(rl_rows)} of them for RL, {len(eval_rows)} {where} eval problems"
    )
    base = tiny_math_model_dir(seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    ctx = EnvContext(tokenizer=tokenizer, seed=cfg.seed, out_dir=out, temperature=cfg.sampling.temperature)
    env = MathEnvironment(MathConfig.model_validate(cfg.env), ctx)
    samples = sft_samples(sft_rows, tokenizer, env.prompt_ids)
    console.print(f"SFT on {len(samples)} reference replies for {p.sft_steps} steps")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    sft = SFTConfig(
        steps=p.sft_steps,
        lr=p.sft_lr,
        batch_size=p.sft_batch_size,
        seed=cfg.seed,
        log_every=50,
        target=p.sft_target,
        temperature=cfg.sampling.temperature,
        target_samples=64,
        target_every=10,
    )
    losses = run_sft(model, samples, sft, log=console.print)
    model.save_pretrained(out / "sft")
    tokenizer.save_pretrained(out / "sft")
    (out / "sft_losses.json").write_text(json.dumps(losses))
    console.print(f"saved the SFT model to {out / 'sft'}")


@app.command()
def train(set_: list[str] = SET, config: Path = CONFIG, dry_run: bool = DRY) -> None:
    """Fully async GRPO + TIS from the SFT model, evaluated before and after (fixed seeds)."""
    from agentrl.runtime import close_parts
    from agentrl.runtime import train as run_training
    from agentrl.runtime.build import build_parts

    cfg = configure(config, set_, dry_run)
    if cfg is None:
        return
    if not Path(str(cfg.engine.model)).is_dir():
        raise typer.BadParameter(
            f"{cfg.engine.model} is missing: run `python recipes/local_dapo_math.py prepare` first"
        )
    parts = build_parts(cfg)

    async def go() -> Any:
        try:
            return await run_training(cfg, parts, reporter=console.print)
        finally:
            counts = dict(getattr(parts.env, "verifier").counts)  # noqa: B009
            await close_parts(parts)
            (cfg.out_dir / "verdicts.json").write_text(json.dumps(counts, indent=1))
            console.print(f"answer verdicts: {counts}")

    result = asyncio.run(go())
    console.print(result.summary(), markup=False, soft_wrap=True)


@app.command("eval")
def eval_cmd(
    model_dir: Path = typer.Argument(
        None, help="Model directory for --engine local (default: the SFT model)."
    ),
    engine: str = typer.Option("local", help="local | sglang | openai"),
    url: list[str] = typer.Option(None, help="SGLang worker URL(s), or the OpenAI-compatible base URL."),
    tokenizer: Path = typer.Option(None, help="Tokenizer directory for --engine sglang."),
    api_model: str = typer.Option(None, help="Model name for --engine openai."),
    api_key_env: str = typer.Option("OPENAI_API_KEY", help="Environment variable holding the API key."),
    output: Path = typer.Option(None, help="Also write the summary JSON to this file."),
    set_: list[str] = SET,
    config: Path = CONFIG,
) -> None:
    """pass@k over the eval rows for any engine (`--set env.eval_file=data/dapo_math/aime-2024.jsonl
    --set eval.samples_per_row=16 --set eval.ks=[1,16]`)."""
    from agentrl.engine.build import EngineSpec, build_engine
    from agentrl.errors import AgentRLError
    from agentrl.runtime.loop import evaluate_engine

    cfg = configure(config, set_, dry_run=False)
    assert cfg is not None
    model = model_dir or Path(str(cfg.engine.model))
    if engine == "local" and not model.is_dir():
        raise typer.BadParameter(f"{model} is missing: run `prepare` first or pass a model directory")
    spec = EngineSpec(
        engine, model, list(url or []), tokenizer=tokenizer, api_model=api_model, api_key_env=api_key_env
    )
    try:
        eng, tok = build_engine(spec)
        label = model.name if engine == "local" else engine
        summary = asyncio.run(evaluate_engine(cfg, eng, tok, label=label, reporter=console.print))
    except AgentRLError as exc:
        console.print(str(exc), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    console.print_json(json.dumps(summary))
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(summary, indent=1))


@app.command()
def download(
    out: Path = typer.Option(Path("data/dapo_math"), help="Where the JSONL files go."),
    endpoint: str = typer.Option(None, help="Hub endpoint (default: huggingface.co, or $HF_ENDPOINT)."),
    keep_duplicates: bool = typer.Option(False, help="Keep the published file's repeated rows."),
) -> None:
    """DAPO-Math-17k (training) and AIME-2024 (eval) from the Hugging Face hub, rows kept as
    published, as the `dapo_math` environment's default files."""
    from envs.dapo_math.hub import HubError, download_datasets

    try:
        written = download_datasets(out, endpoint=endpoint, dedup=not keep_duplicates, report=console.print)
    except HubError as exc:
        console.print(str(exc), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    for path, n in written.items():
        console.print(f"{path}: {n} rows")


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so the verifier's workers and the engine are closed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    app()
