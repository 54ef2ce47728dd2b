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
- `POST /mcp` with `no_mcp` set: answered as upstream's non-MCP servers answer it, HTTP 200 with a
  JSON-RPC 2.0 error (-32700 parse error, -32600 invalid request, else -32601 method not found with
  the reason), never passed to the package's handler (its `openenv/session/create` would open a
  sandbox outside any WebSocket's lifetime). `openenv validate` checks exactly this answer
  (`openenv/cli/_validation.py`, criterion `mcp_endpoint`: status 200 and `"jsonrpc": "2.0"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Coroutine[Any, Any, None]]

CLOSE_IDLE = 4408  # private-use close code (4000-4999), after HTTP 408 Request Timeout
MAX_DEPTH = 32  # JSON nesting of one message (an action needs 3 or 4)


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_message_chars: int,
        idle_timeout_s: float,
        max_http_body_bytes: int,
        refused: dict[str, str] | None = None,
        no_mcp: str | None = None,
    ) -> None:
        """`refused`: "METHOD /path" (or "WS /path") -> why that route is not served; `no_mcp`: why
        `POST /mcp` has no tools (a JSON-RPC error)."""
        self.no_mcp = no_mcp
        self.app = app
        self.max_message_chars = max_message_chars
        self.idle_timeout_s = idle_timeout_s
        self.max_http_body_bytes = max_http_body_bytes
        self.refused = dict(refused or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            why = self.refused.get(f"WS {scope['path']}")
            if why is not None:
                await _refuse_websocket(receive, send, why)
            else:
                await _Connection(self, scope, receive, send).run()
        else:
            await self.app(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        why = self.refused.get(f"{scope['method']} {scope['path']}")
        if why is not None:
            await _json_response(send, 501, {"detail": why})
            return
        limit = self.max_http_body_bytes
        mcp = self.no_mcp is not None and scope["method"] == "POST" and scope["path"] == "/mcp"
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
        if mcp:
            await _json_response(send, 200, _jsonrpc_refusal(b"".join(chunks), str(self.no_mcp)))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


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


def _jsonrpc_refusal(body: bytes, why: str) -> dict[str, Any]:
    """The JSON-RPC 2.0 error a server without MCP tools answers (codes of the JSON-RPC spec)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}
    rid = request.get("id") if isinstance(request, dict) else None
    if not isinstance(request, dict) or not isinstance(request.get("method"), str):
        error = {"code": -32600, "message": "Invalid Request: a JSON-RPC 2.0 request names its method"}
    else:
        error = {"code": -32601, "message": f"Method not found: {request['method']}: {why}"}
    return {"jsonrpc": "2.0", "id": rid if isinstance(rid, (str, int)) else None, "error": error}


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
