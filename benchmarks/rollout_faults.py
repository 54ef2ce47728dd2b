"""The rollout manager on the simulated, fault-injecting workload, step by step (formerly `agentrl
rollout sim`): `python benchmarks/rollout_faults.py sim --steps 5 --create-failure 0.2`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True, help="Rollout manager: simulated runs with fault injection.")
console = Console()


@app.callback()
def rollout() -> None:
    """Rollout manager: simulated runs with fault injection."""


@app.command("sim")
def sim_cmd(
    steps: int = typer.Option(5, help="Trainer steps to run."),
    batch_size: int = typer.Option(32, help="Samples per step (a multiple of --n-samples)."),
    n_samples: int = typer.Option(8, help="GRPO group size."),
    max_in_flight: int = typer.Option(64),
    max_staleness: int = typer.Option(1),
    mode: str = typer.Option("in_place", help="Weight-update pause mode: in_place or abort."),
    create_failure: float = typer.Option(0.10, help="Share of sandbox creates that fail."),
    transport_error: float = typer.Option(0.05, help="Share of episodes with a transport error."),
    burst_rate: float = typer.Option(0.002, help="Chance per generate call that a 503 burst starts."),
    verifier_timeout: float = typer.Option(0.02, help="Share of verifier runs that time out."),
    train_s: float = typer.Option(0.2, help="Simulated trainer step, seconds."),
    metrics: Path | None = typer.Option(None, help="Append one JSON line of StepMetrics per step here."),
    seed: int = typer.Option(0),
    verbose: bool = typer.Option(False, help="Log every infra failure and retry."),
) -> None:
    """Run the manager over SimulatedRunner and print each step's metrics table."""
    import asyncio
    import logging

    # Failures are the point of this run: the tables count them; one log line each is noise.
    logger = logging.getLogger("agentrl.rollout")
    level = logger.level
    logger.setLevel(logging.INFO if verbose else logging.CRITICAL)

    from agentrl.errors import AgentRLError
    from agentrl.rollout import MetricsTracker, RolloutConfig, RolloutManager, render
    from agentrl.testing.rollout_sim import (
        SimEngine,
        SimFaults,
        SimSandboxProvider,
        SimulatedRunner,
        SimWorkload,
    )

    faults = SimFaults(
        create_failure=create_failure,
        transport_error=transport_error,
        engine_burst_rate=burst_rate,
        engine_burst_s=0.05,
        verifier_timeout=verifier_timeout,
        policy_failure=0.05,
    )
    work = SimWorkload(
        engine_per_token_s=0.0005, sandbox_create_s=0.01, sandbox_exec_s=0.005, verifier_s=0.01
    )
    rows = [
        {"prompt": f"task {i}", "metadata": {"task_id": f"t{i}", "p_pass": (i % 5) / 4}} for i in range(64)
    ]

    async def main() -> None:
        engine = SimEngine(work, faults, seed=seed)
        provider = SimSandboxProvider(work, faults, seed=seed)
        runner = SimulatedRunner(engine, provider, work, faults, seed=seed)
        config = RolloutConfig(
            batch_size=batch_size,
            n_samples_per_prompt=n_samples,
            max_in_flight=max_in_flight,
            max_staleness=max_staleness,
            max_attempts=5,
            retry_backoff_s=0.01,
            episode_timeout_s=60,
        )
        mgr = RolloutManager(runner, engine, rows, config, seed=seed)
        tracker = MetricsTracker(mgr, metrics)
        async with mgr:
            for step in range(steps):
                groups = await mgr.get_batch(timeout=120)
                console.print(render(tracker.step(step, groups)))
                await asyncio.sleep(train_s)

                async def sync() -> None:
                    await engine.set_weights(engine.weight_version + 1)

                await mgr.update_weights(sync, mode=mode)  # type: ignore[arg-type]
        console.print(
            f"sandboxes created {provider.created}, closed {provider.closed}, live {provider.live_sandboxes()}; "
            f"infra failures {dict(mgr.counters.failures)}"
        )

    try:
        asyncio.run(main())
    except AgentRLError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    finally:
        logger.setLevel(level)


if __name__ == "__main__":
    app()
