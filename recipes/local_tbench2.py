"""The embedded default: train a tiny GLM-family model end to end on the bundled tasks, on a CPU.

    python recipes/local_tbench2.py prepare   # tasks, tiny model, oracle trajectories, SFT warm start
    python recipes/local_tbench2.py train     # fully async GRPO with real podman sandboxes
    python recipes/local_tbench2.py eval      # pass@1 / pass@k of any model directory

Every piece is the runtime every other entry point uses: the Harbor task model, podman sandboxes,
the agent loop and verifier (`agentrl.episode`), the local engine (in process), the rollout
manager with its staleness bound, the torch GRPO/TIS trainer and an in-process weight sync every
step. `--dry-run` prints the resolved configuration.

The demo trains on the bundled tasks whose reference solution is a single short command (a
random-init model of a few million parameters cannot learn a 1 kB script from a dozen examples);
`--max-solution-chars` widens the set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrl.agent.loop import AgentConfig  # noqa: E402
from agentrl.agent.tokens import ChatRenderer  # noqa: E402
from agentrl.engine.base import SamplingParams  # noqa: E402
from agentrl.episode import EpisodeConfig, EpisodeRunner, run_episode  # noqa: E402
from agentrl.episode_cli import scripted_solution_texts  # noqa: E402
from agentrl.tasks import Task, discover_tasks  # noqa: E402
from agentrl.tasks.dataset import task_row, write_jsonl  # noqa: E402

app = typer.Typer(no_args_is_help=True, add_completion=False)
console = Console()


@dataclass
class RecipeConfig:
    out: str = "runs/local_tbench2"
    tasks: str = str(ROOT / "envs" / "tbench2" / "tasks")
    max_solution_chars: int = 64
    action_format: str = "fenced-bash"
    seed: int = 0
    # agent
    max_turns: int = 3
    max_new_tokens: int = 64
    max_total_tokens: int = 1024
    command_timeout_s: float = 20.0
    # Sampling temperature of rollouts and evals (the trainer's log-probs use the same). At 1.0 a
    # memorised tiny model fails by rare copy errors whose tokens dominate the GRPO gradient; at
    # 0.7 failures sit at the genuinely uncertain tokens, where the gradient helps (see `probe`).
    temperature: float = 0.7
    # SFT warm start (deliberately light: RL must have room to show)
    sft_steps: int = 42
    sft_lr: float = 1e-3
    sft_batch_size: int = 8
    # RL
    steps: int = 24
    prompts_per_step: int = 2
    samples_per_prompt: int = 8
    max_in_flight: int = 8
    max_staleness: int = 1
    # Adam's first steps are sign-like: at 1e-4 and above they perturb every weight of a memorised
    # model by lr and the pass rate collapses (measured with `probe`).
    lr: float = 3e-5
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    tis_clip_low: float = 0.5
    tis_clip: float = 2.0
    # token_mean: shared prefix tokens of a group cancel exactly; with seq_mean_token_mean a short
    # failed reply pushes the shared prefix down harder than the long successes push it up.
    aggregation: str = "token_mean"
    # eval
    eval_samples: int = 8
    eval_concurrency: int = 4
    torch_threads: int = 2
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def out_dir(self) -> Path:
        return Path(self.out)


def demo_tasks(cfg: RecipeConfig) -> list[Task]:
    from agentrl.tasks.lint import lint_tasks

    chosen = []
    for result in lint_tasks(discover_tasks(cfg.tasks)):
        task = result.task
        if result.errors or task.solve_script is None:
            continue
        body = [
            ln
            for ln in task.solve_script.read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith(("#", "set -"))
        ]
        if len("\n".join(body)) <= cfg.max_solution_chars:
            chosen.append(task)
    if not chosen:
        raise typer.BadParameter(
            f"no task in {cfg.tasks} has a solution of <= {cfg.max_solution_chars} chars"
        )
    return chosen


def episode_config(
    cfg: RecipeConfig, *, temperature: float | None = None, seed: int | None = None
) -> EpisodeConfig:
    return EpisodeConfig(
        action_format=cfg.action_format,
        agent=AgentConfig(
            max_turns=cfg.max_turns,
            max_new_tokens=cfg.max_new_tokens,
            max_total_tokens=cfg.max_total_tokens,
            command_timeout_s=cfg.command_timeout_s,
        ),
        sampling=SamplingParams(
            temperature=cfg.temperature if temperature is None else temperature,
            max_new_tokens=cfg.max_new_tokens,
            seed=seed,
        ),
        max_agent_timeout_s=120.0,
    )


def _print_config(cfg: RecipeConfig) -> None:
    console.print_json(json.dumps(dataclasses.asdict(cfg)))


async def harvest(cfg: RecipeConfig, tasks: list[Task], tokenizer: Any, provider: Any) -> Path:
    """Drive each task's reference solution through the real agent loop and sandboxes; keep the
    records of episodes that reached reward 1 as SFT data."""
    from agentrl.engine.fake import ScriptedEngine

    record_dir = cfg.out_dir / "harvest"
    shutil.rmtree(record_dir, ignore_errors=True)
    renderer = ChatRenderer(tokenizer)
    config = episode_config(cfg)
    config = dataclasses.replace(
        config, agent=dataclasses.replace(config.agent, max_new_tokens=1024, max_total_tokens=8192)
    )
    for task in tasks:
        engine = ScriptedEngine(scripted_solution_texts(task, cfg.action_format), tokenizer)
        result = await run_episode(
            task,
            provider=provider,
            engine=engine,
            renderer=renderer,
            config=config,
            run_id="harvest",
            record_dir=record_dir,
        )
        reward = result.verify.reward if result.verify else None
        console.print(f"harvest {task.task_id}: reward {reward}")
        if reward != 1.0:
            raise RuntimeError(
                f"the reference solution of {task.task_id} did not pass through the agent loop"
            )
    return record_dir


async def evaluate(
    cfg: RecipeConfig,
    tasks: list[Task],
    model: Any,
    tokenizer: Any,
    provider: Any,
    *,
    label: str,
    k: int | None = None,
) -> dict[str, Any]:
    """pass@1 (mean reward over samples) and pass@k per task, with fixed sampling seeds."""
    from agentrl.engine.local import LocalEngine

    k = k or cfg.eval_samples
    engine = LocalEngine(model, tokenizer)
    renderer = ChatRenderer(tokenizer)
    sem = asyncio.Semaphore(cfg.eval_concurrency)
    rewards: dict[str, list[float]] = {t.task_id: [] for t in tasks}
    infra = 0

    async def one(task: Task, i: int) -> None:
        nonlocal infra
        from agentrl.errors import InfraError

        async with sem:
            try:
                res = await run_episode(
                    task,
                    provider=provider,
                    engine=engine,
                    renderer=renderer,
                    config=episode_config(cfg, seed=cfg.seed * 1000 + i),
                    run_id=f"eval-{label}",
                    sample_index=i,
                )
            except InfraError as exc:
                infra += 1
                console.print(
                    f"[yellow]eval infra failure ({exc.cause}) on {task.task_id}; not scored: {str(exc)[:300]}[/yellow]"
                )
                return
            rewards[task.task_id].append(float(res.verify.reward >= 1.0))

    await asyncio.gather(*(one(t, i) for t in tasks for i in range(k)))
    await engine.aclose()
    per_task = {t: (sum(r) / len(r) if r else 0.0) for t, r in rewards.items()}
    pass_at_k = {t: float(any(r)) for t, r in rewards.items()}
    n = sum(len(r) for r in rewards.values())
    if n < (len(tasks) * k) // 2:
        raise RuntimeError(
            f"eval {label}: only {n} of {len(tasks) * k} episodes ran ({infra} infra failures): "
            "fix the infrastructure before reading a pass rate"
        )
    summary = {
        "label": label,
        "pass@1": sum(sum(r) for r in rewards.values()) / max(1, n),
        f"pass@{k}": sum(pass_at_k.values()) / max(1, len(pass_at_k)),
        "episodes": n,
        "infra_failures": infra,
        "per_task": per_task,
    }
    table = Table(title=f"eval: {label}")
    table.add_column("task")
    table.add_column("pass@1")
    table.add_column(f"pass@{k}")
    for t in per_task:
        table.add_row(t, f"{per_task[t]:.2f}", f"{pass_at_k[t]:.0f}")
    table.add_row("[b]mean[/b]", f"[b]{summary['pass@1']:.3f}[/b]", f"{summary[f'pass@{k}']:.2f}")
    console.print(table)
    return summary


def _resolve(overrides: list[str] | None) -> RecipeConfig:
    cfg = RecipeConfig()
    for item in overrides or []:
        key, _, value = item.partition("=")
        if not hasattr(cfg, key):
            raise typer.BadParameter(f"unknown setting {key!r}")
        current = getattr(cfg, key)
        setattr(
            cfg,
            key,
            type(current)(value) if not isinstance(current, bool) else value.lower() in ("1", "true"),
        )
    return cfg


def _start(overrides: list[str] | None, dry_run: bool) -> RecipeConfig | None:
    """Resolve the configuration; print it and return None on --dry-run; set torch threads."""
    import torch

    cfg = _resolve(overrides)
    if dry_run:
        _print_config(cfg)
        return None
    torch.set_num_threads(cfg.torch_threads)
    return cfg


@app.command()
def prepare(
    set_: list[str] = typer.Option(None, "--set", help="Override a setting, e.g. --set sft_steps=60."),
    dry_run: bool = typer.Option(False, help="Print the resolved configuration and exit."),
) -> None:
    """Tasks -> training rows; tiny model; oracle trajectories through the agent loop; SFT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.models.tiny import tiny_model_dir
    from agentrl.sandbox.podman import PodmanProvider
    from agentrl.sft import SFTConfig, load_record_samples, run_sft

    cfg = _start(set_, dry_run)
    if cfg is None:
        return
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    tasks = demo_tasks(cfg)
    console.print(f"demo tasks ({len(tasks)}): {', '.join(t.task_id for t in tasks)}")
    write_jsonl(out / "train.jsonl", [task_row(t) for t in tasks])
    base = tiny_model_dir(seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(base))

    async def go() -> Path:
        provider = PodmanProvider()
        try:
            return await harvest(cfg, tasks, tokenizer, provider)
        finally:
            await provider.aclose()

    record_dir = asyncio.run(go())
    samples = load_record_samples(record_dir)
    console.print(f"SFT on {len(samples)} trajectories for {cfg.sft_steps} steps")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    losses = run_sft(
        model,
        samples,
        SFTConfig(steps=cfg.sft_steps, lr=cfg.sft_lr, batch_size=cfg.sft_batch_size, seed=cfg.seed),
        log=console.print,
    )
    model.save_pretrained(out / "sft")
    tokenizer.save_pretrained(out / "sft")
    (out / "sft_losses.json").write_text(json.dumps(losses))
    console.print(f"saved the SFT model to {out / 'sft'}")


@app.command("eval")
def eval_cmd(
    model_dir: Path = typer.Argument(None, help="Model directory (default: the SFT model)."),
    set_: list[str] = typer.Option(None, "--set"),
) -> None:
    """pass@1 and pass@k on the demo tasks for a model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.sandbox.podman import PodmanProvider

    cfg = _start(set_, dry_run=False)
    assert cfg is not None
    model_dir = model_dir or cfg.out_dir / "sft"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    async def go() -> dict[str, Any]:
        provider = PodmanProvider()
        try:
            return await evaluate(cfg, demo_tasks(cfg), model, tokenizer, provider, label=model_dir.name)
        finally:
            await provider.aclose()

    summary = asyncio.run(go())
    console.print_json(json.dumps(summary))


def _flatten(groups: list[Any]) -> list[Any]:
    """Trainable samples of whole groups; an episode split into segments contributes each segment."""
    out = []
    for g in groups:
        for s in g.trainable_samples:
            out += [*s.metadata.pop("prior_segments", []), s]
    return out


def plot(metrics_path: Path, evals: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward_mean"] for r in rows], label="train reward (per step)", alpha=0.4)
    window = 4  # two prompts a step: the per-step mean depends on which tasks were drawn
    smooth = [
        sum(r["pass_rate"] for r in rows[max(0, i - window + 1) : i + 1])
        / len(rows[max(0, i - window + 1) : i + 1])
        for i in range(len(rows))
    ]
    ax.plot(steps, smooth, label=f"train pass rate ({window}-step mean)", linewidth=2)
    for e, marker in zip(evals, ("o", "s", "^"), strict=False):
        ax.scatter(
            [e["step"]], [e["pass@1"]], marker=marker, s=60, label=f"eval pass@1 ({e['label']})", zorder=3
        )
    ax.set_xlabel("trainer step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("local_tbench2: tiny GLM-family model, GRPO + TIS, podman sandboxes")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def make_trainer(cfg: RecipeConfig, policy: Any) -> Any:
    """The GRPO + TIS trainer of `train` and `probe`."""
    from agentrl.algo import LossConfig
    from agentrl.train.config import TrainConfig
    from agentrl.train.torch_backend import TorchTrainer

    return TorchTrainer(
        policy,
        TrainConfig(
            lr=cfg.lr,
            weight_decay=0.0,
            max_tokens_per_micro_batch=8192,
            seed=cfg.seed,
            logprob_chunk_size=None,
            temperature=cfg.temperature,
            loss=LossConfig(
                eps_clip=cfg.eps_clip,
                eps_clip_high=cfg.eps_clip_high,
                tis_clip_low=cfg.tis_clip_low,
                tis_clip=cfg.tis_clip,
                aggregation=cfg.aggregation,
            ),
        ),
        device="cpu",
    )


@app.command()
def train(
    set_: list[str] = typer.Option(None, "--set", help="Override a setting, e.g. --set steps=40."),
    dry_run: bool = typer.Option(False, help="Print the resolved configuration and exit."),
) -> None:
    """Fully async GRPO from the SFT model: rollouts in podman sandboxes, a weight sync every step."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.engine.local import LocalEngine
    from agentrl.rollout.manager import RolloutConfig, RolloutManager
    from agentrl.rollout.metrics import MetricsTracker
    from agentrl.sandbox.podman import PodmanProvider
    from agentrl.train.weight_sync import InProcessSync

    cfg = _start(set_, dry_run)
    if cfg is None:
        return
    out = cfg.out_dir
    sft_dir = out / "sft"
    if not sft_dir.is_dir():
        raise typer.BadParameter(f"{sft_dir} is missing: run `python recipes/local_tbench2.py prepare` first")
    tasks = demo_tasks(cfg)
    rows = [task_row(t) for t in tasks]
    tokenizer = AutoTokenizer.from_pretrained(str(sft_dir))
    policy = AutoModelForCausalLM.from_pretrained(str(sft_dir), dtype=torch.float32)
    engine_model = copy.deepcopy(policy).eval()
    trainer = make_trainer(cfg, policy)
    (out / "records").mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    evals: list[dict[str, Any]] = []

    async def go() -> None:
        provider = PodmanProvider()
        engine = LocalEngine(engine_model, tokenizer)
        sync = InProcessSync([engine])
        try:
            before = await evaluate(
                cfg, tasks, copy.deepcopy(policy).eval(), tokenizer, provider, label="after-SFT"
            )
            evals.append({**before, "step": 0})
            runner = EpisodeRunner(
                provider=provider,
                engine=engine,
                renderer=ChatRenderer(tokenizer),
                config=episode_config(cfg),
                run_id=f"train-{uuid.uuid4().hex[:6]}",
                record_dir=out / "records",
            )
            rcfg = RolloutConfig(
                batch_size=cfg.prompts_per_step * cfg.samples_per_prompt,
                n_samples_per_prompt=cfg.samples_per_prompt,
                max_in_flight=cfg.max_in_flight,
                max_staleness=cfg.max_staleness,
                episode_timeout_s=300.0,
            )
            async with RolloutManager(runner, engine, rows, rcfg, seed=cfg.seed) as mgr:
                tracker = MetricsTracker(mgr, metrics_path)
                for step in range(1, cfg.steps + 1):
                    groups = await mgr.get_batch(timeout=900)
                    samples = _flatten(groups)
                    stats = await asyncio.to_thread(trainer.train_step, samples)
                    # Abort mode: in-flight turns keep their tokens and continue on the new
                    # weights (partial rollouts); each piece records its weight version.
                    await mgr.update_weights(lambda: sync.push(trainer.model, trainer.step), mode="abort")
                    m = tracker.step(step, groups)
                    tracker.print(m, console)
                    console.print(
                        f"  trainer: loss {stats.get('loss', 0):+.4f}  grad_norm {stats.get('grad_norm', 0):.3f}"
                        f"  clip_frac {stats.get('clip_frac', 0):.3f}  step {stats['step_seconds']:.1f}s"
                    )
            trainer.save(out / "checkpoints", buffer_state=mgr.source.state_dict())
            after = await evaluate(
                cfg, tasks, copy.deepcopy(trainer.model).eval(), tokenizer, provider, label="after-RL"
            )
            evals.append({**after, "step": cfg.steps})
        finally:
            await engine.aclose()
            await provider.aclose()

    t0 = time.monotonic()
    asyncio.run(go())
    trainer.model.save_pretrained(out / "final")
    tokenizer.save_pretrained(out / "final")
    (out / "evals.json").write_text(json.dumps(evals, indent=1))
    plot(metrics_path, evals, out / "reward.png")
    delta = evals[-1]["pass@1"] - evals[0]["pass@1"]
    console.print(
        f"[b]pass@1 after SFT {evals[0]['pass@1']:.3f} -> after RL {evals[-1]['pass@1']:.3f} "
        f"({delta:+.3f}) in {time.monotonic() - t0:.0f}s[/b]; plot: {out / 'reward.png'}"
    )


@app.command()
def probe(
    set_: list[str] = typer.Option(None, "--set", help="Override a setting, e.g. --set lr=1e-4."),
    eval_every: int = typer.Option(4, help="Evaluate the proxy pass rate every N steps."),
    eval_samples: int = typer.Option(32, help="Samples per task in each proxy evaluation."),
) -> None:
    """Tune the learning setup in minutes: the same trainer, no sandboxes.

    GRPO on the first turn only, rewarded by a proxy: the parsed commands equal the reference
    solution's (read from the harvest records of `prepare`). On the demo tasks the proxy's pass rate
    tracks the real one (0.255 against 0.292 after SFT). Rollouts are sampled with `generate` at the
    recipe's temperature and are exactly on-policy, so what it shows is the optimisation itself.
    """
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.agent.actions import get_format
    from agentrl.sample import Sample
    from agentrl.train.forward import model_logprobs

    cfg = _start(set_, dry_run=False)
    assert cfg is not None
    out = cfg.out_dir
    if not (out / "sft").is_dir() or not (out / "harvest").is_dir():
        raise typer.BadParameter(f"{out}/sft or {out}/harvest is missing: run `prepare` first")
    tokenizer = AutoTokenizer.from_pretrained(str(out / "sft"))
    model = AutoModelForCausalLM.from_pretrained(str(out / "sft"), dtype=torch.float32)
    fmt = get_format(cfg.action_format)
    eos = tokenizer.eos_token_id

    def commands(text: str) -> list[str]:
        return [c.keystrokes.strip() for c in fmt.parse(text).commands]

    problems = []  # (task id, first-turn prompt tokens, reference commands)
    for path in sorted((out / "harvest").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        first = next(r for r in rows if r["type"] == "turn")
        sample = next(r for r in rows if r["type"] == "result")["samples"][0]
        reference = commands(
            tokenizer.decode(tokenizer.encode(first["model_text"]), skip_special_tokens=True)
        )
        problems.append((rows[0]["task_id"], sample["tokens"][: sample["prompt_length"]], reference))

    @torch.no_grad()
    def sample_turns(prompt: list[int], n: int, seed: int) -> list[list[int]]:
        model.eval()
        torch.manual_seed(seed)
        ids = torch.tensor([prompt] * n)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=cfg.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        turns = []
        for row in gen[:, len(prompt) :].tolist():
            turns.append(row[: row.index(eos) + 1] if eos in row else row)
        return turns

    def reward(turn: list[int], reference: list[str]) -> float:
        return float(commands(tokenizer.decode(turn, skip_special_tokens=True)) == reference)

    def proxy_eval(step: int) -> float:
        per_task = {
            tid: sum(reward(t, ref) for t in sample_turns(prompt, eval_samples, 12345)) / eval_samples
            for tid, prompt, ref in problems
        }
        mean = sum(per_task.values()) / len(per_task)
        console.print(
            f"[b]step {step:3d}  proxy pass@1 {mean:.3f}[/b]  "
            + "  ".join(f"{t}={v:.2f}" for t, v in per_task.items())
        )
        return mean

    trainer = make_trainer(cfg, model)
    rng = random.Random(cfg.seed)
    order: list[int] = []
    start = proxy_eval(0)
    last = start
    for step in range(1, cfg.steps + 1):
        batch, rewards = [], []
        for p in range(cfg.prompts_per_step):
            order = order or rng.sample(range(len(problems)), len(problems))
            tid, prompt, ref = problems[order.pop()]
            for j, turn in enumerate(sample_turns(prompt, cfg.samples_per_prompt, 1000 * step + p)):
                r = reward(turn, ref)
                rewards.append(r)
                with torch.no_grad():
                    ids = torch.tensor([prompt + turn])
                    logp, _ = model_logprobs(model, ids, chunk_size=None, temperature=cfg.temperature)
                    lp = logp[0, len(prompt) :]
                batch.append(
                    Sample(
                        prompt_id=f"{step}:{p}",
                        tokens=prompt + turn,
                        prompt_length=len(prompt),
                        loss_mask=[1] * len(turn),
                        rollout_logprobs=lp.tolist(),
                        reward=r,
                        group_index=p,
                        sample_index=j,
                        task_id=tid,
                    )
                )
        stats = trainer.train_step(batch)
        console.print(
            f"step {step:3d}  reward {sum(rewards) / len(rewards):.2f}  grad_norm {stats['grad_norm']:.3f}"
        )
        if step % eval_every == 0 or step == cfg.steps:
            last = proxy_eval(step)
    console.print(f"[b]proxy pass@1 {start:.3f} -> {last:.3f} ({last - start:+.3f})[/b]")


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so every sandbox is closed and atexit clean-up runs.
    signal.signal(signal.SIGTERM, _interrupt)
    app()
