"""`DaytonaSandbox`: one Daytona sandbox; exec through the SDK's process API and sessions, bounded
replies, upload and download, terminals, the tamper scan, keep-alive."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import math
import os
import re
import shlex
import tarfile
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from daytona import (
    DaytonaError,
    FileDownloadRequest,
    FileUpload,
    SessionExecuteRequest,
)
from daytona_toolbox_api_client_async import ExecuteRequest as ToolboxExecuteRequest
from daytona_toolbox_api_client_async import ExecuteResponse as ToolboxExecuteResponse
from daytona_toolbox_api_client_async import SessionCommandLogsResponse as ToolboxSessionLogs

from agentrl.errors import AgentRLError, InputError
from agentrl.sandbox.base import (
    SYSTEM_PREFIXES,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxPolicyError,
    SandboxTransportError,
    TerminalSession,
    bound_output,
    tampered,
    too_large,
    untar_bounded,
)
from agentrl.sandbox.daytona.common import (
    _ENV_NAME,
    _USER_NAME,
    CORE_PROBE,
    NO_TIMEOUT_S,
    SESSION_SCRIPT,
    SHADOW_PATHS,
    STOP_PROCESSES,
    _new_state_dir,
)
from agentrl.sandbox.terminal import TmuxTerminal
from agentrl.tasks.config import host_kind

log = logging.getLogger(__name__)


class DaytonaHost(Protocol):
    """What a sandbox needs of the provider that created it (`DaytonaProvider`)."""

    output_limit: int
    exec_limit_s: float
    exec_grace_s: float
    session_poll_s: float
    session_poll_max_s: float
    transfer_timeout_s: float
    private_verification: bool

    def _spawn(self, coro: Any, timeout: float) -> None: ...

    async def _delete(self, sandbox: DaytonaSandbox) -> None: ...

    async def copy_of(self, sandbox: DaytonaSandbox) -> DaytonaSandbox: ...


class DaytonaSandbox(Sandbox):
    """One started Daytona sandbox; created by `DaytonaProvider.create`."""

    def __init__(self, provider: DaytonaHost, sdk_sandbox: Any, task_id: str, workdir: str | None) -> None:
        self.provider = provider
        self.sdk = sdk_sandbox
        self.sandbox_id: str = sdk_sandbox.id
        self.task_id = task_id
        self.workdir = workdir
        self.output_limit = provider.output_limit
        self._closed = False
        self._session_id: str | None = None
        self._session_lock = asyncio.Lock()
        self._last_activity = time.monotonic()
        self._keepalive: asyncio.Task[None] | None = None
        self.created_at = time.time()
        self._core: dict[str, str | None] | None = None  # see record_baseline
        self._core_clean: bool | None = None  # compared after the verifier's kill: unchanged
        self._started_clock: int | None = None  # the sandbox's clock (epoch s) before the agent ran
        self._infra: dict[str, tuple[str, str]] | None = None
        self._state_dir = _new_state_dir()  # the agent's shell session (shellstate.py)
        self._terminals: list[TmuxTerminal] = []
        # What `copy_of` needs: the create parameters and the network as it is now (`set_network`),
        # and for a copy, the snapshot it was made from (deleted with it).
        self.params: Any = None
        self.network: dict[str, Any] = {}
        self.snapshot: str | None = None

    def __repr__(self) -> str:
        return f"DaytonaSandbox({self.sandbox_id!r}, task={self.task_id!r})"

    # -- exec ------------------------------------------------------------------------------------
    def _script(
        self,
        cmd: str,
        nonce: str,
        *,
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
        user: str | int | None,
        session: bool = False,
    ) -> str:
        for key in env or {}:
            if not _ENV_NAME.match(key):
                raise AgentRLError(f"environment variable name {key!r} is not a valid shell name")
        if user is not None and not _USER_NAME.match(str(user)):
            raise AgentRLError(f"user {user!r} is not a valid user name or uid")
        seconds = NO_TIMEOUT_S if timeout is None else max(timeout, 0.01)
        assigns = " ".join(shlex.quote(f"{k}={v}") for k, v in (env or {}).items())
        # `$__ar_sh` (bash, or sh where an image has no bash) is expanded by the wrapper's subshell.
        inner = f'env {assigns} "$__ar_sh" -c {shlex.quote(cmd)}'
        if user is not None and str(user) not in ("root", "0"):
            u = shlex.quote(str(user))
            su_arg = (
                shlex.quote(f"exec env {assigns} ") + '"$__ar_sh"' + shlex.quote(f" -c {shlex.quote(cmd)}")
            )
            run = (
                f"if command -v runuser >/dev/null 2>&1; then exec timeout -k 5 {seconds:.3f} runuser -u {u} "
                f"-- {inner}; else exec timeout -k 5 {seconds:.3f} su -s /bin/sh {u} -c {su_arg}; fi"
            )
        else:
            run = f"exec timeout -k 5 {seconds:.3f} {inner}"
        commit = ""
        if session:
            # bash only (a shell without `declare` keeps no session); the state is adopted unless
            # the command was killed by its timeout (124, 137) or saved nothing.
            state = shlex.quote(self._state_dir)
            run = (
                f'if [ "$__ar_sh" = bash ]; then exec timeout -k 5 {seconds:.3f} bash -c '
                f"{shlex.quote(SESSION_SCRIPT)} bash {state} $d {shlex.quote(cmd)}; else {run}; fi"
            )
            commit = (
                f'if [ "$rc" != 124 ] && [ "$rc" != 137 ] && [ -s $d/st/s ]; then '
                f"rm -rf {state} && mv $d/st {state}; fi\n"
            )
        cd = f"cd -- {shlex.quote(cwd)} || exit 1; " if cwd else ""
        half = self.output_limit // 2
        d = f"/tmp/.agentrl-exec-{nonce}"
        return (
            f"d={d}; mkdir -p $d/st || exit 125\n"
            "if command -v bash >/dev/null 2>&1; then __ar_sh=bash; else __ar_sh=sh; fi\n"
            f"( {cd}{run} ) </dev/null >$d/o 2>$d/e &\n"
            f"echo $! >$d/p; wait $!; rc=$?\n{commit}"
            f'emit() {{ s=$(wc -c <"$1"); if [ "$s" -gt {2 * half} ]; then head -c {half} "$1"; '
            f'printf \'\\n__AGENTRL_CUT_{nonce} %s\\n\' "$s"; tail -c {half} "$1"; '
            'else cat "$1"; fi; }\n'
            f"printf '__AGENTRL_OUT_{nonce}\\n'; emit $d/o; printf '\\n__AGENTRL_ERR_{nonce}\\n'; emit $d/e; "
            f"printf '\\n__AGENTRL_END_{nonce} %s\\n' \"$rc\"; rm -rf $d\n"
        )

    def _section(self, text: str, nonce: str) -> str:
        cut = re.search(rf"\n__AGENTRL_CUT_{nonce} (\d+)\n", text)
        if cut is None:
            return bound_output(text, self.output_limit)
        head, tail = text[: cut.start()], text[cut.end() :]
        omitted = int(cut.group(1)) - 2 * (self.output_limit // 2)
        return f"{head}\n[... {omitted} bytes omitted ...]\n{tail}"

    def _parse(self, raw: str, nonce: str) -> tuple[str, str, int]:
        out_tag, err_tag = f"__AGENTRL_OUT_{nonce}\n", f"\n__AGENTRL_ERR_{nonce}\n"
        end = re.search(rf"\n__AGENTRL_END_{nonce} (-?\d+)", raw)
        i, j = raw.find(out_tag), raw.find(err_tag)
        if i < 0 or j < i or end is None or end.start() < j:
            # The toolbox answered, so the sandbox is there: the command itself broke the wrapper
            # (killed it, filled the disk, wrote into its stdout). A policy outcome, never infra.
            raise SandboxPolicyError(
                f"daytona sandbox {self.sandbox_id}: the command wrapper's reply is incomplete "
                f"(the command killed its shell, filled the disk or wrote into the reply): {raw[-500:]!r}",
                cause="shell_protocol",
            )
        out = raw[i + len(out_tag) : j]
        err = raw[j + len(err_tag) : end.start()]
        return self._section(out, nonce), self._section(err, nonce), int(end.group(1))

    async def _exec(
        self,
        cmd: str,
        *,
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
        user: str | int | None,
        session: bool,
    ) -> ExecResult:
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        nonce = uuid.uuid4().hex
        script = self._script(
            cmd, nonce, timeout=timeout, cwd=cwd or self.workdir, env=env, user=user, session=session
        )
        wrapped = f"sh -c {shlex.quote(script)}"
        start = time.monotonic()
        self._last_activity = start
        try:
            if timeout is not None and timeout <= self.provider.exec_limit_s:
                raw = await self._exec_request(wrapped, timeout)
            else:
                raw = await self._exec_session(wrapped, timeout)
        except asyncio.CancelledError:
            self._kill_in_background(nonce)
            raise
        except TimeoutError as exc:
            self._kill_in_background(nonce)
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: no reply to a command within its timeout plus grace"
            ) from exc
        except DaytonaError as exc:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: exec failed: {exc.message}"
            ) from exc
        except (
            aiohttp.ClientError,
            ConnectionError,
        ) as exc:  # the toolbox calls made without the SDK's wrapper
            raise SandboxTransportError(f"daytona sandbox {self.sandbox_id}: exec failed: {exc!r}") from exc
        finally:
            self._last_activity = time.monotonic()
        out, err, rc = self._parse(raw, nonce)
        duration = time.monotonic() - start
        timed_out = timeout is not None and rc in (124, 137) and duration >= timeout * 0.98
        return ExecResult(out, err, None if timed_out else rc, timed_out, duration)

    async def _exec_request(self, wrapped: str, timeout: float) -> str:
        grace = self.provider.exec_grace_s
        server_timeout = math.ceil(timeout + grace)
        api = self.sdk.process._api_client  # the toolbox's generated `ProcessApi`, as `process.exec` uses it
        request = ToolboxExecuteRequest(command=wrapped, timeout=server_timeout)

        async def call() -> str:
            resp = await api.execute_command_without_preload_content(
                request=request, _request_timeout=float(server_timeout + 5)
            )
            body = await self._bounded_body(resp, "a command")
            if resp.status == 408:
                raise TimeoutError(body[:300].decode(errors="replace"))
            if resp.status != 200:
                raise SandboxTransportError(
                    f"daytona sandbox {self.sandbox_id}: exec failed: HTTP {resp.status}: "
                    f"{body[:500].decode(errors='replace')}"
                )
            return ToolboxExecuteResponse.from_json(body.decode(errors="replace")).result or ""

        return await asyncio.wait_for(call(), timeout + 2 * grace)

    def reply_limit(self) -> int:
        """The largest reply a command's wrapper can send: two streams bounded inside the sandbox
        to `output_limit` bytes each, JSON-escaped (up to 6 bytes a byte), and the frame. Anything
        longer was written into the reply by the command itself."""
        return 12 * self.output_limit + 64 * 1024

    async def _bounded_body(self, resp: Any, what: str) -> bytes:
        """Read an HTTP reply of the toolbox without ever holding more than `reply_limit` bytes:
        the SDK's own calls read whole bodies, and a command can write gigabytes into its reply."""
        limit = self.reply_limit()
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := await resp.content.read(1 << 16):
                size += len(chunk)
                if size > limit:
                    resp.close()  # drop the connection rather than drain it
                    raise SandboxPolicyError(
                        f"daytona sandbox {self.sandbox_id}: the reply to {what} is over {limit} bytes "
                        "(the command wrote into its wrapper's output)",
                        cause="shell_protocol",
                    )
                chunks.append(chunk)
        finally:
            resp.release()
        return b"".join(chunks)

    async def _session(self) -> str:
        async with self._session_lock:
            if self._session_id is None:
                sid = f"agentrl-{uuid.uuid4().hex[:12]}"
                await asyncio.wait_for(self.sdk.process.create_session(sid, request_timeout=60), 90)
                self._session_id = sid
            return self._session_id

    async def _exec_session(self, wrapped: str, timeout: float | None) -> str:
        """Long commands: start asynchronously in a session, poll for the exit code, read the logs."""
        sid = await self._session()
        resp = await asyncio.wait_for(
            self.sdk.process.execute_session_command(
                sid, SessionExecuteRequest(command=wrapped, run_async=True), timeout=60
            ),
            90,
        )
        limit = NO_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + limit + self.provider.exec_grace_s
        poll = self.provider.session_poll_s
        while True:
            command = await asyncio.wait_for(
                self.sdk.process.get_session_command(sid, resp.cmd_id, request_timeout=60), 90
            )
            if command.exit_code is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"session command {resp.cmd_id} still running past its timeout")
            await asyncio.sleep(poll)
            poll = min(poll * 1.5, self.provider.session_poll_max_s)
        api = self.sdk.process._api_client

        async def logs() -> str:
            reply = await api.get_session_command_logs_without_preload_content(
                session_id=sid, command_id=resp.cmd_id, _request_timeout=120.0
            )
            body = await self._bounded_body(reply, "a session command's logs")
            if reply.status != 200:
                raise SandboxTransportError(
                    f"daytona sandbox {self.sandbox_id}: reading a command's logs failed: HTTP {reply.status}: "
                    f"{body[:500].decode(errors='replace')}"
                )
            parsed = ToolboxSessionLogs.from_json(body.decode(errors="replace"))
            return parsed.stdout if parsed.stdout is not None else (parsed.output or "")

        return await asyncio.wait_for(logs(), 150)

    def _kill_in_background(self, nonce: str) -> None:
        """The client gave up on a command; the command itself still runs inside. Kill its process
        group without making the cancelled caller wait."""
        if self._closed:
            return
        d = f"/tmp/.agentrl-exec-{nonce}"
        script = f'p=$(cat {d}/p 2>/dev/null) && {{ kill -9 "-$p" 2>/dev/null || kill -9 "$p"; }}; rm -rf {d}'
        self.provider._spawn(self.sdk.process.exec(f"sh -c {shlex.quote(script)}", timeout=30), 45)

    # -- terminal ---------------------------------------------------------------------------------
    async def open_terminal(self, *, width: int = 160, height: int = 40) -> TerminalSession:
        """A tmux session in the sandbox, every tmux command one clean `exec` round trip. Daytona's
        own PTY sessions are not used: Terminus-2's semantics are tmux's (key names, the screen
        as `capture-pane` renders it, the scrollback), which a raw PTY stream does not give."""
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        term = await TmuxTerminal.start(
            self._exec_clean_for_terminal,
            width=width,
            height=height,
            where=f"daytona sandbox {self.sandbox_id}",
            hint="the Daytona image layer that installs it found no package manager or no mirror",
        )
        self._terminals.append(term)
        return term

    async def _exec_clean_for_terminal(self, cmd: str, timeout: float) -> ExecResult:
        return await self._exec_clean(cmd, timeout=timeout)

    def _end_terminals(self) -> None:
        for term in self._terminals:
            term.mark_closed()
        self._terminals.clear()

    # -- the verifier's trusted view (file API only) ------------------------------------------------
    async def record_baseline(self, core: dict[str, str | None] | None = None) -> dict[str, str | None]:
        """Before the agent's first command: the processes the sandbox runs by itself (toolbox
        daemon, init, their helpers) and the content of the verifier's core files (`CORE_TOOLS`
        with their libraries and loader, `SHADOW_PATHS`). `core` reuses a record made on another
        sandbox of the same image; the record is returned for that purpose."""
        probe = await self._exec_clean(
            ("date +%s; " + CORE_PROBE) if core is None else "date +%s", timeout=120
        )
        first, _, rest = probe.stdout.partition("\n")
        self._started_clock = int(first) if first.strip().isdigit() else None
        if core is None:
            found = {p for p in rest.splitlines() if p.startswith("/")}
            core = await self._digests(sorted(found | set(SHADOW_PATHS)))
        self._core = core
        self._infra = await self._processes()
        return core

    async def _digests(self, paths: list[str]) -> dict[str, str | None]:
        """sha256 of each path's content as the daemon reads it (symlinks followed), None if absent."""
        requests = [FileDownloadRequest(source=p) for p in paths]
        try:
            responses = await asyncio.wait_for(
                self.sdk.fs.download_files(requests, timeout=self.provider.transfer_timeout_s),
                self.provider.transfer_timeout_s + 30,
            )
        except (DaytonaError, TimeoutError) as exc:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: reading the verifier's core files failed: {exc}"
            ) from exc
        digests: dict[str, str | None] = {}
        for path, resp in zip(paths, responses, strict=True):
            if resp.error or resp.result is None:
                digests[path] = None
                continue
            data = resp.result if isinstance(resp.result, bytes) else Path(resp.result).read_bytes()
            digests[path] = hashlib.sha256(data).hexdigest()
        return digests

    async def _processes(self) -> dict[str, tuple[str, str]]:
        """Live processes as {pid: (state, comm)} from `/proc` through the file API."""
        try:
            entries = await asyncio.wait_for(self.sdk.fs.list_files("/proc", request_timeout=60), 90)
            pids = [e.name for e in entries if e.name.isdigit()]
            responses = await asyncio.wait_for(
                self.sdk.fs.download_files(
                    [FileDownloadRequest(source=f"/proc/{p}/stat") for p in pids], timeout=60
                ),
                90,
            )
        except (DaytonaError, TimeoutError) as exc:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: listing /proc failed: {exc}"
            ) from exc
        found: dict[str, tuple[str, str]] = {}
        for pid, resp in zip(pids, responses, strict=True):
            if resp.error or resp.result is None:
                continue  # exited between the listing and the read
            data = resp.result if isinstance(resp.result, bytes) else Path(resp.result).read_bytes()
            stat = data.decode(errors="replace")
            # `pid (comm) state ...`; comm may hold spaces and parentheses: split at the last ')'.
            head, _, rest = stat.rpartition(")")
            comm = head.partition("(")[2]
            state = rest.split()[0] if rest.split() else "?"
            found[pid] = (state, comm)
        return found

    async def _core_changes(self) -> list[str]:
        if self._core is None:
            return []
        now = await self._digests(sorted(self._core))
        return sorted(p for p, digest in now.items() if digest != self._core[p])

    async def set_network(self, policy: str, allowed_hosts: tuple[str, ...] = ()) -> None:
        """The runner's network settings (`update_network_settings`): outside the sandbox."""
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        settings: dict[str, Any] = {"network_block_all": policy != "public"}
        if policy == "allowlist":
            settings = allow_settings(allowed_hosts)
        try:
            await asyncio.wait_for(self.sdk.update_network_settings(**settings, request_timeout=60), 90)
        except (DaytonaError, TimeoutError) as exc:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: switching the network to {policy!r} failed: {exc}"
            ) from exc
        self.network = settings

    @contextlib.asynccontextmanager
    async def verification_copy(self) -> AsyncIterator[Sandbox]:
        """With the provider's `private_verification`, a sandbox made from a snapshot of this one
        after the kill: the agent's files, none of its processes (a server it left listening, a
        process that got past the kill, or one driving the toolbox daemon cannot reach the tests or
        the reward), the network as this sandbox's is now; deleted with its snapshot at the end.
        Without it, this sandbox."""
        if not self.provider.private_verification:
            yield self
            return
        copy = await self.provider.copy_of(self)
        try:
            yield copy
        finally:
            await copy.close()

    async def stop_processes(self) -> None:
        """Kill what the agent started, then check from outside that it worked: the kill runs the
        sandbox's own shell, so core files changed since the start, or a process of the agent's
        still alive afterwards (other than a server listening on a socket, which is kept), mean
        the agent subverted it (`tampered`, a policy outcome). The core files are compared after
        the kill, when nothing of the agent's can change them back any more."""
        self._end_terminals()
        try:
            res = await self._exec_clean(STOP_PROCESSES, timeout=120)
        except SandboxPolicyError:
            # The kill's own shell gave no proper reply: a replaced shell says why more precisely.
            changed = await self._core_changes() if self._core is not None else []
            if changed:
                raise SandboxPolicyError(
                    f"daytona sandbox {self.sandbox_id}: files the verifier runs were replaced: "
                    + ", ".join(changed[:10]),
                    cause="system_files",
                ) from None
            raise
        kept = set(re.findall(r"^__agentrl_(?:kept|frozen) (\d+)$", res.stdout, re.MULTILINE))
        self._session_id = None  # its shell was killed with the rest
        self._state_dir = _new_state_dir()  # the verifier never sees the agent's shell session
        if self._core is not None and self._core_clean is None:
            changed = await self._core_changes()
            if changed:
                raise SandboxPolicyError(
                    f"daytona sandbox {self.sandbox_id}: files the verifier runs were replaced: "
                    + ", ".join(changed[:10]),
                    cause="system_files",
                )
            self._core_clean = True  # for tampered_paths: nothing of the agent's runs any more
        if self._infra is None:
            return
        infra_names = {comm for _, comm in self._infra.values()}
        survivors: dict[str, tuple[str, str]] = {}
        for _ in range(3):
            live = await self._processes()
            survivors = {
                pid: (state, comm)
                for pid, (state, comm) in live.items()
                if pid not in self._infra
                and pid not in kept
                and state not in ("Z", "X")
                and comm not in infra_names
            }
            if not survivors:
                return
            await asyncio.sleep(0.5)
        shown = ", ".join(f"{pid} ({comm}, {state})" for pid, (state, comm) in sorted(survivors.items())[:10])
        raise SandboxPolicyError(
            f"daytona sandbox {self.sandbox_id}: processes survived the verifier's kill: {shown}",
            cause="system_files",
        )

    async def tampered_paths(self) -> list[str] | None:
        """Daytona has no `diff` against the image. First the core files (`record_baseline`),
        compared through the file API; with those intact, the sandbox's own `find` can be trusted
        for the rest: files whose status changed since the sandbox was created (`find -newerct`: a
        ctime cannot be set back) under the system prefixes, and suspicious additions anywhere."""
        if not self._core_clean:
            changed_core = await self._core_changes()
            if changed_core:
                return changed_core
        # The sandbox's own clock when it started (`record_baseline`), else the host's with slack.
        since = self._started_clock - 1 if self._started_clock is not None else int(self.created_at) - 120
        prune = " -o ".join(f"-path {p}" for p in ("/proc", "/sys", "/dev", "/run", "/tmp", "/logs"))
        name = f".agentrl-tamper-{uuid.uuid4().hex}"
        # The list travels as a file through the file API: the exec reply passes the sandbox's `cat`.
        await self._exec_clean(
            f"find / -xdev \\( {prune} \\) -prune -o ! -type d -newerct @{since} -print > /tmp/{name} 2>/dev/null",
            timeout=300,
        )
        with tempfile.TemporaryDirectory(prefix="agentrl-tamper-") as tmp:
            if not await self.fetch_files("/tmp", [name], Path(tmp)):
                return ["/tmp (the list of changed files could not be written)"]
            listing = (Path(tmp) / name).read_text(errors="replace")
        await self._exec_clean(f"rm -f /tmp/{name}", timeout=60)
        paths = [p for p in listing.splitlines() if p.startswith("/")]
        changed = [p for p in paths if p.startswith(SYSTEM_PREFIXES) and not p.startswith("/usr/local/")]
        return tampered(changed, [], paths)

    async def fetch_files(self, directory: str, names: list[str], dst: Path) -> list[str]:
        """All files in one request to the toolbox's file API: no `test` or `tar` run by the
        sandbox, whose binaries the agent may have replaced."""
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        requests = [FileDownloadRequest(source=f"{directory.rstrip('/')}/{n}") for n in names]
        try:
            responses = await asyncio.wait_for(
                self.sdk.fs.download_files(requests, timeout=self.provider.transfer_timeout_s),
                self.provider.transfer_timeout_s + 30,
            )
        except (DaytonaError, TimeoutError) as exc:
            raise SandboxTransportError(f"daytona sandbox {self.sandbox_id}: download failed: {exc}") from exc
        dst.mkdir(parents=True, exist_ok=True)
        present = []
        for name, resp in zip(names, responses, strict=True):
            if resp.error or resp.result is None:
                continue
            data = resp.result if isinstance(resp.result, bytes) else Path(resp.result).read_bytes()
            (dst / name).write_bytes(data)
            present.append(name)
        return present

    # -- files -----------------------------------------------------------------------------------
    async def _checked(self, cmd: str, what: str) -> ExecResult:
        res = await self._exec_clean(cmd, timeout=120)
        if res.exit_code != 0:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: {what} failed: {(res.stderr or res.stdout)[-500:]}"
            )
        return res

    async def upload(self, src: Path, dst: str) -> None:
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        src = Path(src)
        if not src.exists():
            raise AgentRLError(f"upload source {src} does not exist")
        if src.is_dir():
            files = sorted(p for p in src.rglob("*") if p.is_file())
            pairs = [(p, f"{dst.rstrip('/')}/{p.relative_to(src).as_posix()}") for p in files]
            dirs = {dst} | {
                f"{dst.rstrip('/')}/{p.relative_to(src).as_posix()}" for p in src.rglob("*") if p.is_dir()
            }
        else:
            pairs = [(src, dst)]
            dirs = set()
        dirs |= {os.path.dirname(remote) or "/" for _, remote in pairs}
        await self._checked("mkdir -p " + " ".join(shlex.quote(d) for d in sorted(dirs)), f"mkdir for {dst}")
        if pairs:
            try:
                await asyncio.wait_for(
                    self.sdk.fs.upload_files(
                        [FileUpload(source=str(p), destination=remote) for p, remote in pairs],
                        timeout=self.provider.transfer_timeout_s,
                    ),
                    self.provider.transfer_timeout_s + 30,
                )
            except (DaytonaError, TimeoutError) as exc:
                raise SandboxTransportError(
                    f"daytona sandbox {self.sandbox_id}: upload {src} -> {dst} failed: {exc}"
                ) from exc
        executable = [remote for p, remote in pairs if os.access(p, os.X_OK)]
        if executable:
            await self._checked("chmod +x " + " ".join(shlex.quote(r) for r in executable), "chmod")

    async def download(self, src: str, dst: Path, *, limit_bytes: int | None = None) -> None:
        if self._closed:
            raise SandboxError(f"daytona sandbox {self.sandbox_id} is closed")
        dst = Path(dst)
        q = shlex.quote(src)
        kind = (
            await self._exec_clean(
                f"if [ -d {q} ]; then echo dir; elif [ -e {q} ]; then echo file; fi", timeout=60
            )
        ).stdout.strip()
        if kind not in ("dir", "file"):
            if limit_bytes is not None:
                raise FileNotFoundError(f"{src} does not exist in daytona sandbox {self.sandbox_id}")
            raise SandboxTransportError(f"daytona sandbox {self.sandbox_id}: {src} does not exist")
        remote = src
        if kind == "dir":
            # One archive instead of one request per file; extracted with tarfile's `data` filter,
            # so links or absolute paths inside cannot write outside `dst`.
            remote = f"/tmp/.agentrl-download-{uuid.uuid4().hex}.tar"
            await self._checked(f"tar -C {q} -cf {shlex.quote(remote)} .", f"archiving {src}")
        try:
            if limit_bytes is not None:
                # Sized by the toolbox's file API before the transfer (the archive, made by the
                # sandbox's own tar, is untrusted and re-filtered on the host).
                info = await self.sdk.fs.get_file_info(remote)
                if int(info.size) > limit_bytes + (1 << 20) * (kind == "dir"):
                    raise too_large(src, limit_bytes)
            responses = await asyncio.wait_for(
                self.sdk.fs.download_files(
                    [FileDownloadRequest(source=remote)], timeout=self.provider.transfer_timeout_s
                ),
                self.provider.transfer_timeout_s + 30,
            )
        except (DaytonaError, TimeoutError) as exc:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: download {src} failed: {exc}"
            ) from exc
        finally:
            if kind == "dir":
                await self._exec_clean(f"rm -f {shlex.quote(remote)}", timeout=60)
        (resp,) = responses
        if resp.error or resp.result is None:
            raise SandboxTransportError(
                f"daytona sandbox {self.sandbox_id}: download {src} failed: {resp.error}"
            )
        data = resp.result if isinstance(resp.result, bytes) else Path(resp.result).read_bytes()
        if kind == "file":
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            return
        dst.mkdir(parents=True, exist_ok=True)
        if limit_bytes is not None:
            untar_bounded(io.BytesIO(data), dst, limit_bytes, src)
            return
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(dst, filter="data")

    # -- lifetime --------------------------------------------------------------------------------
    def start_keepalive(self, interval_s: float) -> None:
        if interval_s > 0:
            self._keepalive = asyncio.get_running_loop().create_task(
                self._keep_alive(interval_s), name=f"daytona-keepalive-{self.sandbox_id}"
            )

    async def _keep_alive(self, interval_s: float) -> None:
        """Refresh Daytona's activity timer while no command runs (the model may think for minutes)."""
        while True:
            idle = time.monotonic() - self._last_activity
            await asyncio.sleep(max(interval_s - idle, 0.05))
            if time.monotonic() - self._last_activity < interval_s:
                continue
            try:
                await asyncio.wait_for(self.sdk.refresh_activity(request_timeout=30), 45)
                self._last_activity = time.monotonic()
            except (DaytonaError, TimeoutError) as exc:
                log.warning("daytona sandbox %s: keepalive failed: %s", self.sandbox_id, exc)
                self._last_activity = time.monotonic()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end_terminals()
        if self._keepalive is not None:
            self._keepalive.cancel()
        # Shielded: a cancelled owner must still not leave a (billed) sandbox behind.
        await asyncio.shield(self.provider._delete(self))
        if self._keepalive is not None:
            await asyncio.wait([self._keepalive], timeout=5)


def allow_settings(hosts: tuple[str, ...]) -> dict[str, Any]:
    """Daytona's network settings for an allowlist (its network limits: `domain_allow_list` for
    hostnames and *.wildcards, `network_allow_list` for IPv4 CIDRs, at most 5, an address as /32);
    an empty list blocks all. IPv6 entries and a sixth range are refused (`InputError`)."""
    domains, nets = [], []
    for host in hosts:
        kind = host_kind(host)
        if kind in ("hostname", "wildcard-hostname"):
            domains.append(host)
        elif kind == "ipv4-address":
            nets.append(f"{host}/32")
        elif kind == "ipv4-cidr":
            nets.append(host)
        else:
            raise InputError(
                f"Daytona's network limits take IPv4 ranges only: {host!r} ({kind}) cannot be allowed"
            )
    if len(nets) > 5:
        raise InputError(f"Daytona's network_allow_list takes at most 5 ranges; the task allows {len(nets)}")
    if not (domains or nets):
        return {"network_block_all": True}
    settings: dict[str, Any] = {"network_block_all": False}
    if domains:
        settings["domain_allow_list"] = ",".join(domains)
    if nets:
        settings["network_allow_list"] = ",".join(nets)
    return settings
