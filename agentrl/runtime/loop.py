"""The asynchronous training loop as library code: every recipe and `agentrl train` call `train`.

    rollout manager (episodes from the environment's runner, staleness-bounded admission)
      -> buffer -> advantages once per episode -> trainer.train_step
      -> weight sync (trainer.export_weights x transport, inside the manager's pause/resume)
      -> eval (shared evaluator, fixed seeds; on servers set aside while training goes on, or with
         admission closed) -> checkpoint (trainer + rollout position) -> metrics

The loop knows no environment, engine or trainer backend: it gets them built (`RunParts`,
`agentrl.runtime.build.build_parts` builds them from a `RunConfig`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from agentrl.dashboard.sinks import open_sinks
from agentrl.engine.base import Engine, EngineVersionMismatch
from agentrl.eval.passk import EvalSummary, evaluate, standard_error
from agentrl.overrides import ConfigError
from agentrl.progress import progress_bar
from agentrl.rollout.environment import EnvContext, Environment, get_plugin
from agentrl.rollout.manager import RolloutManager
from agentrl.rollout.metrics import MetricsTracker, StepMetrics
from agentrl.runtime.config import RunConfig
from agentrl.train.base import Trainer, WeightBucket
from agentrl.train.batch import training_samples

log = logging.getLogger("agentrl.runtime")


class WeightTransport(Protocol):
    """Moves weight buckets into every engine and sets their version (`agentrl.train.weight_sync`)."""

    async def push(self, buckets: Iterator[WeightBucket], *, version: int) -> None: ...


@dataclass
class RunParts:
    """The built components of a run."""

    env: Environment
    engine: Engine
    trainer: Trainer
    transport: WeightTransport
    tokenizer: Any = None
    export_dtype: torch.dtype | None = None
    closers: list[Callable[[], Any]] = field(default_factory=list)  # sync or async, run at the end


@dataclass
class RunResult:
    steps: int
    evals: list[dict[str, Any]]
    metrics: list[StepMetrics]
    out_dir: Path
    seconds: float

    def summary(self) -> str:
        """A few lines for the end of a run: pass@1 before and after with standard errors, per task,
        and where the plot, the evals and the episodes are."""
        minutes, secs = divmod(round(self.seconds), 60)
        lines = [f"trained {self.steps} steps in {minutes}m{secs:02d}s"]
        if len(self.evals) >= 2:
            a, b = self.evals[0], self.evals[-1]
            pa, pb, na, nb = a["pass@1"], b["pass@1"], a["episodes"], b["episodes"]
            sa, sb = standard_error(pa, na), standard_error(pb, nb)
            lines.append(
                f"pass@1 {a['label']} {pa:.3f} +- {sa:.3f} -> {b['label']} {pb:.3f} +- {sb:.3f}: "
                f"{pb - pa:+.3f} +- {(sa**2 + sb**2) ** 0.5:.3f} ({na} and {nb} fixed-seed episodes)"
            )
            tasks = [t for t in b.get("per_task", {}) if t in a.get("per_task", {})]
            if 1 < len(tasks) <= 12:
                lines.append(
                    "per task: "
                    + ", ".join(f"{t} {_rate(a['per_task'][t])} -> {_rate(b['per_task'][t])}" for t in tasks)
                )
        files = [self.out_dir / n for n in ("reward.png", "evals.json", "metrics.jsonl", "records")]
        if present := [str(f) for f in files if f.exists()]:
            lines.append("see " + ", ".join(present))
        return "\n".join(lines)


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _report(reporter: Callable[[str], None] | None, text: str) -> None:
    if reporter is not None:
        reporter(text)
    log.info(text)


async def run_eval(
    cfg: RunConfig,
    parts: RunParts,
    *,
    label: str,
    step: int,
    reporter: Callable[[str], None] | None = None,
    engine: Engine | None = None,
) -> dict[str, Any]:
    """pass@k of the engine's current weights (or `engine`'s) on the environment's eval rows."""
    engine = engine or parts.engine
    runner = parts.env.runner(engine, run_id=f"eval-{label}", record_dir=None)
    rows = parts.env.rows("eval")
    with progress_bar(f"eval {label}", total=len(rows) * cfg.eval.samples_per_row) as bar:
        summary: EvalSummary = await evaluate(
            runner,
            rows,
            samples_per_row=cfg.eval.samples_per_row,
            ks=cfg.eval.ks,
            seed_base=cfg.seed * 1000,
            concurrency=cfg.eval.concurrency,
            max_attempts=cfg.eval.max_attempts,
            pass_threshold=cfg.rollout.pass_threshold,
            max_unscored_fraction=cfg.eval.max_unscored_fraction,
            label=label,
            on_done=bar.advance,
        )
    result = {**summary.to_dict(), "step": step, "weight_version": engine.weight_version}
    _report(
        reporter,
        f"eval {label} (step {step}): " + ", ".join(f"pass@{k} {summary.pass_at(k):.3f}" for k in summary.ks),
    )
    return result


def eval_mode(cfg: RunConfig, engine: Engine) -> Literal["aside", "pause"]:
    """How the evals between steps run (`eval.mode`); raises `ConfigError` when "aside" is asked
    of an engine that cannot set servers aside."""
    if cfg.eval.mode == "pause":
        return "pause"
    if engine.can_set_aside(cfg.eval.aside_servers):
        return "aside"
    if cfg.eval.mode == "aside":
        raise ConfigError(
            f"eval.mode=aside takes {cfg.eval.aside_servers} server(s) out of the engine fleet for each eval "
            f"and needs at least one more to train on; {type(engine).__name__} cannot (an SGLang fleet "
            "with a fixed worker list can: engine.kind=sglang with engine.urls). Set eval.mode=pause or "
            "eval.aside_servers lower."
        )
    return "pause"


class AsideEvals:
    """Evals on servers set aside while training goes on (`eval.mode` "aside"), one at a time.

    `start` takes `eval.aside_servers` servers out of the fleet at the current weight version
    (`Engine.set_aside`) and runs the eval on them in the background; training, its weight
    pushes and its rollouts go on with the other servers. When the eval ends its servers are
    checked to still serve that version (else the eval is void: `EngineVersionMismatch`) and given
    back (`Engine.rejoin`); the next weight push puts them on the fleet's version before they are
    routed to again. A result (or the eval's error) is taken up by `collect` after the step that
    sees it done, or by `wait`; an eval that is due while the last one still runs waits for it."""

    def __init__(
        self,
        cfg: RunConfig,
        parts: RunParts,
        evals: list[dict[str, Any]],
        evals_path: Path,
        reporter: Callable[[str], None] | None,
    ) -> None:
        self.cfg, self.parts, self.evals, self.evals_path, self.reporter = (
            cfg,
            parts,
            evals,
            evals_path,
            reporter,
        )
        self.task: asyncio.Task[dict[str, Any]] | None = None

    async def start(self, label: str, step: int) -> None:
        await self.wait()
        engine = await self.parts.engine.set_aside(self.cfg.eval.aside_servers)
        self.task = asyncio.create_task(self._run(engine, label, step), name=f"eval-{label}")

    async def _run(self, engine: Engine, label: str, step: int) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            result = await run_eval(
                self.cfg, self.parts, label=label, step=step, reporter=self.reporter, engine=engine
            )
            versions = await engine.weight_versions()
            if any(v != engine.weight_version for v in versions.values()):
                raise EngineVersionMismatch(
                    f"eval {label}: the servers set aside at weight version {engine.weight_version} report "
                    f"{versions}; weights changed under the eval, so it is void"
                )
            return {**result, "mode": "aside", "seconds": round(time.monotonic() - t0, 3)}
        finally:
            await self.parts.engine.rejoin(engine)

    def _record(self, result: dict[str, Any]) -> None:
        self.evals.append(result)
        self.evals_path.write_text(json.dumps(self.evals, indent=1))

    def collect(self) -> None:
        """Take up a finished eval (re-raising its error); never waits."""
        if self.task is not None and self.task.done():
            task, self.task = self.task, None
            self._record(task.result())

    async def wait(self) -> None:
        if self.task is not None:
            if not self.task.done():
                _report(
                    self.reporter,
                    f"waiting for {self.task.get_name()} (still running on the servers set aside)",
                )
            task, self.task = self.task, None
            self._record(await task)

    async def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
            self.task = None


async def sync_weights(
    cfg: RunConfig, parts: RunParts, manager: RolloutManager | None = None, *, version: int | None = None
) -> int:
    """Push the trainer's weights as the next version, or as `version` (through the manager's
    pause wrapper when rollouts are running); returns the version pushed."""
    version = parts.engine.weight_version + 1 if version is None else version
    bucket_bytes = cfg.sync.bucket_mb * 2**20

    async def push() -> None:
        if getattr(parts.transport, "exports", "weights") == "adapter":  # LoRA adapters alone
            buckets = parts.trainer.export_adapter(parts.export_dtype)
        else:
            buckets = parts.trainer.export_weights(parts.export_dtype, bucket_bytes=bucket_bytes)
        await parts.transport.push(buckets, version=version)

    if manager is None:
        await push()
    else:
        await manager.update_weights(push, mode=cfg.sync.pause_mode)
    return version


async def train(
    cfg: RunConfig, parts: RunParts, *, reporter: Callable[[str], None] | None = None
) -> RunResult:
    """Run `cfg.steps` rollout steps (resuming from the last checkpoint when asked). Everything
    agentrl logs at INFO and above during the run also goes to `<out>/run.log`."""
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    with _run_log(out / "run.log"):
        return await _train(cfg, parts, reporter=reporter)


@contextlib.contextmanager
def _run_log(path: Path) -> Iterator[None]:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("agentrl")
    previous = root.level
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)  # the file gets INFO; the console handler keeps its own level
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)
        handler.close()


async def _train(cfg: RunConfig, parts: RunParts, *, reporter: Callable[[str], None] | None) -> RunResult:
    t0 = time.monotonic()
    out = cfg.out_dir
    (out / "config.json").write_text(json.dumps(cfg.dump(), indent=1))
    ckpt_root = out / "checkpoints"
    metrics_path = out / "metrics.jsonl"
    evals_path = out / "evals.json"
    start_step = 0
    rollout_state: dict[str, Any] | None = None
    evals: list[dict[str, Any]] = []
    refresh = getattr(parts.engine, "refresh_weight_version", None)
    if refresh is not None:  # a fleet of servers: start from the version they really serve
        # A resumed run pushes its checkpoint's weights next, which levels servers that restarted.
        await refresh(allow_laggards=cfg.checkpoint.resume and (ckpt_root / "latest").exists())
        # A run that stopped inside a weight sync (a crash between pause and resume) leaves its
        # servers paused, and every turn of this run would wait there: start them again
        # (`/continue_generation` answers the same on a server that is not paused).
        await parts.engine.resume()
    if cfg.checkpoint.resume and (ckpt_root / "latest").exists():
        state = parts.trainer.load(ckpt_root)
        start_step = int(state.buffer_state.get("step", state.step))
        rollout_state = state.buffer_state.get("rollout")
        if evals_path.exists():
            evals = [e for e in json.loads(evals_path.read_text()) if e.get("step", 0) <= start_step]
        keep_metrics_through(metrics_path, start_step)
        _report(reporter, f"resumed from {ckpt_root} at step {start_step}")
        # The checkpoint holds the weights of step N, which were version N (one per step): the
        # engines serve them under that version again, so versions keep counting steps.
        await sync_weights(cfg, parts, version=max(start_step, parts.engine.weight_version + 1))
    else:
        metrics_path.unlink(missing_ok=True)
    if start_step >= cfg.steps:
        return RunResult(start_step, evals, [], out, time.monotonic() - t0)
    mode = eval_mode(cfg, parts.engine) if cfg.eval.every else "pause"
    if cfg.eval.before or cfg.eval.after or cfg.eval.every:
        parts.env.rows("eval")  # a missing or empty eval set fails now, not at the first eval
    sinks = open_sinks(cfg.sinks, out, cfg.dump())
    parts.closers.append(sinks.close)  # close_parts closes them, also when the run fails

    if cfg.eval.before and start_step == 0:
        evals.append(await run_eval(cfg, parts, label="before", step=0, reporter=reporter))

    record_dir = out / "records"
    runner = parts.env.runner(parts.engine, run_id=f"train-{uuid.uuid4().hex[:6]}", record_dir=record_dir)
    manager = RolloutManager(runner, parts.engine, parts.env.rows("train"), cfg.rollout, seed=cfg.seed)
    if rollout_state is not None:
        manager.load_state_dict(rollout_state)
    step = start_step
    aside = AsideEvals(cfg, parts, evals, evals_path, reporter)
    async with manager, contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(aside.cancel)  # a run that fails leaves no eval running
        tracker = MetricsTracker(manager, metrics_path)
        with progress_bar("train", total=cfg.steps) as bar:
            bar.advance(start_step)
            train_t0 = time.monotonic()
            for step in range(start_step + 1, cfg.steps + 1):
                groups = await manager.get_batch(timeout=cfg.batch_timeout_s)
                consumed_at = parts.engine.weight_version
                samples = training_samples(
                    [g.episodes for g in groups], normalize_std=cfg.trainer.normalize_adv_std
                )
                stats = await asyncio.to_thread(parts.trainer.train_step, samples) if samples else {}
                version = await sync_weights(cfg, parts, manager)
                m = tracker.step(
                    step,
                    groups,
                    consumed_at_version=consumed_at,
                    extra={"trainer": stats, "version": version},
                )
                aside.collect()
                sinks.log(evals, step=step, metrics=m)
                prune_records(record_dir, cfg.records_keep)
                bar.advance(note=f"reward {m.reward_mean:.3f}, pass {m.pass_rate:.2f}")
                _report(
                    reporter,
                    f"step {step}/{cfg.steps}: reward {m.reward_mean:.3f}  pass {m.pass_rate:.2f}"
                    f" (all {m.rollout_pass_rate:.2f})"
                    f"  loss {stats.get('loss', 0.0):+.4f}  grad_norm {stats.get('grad_norm', 0.0):.3f}"
                    + (f"  dropped {m.groups_filtered}" if cfg.rollout.dynamic_filter else "")
                    + (f" (+{m.prompts_skipped} skipped)" if m.prompts_skipped else "")
                    + ("  non-finite: step skipped" if stats.get("skipped_steps") else "")
                    + f"  infra {sum(m.failures_by_cause.values())}"
                    + f"  {m.wall_s:.1f}s{_time_left(train_t0, step - start_step, cfg.steps - step)}",
                )
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.steps:
                    parts.trainer.save(
                        ckpt_root, buffer_state={"step": step, "rollout": manager.state_dict()}
                    )
                if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
                    if mode == "aside":
                        await aside.start(f"step-{step}", step)
                    else:
                        async with manager.paused():
                            evals.append(
                                await run_eval(cfg, parts, label=f"step-{step}", step=step, reporter=reporter)
                            )
                        evals_path.write_text(json.dumps(evals, indent=1))
            await aside.wait()
        parts.trainer.save(ckpt_root, buffer_state={"step": step, "rollout": manager.state_dict()})
        _save_policy(parts, out / "final")
        history = tracker.history
    if cfg.eval.after:
        evals.append(await run_eval(cfg, parts, label="after", step=step, reporter=reporter))
    evals_path.write_text(json.dumps(evals, indent=1))
    sinks.log(evals)
    _plot(cfg, evals)
    return RunResult(step, evals, history, out, time.monotonic() - t0)


def _save_policy(parts: RunParts, path: Path) -> None:
    """`<out>/final`: the trained policy as a plain Hugging Face model with its tokenizer, which any
    loader, `agentrl eval` and `agentrl engine serve` take (LoRA adapters merged in). Only a
    trainer that holds the whole model in this process has one (`engine_model`); Megatron's ranks
    export through their converter (docs/megatron.md)."""
    engine_model = getattr(parts.trainer, "engine_model", None)
    if engine_model is None or not hasattr(parts.tokenizer, "save_pretrained"):
        return
    engine_model().save_pretrained(path)
    parts.tokenizer.save_pretrained(path)


def _time_left(t0: float, done: int, left: int) -> str:
    """`, about 3m left` from the steps done so far (the evals after training not counted)."""
    if done <= 0 or left <= 0:
        return ""
    seconds = (time.monotonic() - t0) / done * left
    return f", about {seconds / 60:.0f}m left" if seconds >= 90 else f", about {seconds:.0f}s left"


def prune_records(record_dir: Path, keep: int) -> int:
    """Keep the newest `keep` episode records (0: all); return how many were removed. Records are
    for reading episodes, and a long run writes one per episode: without a bound they fill the disk."""
    if keep <= 0 or not record_dir.is_dir():
        return 0
    with os.scandir(record_dir) as entries:
        files = [(e.stat().st_mtime, e.path) for e in entries if e.is_file() and e.name.endswith(".jsonl")]
    if len(files) <= keep:
        return 0
    files.sort()
    for _, path in files[: len(files) - keep]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return len(files) - keep


def _plot(cfg: RunConfig, evals: list[dict[str, Any]]) -> None:
    """`<out>/reward.png` when matplotlib is installed (the `local` extra has it)."""
    try:
        from agentrl.runtime.plot import plot_run

        title = f"{cfg.env['name']}: GRPO + TIS ({cfg.out_dir.name})"
        plot_run(cfg.out_dir / "metrics.jsonl", evals, cfg.out_dir / "reward.png", title=title)
    except ImportError as exc:
        log.info("no reward plot: %s", exc)


async def close_parts(parts: RunParts) -> None:
    """Close the environment, the engine and whatever else the builder registered."""
    await parts.env.aclose()
    await parts.engine.aclose()
    for close in reversed(parts.closers):
        res = close()
        if asyncio.iscoroutine(res):
            await res


async def evaluate_engine(
    cfg: RunConfig,
    engine: Engine,
    tokenizer: Any,
    *,
    label: str,
    reporter: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """pass@k of any engine (local, SGLang, an OpenAI-compatible API) on the configured
    environment's eval rows; the environment and the engine are closed afterwards."""

    plugin = get_plugin(cfg.env["name"])
    context = EnvContext(
        tokenizer=tokenizer,
        seed=cfg.seed,
        out_dir=cfg.out_dir,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
    )
    env = plugin.build(plugin.Config.model_validate(cfg.env), context)
    try:
        parts = RunParts(env=env, engine=engine, trainer=None, transport=None)  # type: ignore[arg-type]
        return await run_eval(cfg, parts, label=label, step=0, reporter=reporter)
    finally:
        await env.aclose()
        await engine.aclose()


def keep_metrics_through(path: Path, step: int) -> None:
    """Drop the metrics rows after `step` (and a row cut short) before a resumed run appends: a
    crash between a step's metrics row and its checkpoint leaves a row the resumed run redoes."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and int(row.get("step", 0)) <= step:
            kept.append(line)
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)
