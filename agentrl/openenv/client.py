"""Clients of OpenEnv servers as training needs them, on the `openenv` package's own `EnvClient`.

- One session per episode, sticky: the WebSocket that carried `reset` carries every later step. The
  package's client reconnects on its own when a socket closes, which would silently continue the
  episode in a fresh server session; `RemoteSession` refuses instead, so a dropped connection is an
  infrastructure failure of the episode, never a half-episode on new state and never a reward 0.
- Every call has a time limit; every failure is typed: `OpenEnvInfraError` (a `SandboxError`, so
  the agent loop and the rollout manager classify and retry it like a sandbox's, counted by `cause`:
  `openenv_connect`, `openenv_connection`, `openenv_timeout`, `openenv_capacity`,
  `openenv_server_error`, `openenv_protocol`, or the server's own cause) and `OpenEnvRequestError`
  (the server rejected what was sent; the caller decides whose doing that was).
- `RemoteSandbox`: a terminal session on an `agentrl env serve` (or upstream `tbench2_env`) server
  as a `Sandbox`, so `agentrl.agent.loop.run_agent` drives it unchanged on the command path.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.generic_client import GenericEnvClient
from pydantic import ValidationError
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State as SocketState

from agentrl.errors import AgentRLError, InputError
from agentrl.openenv.schema import TerminalAction, TerminalObservation, TerminalState
from agentrl.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxPolicyError

T = TypeVar("T")
REQUEST_CODES = ("VALIDATION_ERROR", "INVALID_JSON", "UNKNOWN_TYPE")
REFUSED_EXIT_CODE = 126  # "found but cannot execute": a command the server refused to run


class OpenEnvInfraError(SandboxError):
    """The remote environment failed as infrastructure (connection, time limit, capacity, its own
    sandbox or verifier): no reward; retried in a new session. `code`: the server's error frame
    code when it sent one (EXECUTION_ERROR, SESSION_ERROR, ...)."""

    cause = "openenv_server_error"

    def __init__(
        self, message: str, *, cause: str | None = None, code: str | None = None, log_tail: str = ""
    ) -> None:
        super().__init__(message, cause=cause, log_tail=log_tail)
        self.code = code
        self.server_message = message


# What an OpenEnv server says when a reset names a task it does not have. Upstream's tbench2_env
# raises FileNotFoundError("Task path not found: <tasks_dir>/<task_id>") in `reset`, which the
# package's WebSocket handler sends as an EXECUTION_ERROR frame (openenv/core/env_server/http_server.py).
_MISSING = re.compile(r"not found|unknown|does not exist|no such|not a valid|invalid task", re.IGNORECASE)


def names_missing_task(exc: OpenEnvInfraError, task_id: str) -> bool:
    """Whether a failed reset is the server saying it has no task `task_id` (an input error: a
    retry cannot fix it) rather than failing to start one (infrastructure, retried)."""
    text = exc.server_message
    return exc.code == "EXECUTION_ERROR" and bool(task_id) and task_id in text and bool(_MISSING.search(text))


class OpenEnvRequestError(AgentRLError):
    """The server rejected a message (`code`: VALIDATION_ERROR, INVALID_JSON or UNKNOWN_TYPE)."""

    def __init__(self, message: str, *, code: str) -> None:
        self.code = code
        super().__init__(message)


def _error_frame(data: dict[str, Any], url: str) -> Exception:
    code = str(data.get("code", "UNKNOWN"))
    message = str(data.get("message", "no message"))
    if code == "CAPACITY_REACHED":
        return OpenEnvInfraError(f"{url}: {message}", cause="openenv_capacity")
    if code in REQUEST_CODES:
        details = [
            f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}"
            for e in (data.get("errors") or [])[:5]
            if isinstance(e, dict)
        ]
        return OpenEnvRequestError(
            f"{message}{' (' + '; '.join(details) + ')' if details else ''}", code=code
        )
    error = OpenEnvInfraError(
        f"{url}: server error {code}: {message}", cause="openenv_server_error", code=code
    )
    error.server_message = message
    return error


def _closed_reason(exc: ConnectionClosed) -> str:
    frame = exc.rcvd
    if frame is None:
        return "without a close frame"
    return f"with code {frame.code}" + (f": {frame.reason}" if frame.reason else "")


class _Sticky:
    """Mixed into an `EnvClient`: once pinned, the session's socket is the only one it uses."""

    _pinned: Any = None
    _ws: Any
    _ws_url: str | None

    def pin(self) -> None:
        self._pinned = self._ws

    async def _ensure_connected(self) -> None:
        if self._pinned is None:
            await super()._ensure_connected()  # type: ignore[misc]
            return
        if self._ws is not self._pinned or self._pinned.state is not SocketState.OPEN:
            code = getattr(self._pinned, "close_code", None)
            why = f" (closed with code {code}: {getattr(self._pinned, 'close_reason', '')})" if code else ""
            raise OpenEnvInfraError(
                f"the connection to {self._ws_url} was lost mid-episode{why}: its server-side session "
                "is gone with it",
                cause="openenv_connection",
            )

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            try:
                await self._send(message)  # type: ignore[attr-defined]
            except ConnectionClosed:
                pass  # a refused session sends its error frame, then closes: read the frame
            response: dict[str, Any] = await self._receive()  # type: ignore[attr-defined]
        except ConnectionClosed as exc:
            raise OpenEnvInfraError(
                f"the connection to {self._ws_url} closed {_closed_reason(exc)}", cause="openenv_connection"
            ) from None
        if response.get("type") == "error":
            raise _error_frame(response.get("data") or {}, str(self._ws_url))
        return response


class TerminalClient(_Sticky, EnvClient[TerminalAction, TerminalObservation, TerminalState]):
    """The tbench2_env schema's typed client (as upstream's `Tbench2Env`), sticky."""

    def _step_payload(self, action: TerminalAction) -> dict[str, Any]:
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[TerminalObservation]:
        obs = payload.get("observation") or {}
        known = {
            k: obs[k] for k in TerminalObservation.model_fields if k in obs and k not in ("reward", "done")
        }
        observation = TerminalObservation(
            **known, reward=payload.get("reward"), done=payload.get("done", False)
        )
        return StepResult(
            observation=observation, reward=payload.get("reward"), done=bool(payload.get("done"))
        )

    def _parse_state(self, payload: dict[str, Any]) -> TerminalState:
        return TerminalState.model_validate(payload)


class TextClient(_Sticky, GenericEnvClient):
    """Any OpenEnv server, with plain dict actions and observations, sticky."""


C = TypeVar("C", TerminalClient, TextClient)


_CAPACITY = re.compile(r"(\d+)\s*/\s*(\d+)\s*sessions")  # "Server at capacity: 1/1 sessions active."


class SessionGate:
    """How many sessions this client opens on one server at once, and the waiting when it is full.

    A server answers a session over its cap with CAPACITY_REACHED (openenv's `SessionCapacityError`:
    "Server at capacity: A/M sessions active"). The gate then learns the room it has (at most M,
    and fewer than the sessions it holds itself when other clients hold the rest), holds episodes
    back until a session of its own closes, and tries again with a backoff: a full server costs
    time, never an episode's infrastructure attempt. Only a wait longer than `wait_s` becomes an
    infrastructure failure. `limit` None: learn it; `waited_s` and `refusals` are the metrics."""

    def __init__(self, *, limit: int | None = None, wait_s: float = 900.0) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self.in_use = 0
        self.refusals = 0
        self.waited_s = 0.0
        self._changed = asyncio.Condition()

    async def _acquire(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.limit is None or self.in_use < self.limit)
            self.in_use += 1

    async def _release(self) -> None:
        async with self._changed:
            self.in_use -= 1
            self._changed.notify_all()

    def _learn(self, exc: OpenEnvInfraError) -> None:
        found = _CAPACITY.search(exc.server_message)
        published = int(found.group(2)) if found else None
        mine = max(1, self.in_use - 1)  # what this client holds besides the refused one
        room = min(published, mine) if published else mine
        self.limit = room if self.limit is None else min(self.limit, room)

    @contextlib.asynccontextmanager
    async def opened(
        self, open_: Callable[[contextlib.AsyncExitStack], Awaitable[T]]
    ) -> AsyncIterator[tuple[T, float]]:
        """Hold a slot and run `open_(stack)` (connect and reset, entering the session into the
        stack) until the server has room; yields (what `open_` returned, seconds spent waiting for
        room); the session closes and the slot frees at exit."""
        start = time.monotonic()
        delay = 0.1
        while True:
            await self._acquire()
            stack = contextlib.AsyncExitStack()
            try:
                opened = await open_(stack)
                break
            except OpenEnvInfraError as exc:
                await stack.aclose()
                await self._release()
                if exc.cause != "openenv_capacity":
                    raise
                self.refusals += 1
                self._learn(exc)
                if time.monotonic() - start > self.wait_s:
                    raise OpenEnvInfraError(
                        f"{exc} (waited {self.wait_s:g}s for a session: the server is the bottleneck)",
                        cause="openenv_capacity",
                    ) from None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
            except BaseException:
                await stack.aclose()
                await self._release()
                raise
        waited = time.monotonic() - start
        self.waited_s += waited
        try:
            async with stack:
                yield opened, waited
        finally:
            await self._release()


class RemoteSession(Generic[C]):
    """One OpenEnv session: `async with`, then `reset` and `step` with a time limit each. Leaving
    the block closes the session (on an agentrl server: its sandbox)."""

    def __init__(
        self, client: C, *, url: str, connect_timeout_s: float, close_timeout_s: float = 15.0
    ) -> None:
        self.client: C = client
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self.close_timeout_s = close_timeout_s

    async def __aenter__(self) -> RemoteSession[C]:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self.client.connect()
        except TimeoutError:
            await self._close()
            raise OpenEnvInfraError(
                f"no connection to {self.url} within {self.connect_timeout_s:g}s", cause="openenv_connect"
            ) from None
        except (ConnectionError, OSError) as exc:
            await self._close()
            raise OpenEnvInfraError(f"cannot connect to {self.url}: {exc}", cause="openenv_connect") from None
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        try:
            async with asyncio.timeout(self.close_timeout_s):
                await self.client.close()
        except Exception:  # the session ends with its socket either way
            pass

    async def reset(self, *, timeout_s: float, **kwargs: Any) -> StepResult[Any]:
        result = await self._call("reset", lambda: self.client.reset(**kwargs), timeout_s)
        self.client.pin()
        return result

    async def step(self, action: Any, *, timeout_s: float) -> StepResult[Any]:
        return await self._call("step", lambda: self.client.step(action), timeout_s)

    async def _call(self, what: str, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        try:
            async with asyncio.timeout(timeout_s):
                return await call()
        except TimeoutError:
            raise OpenEnvInfraError(
                f"{what}: no answer from {self.url} within {timeout_s:g}s", cause="openenv_timeout"
            ) from None
        except ValidationError as exc:
            raise OpenEnvInfraError(
                f"{what}: the answer of {self.url} does not fit the schema: {exc}", cause="openenv_protocol"
            ) from None
        except (ConnectionError, OSError) as exc:
            raise OpenEnvInfraError(f"{what}: {self.url}: {exc}", cause="openenv_connection") from None


class RemoteSandbox(Sandbox):
    """A remote terminal session as a `Sandbox` (exec only: the agent loop's command path).

    The server's classification comes through: `info.failure == "policy"` raises
    `SandboxPolicyError` (the agent broke its sandbox), `"infra"` raises `OpenEnvInfraError` with the
    server's cause, `"request"` (e.g. a command over the server's size limit) is the command's
    output, exit code 126, so the agent sees why. A server without agentrl's `info` (upstream's)
    gives `output` as stdout and exit 0 or 1 from `success`.
    """

    def __init__(
        self,
        session: RemoteSession[TerminalClient],
        *,
        default_timeout_s: float,
        grace_s: float,
        sandbox_id: str,
    ) -> None:
        self.session = session
        self.default_timeout_s = default_timeout_s
        self.grace_s = grace_s
        self.sandbox_id = sandbox_id

    async def exec(
        self,
        cmd: str,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        if cwd is not None or env or user is not None:
            raise AgentRLError("exec over OpenEnv runs in the session's shell: no cwd, env or user")
        limit = timeout or self.default_timeout_s
        action = TerminalAction(action_type="exec", command=cmd, metadata={"timeout_s": limit})
        try:
            result = await self.session.step(action, timeout_s=limit + self.grace_s)
        except OpenEnvRequestError as exc:
            return ExecResult("", f"[refused by the environment server: {exc}]\n", REFUSED_EXIT_CODE)
        obs: TerminalObservation = result.observation
        info = obs.info
        failure = info.get("failure")
        if failure == "policy":
            raise SandboxPolicyError(obs.error, cause=str(info.get("cause") or "policy"))
        if failure == "request":
            return ExecResult("", f"[refused by the environment server: {obs.error}]\n", REFUSED_EXIT_CODE)
        if failure is not None:
            raise OpenEnvInfraError(
                obs.error or f"exec failed ({failure})", cause=str(info.get("cause") or "openenv")
            )
        if "exit_code" in info:
            return ExecResult(
                str(info.get("stdout", "")),
                str(info.get("stderr", "")),
                info["exit_code"],
                bool(info.get("timed_out", False)),
                float(info.get("duration_s") or 0.0),
            )
        return ExecResult(obs.output, obs.error, 0 if obs.success else 1)

    async def upload(self, src: Any, dst: str) -> None:
        raise AgentRLError("a remote OpenEnv session takes commands only (no upload)")

    async def download(self, src: str, dst: Any, *, limit_bytes: int | None = None) -> None:
        raise AgentRLError("a remote OpenEnv session takes commands only (no download)")

    async def close(self) -> None:
        """The session's owner (`RemoteSession`) ends it."""


@contextlib.asynccontextmanager
async def episode_session(
    gate: SessionGate,
    make_client: Callable[[], C],
    *,
    url: str,
    connect_timeout_s: float,
    reset_timeout_s: float,
    task: str,
    **reset: Any,
) -> AsyncIterator[tuple[RemoteSession[C], StepResult[Any], float]]:
    """An episode's session: a slot of `gate` (waiting while the server is full), connect, reset
    with `reset` (`task` names the episode's task in errors); yields (session, the reset's result, seconds waited for room). A reset the server fails
    because it has no such task is an `InputError` (never retried); other failures stay infra."""

    async def open_(stack: contextlib.AsyncExitStack) -> tuple[RemoteSession[C], StepResult[Any]]:
        session = await stack.enter_async_context(
            RemoteSession(make_client(), url=url, connect_timeout_s=connect_timeout_s)
        )
        try:
            return session, await session.reset(timeout_s=reset_timeout_s, **reset)
        except OpenEnvInfraError as exc:
            if names_missing_task(exc, task):
                raise InputError(f"{url} cannot run task {task!r}: {exc.server_message}") from None
            raise

    async with gate.opened(open_) as ((session, first), waited):
        yield session, first, waited
