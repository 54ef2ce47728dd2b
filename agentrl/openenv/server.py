"""`agentrl env serve`: an environment plugin served as an OpenEnv environment server.

The app is the `openenv` package's own (`create_fastapi_app`: `/ws` sessions, `/schema`, `/health`,
`/metadata`, the Task API, MCP over `POST /mcp`), around one `TerminalEnvironment` per session (a
WebSocket's, or one opened over `POST /mcp` as upstream's MCPToolClient does), behind `Guard`
(payload sizes, idle sessions, refused routes). The package caps sessions (`max_sessions`): one over
the cap is answered `CAPACITY_REACHED` and closed.

    server = build_server(ServeConfig(env={"name": "tbench2", "backend": "podman"}))
    serve(config)                         # uvicorn, until Ctrl-C
    with run_in_thread(config) as url:    # embedded (tests, notebooks): its own thread and loop
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import AgentRLError
from agentrl.openenv.config import ServeConfig
from agentrl.openenv.guard import Guard
from agentrl.rollout.environment import EnvContext, EnvironmentPluginError, get_plugin
from agentrl.sandbox.base import SandboxProvider

log = logging.getLogger("agentrl.openenv")


@dataclass
class Server:
    """A built server: the ASGI app to run, and what it serves."""

    app: Guard
    hub: Any  # agentrl.openenv.terminal.TerminalHub
    environment: Any  # the plugin's built environment (owns the sandbox provider)

    async def aclose(self) -> None:
        await self.app.aclose()
        await self.hub.aclose()
        await self.environment.aclose()


def _require_openenv() -> None:
    try:
        import openenv.core.env_server  # noqa: F401
    except ImportError as exc:
        raise EnvironmentPluginError(
            f"serving over OpenEnv needs the openenv package ({exc}): pip install 'agentrl[openenv]' "
            "then pip install --no-deps 'openenv>=0.10,<0.11' (the slim install, without its web UI)"
        ) from None


def openenv_line() -> str:
    """Which distribution provides the `openenv` module here, and its version: the `openenv` line
    (0.10.x) or `openenv-core` (0.3.x, which upstream environment packages install over it)."""
    from importlib import metadata

    owners = metadata.packages_distributions().get("openenv", [])
    found = []
    for name in dict.fromkeys(owners):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or "an openenv module of unknown origin"


class OpenEnvVersionError(EnvironmentPluginError):
    """The installed `openenv` module is not the package line `agentrl env serve` is built on."""


def _app_options(create: Any, **wanted: Any) -> dict[str, Any]:
    """The options `create_fastapi_app` must take. openenv 0.10 names the app (`env_name`), types
    its state (`state_cls`) and picks `mode`; openenv-core 0.3 (which every upstream environment
    package installs over the shared `openenv` module) has none of them, and signals a full server
    differently, so serving on it is refused with the way back instead of a TypeError."""
    params = inspect.signature(create).parameters
    missing = sorted(k for k in wanted if k not in params)
    if missing:
        raise OpenEnvVersionError(
            f"agentrl env serve is built on openenv 0.10.x's server; the installed openenv module comes "
            f"from {openenv_line()}, whose create_fastapi_app has no {', '.join(missing)} (an upstream "
            "environment package that depends on openenv-core replaces the module). Restore it with "
            "pip install --no-deps --force-reinstall 'openenv>=0.10,<0.11'"
        )
    return wanted


def build_server(config: ServeConfig, *, provider: SandboxProvider | None = None) -> Server:
    """The app for `config`; `provider` replaces the plugin's sandbox backend (tests)."""
    _require_openenv()
    from openenv.core.env_server.http_server import create_fastapi_app

    from agentrl.openenv.schema import TerminalObservation, TerminalState
    from agentrl.openenv.terminal import ServedAction, TerminalEnvironment, TerminalHub

    plugin = get_plugin(config.env["name"])
    env_config = plugin.Config.model_validate(config.env)
    environment: Any = plugin.build(
        env_config, EnvContext(tokenizer=None, seed=0, out_dir=Path("."), temperature=1.0)
    )
    hub = TerminalHub(
        config,
        environment.tasks,
        provider if provider is not None else environment.provider,
        create_timeout_s=env_config.create_timeout_s,  # type: ignore[attr-defined]
    )
    app = create_fastapi_app(
        functools.partial(TerminalEnvironment, hub),
        ServedAction,
        TerminalObservation,
        max_concurrent_envs=config.max_sessions,
        **_app_options(
            create_fastapi_app, env_name=config.env["name"], state_cls=TerminalState, mode="simulation"
        ),
    )
    stateless = (
        "stateless HTTP episodes are not served: a terminal episode keeps a sandbox, which lives as "
        "long as a WebSocket session; connect to /ws (openenv's EnvClient does)"
    )
    no_ws_mcp = (
        "MCP over the /mcp WebSocket is not served (an episode starts with a reset, which it cannot "
        "send): call the tools (exec, write_file, evaluate) as list_tools / call_tool steps over /ws, "
        "or over POST /mcp in a session opened there and reset over /ws?session_id= (upstream's "
        "MCPToolClient does this)"
    )
    guarded = Guard(
        app,
        max_message_chars=config.max_message_chars,
        idle_timeout_s=config.idle_timeout_s,
        max_http_body_bytes=config.max_http_body_bytes,
        refused={"POST /reset": stateless, "POST /step": stateless, "WS /mcp": no_ws_mcp},
    )
    server = Server(app=guarded, hub=hub, environment=environment)
    app.router.on_startup.append(hub.start)
    app.router.on_shutdown.append(server.aclose)
    return server


def _uvicorn_config(config: ServeConfig, app: Any) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        ws_max_size=config.max_frame_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        log_level="warning",
        timeout_graceful_shutdown=int(config.close_timeout_s),
    )


def serve(config: ServeConfig, *, provider: SandboxProvider | None = None) -> None:
    """Run the server until interrupted; every sandbox is closed on the way out."""
    import uvicorn

    server = build_server(config, provider=provider)
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "serving on %s: anyone who reaches it can run commands in sandboxes (there is no "
            "authentication); put it behind your own access control",
            config.host,
        )
    uvicorn.Server(_uvicorn_config(config, server.app)).run()


@contextlib.contextmanager
def run_in_thread(
    config: ServeConfig, *, provider: SandboxProvider | None = None, start_timeout_s: float = 60.0
) -> Iterator[tuple[str, Server]]:
    """Serve in a background thread with its own event loop; yields (base URL, server). Leaving
    the block shuts the server down (sessions closed, sandboxes released)."""
    import uvicorn

    server = build_server(config, provider=provider)
    userver = uvicorn.Server(_uvicorn_config(config, server.app))
    failure: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(userver.serve())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=main, name="openenv-server", daemon=True)
    thread.start()
    deadline = threading.Event()
    for _ in range(int(start_timeout_s * 20)):
        if userver.started or failure or not thread.is_alive():
            break
        deadline.wait(0.05)
    if not userver.started:
        userver.should_exit = True
        thread.join(10)
        raise AgentRLError(f"the OpenEnv server did not start: {failure[0] if failure else 'timeout'}")
    port = userver.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{config.host}:{port}", server
    finally:
        userver.should_exit = True
        thread.join(config.close_timeout_s + 30)
