"""The terminal environment as an OpenEnv `Environment`: one `TerminalEnvironment` per WebSocket session,
one sandbox per episode, the task's own verifier for the reward.

    reset(task_id=...)          start a sandbox for the task (agent phase: no tests inside);
                                the observation carries the instruction and the task's time limits
    step(exec, command)         `Sandbox.exec` with a timeout (the command path of the agent loop)
    step(write_file, ...)       a file into the sandbox
    step(evaluate)              `agentrl.episode.verify.verify`: processes stopped, tampering checked, tests
                                uploaded only now; the reward, done; the sandbox is closed
    step(close)                 close the sandbox
    state                       `TerminalState`

Classification is the episode runner's (`docs/failures.md`): an action the agent's commands could
have broken is a policy outcome (reward 0, `info.failure == "policy"`); a sandbox or verifier that
failed on its own is infrastructure (no reward, `info.failure == "infra"`, retried by consumers);
a malformed or untimely action is refused (`info.failure == "request"`) and changes nothing.

`TerminalHub` is what the sessions of one server share: the served tasks, the sandbox provider and a
hard cap on live sandboxes (started, running or closing), so no client order of events (a session
torn down while its sandbox starts, a reset storm) can hold more sandboxes than `max_sessions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import shlex
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    Tool,
    ToolError,
    ToolErrorType,
)
from openenv.core.env_server.types import EnvironmentMetadata
from pydantic import ValidationError

import agentrl
from agentrl.episode.oracle import ensure_footprint
from agentrl.episode.verify import verify_phase
from agentrl.errors import InfraError, InputError
from agentrl.openenv.config import ServeConfig
from agentrl.openenv.schema import (
    ACTION_TYPES,
    UPSTREAM_ONLY,
    TerminalAction,
    TerminalObservation,
    TerminalState,
)
from agentrl.sandbox.base import (
    Sandbox,
    SandboxCreateError,
    SandboxError,
    SandboxPolicyError,
    SandboxProvider,
    SandboxTransportError,
)
from agentrl.tasks.task import Task

log = logging.getLogger("agentrl.openenv")


class ServedAction(TerminalAction):
    """The action class the server is built with: a `TerminalAction`, or an MCP `list_tools` /
    `call_tool` action. The package recognises MCP payloads only for servers built on its base
    `Action` (`serialization._deserialize_mcp_action`), so this class routes them itself; its
    schema (`/schema`) is `TerminalAction`'s, the tbench2_env schema upstream clients expect."""

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "list_tools":
            return ListToolsAction.model_validate(obj)
        if kind == "call_tool":
            return CallToolAction.model_validate(obj)
        return TerminalAction.model_validate(obj, *args, **kwargs)

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return TerminalAction.model_json_schema(*args, **kwargs)


# The terminal's actions as MCP tools, for clients that speak MCP over the session's /ws.
MCP_TOOLS = (
    Tool(
        name="exec",
        description="Run a shell command in the task's sandbox to completion; returns its output.",
        input_schema={
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The shell command."},
                "timeout_s": {"type": "number", "description": "Its time limit (capped by the server)."},
            },
            "required": ["command"],
        },
    ),
    Tool(
        name="write_file",
        description="Write a file in the sandbox.",
        input_schema={
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["file_path", "content"],
        },
    ),
    Tool(
        name="evaluate",
        description="Run the task's tests: the reward, and the end of the episode.",
        input_schema={"type": "object", "properties": {}},
    ),
)


class ToolCallError(Exception):
    """A tool call the session refused (unknown arguments, wrong types): the package's HTTP MCP
    handler answers it as a JSON-RPC error with this message."""


@dataclass(frozen=True)
class SessionTool:
    """One tool as the package's HTTP MCP handler reads a FastMCP tool: its name, description,
    parameters (the input schema) and `fn`, awaited with the call's arguments."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Awaitable[dict[str, Any]]]


class SessionTools:
    """A session's tools where the package's `POST /mcp` handler looks for them (an environment's
    `mcp_server`, read by `get_server_tools`: `get_tools()` -> {name: tool}). Upstream's
    MCPToolClient (production mode) opens a session with `openenv/session/create`, resets it over
    the WebSocket it attaches with that session id, and calls the tools here with the session id:
    the same actions, checks and locks as the WebSocket's `call_tool` steps. A call's result is the
    WebSocket's CallToolResult plus the step's reward and done; a call the session refuses raises
    `ToolCallError`, which the handler answers as a JSON-RPC error."""

    def __init__(self, env: TerminalEnvironment) -> None:
        self._env = env

    async def get_tools(self) -> dict[str, SessionTool]:
        return {
            t.name: SessionTool(t.name, t.description, dict(t.input_schema), self._caller(t.name))
            for t in MCP_TOOLS
        }

    def _caller(self, name: str) -> Callable[..., Awaitable[dict[str, Any]]]:
        async def call(**arguments: Any) -> dict[str, Any]:
            obs = await self._env.step_async(CallToolAction(tool_name=name, arguments=arguments))
            assert isinstance(obs, CallToolObservation)
            if obs.error is not None:
                raise ToolCallError(obs.error.message)
            return {**obs.result, "reward": obs.reward, "done": obs.done}

        return call


STATE_TEXT_LIMIT = 4096  # last_command / last_output kept in the state, characters
UPLOAD_TIMEOUT_S = 120.0  # one write_file copy (at most max_file_bytes)


class CapacityError(InfraError):
    cause = "capacity"


class TerminalHub:
    """Tasks, provider and the sandbox budget of one server."""

    def __init__(
        self,
        config: ServeConfig,
        tasks: list[Task],
        provider: SandboxProvider,
        *,
        create_timeout_s: float | None = None,
    ) -> None:
        self.config = config
        self.tasks = {t.task_id: t for t in tasks}
        self.task_list = sorted(self.tasks.values(), key=lambda t: t.task_id)
        self.provider = provider
        self.create_timeout_s = create_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sandboxes = 0  # started, live or closing: never more than config.max_sessions
        self._open: set[Sandbox] = set()
        self._background: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()

    async def aclose(self) -> None:
        """Close every sandbox still open (shutdown); the provider is its owner's to close."""
        for sandbox in list(self._open):
            await self.release(sandbox)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def open(self, task: Task) -> Sandbox:
        """A started sandbox for `task`, counted against the budget; `CapacityError` when full."""
        limit = self.config.max_sessions
        if self.sandboxes >= limit:
            raise CapacityError(
                f"capacity reached: {self.sandboxes} of {limit} sandboxes are starting, live or closing; "
                "retry when a session ends"
            )
        self.sandboxes += 1
        creating = asyncio.ensure_future(self._create(task))
        try:
            sandbox = await asyncio.shield(creating)
        except asyncio.CancelledError:
            # The session is gone while its sandbox starts: close whatever the start produces.
            self._spawn(self._discard(creating))
            raise
        except BaseException:
            self.sandboxes -= 1
            raise
        self._open.add(sandbox)
        return sandbox

    async def _create(self, task: Task) -> Sandbox:
        limit = self.create_timeout_s or task.config.environment.build_timeout_sec
        try:
            return await asyncio.wait_for(self.provider.create(task, run_id=self.config.run_id), limit)
        except TimeoutError:
            raise SandboxCreateError(
                f"the sandbox for {task.task_id} was not ready after {limit:g}s"
            ) from None

    async def _discard(self, creating: asyncio.Future[Sandbox]) -> None:
        try:
            sandbox = await creating
        except BaseException:
            self.sandboxes -= 1
            return
        self._open.add(sandbox)
        await self.release(sandbox)

    async def release(self, sandbox: Sandbox) -> None:
        """Close `sandbox` and give its place in the budget back."""
        if sandbox not in self._open:
            return
        self._open.discard(sandbox)
        try:
            await asyncio.wait_for(sandbox.close(), self.config.close_timeout_s)
        except Exception as exc:  # the provider's own reaper finds it by its run label
            log.error("closing sandbox %s failed: %r", getattr(sandbox, "sandbox_id", "?"), exc)
        finally:
            self.sandboxes -= 1

    def release_soon(self, sandbox: Sandbox) -> None:
        """`release` from any thread: the package closes sessions from worker threads and, for
        short-lived instances, from the event loop itself."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._spawn(self.release(sandbox))
            return
        future = asyncio.run_coroutine_threadsafe(self.release(sandbox), loop)
        try:
            future.result(timeout=self.config.close_timeout_s + 5)
        except Exception as exc:
            log.error("closing a sandbox from the session's thread failed: %r", exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class TerminalEnvironment(Environment[TerminalAction, TerminalObservation, TerminalState]):
    """One session (a WebSocket connection): episodes one after another, one sandbox at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, hub: TerminalHub) -> None:
        super().__init__()
        self.hub = hub
        self._state = TerminalState()
        self._task: Task | None = None
        self._instruction = ""
        self._sandbox: Sandbox | None = None
        self._broken: SandboxPolicyError | None = None
        self._done = False
        self._busy = False
        self._closed = False
        # One action at a time: over /ws the package sends them in order, but HTTP MCP calls on
        # the same session (upstream's MCPToolClient) may arrive together.
        self._lock = asyncio.Lock()
        self.mcp_server = SessionTools(self)

    # -- the package's calls -----------------------------------------------------------------

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> TerminalObservation:
        return self._from_thread(self.reset_async(seed=seed, episode_id=episode_id, **kwargs))

    def step(
        self, action: TerminalAction, timeout_s: float | None = None, **kwargs: Any
    ) -> TerminalObservation:
        return self._from_thread(self.step_async(action, timeout_s=timeout_s))

    def _from_thread(self, coro: Coroutine[Any, Any, TerminalObservation]) -> TerminalObservation:
        if self.hub.loop is None:
            coro.close()
            raise RuntimeError("the server has not started")
        return asyncio.run_coroutine_threadsafe(coro, self.hub.loop).result()

    @property
    def state(self) -> TerminalState:
        return self._state

    def close(self) -> None:
        """The package ends the session (disconnect, or a short-lived instance)."""
        self._closed = True
        if self._busy:
            return  # the running action releases the sandbox when it ends
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            self.hub.release_soon(sandbox)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name=str(self.hub.config.env["name"]),
            description="agentrl terminal tasks (Harbor / terminal-bench-2 format): one sandbox per "
            "episode, scored by the task's own tests/test.sh",
            version=agentrl.__version__,
        )

    # -- the Task API (the package's TaskProvider protocol) ------------------------------------

    def list_splits(self) -> list[str]:
        return ["train"]

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return [self._spec(i, t) for i, t in enumerate(self._split(split))]

    def num_tasks(self, split: str) -> int:
        return len(self._split(split))

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        tasks = self._split(split)
        if not 0 <= index < len(tasks):
            raise IndexError(index)
        return self._spec(index, tasks[index])

    def _split(self, split: str) -> list[Task]:
        return self.hub.task_list if split == "train" else []

    @staticmethod
    def _spec(index: int, task: Task) -> dict[str, Any]:
        meta = task.config.metadata
        return {
            "index": index,
            "task_id": task.task_id,
            "difficulty": meta.difficulty,
            "category": meta.category,
        }

    # -- reset -------------------------------------------------------------------------------

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> TerminalObservation:
        async with self._lock:
            return await self._reset(seed, episode_id, **kwargs)

    async def _reset(self, seed: int | None, episode_id: str | None, **kwargs: Any) -> TerminalObservation:
        del seed  # an episode is the task's image and the agent's commands: nothing to seed
        if self._closed:
            return self._refuse("reset", "session_closed", "this session is closed: open a new connection")
        if "task_path" in kwargs or "path" in kwargs:
            return self._refuse(
                "reset", "task_path", "task_path is not accepted: name a served task by task_id"
            )
        unknown = sorted(set(kwargs) - {"task_id", "task_name"})
        if unknown:
            return self._refuse(
                "reset",
                "unknown_parameter",
                f"unknown reset parameter(s) {', '.join(map(repr, unknown))}: reset takes task_id "
                "(and seed, episode_id)",
            )
        task_id = kwargs.get("task_id") or kwargs.get("task_name")
        if task_id is None and len(self.hub.tasks) == 1:
            task_id = next(iter(self.hub.tasks))
        task = self.hub.tasks.get(str(task_id)) if isinstance(task_id, str) else None
        if task is None:
            known = [t.task_id for t in self.hub.task_list]
            shown = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
            what = "reset needs a task_id" if task_id is None else f"unknown task_id {str(task_id)[:200]!r}"
            return self._refuse("reset", "unknown_task", f"{what}: this server has {shown}")
        self._busy = True
        try:
            await self._release()
            self._task, self._done, self._broken = task, False, None
            self._state = TerminalState(
                episode_id=(episode_id or uuid.uuid4().hex)[:255],
                task_id=task.task_id,
                task_path=task.path.name,
            )
            try:
                self._instruction = task.instruction
                self._sandbox = await self.hub.open(task)
            except InputError as exc:
                self._done = True
                return self._refuse("reset", "bad_task", str(exc), failure="input", done=True)
            except InfraError as exc:
                self._done = True
                return self._refuse("reset", exc.cause, str(exc), failure="infra", done=True)
            self._state.terminal_ready = True
            c = self.hub.config
            return self._observe(
                "reset",
                info={
                    "agent_timeout_sec": task.config.agent.timeout_sec,
                    "verifier_timeout_sec": task.config.verifier.timeout_sec,
                    "command_timeout_s": c.command_timeout_s,
                    "max_command_timeout_s": c.max_command_timeout_s,
                    "max_command_bytes": c.max_command_bytes,
                    "max_file_bytes": c.max_file_bytes,
                },
            )
        finally:
            await self._after_action()

    # -- step --------------------------------------------------------------------------------

    async def step_async(
        self,
        action: TerminalAction | ListToolsAction | CallToolAction,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> TerminalObservation | ListToolsObservation | CallToolObservation:
        # MCP clients (upstream's MCPToolClient, agentrl's env.protocol=mcp): the same actions as
        # tools, each answered as MCP's CallToolResult.
        if isinstance(action, ListToolsAction):
            return ListToolsObservation(tools=list(MCP_TOOLS))
        async with self._lock:
            if isinstance(action, CallToolAction):
                return await self._call_tool(action, timeout_s)
            return await self._step(action, timeout_s)

    async def _step(self, action: TerminalAction, timeout_s: float | None) -> TerminalObservation:
        self._state.step_count += 1
        self._state.last_action_type = action.action_type[:64]
        self._state.last_command = action.command[:STATE_TEXT_LIMIT]
        obs = self._check(action) or await self._run(action, timeout_s)
        self._state.last_output = (obs.output or obs.error)[-STATE_TEXT_LIMIT:]
        return obs

    async def _call_tool(self, action: CallToolAction, timeout_s: float | None) -> CallToolObservation:
        name, args = action.tool_name, dict(action.arguments)
        if name not in {t.name for t in MCP_TOOLS}:
            error = ToolError(error_type=ToolErrorType.TOOL_NOT_FOUND, message=f"no tool {name[:64]!r}: "
                              f"the tools are {', '.join(t.name for t in MCP_TOOLS)}")  # fmt: skip
            return CallToolObservation(tool_name=name[:64], error=error)
        limit = args.pop("timeout_s", None)
        try:
            step = TerminalAction(
                action_type=name, metadata={"timeout_s": limit} if limit is not None else {}, **args
            )
        except (ValidationError, TypeError) as exc:
            error = ToolError(error_type=ToolErrorType.INVALID_ARGS, message=str(exc)[:2000])
            return CallToolObservation(tool_name=name, error=error)
        obs = await self._step(step, timeout_s)
        text = obs.output + (f"\n{obs.error}" if obs.error else "")
        result = {
            "content": [{"type": "text", "text": text}],
            "structured_content": {
                "output": obs.output,
                "error": obs.error,
                "success": obs.success,
                "info": obs.info,
            },
            "is_error": not obs.success,
        }
        return CallToolObservation(tool_name=name, result=result, reward=obs.reward, done=obs.done)

    async def _run(self, action: TerminalAction, timeout_s: float | None) -> TerminalObservation:
        self._busy = True
        try:
            if action.action_type == "exec":
                return await self._exec(action, timeout_s)
            if action.action_type == "write_file":
                return await self._write_file(action)
            if action.action_type == "evaluate":
                return await self._evaluate()
            await self._release()
            self._done = True
            return self._observe("close", output="the sandbox is closed", done=True)
        finally:
            await self._after_action()

    def _check(self, action: TerminalAction) -> TerminalObservation | None:
        """A refusal for an action that cannot run now, or None."""
        kind, c = action.action_type, self.hub.config
        if kind not in ACTION_TYPES:
            extra = (
                " (upstream's background-process actions are not served: run commands to completion)"
                if kind in UPSTREAM_ONLY
                else ""
            )
            return self._refuse(
                kind[:64],
                "unknown_action",
                f"unknown action_type {kind[:64]!r}: use one of {', '.join(ACTION_TYPES)}{extra}",
            )
        if self._closed:
            return self._refuse(kind, "session_closed", "this session is closed: open a new connection")
        if self._task is None:
            return self._refuse(kind, "not_reset", "no episode: reset(task_id=...) first")
        if self._done or self._sandbox is None:
            return self._refuse(kind, "episode_done", "this episode is over: reset to start another")
        if kind == "exec":
            size = len(action.command.encode())
            if size > c.max_command_bytes:
                return self._refuse(
                    kind, "command_too_large", f"command of {size} bytes: the limit is {c.max_command_bytes}"
                )
            if not action.block:
                return self._refuse(
                    kind,
                    "non_blocking",
                    "block=false (a background process) is not served: commands run to completion; "
                    "start a background job with `&` inside the command instead",
                )
        if kind == "write_file":
            size = len(action.content.encode())
            if size > c.max_file_bytes:
                return self._refuse(
                    kind, "content_too_large", f"content of {size} bytes: the limit is {c.max_file_bytes}"
                )
            if not action.file_path.startswith("/") or "\x00" in action.file_path:
                return self._refuse(kind, "bad_path", "file_path must be an absolute path")
        return None

    def _timeout(self, action: TerminalAction, timeout_s: float | None) -> float:
        """The exec limit: `metadata.timeout_s` (or the step's), capped by the server."""
        c = self.hub.config
        wanted = action.metadata.get("timeout_s", timeout_s)
        if (
            isinstance(wanted, int | float)
            and not isinstance(wanted, bool)
            and math.isfinite(wanted)
            and wanted > 0
        ):
            return min(float(wanted), c.max_command_timeout_s)
        return c.command_timeout_s

    async def _exec(self, action: TerminalAction, timeout_s: float | None) -> TerminalObservation:
        assert self._sandbox is not None
        timeout = self._timeout(action, timeout_s)
        try:
            res = await self._sandbox.exec(action.command, timeout=timeout)
        except SandboxPolicyError as exc:
            return await self._policy_failure("exec", exc)
        except SandboxError as exc:
            return await self._infra_failure("exec", exc)
        return self._observe(
            "exec",
            output=res.stdout + res.stderr,
            success=res.ok,
            info={
                "exit_code": res.exit_code,
                "timed_out": res.timed_out,
                "duration_s": round(res.duration_s, 3),
                "timeout_s": timeout,
                "stdout": res.stdout,
                "stderr": res.stderr,
            },
        )

    async def _write_file(self, action: TerminalAction) -> TerminalObservation:
        assert self._sandbox is not None
        path = action.file_path
        parent = path.rsplit("/", 1)[0] or "/"
        with tempfile.TemporaryDirectory(prefix="agentrl-openenv-") as tmp:
            src = Path(tmp) / "content"
            src.write_text(action.content, encoding="utf-8")
            try:
                await self._sandbox.exec(f"mkdir -p -- {shlex.quote(parent)}", timeout=60)
                try:
                    await asyncio.wait_for(self._sandbox.upload(src, path), UPLOAD_TIMEOUT_S)
                except TimeoutError:
                    raise SandboxTransportError(
                        f"copying {path[:200]} took over {UPLOAD_TIMEOUT_S:g}s"
                    ) from None
            except SandboxPolicyError as exc:
                return await self._policy_failure("write_file", exc)
            except SandboxError as exc:
                # A path the agent made unwritable (a directory in the way, a read-only mount) fails
                # the copy as well as a dead sandbox does: only a sandbox that still answers says
                # which it was.
                try:
                    alive = (await self._sandbox.exec("true", timeout=30)).ok
                except (SandboxError, SandboxPolicyError):
                    alive = False
                if not alive:
                    return await self._infra_failure("write_file", exc)
                return self._refuse("write_file", "write_failed", f"could not write {path[:200]}: {exc}")
        return self._observe(
            "write_file", output=f"wrote {len(action.content.encode())} bytes to {path[:200]}"
        )

    async def _evaluate(self) -> TerminalObservation:
        assert self._sandbox is not None and self._task is not None
        if self._broken is not None:
            return await self._policy_failure("evaluate", self._broken)
        try:
            task, hub = self._task, self.hub
            vres = await verify_phase(
                self._sandbox,
                task,
                provider=hub.provider,
                run_id=hub.config.run_id,
                footprint=lambda: ensure_footprint(hub.provider, task, run_id=hub.config.run_id),
            )
        except InputError as exc:
            await self._release()
            self._done = True
            return self._refuse("evaluate", "bad_task", str(exc), failure="input", done=True)
        except SandboxError as exc:
            return await self._infra_failure("evaluate", exc)
        await self._release()
        self._done = True
        info: dict[str, Any] = {
            "outcome": vres.outcome,
            "tests_passed": vres.outcome == "pass",
            "rewards": vres.rewards,
            "cause": vres.cause,
            "duration_s": round(vres.duration_s, 3),
        }
        if vres.infra_failure and not vres.policy_failure:
            info["failure"] = "infra"
            return self._observe(
                "evaluate",
                output=vres.log_tail,
                success=False,
                error=vres.error or vres.outcome,
                info=info,
                done=True,
            )
        if vres.policy_failure:
            info["failure"] = "policy"
            return self._observe(
                "evaluate",
                output=vres.log_tail,
                success=False,
                error=vres.error or vres.outcome,
                info=info,
                reward=0.0,
                done=True,
            )
        return self._observe("evaluate", output=vres.log_tail, info=info, reward=vres.reward, done=True)

    # -- outcomes ----------------------------------------------------------------------------

    async def _policy_failure(self, kind: str, exc: SandboxPolicyError) -> TerminalObservation:
        """The agent's command broke its sandbox: the episode is over with reward 0."""
        self._broken = exc
        await self._release()
        self._done = True
        return self._refuse(kind, exc.cause, str(exc), failure="policy", reward=0.0, done=True)

    async def _infra_failure(self, kind: str, exc: InfraError) -> TerminalObservation:
        await self._release()
        self._done = True
        return self._refuse(kind, exc.cause, str(exc), failure="infra", done=True)

    def _observe(
        self,
        kind: str,
        *,
        output: str = "",
        success: bool = True,
        error: str = "",
        info: dict[str, Any] | None = None,
        reward: float | None = None,
        done: bool = False,
    ) -> TerminalObservation:
        return TerminalObservation(
            instruction=self._instruction,
            output=output,
            success=success,
            error=error,
            task_id=self._state.task_id,
            task_path=self._state.task_path,
            session_id=None,
            action_type=kind,
            info=info or {},
            reward=reward,
            done=done,
        )

    def _refuse(
        self,
        kind: str,
        cause: str,
        message: str,
        *,
        failure: str = "request",
        reward: float | None = None,
        done: bool = False,
    ) -> TerminalObservation:
        return self._observe(
            kind,
            success=False,
            error=message,
            info={"failure": failure, "cause": cause},
            reward=reward,
            done=done,
        )

    async def _release(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        self._state.terminal_ready = False
        if sandbox is not None:
            await self.hub.release(sandbox)

    async def _after_action(self) -> None:
        self._busy = False
        if self._closed:
            with contextlib.suppress(Exception):
                await self._release()
