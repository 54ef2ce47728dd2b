"""The multi-turn terminal agent: generate, parse, act in the sandbox, observe, repeat.

Commands run through the sandbox's persistent shell (exec mode), not a tmux pane: each command's
keystrokes are run as a shell command with a per-command timeout, and the observation shows a
terminal-like transcript (prompt, command, output, exit code when non-zero). Tmux control keys
(`C-c`, ...) have no running program to act on in this mode and are answered with a note.

Caps are checked before every generate: max turns, max new tokens per turn, the session token
budget (context + the turn's new tokens), and the wall clock. End reasons are enumerated in
`EndReason`.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict

from agentrl.agent.actions import ActionFormat, Command, ParsedAction, TerminusJSONFormat
from agentrl.agent.tokens import ChatRenderer, Segment, TokenTrajectory
from agentrl.engine.base import Engine, EngineAborted, EngineError, SamplingParams
from agentrl.errors import InfraError
from agentrl.sandbox.base import Sandbox, SandboxError, SandboxPolicyError, bound_output

OBSERVATION_LIMIT_BYTES = 10_000
_TMUX_KEYS = {"C-c", "C-d", "C-z", "C-l", "Enter", "Escape", "Tab", "Up", "Down", "Left", "Right", "C-m"}


class EndReason(enum.StrEnum):
    TASK_COMPLETE = "task_complete"
    MAX_TURNS = "max_turns"
    TOKEN_BUDGET = "token_budget"
    TIMEOUT = "timeout"
    NO_ACTION = "no_action"
    ENGINE_ERROR = "engine_error"
    SANDBOX_ERROR = "sandbox_error"
    SANDBOX_BROKEN = "sandbox_broken"  # the agent's command broke its sandbox: a policy failure


TRUNCATING = {EndReason.MAX_TURNS, EndReason.TOKEN_BUDGET, EndReason.TIMEOUT}


@dataclass
class AgentConfig:
    # Unknown keys in a run configuration are errors, not silently dropped settings.
    __pydantic_config__ = ConfigDict(extra="forbid")

    max_turns: int = 20
    max_new_tokens: int = 512
    max_total_tokens: int = 16384
    min_turn_tokens: int = 16
    command_timeout_s: float = 60.0
    wall_clock_s: float | None = None
    observation_limit_bytes: int = OBSERVATION_LIMIT_BYTES
    confirm_completion: bool = False
    max_consecutive_malformed: int = 3
    check_prefix: bool = True
    engine_timeout_s: float = 600.0


@dataclass
class CommandOutput:
    keystrokes: str
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float


@dataclass
class TurnRecord:
    index: int
    model_text: str
    action: dict[str, Any]
    outputs: list[CommandOutput]
    observation: str
    weight_versions: list[int]
    engine_s: float
    sandbox_s: float
    finish_reason: str


@dataclass
class AgentRun:
    segments: list[Segment]
    turns: list[TurnRecord]
    end_reason: EndReason
    malformed_turns: int = 0
    infra_error: InfraError | None = None
    policy_error: SandboxPolicyError | None = None  # reward 0, counted under its `cause`
    timings: dict[str, float] = field(default_factory=dict)
    version_mismatches: int = 0  # generations answered under an unexpected weight version

    @property
    def n_generated(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)


def limit_bytes(text: str, limit: int) -> str:
    """Terminus-2's observation limit: first and last half of `limit` bytes with a marker."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    half = limit // 2
    head = data[:half].decode("utf-8", errors="ignore")
    tail = data[-half:].decode("utf-8", errors="ignore")
    omitted = len(data) - 2 * half
    return f"{head}\n[... output limited to {limit} bytes; {omitted} interior bytes omitted ...]\n{tail}"


def format_outputs(outputs: list[CommandOutput], limit: int) -> str:
    parts: list[str] = []
    for out in outputs:
        cmd = out.keystrokes.rstrip("\n")
        body = out.stdout + out.stderr
        line = f"$ {cmd}\n{body}"
        if body and not body.endswith("\n"):
            line += "\n"
        if out.timed_out:
            line += f"[command timed out after {out.duration_s:.0f}s and was killed]\n"
        elif out.exit_code not in (0, None):
            line += f"[exit code {out.exit_code}]\n"
        parts.append(line)
    text = "".join(parts) if parts else "(no commands were run)\n"
    return limit_bytes("New Terminal Output:\n" + text, limit)


async def run_command(sandbox: Sandbox, command: Command, timeout_s: float) -> CommandOutput:
    keys = command.keystrokes
    if keys.strip() in _TMUX_KEYS:
        return CommandOutput(
            keys, "", f"[{keys.strip()} ignored: no interactive program is running]\n", 0, False, 0.0
        )
    cmd = keys.rstrip("\n")
    if not cmd.strip():
        if command.duration > 0:
            await asyncio.sleep(min(command.duration, 1.0))
        return CommandOutput(keys, "", "", 0, False, 0.0)
    res = await sandbox.exec(cmd, timeout=timeout_s)
    return CommandOutput(keys, res.stdout, res.stderr, res.exit_code, res.timed_out, res.duration_s)


def _action_dict(action: ParsedAction) -> dict[str, Any]:
    return {
        "commands": [{"keystrokes": c.keystrokes, "duration": c.duration} for c in action.commands],
        "task_complete": action.task_complete,
        "error": action.error,
        "warnings": action.warnings,
    }


class _TokenSession:
    """Token-in/token-out generation over a `TokenTrajectory` (SGLang, local engines)."""

    def __init__(
        self, engine: Engine, traj: TokenTrajectory, session_id: str, engine_timeout_s: float
    ) -> None:
        self.engine = engine
        self.traj = traj
        self.session_id = session_id
        self.engine_timeout_s = engine_timeout_s
        # Pieces generated under a weight version the engine did not expect (e.g. a router replayed
        # the request on a server that missed an update): recorded, so the run can count them.
        self.version_mismatches = 0

    def context_len(self) -> int:
        return self.traj.context_len()

    async def generate(self, sampling: SamplingParams, deadline: float | None) -> tuple[str, str, list[int]]:
        ids: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        finish = "abort"
        # Partial rollouts: an aborted generation (weight update) keeps its tokens and the turn
        # continues from them on the new weights; each piece records its weight version.
        while finish == "abort":
            left = sampling.max_new_tokens - len(ids)
            if left <= 0:
                finish = "length"
                break
            piece = SamplingParams(**{**sampling.__dict__, "max_new_tokens": left})
            wait = self.engine_timeout_s
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            try:
                gen = await asyncio.wait_for(
                    self.engine.generate(self.traj.context_ids() + ids, piece, session_id=self.session_id),
                    wait,
                )
            except EngineAborted:
                continue
            ids += gen.output_ids
            logps += gen.logprobs
            versions.append(gen.weight_version)
            self.version_mismatches += int(gen.version_mismatch)
            finish = gen.finish_reason
        return self.traj.add_generation(ids, logps, versions), finish, versions

    def add_observation(self, text: str, observation: str) -> None:
        self.traj.add_observation(text, observation)

    @property
    def segments(self) -> list[Segment]:
        return self.traj.segments


class _ChatSession:
    """Text-in/text-out generation for API models (`OpenAIChatEngine.chat`): evaluation only, no
    tokens or log-probs, so it produces no training segments."""

    def __init__(
        self, engine: Any, messages: list[dict[str, str]], observation_role: str, engine_timeout_s: float
    ) -> None:
        self.engine = engine
        self.messages = list(messages)
        self.observation_role = "user" if observation_role == "tool" else observation_role
        self.engine_timeout_s = engine_timeout_s
        self.chars = sum(len(m["content"]) for m in messages)

    def context_len(self) -> int:
        return self.chars // 4  # a rough token estimate; the API enforces the real limit

    async def generate(self, sampling: SamplingParams, deadline: float | None) -> tuple[str, str, list[int]]:
        wait = self.engine_timeout_s
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
        text, finish = await asyncio.wait_for(self.engine.chat(self.messages, sampling), wait)
        self.chars += len(text)
        return text, finish, []

    def add_observation(self, text: str, observation: str) -> None:
        self.messages += [
            {"role": "assistant", "content": text},
            {"role": self.observation_role, "content": observation},
        ]
        self.chars += len(observation)

    @property
    def segments(self) -> list[Segment]:
        return []


async def run_agent(
    *,
    engine: Engine,
    sandbox: Sandbox,
    renderer: ChatRenderer | None,
    action_format: ActionFormat,
    instruction: str,
    config: AgentConfig,
    sampling: SamplingParams,
    session_id: str,
    system_prompt: str | None = None,
) -> AgentRun:
    """Run one agent phase. Never raises for policy problems; infra failures end the run with
    `infra_error` set (the caller classifies them), so the turns so far are never lost.

    With a `renderer`, generation is token-in/token-out; without one, the engine must offer
    `chat(messages, sampling) -> (text, finish_reason)` (API models, evaluation only).
    """
    messages = [
        {"role": "system", "content": system_prompt or action_format.system_prompt},
        {"role": "user", "content": instruction},
    ]
    session: _TokenSession | _ChatSession
    if renderer is not None:
        # Observations in the role the action format defines (tool-call outputs as `tool` messages).
        renderer = renderer.for_role(action_format.observation_role)
        traj = TokenTrajectory(renderer, messages, check_prefix=config.check_prefix)
        session = _TokenSession(engine, traj, session_id, config.engine_timeout_s)
    else:
        if not hasattr(engine, "chat"):
            raise TypeError(f"{type(engine).__name__} needs a tokenizer renderer (it has no chat method)")
        session = _ChatSession(engine, messages, action_format.observation_role, config.engine_timeout_s)
    turns: list[TurnRecord] = []
    malformed = consecutive_malformed = 0
    pending_complete = False
    engine_s = sandbox_s = 0.0
    start = time.monotonic()
    deadline = start + config.wall_clock_s if config.wall_clock_s else None
    end: EndReason | None = None
    infra: InfraError | None = None
    policy: SandboxPolicyError | None = None

    for index in range(config.max_turns):
        max_new = min(config.max_new_tokens, config.max_total_tokens - session.context_len())
        if max_new < config.min_turn_tokens:
            end = EndReason.TOKEN_BUDGET
            break
        if deadline is not None and deadline - time.monotonic() <= 0:
            end = EndReason.TIMEOUT
            break
        t0 = time.monotonic()
        try:
            text, finish, versions = await session.generate(
                SamplingParams(**{**sampling.__dict__, "max_new_tokens": max_new}), deadline
            )
        except TimeoutError:
            engine_s += time.monotonic() - t0
            end = EndReason.TIMEOUT
            break
        except EngineError as exc:
            engine_s += time.monotonic() - t0
            end, infra = EndReason.ENGINE_ERROR, exc
            break
        t1 = time.monotonic()
        engine_s += t1 - t0

        action = action_format.parse(text)
        outputs: list[CommandOutput] = []
        if action.malformed:
            malformed += 1
            consecutive_malformed += 1
            observation = action_format.error_observation(action)
            if finish == "length":
                observation = "Your reply was cut off at the token limit.\n" + observation
        else:
            consecutive_malformed = 0
            try:
                for command in action.commands:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        end = EndReason.TIMEOUT
                        break
                    timeout = (
                        config.command_timeout_s if left is None else min(config.command_timeout_s, left)
                    )
                    outputs.append(await run_command(sandbox, command, timeout))
            except (SandboxError, SandboxPolicyError) as exc:
                # Infrastructure (the container gone, the host's client dead) vs. what the command
                # itself could have done to its shell (docs/failures.md): the sandbox decides.
                sandbox_s += time.monotonic() - t1
                if isinstance(exc, SandboxPolicyError):
                    end, policy = EndReason.SANDBOX_BROKEN, exc
                else:
                    end, infra = EndReason.SANDBOX_ERROR, exc
                turns.append(
                    TurnRecord(
                        index,
                        text,
                        _action_dict(action),
                        outputs,
                        "",
                        versions,
                        t1 - t0,
                        time.monotonic() - t1,
                        finish,
                    )
                )
                break
            observation = format_outputs(outputs, config.observation_limit_bytes)
            if action.warnings:
                observation = (
                    "Previous response had warnings:\nWARNINGS: "
                    + "\n".join(f"- {w}" for w in action.warnings)
                    + "\n\n"
                    + observation
                )
        turn_sandbox_s = time.monotonic() - t1
        sandbox_s += turn_sandbox_s
        done = False
        if not action.malformed and action.task_complete:
            if pending_complete or not config.confirm_completion:
                done = True
            else:
                pending_complete = True
                observation += (
                    "\nAre you sure you want to mark the task as complete? Grading follows and no "
                    'further corrections are possible. If so, repeat "task_complete": true.'
                )
        elif not action.malformed:
            pending_complete = False
        turns.append(
            TurnRecord(
                index,
                text,
                _action_dict(action),
                outputs,
                observation,
                versions,
                t1 - t0,
                turn_sandbox_s,
                finish,
            )
        )
        if end is not None:
            break
        if done:
            end = EndReason.TASK_COMPLETE
            break
        if consecutive_malformed >= config.max_consecutive_malformed:
            end = EndReason.NO_ACTION
            break
        session.add_observation(text, observation)
        if session.context_len() >= config.max_total_tokens:
            end = EndReason.TOKEN_BUDGET
            break
    if end is None:
        end = EndReason.MAX_TURNS
    return AgentRun(
        segments=session.segments,
        turns=turns,
        end_reason=end,
        malformed_turns=malformed,
        infra_error=infra,
        policy_error=policy,
        timings={"engine_s": engine_s, "sandbox_s": sandbox_s, "agent_s": time.monotonic() - start},
        version_mismatches=getattr(session, "version_mismatches", 0),
    )


__all__ = [
    "AgentConfig",
    "AgentRun",
    "EndReason",
    "TerminusJSONFormat",
    "TurnRecord",
    "bound_output",
    "run_agent",
]
