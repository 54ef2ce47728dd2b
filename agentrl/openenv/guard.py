"""`Guard`: the ASGI layer in front of the `openenv` package's server app that bounds what one client
can cost, and answers every refusal in words.

- WebSocket messages: one over `max_message_chars`, or nested too deeply for a JSON parser, is
  answered with an error frame (the package's `{"type": "error", "data": {"message", "code"}}`
  shape) and dropped; the session goes on. Frames over the server's hard cap (uvicorn's
  `ws_max_size`) close the connection with 1009.
- Idle sessions: a connection whose client sends nothing for `idle_timeout_s` while the server
  waits for its next message is ended as if the client had left, so the package tears the session
  down (its sandbox closed), and the close frame says why (code 4408). A step that runs long is never
  idle: the clock runs only while the server waits.
- A client that disconnects in the middle of a step: the step is cancelled at once, so its sandbox
  is closed now rather than when a long command or the verifier would have finished.
- HTTP: bodies over `max_http_body_bytes` get 413; the routes in `refused` get 501 with the reason
  (stateless HTTP episodes, which a sandbox-per-session environment does not serve).
- `POST /mcp` (MCP over HTTP, as upstream's MCPToolClient speaks it) goes to the package's handler,
  with bodies up to `max_message_chars` (a tool call carries a command or a file). A session opened
  there (`openenv/session/create`) lives while a call runs on it or a WebSocket is attached to it
  (`/ws?session_id=`); when neither has happened for `idle_timeout_s`, the guard closes it through
  the package's own `openenv/session/close`, which closes its sandbox, so a client that vanishes
  without closing leaves nothing behind. `openenv validate` checks this route's answer
  (`openenv/cli/_validation.py`, criterion `mcp_endpoint`: status 200 and `"jsonrpc": "2.0"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Coroutine[Any, Any, None]]

CLOSE_IDLE = 4408  # private-use close code (4000-4999), after HTTP 408 Request Timeout
MAX_DEPTH = 32  # JSON nesting of one message (an action needs 3 or 4)
SESSION_METHODS = ("openenv/session/create", "openenv/session/close")
log = logging.getLogger("agentrl.openenv")


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_message_chars: int,
        idle_timeout_s: float,
        max_http_body_bytes: int,
        refused: dict[str, str] | None = None,
    ) -> None:
        """`refused`: "METHOD /path" (or "WS /path") -> why that route is not served."""
        self.app = app
        self.max_message_chars = max_message_chars
        self.idle_timeout_s = idle_timeout_s
        self.max_http_body_bytes = max_http_body_bytes
        self.refused = dict(refused or {})
        self.mcp_sessions = _McpSessions(self)

    async def aclose(self) -> None:
        await self.mcp_sessions.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            why = self.refused.get(f"WS {scope['path']}")
            if why is not None:
                await _refuse_websocket(receive, send, why)
                return
            with self.mcp_sessions.using(_query(scope).get("session_id")):
                await _Connection(self, scope, receive, send).run()
        else:
            await self.app(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        why = self.refused.get(f"{scope['method']} {scope['path']}")
        if why is not None:
            await _json_response(send, 501, {"detail": why})
            return
        mcp = scope["method"] == "POST" and scope["path"] == "/mcp"
        limit = self.max_message_chars if mcp else self.max_http_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _json_response(
                send, 413, {"detail": f"request body of {int(declared)} bytes: the limit is {limit}"}
            )
            return
        # The body is read here, within the limit, and replayed to the app: a client that streams
        # more than it declared (or declares nothing) is cut off at the limit too.
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > limit:
                await _json_response(send, 413, {"detail": f"request body over the limit of {limit} bytes"})
                return
            chunks.append(body)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replay = _replayed(body, receive)
        if mcp:
            await self.mcp_sessions.call(scope, replay, send, body)
        else:
            await self.app(scope, replay, send)


class _McpSessions:
    """The sessions opened over `POST /mcp`, closed by the guard once idle (see the module's doc)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.idle_since: dict[str, float] = {}  # session id -> when its last use ended
        self.users: dict[str, int] = {}  # session id -> calls running and WebSockets attached
        self.reaper: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def using(self, session_id: Any) -> Any:
        if not isinstance(session_id, str) or not session_id:
            yield
            return
        self.users[session_id] = self.users.get(session_id, 0) + 1
        try:
            yield
        finally:
            self.users[session_id] -= 1
            if not self.users[session_id]:
                del self.users[session_id]
            if session_id in self.idle_since:
                self.idle_since[session_id] = time.monotonic()

    async def call(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        """One `POST /mcp` request through the package's handler, noting the sessions it opens,
        uses and closes."""
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            request = None
        method = request.get("method") if isinstance(request, dict) else None
        params = request.get("params") if isinstance(request, dict) else None
        named = params.get("session_id") if isinstance(params, dict) else None
        answer: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.body" and method in SESSION_METHODS:
                answer.append(message.get("body", b""))
            await send(message)

        with self.using(named):
            await self.guard.app(scope, receive, capture)
        try:
            result = json.loads(b"".join(answer)).get("result") if answer else None
        except (ValueError, UnicodeDecodeError, AttributeError):
            result = None
        if not isinstance(result, dict):
            return
        if method == "openenv/session/create" and isinstance(result.get("session_id"), str):
            self.idle_since.setdefault(result["session_id"], time.monotonic())
            if self.reaper is None:
                self.reaper = asyncio.create_task(self._reap(), name="openenv-mcp-sessions")
        elif method == "openenv/session/close" and (result.get("closed") or result.get("closing")):
            # "closing": a WebSocket was still attached; the package closes it when that detaches.
            self.idle_since.pop(str(result.get("session_id")), None)

    async def _reap(self) -> None:
        idle = self.guard.idle_timeout_s
        while True:
            await asyncio.sleep(min(max(idle / 4, 0.05), 5.0))
            now = time.monotonic()
            for sid, since in list(self.idle_since.items()):
                if sid not in self.users and now - since > idle:
                    del self.idle_since[sid]
                    await self._close(sid)

    async def _close(self, session_id: str) -> None:
        """`openenv/session/close` through the package's handler, as a client would send it."""
        body = json.dumps(
            {"jsonrpc": "2.0", "id": "agentrl-idle", "method": "openenv/session/close",
             "params": {"session_id": session_id}}
        ).encode()  # fmt: skip
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/mcp", "raw_path": b"/mcp", "root_path": "", "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": None, "server": None,
        }  # fmt: skip

        async def never() -> Message:
            await asyncio.Event().wait()  # nothing more: the request is whole
            return {"type": "http.disconnect"}

        receive = _replayed(body, never)

        async def discard(message: Message) -> None:
            pass

        try:
            await self.guard.app(scope, receive, discard)
        except Exception:  # the server is going down; its shutdown closes every sandbox
            log.warning("closing idle MCP session %s failed", session_id, exc_info=True)
        else:
            log.info(
                "MCP session %s idle for %gs: closed with its sandbox", session_id, self.guard.idle_timeout_s
            )

    async def aclose(self) -> None:
        if self.reaper is not None:
            self.reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reaper
            self.reaper = None


class _Connection:
    """One WebSocket connection between the client and the package's handler."""

    def __init__(self, guard: Guard, scope: Scope, receive: Receive, send: Send) -> None:
        self.guard = guard
        self.scope = scope
        self.client_receive = receive
        self.client_send = send
        # One message ahead at most: the reader keeps listening (for a disconnect) while the app
        # works on a message, but never buffers what a pipelining client floods it with.
        self.inbox: asyncio.Queue[Message] = asyncio.Queue(maxsize=1)
        self.connected = False  # the app has taken the connect event
        self.in_message = False  # the app is working on a message it has not answered yet
        self.expired = False
        self.app_task: asyncio.Task[None] | None = None
        self.cancelled_app = False

    async def run(self) -> None:
        reader = asyncio.create_task(self._read(), name="openenv-guard-reader")
        self.app_task = asyncio.create_task(
            self.guard.app(self.scope, self._receive, self._send), name="openenv-session"
        )
        try:
            await self.app_task
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if not self.cancelled_app or (this is not None and this.cancelling()):
                raise
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(self) -> None:
        while True:
            message = await self.client_receive()
            kind = message["type"]
            if kind == "websocket.receive":
                message = self._screen(message)
            elif kind == "websocket.disconnect":
                if self.in_message and self.app_task is not None and not self.app_task.done():
                    # Whatever the step was doing is for nobody now: end it, so the session's
                    # sandbox is closed at once.
                    self.cancelled_app = True
                    self.app_task.cancel()
                await self.inbox.put(message)
                return
            await self.inbox.put(message)

    def _screen(self, message: Message) -> Message:
        data = message.get("text")
        if data is None:
            return _rejection("binary frames are not accepted: send each message as JSON text")
        limit = self.guard.max_message_chars
        if len(data) > limit:
            return _rejection(
                f"message of {len(data)} characters: this server takes messages of up to {limit} "
                "(see the observation's info for the command and file limits)"
            )
        try:
            parsed = json.loads(data)
        except RecursionError:
            parsed = None
            deep = True
        except ValueError:
            return message  # the package answers malformed JSON itself (INVALID_JSON)
        else:
            deep = _deeper_than(parsed, MAX_DEPTH)
        if deep:
            # The package echoes a rejected value in its error frame, and cannot serialize one nested
            # this deep: its answer would fail and take the session down with it.
            return _rejection(f"message nested more than {MAX_DEPTH} levels deep: no action needs that")
        # The package's handler answers every message but `close`, after which it tears down.
        answered = not (isinstance(parsed, dict) and parsed.get("type") == "close")
        return {**message, "agentrl.answered": answered}

    async def _receive(self) -> Message:
        while True:
            if not self.connected:
                message = await self.inbox.get()
                self.connected = True
            else:
                try:
                    message = await asyncio.wait_for(self.inbox.get(), self.guard.idle_timeout_s)
                except TimeoutError:
                    self.expired = True
                    return {"type": "websocket.disconnect", "code": CLOSE_IDLE}
            if message["type"] == "agentrl.rejected":
                await self.client_send(
                    {"type": "websocket.send", "text": json.dumps({"type": "error", "data": message["data"]})}
                )
                continue
            if message["type"] == "websocket.receive":
                self.in_message = bool(message.pop("agentrl.answered", True))
            return message

    async def _send(self, message: Message) -> None:
        if message["type"] == "websocket.send":
            self.in_message = False
        elif message["type"] == "websocket.close" and self.expired:
            idle = self.guard.idle_timeout_s
            message = {
                **message,
                "code": CLOSE_IDLE,
                "reason": f"idle for {idle:g}s: the session and its sandbox were closed",
            }
        await self.client_send(message)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` (parsed JSON) nests more than `limit` containers deep; iterative, so any
    depth the parser accepted is measured without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _replayed(body: bytes, then: Receive) -> Receive:
    """A `receive` that gives a request's whole `body` once, then whatever `then` gives."""
    given = False

    async def receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()

    return receive


def _query(scope: Scope) -> dict[str, str]:
    raw = scope.get("query_string") or b""
    return {k: v[0] for k, v in parse_qs(raw.decode("latin-1")).items() if v}


def _rejection(why: str) -> Message:
    return {"type": "agentrl.rejected", "data": {"message": why, "code": "VALIDATION_ERROR"}}


async def _json_response(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def _refuse_websocket(receive: Receive, send: Send, why: str) -> None:
    """Accept, say why in an error frame, close: clearer than a bare handshake rejection."""
    if (await receive())["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send(
        {
            "type": "websocket.send",
            "text": json.dumps({"type": "error", "data": {"message": why, "code": "UNKNOWN_TYPE"}}),
        }
    )
    await send({"type": "websocket.close", "code": 1008, "reason": why[:120]})
