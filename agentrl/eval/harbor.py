"""Any model on any tasks (`agentrl eval`), scored as Harbor scores them, written as a Harbor job.

    agentrl eval envs/tbench2/tasks --engine openai --url http://127.0.0.1:30000/v1
    agentrl eval TASKS --engine local --model MODEL_DIR --backend podman -k 4 --pass-at 1 --pass-at 4
    agentrl eval TASKS --engine sglang --url http://w1:30000 --url http://w2:30000 --tokenizer DIR

Harbor's semantics by default (docs/eval.md):
- each task's own `[agent].timeout_sec` (no cap unless `--max-agent-timeout`), its `[verifier]`
  timeout and its resource limits (the sandbox backend applies cpus / memory / storage);
- Terminus-2: the terminus-json format driving a tmux terminal (`AgentConfig.terminal="auto"`),
  no system message, completion confirmed by a second `task_complete`, 10 kB observations,
  replies cut at the token limit not run, and no turn cap of its own (Terminus-2's is 1,000,000);
  a parse error is answered and the episode goes on (Terminus-2 has no malformed-reply cap);
- the per-turn output limit and the context budget come from the model (its context length, asked
  of the server or read from the model directory), never the tiny demo's values; a setting that
  would score a real model wrongly is warned about before anything runs.

Every (task, attempt) runs with sampling seed `seed + attempt`; pass@k comes from the shared
evaluator (`agentrl.eval.passk.evaluate`): an episode that failed for infrastructure reasons after
its retries is reported as unscored, never as reward 0. The job directory is Harbor's layout
(`agentrl.eval.harbor_job`), its trajectories ATIF. torch is imported only by `--engine local|sglang`.
"""

from __future__ import annotations

import asyncio
import fnmatch
import importlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.markup import escape

import agentrl
from agentrl.agent.actions import get_format
from agentrl.agent.loop import AgentConfig
from agentrl.agent.prompts import harbor_template_path
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.build import EngineSpec, build_engine
from agentrl.episode.oracle import build_images
from agentrl.episode.run import EpisodeConfig, run_episode
from agentrl.errors import AgentRLError
from agentrl.eval.harbor_job import AGENT_NAME, HarborJob, TrajectoryInfo, first_messages, harbor_pass_at_k
from agentrl.eval.passk import evaluate
from agentrl.progress import progress_bar
from agentrl.sandbox import base
from agentrl.sandbox.lint import lint_tasks
from agentrl.sandbox.registry import make_provider
from agentrl.tasks.dataset import task_row
from agentrl.tasks.rows import read_jsonl
from agentrl.tasks.task import Task, discover_tasks

log = logging.getLogger("agentrl.eval")
console = Console()

ENGINES = ("openai", "local", "sglang")
TERMINUS_MAX_TURNS = 1_000_000  # Terminus-2's default `max_turns` (harbor/agents/terminus_2)
DEFAULT_MAX_NEW_TOKENS = 8192
FALLBACK_CONTEXT = 32768
# Chat engines see no token counts: the loop estimates 4 characters a token, which undercounts
# code and terminal output, so their default budget keeps this share of the context in reserve.
CHAT_CONTEXT_SHARE = 0.85


class EvalConfigError(AgentRLError):
    """The evaluation's settings are incomplete or contradict each other."""


@dataclass
class HarborEvalSettings:
    """Every setting of one `agentrl eval` run (printed by `--dry-run`)."""

    tasks: list[str]
    engine: str = "openai"
    model: str | None = None
    urls: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    backend: str = "podman"
    n_attempts: int = 1
    pass_at: list[int] = field(default_factory=list)
    n_concurrent: int = 4
    max_attempts: int = 3
    task_names: list[str] = field(default_factory=list)
    n_tasks: int | None = None
    jobs_dir: str = "jobs"
    job_name: str | None = None
    action_format: str = "terminus-json"
    terminal: str = "auto"
    system_prompt: str | None = None
    prompt_template: str | None = None
    max_turns: int = TERMINUS_MAX_TURNS
    max_new_tokens: int | None = None  # None: min(8192, context / 2)
    max_total_tokens: int | None = None  # None: the model's context (chat engines: 85% of it)
    max_consecutive_malformed: int | None = None  # None: no cap of its own (Terminus-2's)
    summarize: bool = True  # Terminus-2's context summaries (`agentrl.agent.summarize`)
    summarize_threshold: int = 8000
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    max_agent_timeout: float | None = None
    create_timeout: float | None = None


@dataclass
class TaskSet:
    """The tasks to run, each with the dataset (`source`) it came from."""

    tasks: list[Any]  # agentrl.tasks.Task
    sources: dict[str, str]  # task path -> source
    datasets: list[dict[str, Any]]  # Harbor DatasetConfig / TaskConfig entries for config.json
    single: list[dict[str, Any]]
    skipped: list[str]


def _glob_ok(name: str, globs: list[str]) -> bool:
    return not globs or any(fnmatch.fnmatch(name, g) for g in globs)


def load_task_set(settings: HarborEvalSettings) -> TaskSet:
    """Task directories, directories of tasks, or JSONL rows naming `metadata.task_path`; lint
    errors skip a task (reported), as Harbor skips invalid task directories."""

    found: list[tuple[Any, str]] = []
    datasets: list[dict[str, Any]] = []
    single: list[dict[str, Any]] = []
    for spec in settings.tasks:
        path = Path(spec)
        if path.is_file() and path.suffix == ".jsonl":
            rows = read_jsonl(path)
            for i, row in enumerate(rows):
                task_path = (row.get("metadata") or {}).get("task_path")
                if not task_path:
                    raise EvalConfigError(
                        f"{path}: row {i} has no metadata.task_path (make rows with `agentrl tasks make-data`)"
                    )
                found.append((Task(Path(task_path)), path.stem))
                single.append({"path": str(Path(task_path).resolve()), "source": path.stem})
        elif (path / "task.toml").exists():
            found.append((Task(path), "adhoc"))
            single.append({"path": str(path.resolve())})
        elif path.is_dir():
            tasks = discover_tasks(path)
            found += [(t, path.resolve().name) for t in tasks]
            entry: dict[str, Any] = {"path": str(path.resolve())}
            if settings.task_names:
                entry["task_names"] = list(settings.task_names)
            if settings.n_tasks is not None:
                entry["n_tasks"] = settings.n_tasks
            datasets.append(entry)
        else:
            raise EvalConfigError(
                f"{spec}: not a task directory, a directory of tasks, or a .jsonl file of rows"
            )
    chosen = [(t, s) for t, s in found if _glob_ok(t.task_id, settings.task_names)]
    if settings.n_tasks is not None:
        chosen = chosen[: settings.n_tasks]
    if not chosen:
        raise EvalConfigError(
            f"no task under {', '.join(settings.tasks)} matches {settings.task_names or 'anything'}"
        )
    skipped = []
    valid = []
    sources = dict((str(t.path.resolve()), s) for t, s in chosen)
    for result in lint_tasks([t for t, _ in chosen]):
        if result.errors:
            skipped.append(f"{result.task.task_id}: {'; '.join(map(str, result.errors))}")
        else:
            valid.append(result.task)
    return TaskSet(valid, sources, datasets, single, skipped)


# --- engines -----------------------------------------------------------------------------------


async def _get_json(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> Any:

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(url, headers=headers or {}) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)


def _api_base(url: str) -> str:
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


async def probe_models(url: str, key_env: str = "") -> tuple[str | None, int | None]:
    """(first served model id, its context length) from an OpenAI-compatible `GET /v1/models`
    (SGLang and vLLM report `max_model_len`); (None, None) when the server does not say. With
    `key_env`, the API key in that variable is sent."""

    key = os.environ.get(key_env) if key_env else None
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        reply = await _get_json(_api_base(url) + "/v1/models", headers=headers)
    except (OSError, TimeoutError, ValueError) as exc:
        log.info("GET %s/v1/models failed: %s", _api_base(url), exc)
        return None, None
    cards = (reply or {}).get("data") if isinstance(reply, dict) else None
    if not cards:
        return None, None
    card = cards[0]
    length = card.get("max_model_len")
    return card.get("id"), int(length) if isinstance(length, int) else None


@dataclass
class BuiltEngine:
    engine: Any
    tokenizer: Any  # None for chat engines (text in, text out)
    label: str  # the model's name in results
    context: int | None  # the model's context length, when known


async def build_eval_engine(settings: HarborEvalSettings) -> BuiltEngine:

    if settings.engine == "openai":
        if not settings.urls:
            raise EvalConfigError(
                "--engine openai needs --url (the server's base URL, e.g. http://127.0.0.1:30000/v1)"
            )
        served, context = await probe_models(settings.urls[0])
        model = settings.model or served
        if not model:
            raise EvalConfigError(f"{settings.urls[0]} lists no model at /v1/models: pass --model NAME")

        key_env = settings.api_key_env if os.environ.get(settings.api_key_env) else ""
        if not key_env:
            log.info("%s is not set: no API key is sent", settings.api_key_env)
        spec = EngineSpec("openai", urls=list(settings.urls), api_model=model, api_key_env=key_env)
        engine, _ = build_engine(spec)
        return BuiltEngine(engine, None, model, context)
    if settings.engine == "sglang":
        tokenizer_dir = settings.tokenizer or settings.model
        if not settings.urls or not tokenizer_dir:
            raise EvalConfigError(
                "--engine sglang needs --url (one per worker, or a router) and --tokenizer DIR"
            )
        # A keyed fleet (a cluster run's servers: `--api-key-env` naming a variable that holds
        # the run's engine key); none is sent when the variable is unset (build_engine decides).
        _, context = await probe_models(settings.urls[0], settings.api_key_env)
        spec = EngineSpec(
            "sglang",
            urls=list(settings.urls),
            tokenizer=Path(tokenizer_dir),
            api_key_env=settings.api_key_env,
        )
        engine, tok = await asyncio.to_thread(build_engine, spec)
        return BuiltEngine(engine, tok, Path(settings.model or tokenizer_dir).name, context)
    if settings.engine == "local":
        if not settings.model:
            raise EvalConfigError("--engine local needs --model MODEL_DIR (a transformers model directory)")
        if not Path(settings.model).is_dir():
            raise EvalConfigError(
                f"--model {settings.model} is not a directory (it must hold a transformers model)"
            )
        spec = EngineSpec("local", model=Path(settings.model))
        engine, tok = await asyncio.to_thread(build_engine, spec)
        return BuiltEngine(engine, tok, Path(settings.model).name, getattr(engine, "context_length", None))
    raise EvalConfigError(f"unknown engine {settings.engine!r}: choose one of {', '.join(ENGINES)}")


# --- Harbor semantics --------------------------------------------------------------------------


@dataclass
class Resolved:
    """Settings after the model's context is known."""

    max_new_tokens: int
    max_total_tokens: int
    max_consecutive_malformed: int
    mode: str  # "tmux" | "commands"


def resolve_limits(settings: HarborEvalSettings, built: BuiltEngine) -> Resolved:

    context = built.context or FALLBACK_CONTEXT
    max_total = settings.max_total_tokens
    if max_total is None:
        max_total = int(context * CHAT_CONTEXT_SHARE) if built.tokenizer is None else context
    max_new = settings.max_new_tokens or max(256, min(DEFAULT_MAX_NEW_TOKENS, context // 2))
    malformed = settings.max_consecutive_malformed or settings.max_turns + 1  # never before max_turns
    mode = AgentConfig(terminal=settings.terminal).mode_for(get_format(settings.action_format))
    return Resolved(max_new, max_total, malformed, mode)


def harbor_warnings(
    settings: HarborEvalSettings, resolved: Resolved, built: BuiltEngine, tasks: list[Any]
) -> list[str]:
    """Settings that would make the score differ from what Harbor's Terminus-2 would give the model."""
    out = []
    if settings.action_format != "terminus-json":
        out.append(
            f"--action-format {settings.action_format}: Harbor evaluates with Terminus-2's terminus-json"
        )
    if resolved.mode != "tmux":
        out.append(
            "the agent's commands run on the command path, not in a tmux terminal as Terminus-2's do: "
            "interactive programs and `duration` waits behave differently"
        )
    if settings.max_turns < 50:
        out.append(
            f"--max-turns {settings.max_turns}: Terminus-2 has no turn cap of its own; terminal-bench-2 "
            "tasks often take a real model 20-100 turns, so this scores it lower than Harbor would"
        )
    if resolved.max_new_tokens < 2048:
        out.append(
            f"--max-new-tokens {resolved.max_new_tokens}: a reply cut at the limit is not run (Terminus-2's "
            "rule); real models' analysis + plan + commands often need more"
        )
    if built.context is None and settings.max_total_tokens is None:
        out.append(
            f"the server did not report the model's context length: assuming {FALLBACK_CONTEXT} tokens "
            "(pass --max-total-tokens)"
        )
    if resolved.max_total_tokens < 16384 and (built.context or 0) >= 16384:
        out.append(
            f"--max-total-tokens {resolved.max_total_tokens} is far below the model's context "
            f"({built.context}): long episodes end early (token_budget)"
        )
    if not settings.summarize:
        out.append(
            "--no-summarize: Terminus-2 summarises a context that runs low; this run ends it (token_budget)"
        )
    elif resolved.max_total_tokens <= settings.summarize_threshold:
        out.append(
            f"a context of {resolved.max_total_tokens} tokens is within --summarize-threshold "
            f"{settings.summarize_threshold}: Terminus-2 (and this run) summarise before every turn"
        )
    if settings.max_consecutive_malformed is not None:
        out.append(
            f"--max-consecutive-malformed {settings.max_consecutive_malformed}: Terminus-2 keeps answering "
            "parse errors until the task's timeout"
        )
    if settings.max_agent_timeout is not None:
        capped = [
            t.task_id
            for t in tasks
            if (t.config.agent.timeout_sec or float("inf")) > settings.max_agent_timeout
        ]
        if capped:
            out.append(
                f"--max-agent-timeout {settings.max_agent_timeout:g} cuts the task's own agent timeout for "
                f"{len(capped)} task(s) ({', '.join(capped[:5])}{', ...' if len(capped) > 5 else ''})"
            )
    unlimited = [t.task_id for t in tasks if t.config.agent.timeout_sec is None]
    if unlimited and settings.max_agent_timeout is None:
        out.append(
            f"{len(unlimited)} task(s) set no agent timeout ({', '.join(unlimited[:5])}): as in Harbor their "
            "episodes end only when the model completes or the token budget runs out"
        )
    return out


# --- the run -----------------------------------------------------------------------------------


class TrialRunner:
    """The evaluator's runner (`agentrl.rollout.manager.EpisodeRunner`): one episode per call,
    each in its own Harbor trial directory, the episode record inside it."""

    def __init__(self, job: Any, *, provider: Any, engine: Any, renderer: Any, config: Any, run_id: str,
                 tasks: dict[str, Any], sources: dict[str, str], model_label: str, report: Any) -> None:  # fmt: skip
        self.job = job
        self.provider = provider
        self.engine = engine
        self.renderer = renderer
        self.config = config
        self.run_id = run_id
        self.tasks = tasks
        self.sources = sources
        self.model_label = model_label
        self.report = report
        self._last: dict[tuple[str, int], Any] = {}

    def _timeout(self, task: Any) -> float | None:
        limit = task.config.agent.timeout_sec
        cap = self.config.max_agent_timeout_s
        if cap is not None:
            limit = min(limit or cap, cap)
        return limit

    def _info(self, task: Any) -> Any:

        fmt = get_format(self.config.action_format)
        instruction = task.instruction
        steps = {step.step_name: step.instruction for step in task.steps}

        def first(record: dict[str, Any]) -> list[dict[str, str]]:
            header = record.get("header") or {}
            return first_messages(
                mode=header.get("terminal") or "commands",
                instruction=steps.get(record.get("step_name") or "", instruction),
                initial_state=(record.get("terminal") or {}).get("initial_state"),
                system_prompt=self.config.system_prompt,
                format_system_prompt=fmt.system_prompt,
                prompt_template=self.config.agent.prompt_template,
            )

        return TrajectoryInfo(
            model_name=self.model_label, agent_version=agentrl.__version__, first_messages=first
        )

    async def run(self, row: dict[str, Any], *, group_id: str, sample_index: int, attempt: int = 0,
                  eval: bool = False, seed: int | None = None) -> Any:  # fmt: skip

        task = self.tasks[row["metadata"]["task_path"]]
        key = (group_id, sample_index)
        trial = self.job.trial(
            task.name, task.path, self.sources[str(task.path.resolve())], previous=self._last.get(key),
            verifier_mode=None if task.steps else task.verifier_mode,  # Harbor: null for multi-step
        )  # fmt: skip
        self._last[key] = trial
        config = self.config
        if seed is not None:
            config = replace(config, sampling=replace(config.sampling, seed=seed))
        info = self._info(task)
        try:
            result = await run_episode(
                task,
                provider=self.provider,
                engine=self.engine,
                renderer=self.renderer,
                config=config,
                run_id=self.run_id,
                prompt_id=group_id,
                sample_index=sample_index,
                record_dir=trial.agent_dir,
                artifacts_dir=trial.dir / "artifacts",
            )
        except BaseException as exc:
            trial.finish(info=info, error=exc, timeout_s=self._timeout(task))
            self.report(trial, task, sample_index, None, exc)
            raise
        outcome = trial.finish(info=info, timeout_s=self._timeout(task))
        self.report(trial, task, sample_index, result, outcome)
        return result.episode


def _default_ks(n: int) -> list[int]:

    return sorted({1, n, *harbor_pass_at_k({"t": [1.0] * n})})


async def run_harbor_eval(
    settings: HarborEvalSettings, *, dry_run: bool = False, provider: Any = None
) -> dict[str, Any] | None:
    """Run the evaluation; returns agentrl's summary (`EvalSummary.to_dict()` plus the job
    directory and the warnings), or None for a dry run. `provider` overrides `--backend`."""

    if settings.n_attempts < 1:
        raise EvalConfigError(f"--n-attempts must be >= 1 (got {settings.n_attempts})")
    ks = sorted(set(settings.pass_at)) if settings.pass_at else _default_ks(settings.n_attempts)
    if any(not 1 <= k <= settings.n_attempts for k in ks):
        raise EvalConfigError(
            f"every --pass-at k must be in 1..--n-attempts={settings.n_attempts} (got {ks})"
        )
    if settings.prompt_template == "harbor":
        found = harbor_template_path()
        if found is None:
            raise EvalConfigError(
                "--prompt-template harbor: no harbor package is importable here; pass the file's path"
            )
        settings = replace(settings, prompt_template=str(found))
    task_set = load_task_set(settings)
    for line in task_set.skipped:
        console.print(f"[yellow]skipped[/yellow] {escape(line)}")
    if not task_set.tasks:
        raise EvalConfigError("no valid task to run: `agentrl tasks lint` says why")
    built = await build_eval_engine(settings)
    try:
        resolved = resolve_limits(settings, built)
        warnings = harbor_warnings(settings, resolved, built, task_set.tasks)
        agent = AgentConfig(
            max_turns=settings.max_turns,
            max_new_tokens=resolved.max_new_tokens,
            max_total_tokens=resolved.max_total_tokens,
            max_consecutive_malformed=resolved.max_consecutive_malformed,
            terminal=settings.terminal,
            prompt_template=settings.prompt_template,
            summarize=settings.summarize,
            summarize_threshold=settings.summarize_threshold,
        )
        config = EpisodeConfig(
            action_format=settings.action_format,
            agent=agent,
            sampling=SamplingParams(
                temperature=settings.temperature, top_p=settings.top_p, max_new_tokens=resolved.max_new_tokens
            ),
            system_prompt=settings.system_prompt,
            create_timeout_s=settings.create_timeout,
            max_agent_timeout_s=settings.max_agent_timeout,
        )
        job_name = settings.job_name or datetime.now().strftime("%Y-%m-%d__%H-%M-%S")
        agent_kwargs = {
            "engine": settings.engine,
            "urls": settings.urls,
            "action_format": settings.action_format,
            "terminal": resolved.mode,
            "max_turns": settings.max_turns,
            "max_new_tokens": resolved.max_new_tokens,
            "max_total_tokens": resolved.max_total_tokens,
            "enable_summarize": settings.summarize,
            "proactive_summarization_threshold": settings.summarize_threshold,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "seed": settings.seed,
        }
        agent_config: dict[str, Any] = {"name": AGENT_NAME, "model_name": built.label, "kwargs": agent_kwargs}
        if settings.max_agent_timeout is not None:
            agent_config["max_timeout_sec"] = settings.max_agent_timeout
        if settings.backend in ("podman", "docker", "daytona") and provider is None:
            environment_config: dict[str, Any] = {"type": settings.backend}
        else:
            environment_config = {
                "import_path": f"agentrl.sandbox.registry:make_provider({settings.backend!r})"
            }
        job_config: dict[str, Any] = {
            "job_name": job_name,
            "jobs_dir": settings.jobs_dir,
            "n_attempts": settings.n_attempts,
            "n_concurrent_trials": settings.n_concurrent,
            "retry": {"max_retries": settings.max_attempts - 1},
            "environment": environment_config,
            "agents": [agent_config],
            "datasets": task_set.datasets,
            "tasks": task_set.single,
        }
        if dry_run:
            console.print_json(
                json.dumps(
                    {
                        "settings": asdict(settings),
                        "resolved": asdict(resolved),
                        "model": built.label,
                        "context_length": built.context,
                        "pass_at": ks,
                        "tasks": [t.task_id for t in task_set.tasks],
                        "harbor_job_config": job_config,
                        "warnings": warnings,
                    },
                    default=str,
                )
            )
            return None
        for w in warnings:
            console.print(f"[yellow]warning:[/yellow] {escape(w)}")
        if provider is None:
            provider = make_provider(settings.backend)
        _check_terminal(provider, resolved.mode, settings.backend)
        renderer = None
        if built.tokenizer is not None:
            renderer = ChatRenderer.for_format(built.tokenizer, settings.action_format)
        n_total = len(task_set.tasks) * settings.n_attempts
        job = HarborJob(
            Path(settings.jobs_dir),
            job_name,
            config=job_config,
            agent_config=agent_config,
            environment_config=environment_config,
            agent_info={
                "name": AGENT_NAME,
                "version": __import__("agentrl").__version__,
                "model_info": {"name": built.label, "provider": settings.engine},
            },
            n_total_trials=n_total,
        )
        console.print(
            f"job {job.dir}: {len(task_set.tasks)} task(s) x {settings.n_attempts} attempt(s), model "
            f"{escape(built.label)} ({settings.engine}), {settings.backend} sandboxes, "
            f"{resolved.mode} terminal, up to {resolved.max_new_tokens} new tokens a turn, "
            f"{resolved.max_total_tokens} in all"
        )
        done = 0
        t_start = time.monotonic()

        def report(trial: Any, task: Any, i: int, result: Any, outcome: Any) -> None:
            nonlocal done
            done += 1
            if result is None:
                what = f"[red]error[/red] {escape(type(outcome).__name__)}: {escape(str(outcome).splitlines()[0][:160] if str(outcome) else '')}"
            else:
                ep = result.episode
                what = f"reward {ep.reward:g} ({ep.end_reason}, {ep.metadata.get('turns', 0)} turns)"
            console.print(f"[{done}/{n_total}] {escape(task.task_id)} #{i}: {what}  {escape(trial.name)}")
            job.log(f"{trial.name} {task.task_id} #{i}: {what}")

        tasks = {str(t.path.resolve()): t for t in task_set.tasks}
        runner = TrialRunner(
            job,
            provider=provider,
            engine=built.engine,
            renderer=renderer,
            config=config,
            run_id=f"eval-{uuid.uuid4().hex[:8]}",
            tasks=tasks,
            sources=task_set.sources,
            model_label=built.label,
            report=report,
        )
        rows = []
        for t in task_set.tasks:
            row = task_row(t)
            row["metadata"]["task_path"] = str(t.path.resolve())
            rows.append(row)
        summary = None
        try:
            with progress_bar("images", total=len(task_set.tasks)) as bar:
                await build_images(
                    provider,
                    task_set.tasks,
                    concurrency=settings.n_concurrent,
                    on_built=lambda task, error: bar.advance(
                        note=f"{task.task_id}: {'ok' if error is None else 'failed'}"
                    ),
                )
            with progress_bar("episodes", total=n_total) as bar:
                summary = await evaluate(
                    runner,
                    rows,
                    samples_per_row=settings.n_attempts,
                    ks=ks,
                    seed_base=settings.seed,
                    concurrency=settings.n_concurrent,
                    max_attempts=settings.max_attempts,
                    label=built.label,
                    max_unscored_fraction=1.0,  # reported below; the job directory is written either way
                    on_done=bar.advance,
                )
        finally:
            out = None
            if summary is not None:
                out = {
                    **summary.to_dict(),
                    "job_dir": str(job.dir),
                    "seconds": round(time.monotonic() - t_start, 1),
                    "warnings": warnings,
                    "settings": {**asdict(settings), **asdict(resolved)},
                }
            job.close(out)
            await provider.aclose()
        console.print(summary.table())
        assert out is not None
        return out
    finally:
        await built.engine.aclose()


def _check_terminal(provider: Any, mode: str, backend: str) -> None:
    """The terminal path needs sandboxes that can open a terminal: refuse before any episode runs
    rather than score every episode 0 for a missing method."""
    if mode != "tmux":
        return
    if not _sandbox_can_open_terminal(provider, backend):
        raise EvalConfigError(
            f"the {backend} sandboxes of this agentrl cannot open a terminal yet, which terminus-json "
            "needs for Harbor's semantics: pass --terminal commands (and expect different scores on "
            "interactive tasks)"
        )


def _sandbox_can_open_terminal(provider: Any, backend: str) -> bool:
    """Whether the backend's sandboxes implement `open_terminal` themselves (the base class's only
    says there is no terminal)."""

    classes = {
        "podman": ("agentrl.sandbox.podman", "PodmanSandbox"),
        "docker": ("agentrl.sandbox.podman", "PodmanSandbox"),
        "daytona": ("agentrl.sandbox.daytona", "DaytonaSandbox"),
        "fake": ("agentrl.testing.sandbox", "FakeSandbox"),
    }
    cls = getattr(provider, "sandbox_class", None)
    if cls is None:
        if backend not in classes:
            return True  # a provider of its own: its episodes will say
        module, name = classes[backend]
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return True
    own = getattr(cls, "open_terminal", None)
    return callable(own) and own is not getattr(base.Sandbox, "open_terminal", None)
