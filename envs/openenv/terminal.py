"""`RemoteTerminalRunner`: a terminal episode on a remote tbench2_env-schema server.

The same agent loop and the same `Episode` as the local terminal environment (`agentrl.episode.run`),
with the sandbox replaced by the remote session: reset -> agent phase (each command an `exec` step)
-> `evaluate`. Only the transport differs, so a task scores the same through either path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agentrl.agent.actions import get_format
from agentrl.agent.loop import run_agent
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import Engine, SamplingParams
from agentrl.episode.run import episode_from_run
from agentrl.episode.sample import Episode, Status
from agentrl.errors import InputError
from agentrl.openenv.client import (
    OpenEnvInfraError,
    OpenEnvRequestError,
    RemoteSandbox,
    RemoteSession,
    SessionGate,
    TerminalClient,
    episode_session,
)
from agentrl.openenv.schema import TerminalAction

EVALUATE_MARGIN_S = 300.0  # over the task's verifier limit: stopping processes, the tamper scan, copies


class RemoteTerminalRunner:
    """One task row -> one `Episode` (the `EpisodeRunner` protocol), or an `InfraError`."""

    def __init__(
        self,
        config: Any,
        engine: Engine,
        *,
        client_options: dict[str, Any],
        sampling: Callable[[int, int | None], SamplingParams],
        renderer: ChatRenderer | None,
        run_id: str,
        gate: SessionGate | None = None,
    ) -> None:
        """`config`: the openenv plugin's settings; `sampling(max_new_tokens, seed)` its sampling;
        `gate`: the sessions this run holds on the server (shared by the environment's runners)."""
        self.gate = gate or SessionGate(limit=config.max_sessions, wait_s=config.capacity_wait_s)
        self.config = config
        self.engine = engine
        self.client_options = client_options
        self.sampling = sampling
        self.renderer = renderer
        self.run_id = run_id

    async def run(
        self,
        row: dict[str, Any],
        *,
        group_id: str,
        sample_index: int,
        attempt: int = 0,
        eval: bool = False,
        seed: int | None = None,
    ) -> Episode:
        c = self.config
        task_id = str((row.get("metadata") or {}).get("task_id") or group_id)
        session_id = f"{self.run_id}:{group_id}:{sample_index}:{attempt}"
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        opened = episode_session(
            self.gate, lambda: TerminalClient(**self.client_options), url=c.url,
            connect_timeout_s=c.connect_timeout_s, reset_timeout_s=c.reset_timeout_s, task=task_id,
            task_id=task_id,
        )  # fmt: skip
        async with opened as (session, first, waited):
            timings["capacity_wait_s"] = waited
            obs = first.observation
            failure = obs.info.get("failure")
            if failure in ("request", "input"):
                raise InputError(f"{c.url} cannot run task {task_id!r}: {obs.error}")
            if failure is not None or not obs.success:
                raise OpenEnvInfraError(
                    f"{c.url}: reset of {task_id}: {obs.error}", cause=str(obs.info.get("cause") or "openenv")
                )
            timings["create_s"] = time.monotonic() - t0 - waited
            agent = replace(c.agent, terminal="commands", wall_clock_s=self._agent_limit(obs.info))
            sandbox = RemoteSandbox(
                session,
                default_timeout_s=agent.command_timeout_s,
                grace_s=c.step_grace_s,
                sandbox_id=session_id,
            )
            run = await run_agent(
                engine=self.engine,
                sandbox=sandbox,
                renderer=self.renderer,
                action_format=get_format(c.action_format),
                instruction=obs.instruction,
                config=agent,
                sampling=self.sampling(agent.max_new_tokens, seed),
                session_id=session_id,
                system_prompt=c.system_prompt,
            )
            timings.update(run.timings)
            if run.infra_error is not None:
                raise run.infra_error
            cause: str | None = None
            if run.policy_error is not None:
                reward, cause = 0.0, run.policy_error.cause  # the agent broke its sandbox
            else:
                t1 = time.monotonic()
                reward, cause = await self._evaluate(session, obs.info, task_id)
                timings["verifier_s"] = time.monotonic() - t1
        timings["total_s"] = time.monotonic() - t0
        episode = episode_from_run(
            run,
            reward=reward,
            prompt_id=group_id,
            sample_index=sample_index,
            task_id=task_id,
            timings=timings,
        )
        if cause is not None:
            episode.status, episode.failure_cause = Status.FAILED_POLICY, cause
            for seg in episode.segments:
                seg.status, seg.failure_cause = Status.FAILED_POLICY, cause
        episode.attempt = attempt
        return episode

    def _agent_limit(self, info: dict[str, Any]) -> float | None:
        """The task's agent time limit as the server reports it, capped like a local episode's."""
        limit = info.get("agent_timeout_sec")
        limit = float(limit) if isinstance(limit, int | float) and limit > 0 else None
        cap = self.config.max_agent_timeout_s
        if cap is not None:
            limit = min(limit or cap, cap)
        return limit if limit is not None else self.config.agent.wall_clock_s

    async def _evaluate(
        self, session: RemoteSession[TerminalClient], info: dict[str, Any], task_id: str
    ) -> tuple[float, str | None]:
        """(reward, policy-failure cause or None); infrastructure failures raise."""
        c = self.config
        timeout = c.evaluate_timeout_s
        if timeout is None:
            verifier = info.get("verifier_timeout_sec")
            timeout = (float(verifier) if isinstance(verifier, int | float) else 900.0) + EVALUATE_MARGIN_S
        try:
            result = await session.step(TerminalAction(action_type="evaluate"), timeout_s=timeout)
        except OpenEnvRequestError as exc:
            raise OpenEnvInfraError(f"{c.url} refused evaluate: {exc}", cause="openenv_protocol") from None
        obs = result.observation
        failure = obs.info.get("failure")
        cause = obs.info.get("cause")
        if failure == "policy":
            return 0.0, str(cause or "policy")
        if failure == "input":
            raise InputError(f"{c.url} cannot verify {task_id}: {obs.error}")
        if failure is not None:
            raise OpenEnvInfraError(
                f"{c.url}: evaluate of {task_id}: {obs.error}", cause=str(cause or "openenv")
            )
        if result.reward is None:
            raise OpenEnvInfraError(
                f"{c.url}: evaluate of {task_id} gave no reward", cause="openenv_protocol"
            )
        return float(result.reward), None
