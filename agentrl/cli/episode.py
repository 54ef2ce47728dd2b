"""`agentrl episode run|replay`: one episode against any engine and sandbox backend."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from agentrl.agent.actions import get_format
from agentrl.agent.loop import AgentConfig
from agentrl.agent.solution import scripted_solution_texts
from agentrl.agent.tokens import ChatRenderer
from agentrl.cli import safe_text as _safe
from agentrl.engine.base import SamplingParams
from agentrl.engine.build import EngineSpec, build_engine
from agentrl.episode.run import EpisodeConfig, replay_episode, run_episode
from agentrl.errors import AgentRLError, InfraError, TaskFormatError
from agentrl.sandbox.registry import make_provider
from agentrl.tasks.task import load_task

app = typer.Typer(no_args_is_help=True, help="Run, record and replay single episodes.")
console = Console()


@app.command("run")
def run_cmd(
    task_dir: Path = typer.Argument(..., help="A task directory."),
    engine: str = typer.Option("local", help="local | sglang | openai | scripted (the task's solution)."),
    backend: str = typer.Option("podman", help="Sandbox backend: podman | docker | daytona | fake."),
    model: Path | None = typer.Option(None, help="Model directory for --engine local (default: tiny)."),
    url: list[str] | None = typer.Option(None, help="Engine URL(s): SGLang workers/router, or the API base."),
    tokenizer: Path | None = typer.Option(None, help="Tokenizer directory for --engine sglang."),
    api_model: str | None = typer.Option(None, help="Model name for --engine openai."),
    api_key_env: str = typer.Option("OPENAI_API_KEY", help="Environment variable holding the API key."),
    action_format: str = typer.Option(
        "terminus-json", "--format", help="terminus-json | tool-call | fenced-bash"
    ),
    record: Path | None = typer.Option(None, help="Directory to write the episode record into."),
    max_turns: int = typer.Option(20),
    max_new_tokens: int = typer.Option(1024),
    max_total_tokens: int = typer.Option(32768),
    temperature: float = typer.Option(1.0),
    seed: int = typer.Option(0),
) -> None:
    """Run one episode and print its outcome."""

    try:
        task = load_task(task_dir)
        task.validate()
        _ = task.instruction  # refused here, before any sandbox starts, when over the size cap
    except TaskFormatError as exc:
        console.print(f"[red]task error:[/red] {_safe(str(exc))}")
        raise typer.Exit(2) from None

    spec = EngineSpec(
        kind=engine,
        model=model,
        urls=list(url or []),
        tokenizer=tokenizer,
        api_model=api_model,
        api_key_env=api_key_env,
        scripted_replies=(
            scripted_solution_texts(
                task, action_format, terminal=AgentConfig().mode_for(get_format(action_format)) == "tmux"
            )
            if engine == "scripted"
            else ()
        ),
    )
    try:
        eng, tok = build_engine(spec)
    except AgentRLError as exc:
        console.print(f"[red]{_safe(str(exc))}[/red]")
        raise typer.Exit(2) from None
    renderer = ChatRenderer.for_format(tok, action_format) if tok else None
    config = EpisodeConfig(
        action_format=action_format,
        agent=AgentConfig(
            max_turns=max_turns, max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens
        ),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed),
    )
    run_id = f"episode-{uuid.uuid4().hex[:8]}"

    async def go() -> Any:
        provider = make_provider(backend)
        try:
            return await run_episode(
                task,
                provider=provider,
                engine=eng,
                renderer=renderer,
                config=config,
                run_id=run_id,
                record_dir=record,
            )
        finally:
            await provider.aclose()
            await eng.aclose()

    try:
        result = asyncio.run(go())
    except InfraError as exc:
        console.print(f"[red]infrastructure failure ({_safe(exc.cause)}):[/red] {_safe(str(exc))}")
        raise typer.Exit(2) from None
    table = Table(title=f"episode {task.task_id}")
    for col in ("reward", "outcome", "end reason", "turns", "malformed", "generated tokens", "seconds"):
        table.add_column(col)
    run = result.run
    table.add_row(
        f"{result.verify.reward}",
        _safe(result.verify.outcome + (f" ({result.verify.cause})" if result.verify.cause else "")),
        run.end_reason.value,
        str(len(run.turns)),
        str(run.malformed_turns),
        str(run.n_generated),
        f"{run.timings.get('agent_s', 0):.1f}",
    )
    console.print(table)
    if result.record_path:
        console.print(f"record: {result.record_path}")


@app.command("replay")
def replay_cmd(
    record: Path = typer.Argument(..., help="An episode record (JSONL)."),
    backend: str = typer.Option("podman", help="Sandbox backend."),
    task_dir: Path | None = typer.Option(None, help="Override the task path stored in the record."),
) -> None:
    """Re-run a record's actions in a fresh sandbox; exit 1 if the reward or any output differs."""

    async def go() -> Any:
        provider = make_provider(backend)
        try:
            return await replay_episode(
                record, provider=provider, run_id=f"replay-{uuid.uuid4().hex[:8]}", task_path=task_dir
            )
        finally:
            await provider.aclose()

    report = asyncio.run(go())
    table = Table(title=f"replay of {record.name}")
    table.add_column("turn")
    table.add_column("outputs match")
    table.add_column("detail", overflow="fold")
    for t in report.turns:
        table.add_row(str(t.index), "yes" if t.matched else "[red]no[/red]", _safe(t.detail))
    console.print(table)
    console.print(f"reward recorded {report.recorded_reward}, replayed {report.replayed_reward}")
    if not (report.reward_matches and report.outputs_match):
        raise typer.Exit(1)
