"""Local sandboxes on podman, written against the docker-compatible CLI (`docker` works the same:
`--cli docker` or `AGENTRL_CONTAINER_CLI=docker`).

- Images: built from the task's `environment/` context, tagged by a content hash of that context,
  so an unchanged task reuses its image; one build per tag at a time; `--pull=never` when the base
  image exists locally (offline stand-ins, see `images.py`); the build timeout from task.toml; the
  host CA bundle handed to pip in build steps (a pip.conf in a read-only mount at /etc/xdg/pip,
  which leaves nothing in the image) so `pip install` works behind TLS-intercepting proxies.
  Mounting the bundle over /etc/ssl/certs/ca-certificates.crt instead breaks every build that
  runs update-ca-certificates.
- Isolation: `--network=none` unless the task allows internet (or the user overrides), cpus and
  memory from task.toml, a pids limit, no host mounts; tests/ and solution/ are never inside
  during the agent phase. Labels (run id, task id, created-at) let `agentrl sandbox reap` find what
  a dead process left behind; containers are removed on close, on cancellation and at exit.
- Fast exec: commands go through one persistent `bash` per container over a pipe (~1 ms a command
  instead of ~150 ms for `podman exec`). Each command runs in its own subshell (cwd, env and shell
  state do not leak between commands, like Harbor's exec), under `timeout`, with stdout and stderr
  captured to files, bounded head+tail inside the container, and sent back base64-framed. If the
  shell dies, the sandbox falls back to one `podman exec` per command and says so once; a command
  the dying shell may have started is reported as a transport error, never run twice.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import hashlib
import logging
import os
import re
import shlex
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.sandbox.base import (
    DEFAULT_OUTPUT_LIMIT,
    ExecResult,
    ImageBuildError,
    Sandbox,
    SandboxCreateError,
    SandboxError,
    SandboxProvider,
    SandboxTransportError,
)

if TYPE_CHECKING:
    from agentrl.tasks import Task

log = logging.getLogger(__name__)

LABEL_RUN = "agentrl.run-id"
LABEL_TASK = "agentrl.task-id"
LABEL_CREATED = "agentrl.created-at"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_PIP_DIR = "/etc/xdg/pip"  # on pip's site-wide config path; mounted only during builds


def build_ca_dir(bundle: Path = HOST_CA_BUNDLE) -> Path | None:
    """A directory with the host CA bundle and a pip.conf pointing at it, for build mounts."""
    if not bundle.is_file():
        return None
    data = bundle.read_bytes()
    cache = Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))
    directory = cache / f"build-ca-{hashlib.sha256(data).hexdigest()[:12]}"
    if not (directory / "pip.conf").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "host-ca.crt").write_bytes(data)
        (directory / "pip.conf").write_text(f"[global]\ncert = {BUILD_PIP_DIR}/host-ca.crt\n")
    return directory


def is_podman(cli: str) -> bool:
    return "podman" in Path(cli).name


def rm_args(cli: str) -> list[str]:
    """Force removal at once: PID 1 (sleep) ignores SIGTERM, so do not wait for it to stop."""
    return ["rm", "-f", "-t", "0"] if is_podman(cli) else ["rm", "-f"]


@functools.cache
def cli_cwd() -> str:
    """Working directory for container CLI processes (so host paths passed to it must be absolute). podman's conmon writes a file named `oom`
    into its working directory when a process in the container is OOM-killed; run it here so that
    never lands in the user's directory."""
    path = Path(tempfile.gettempdir()) / f"agentrl-cli-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


# Containers this process started and has not removed; removed synchronously at interpreter exit.
_LIVE: dict[str, str] = {}


def _remove_live_at_exit() -> None:
    for name, cli in list(_LIVE.items()):
        subprocess.run(
            [cli, *rm_args(cli), name], capture_output=True, timeout=60, check=False, cwd=cli_cwd()
        )
        _LIVE.pop(name, None)


atexit.register(_remove_live_at_exit)


async def run_cli(
    cli: str, *args: str, timeout: float = 120, stdin: bytes | None = None
) -> tuple[int, str, str]:
    """Run a container CLI command; kill it on timeout or cancellation."""
    try:
        proc = await asyncio.create_subprocess_exec(
            cli,
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cli_cwd(),
        )
    except FileNotFoundError:
        raise SandboxError(
            f"container CLI {cli!r} not found: run `bash sandbox_images/setup_host.sh`, or pick another"
            " with AGENTRL_CONTAINER_CLI / --backend"
        ) from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


def context_hash(directory: Path) -> str:
    """Content hash of a build context: relative paths, modes and bytes of every file."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(directory).as_posix()
        h.update(rel.encode() + b"\0" + oct(path.lstat().st_mode).encode() + b"\0")
        h.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _from_images(dockerfile: Path) -> list[str]:
    images = []
    for line in dockerfile.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.strip().split()
        if len(parts) >= 2 and parts[0].upper() == "FROM":
            args = [p for p in parts[1:] if not p.startswith("--")]
            if args:
                images.append(args[0])
    return images


# Defined once per persistent shell. Everything on the per-command path is a bash builtin except
# the command itself and one fork for its subshell (process creation costs ~2-3 ms inside a
# container here): the timeout watchdog waits with `read -t` on a FIFO, the output is read with
# `read -N` and sent length-prefixed; `stat`/`head`/`tail` run only for outputs over the limit.
_BOOTSTRAP = r"""
__ar_lc=${LC_ALL-__unset__}; export LC_ALL=C; set -m
__ar_d=/tmp/.agentrl-shell-$$; mkdir -p $__ar_d; mkfifo $__ar_d/f; exec {__ar_fd}<>$__ar_d/f
__ar_emit() {
  local f=$__ar_d/$1 h= m= fd
  exec {fd}<"$f"
  IFS= read -r -N __LIMIT__ h <&$fd; IFS= read -r -N 1 m <&$fd
  exec {fd}<&-
  if [ -n "$m" ]; then
    printf '__AGENTRL_%s_%s BIG %s\n' "$3" "$2" "$(stat -c %s "$f")"
    head -c __HALF__ "$f"; tail -c __HALF__ "$f"
  else
    printf '__AGENTRL_%s_%s %d\n%s' "$3" "$2" "${#h}" "$h"
  fi
}
__ar_run() {
  local n=$1 t=$2 p w= rc to=0
  : > $__ar_d/t
  ( if [ "$__ar_lc" = __unset__ ]; then unset LC_ALL; else export LC_ALL="$__ar_lc"; fi
    if [ -n "$3" ]; then cd -- "$3" || exit 1; fi
    eval "$5"; eval "$4" ) </dev/null >$__ar_d/o 2>$__ar_d/e &
  p=$!; echo $p > $__ar_d/p
  if [ -n "$t" ]; then
    ( read -t "$t" -u $__ar_fd; echo 1 > $__ar_d/t; kill -KILL -- -$p 2>/dev/null || kill -KILL $p ) 2>/dev/null &
    w=$!
  fi
  wait $p; rc=$?
  if [ -n "$w" ]; then kill $w 2>/dev/null; wait $w 2>/dev/null; fi
  [ -s $__ar_d/t ] && to=1
  __ar_emit o "$n" OUT; __ar_emit e "$n" ERR
  printf '__AGENTRL_END_%s %d %d\n' "$n" "$rc" "$to"
}
echo __AGENTRL_READY $__ar_d
"""


class _NotSent(Exception):
    """The command never reached the persistent shell, so running it another way is safe."""


class _Shell:
    """One persistent bash inside the container, driven over a pipe with length-prefixed replies."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lock = asyncio.Lock()
        self.state_dir = ""

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def start(self, limit: int, wait: float = 30.0) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        half = limit // 2
        script = _BOOTSTRAP.replace("__LIMIT__", str(2 * half)).replace("__HALF__", str(half))
        self.proc.stdin.write(script.encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), wait)
        parts = line.split()
        if len(parts) != 2 or parts[0] != b"__AGENTRL_READY":
            raise SandboxTransportError(f"persistent shell did not start: {line[:200]!r}")
        self.state_dir = parts[1].decode()

    async def _payload(self, tag: bytes, wait: float) -> tuple[bytes, int]:
        """Read one `__AGENTRL_<tag>_<nonce> <len>` header and its bytes: (data, original size)."""
        assert self.proc.stdout is not None
        header = await asyncio.wait_for(self.proc.stdout.readline(), wait)
        if not header.startswith(tag):
            raise SandboxTransportError(f"persistent shell protocol error: {header[:200]!r}")
        parts = header.split()
        if parts[1] == b"BIG":
            size = int(parts[2])
            data = await asyncio.wait_for(self.proc.stdout.readexactly(self._half * 2), wait)
            return data, size
        n = int(parts[1])
        data = await asyncio.wait_for(self.proc.stdout.readexactly(n), wait) if n else b""
        return data, n

    async def run(
        self, line: str, nonce: str, wait: float, limit: int
    ) -> tuple[bytes, int, bytes, int, int, bool]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._half = limit // 2
        async with self.lock:
            if not self.alive:
                raise _NotSent("the persistent shell has exited")
            try:
                self.proc.stdin.write(line.encode())
                await self.proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise _NotSent(repr(exc)) from exc
            out, out_size = await self._payload(f"__AGENTRL_OUT_{nonce}".encode(), wait)
            err, err_size = await self._payload(f"__AGENTRL_ERR_{nonce}".encode(), 30.0)
            end = await asyncio.wait_for(self.proc.stdout.readline(), 30.0)
            parts = end.split()
            if not end.startswith(f"__AGENTRL_END_{nonce}".encode()) or len(parts) != 3:
                raise SandboxTransportError(f"persistent shell protocol error: {end[:200]!r}")
            return out, out_size, err, err_size, int(parts[1]), parts[2] == b"1"

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()


def _bounded(data: bytes, size: int) -> str:
    if size > len(data):
        half = len(data) // 2
        return (
            f"{data[:half].decode(errors='replace')}\n[... {size - len(data)} bytes omitted ...]\n"
            f"{data[half:].decode(errors='replace')}"
        )
    return data.decode(errors="replace")


class PodmanSandbox(Sandbox):
    def __init__(self, provider: PodmanProvider, name: str, workdir: str | None) -> None:
        self.provider = provider
        self.cli = provider.cli
        self.sandbox_id = name
        self.workdir = workdir
        self.output_limit = provider.output_limit
        self._shell: _Shell | None = None
        self._fallback_noted = False
        self._closed = False

    async def _start_shell(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            self.cli,
            "exec",
            "-i",
            self.sandbox_id,
            "bash",
            "--noprofile",
            "--norc",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            limit=32 * 1024 * 1024,  # one framed line carries a whole (bounded) output
            cwd=cli_cwd(),
        )
        self._shell = _Shell(proc)
        await self._shell.start(self.output_limit)

    @staticmethod
    def _line(
        cmd: str, *, timeout: float | None, cwd: str | None, env: dict[str, str] | None, nonce: str
    ) -> str:
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
        t = "" if timeout is None else f"{max(timeout, 0.001):.3f}"
        return (
            " ".join(
                [
                    "__ar_run",
                    nonce,
                    shlex.quote(t),
                    shlex.quote(cwd or ""),
                    shlex.quote(cmd),
                    shlex.quote(exports),
                ]
            )
            + "\n"
        )

    async def exec(
        self,
        cmd: str,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        if self._closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed")
        cwd = cwd or self.workdir
        if user not in (None, "root", 0, "0"):
            return await self._exec_cli(cmd, timeout=timeout, cwd=cwd, env=env, user=user)
        if self._fallback_noted:
            return await self._exec_cli(cmd, timeout=timeout, cwd=cwd, env=env, user=user)
        if self._shell is None:
            try:
                await self._start_shell()
            except (TimeoutError, SandboxTransportError, OSError) as exc:
                return await self._fall_back(exc, cmd, timeout=timeout, cwd=cwd, env=env)
        assert self._shell is not None
        nonce = uuid.uuid4().hex
        start = time.monotonic()
        wait = (timeout or 3600.0) + 30.0
        try:
            out, out_size, err, err_size, rc, timed_out = await self._shell.run(
                self._line(cmd, timeout=timeout, cwd=cwd, env=env, nonce=nonce),
                nonce,
                wait,
                self.output_limit,
            )
        except _NotSent as exc:
            return await self._fall_back(exc, cmd, timeout=timeout, cwd=cwd, env=env)
        except (TimeoutError, SandboxTransportError, OSError, asyncio.IncompleteReadError) as exc:
            # The command may have run, partly or fully: never run it a second time.
            self._shell.kill()
            self._kill_inside(self._shell.state_dir)
            self._shell = None
            running = await self._running()
            self._note_fallback(exc)
            where = "its persistent shell failed mid-command" if running else "the container is gone"
            raise SandboxTransportError(f"exec in {self.sandbox_id}: {where}: {exc!r}") from exc
        except asyncio.CancelledError:
            # The shell is mid-command: its framing can no longer be trusted. Killing the client
            # does not stop the command inside, so its process group is killed in the background.
            self._shell.kill()
            self._kill_inside(self._shell.state_dir)
            self._shell = None
            raise
        duration = time.monotonic() - start
        return ExecResult(
            _bounded(out, out_size), _bounded(err, err_size), None if timed_out else rc, timed_out, duration
        )

    def _note_fallback(self, exc: BaseException) -> None:
        if not self._fallback_noted:
            log.warning(
                "persistent shell of %s failed (%r); using one `%s exec` per command from now on",
                self.sandbox_id,
                exc,
                self.cli,
            )
            self._fallback_noted = True

    async def _fall_back(
        self,
        exc: BaseException,
        cmd: str,
        *,
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
    ) -> ExecResult:
        if self._shell is not None:
            self._shell.kill()
            self._shell = None
        self._note_fallback(exc)
        return await self._exec_cli(cmd, timeout=timeout, cwd=cwd, env=env, user=None)

    async def _exec_cli(
        self,
        cmd: str,
        *,
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
        user: str | int | None,
    ) -> ExecResult:
        args = ["exec"]
        if cwd:
            args += ["-w", cwd]
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        if user is not None:
            args += ["--user", str(user)]
        inner = (
            cmd if timeout is None else f"timeout -k 2 {max(timeout, 0.01):.3f} bash -c {shlex.quote(cmd)}"
        )
        start = time.monotonic()
        try:
            rc, out, err = await run_cli(
                self.cli, *args, self.sandbox_id, "bash", "-c", inner, timeout=(timeout or 3600.0) + 30.0
            )
        except TimeoutError as exc:
            raise SandboxTransportError(f"`{self.cli} exec` into {self.sandbox_id} hung") from exc
        duration = time.monotonic() - start
        if rc in (125, 126) and "no such container" in err.lower():
            raise SandboxTransportError(f"container {self.sandbox_id} is gone: {err.strip()[-300:]}")
        timed_out = timeout is not None and rc in (124, 137) and duration >= timeout * 0.98
        from agentrl.sandbox.base import bound_output

        return ExecResult(
            bound_output(out, self.output_limit),
            bound_output(err, self.output_limit),
            None if timed_out else rc,
            timed_out,
            duration,
        )

    def _kill_inside(self, state_dir: str) -> None:
        if not state_dir:
            return
        script = f"kill -KILL -- -$(cat {state_dir}/p) 2>/dev/null; rm -rf {state_dir}"
        t = asyncio.get_running_loop().create_task(
            run_cli(self.cli, "exec", self.sandbox_id, "bash", "-c", script, timeout=30)
        )
        self.provider._background.add(t)
        t.add_done_callback(self.provider._background.discard)

    async def _running(self) -> bool:
        rc, out, _ = await run_cli(
            self.cli, "inspect", "--format", "{{.State.Running}}", self.sandbox_id, timeout=30
        )
        return rc == 0 and out.strip() == "true"

    async def upload(self, src: Path, dst: str) -> None:
        src = Path(src).resolve()  # the CLI runs in cli_cwd()
        if src.is_dir():
            await self.exec(f"mkdir -p {shlex.quote(dst)}")
            rc, _, err = await run_cli(self.cli, "cp", f"{src}/.", f"{self.sandbox_id}:{dst}", timeout=300)
        else:
            await self.exec(f"mkdir -p {shlex.quote(os.path.dirname(dst) or '/')}")
            rc, _, err = await run_cli(self.cli, "cp", str(src), f"{self.sandbox_id}:{dst}", timeout=300)
        if rc != 0:
            raise SandboxTransportError(f"upload {src} -> {dst} failed: {err.strip()[-500:]}")

    async def download(self, src: str, dst: Path) -> None:
        # A directory's contents land in dst, like upload, whether or not dst exists yet.
        is_dir = (await self.exec(f"test -d {shlex.quote(src)}", timeout=30)).exit_code == 0
        dst = Path(dst).resolve()  # the CLI runs in cli_cwd()
        dst.parent.mkdir(parents=True, exist_ok=True)
        source = f"{src.rstrip('/')}/." if is_dir else src
        rc, _, err = await run_cli(self.cli, "cp", f"{self.sandbox_id}:{source}", str(dst), timeout=300)
        if rc != 0:
            raise SandboxTransportError(f"download {src} -> {dst} failed: {err.strip()[-500:]}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._shell is not None:
            self._shell.kill()
        # Shielded: a cancelled owner must still not leave the container behind.
        await asyncio.shield(self.provider._remove(self.sandbox_id))

    async def alive(self) -> bool:
        if self._closed:
            return False
        try:
            res = await self.exec("true", timeout=10)
        except SandboxError:
            return False
        return res.exit_code == 0


class PodmanProvider(SandboxProvider):
    """Creates `PodmanSandbox`es for tasks; optionally keeps a warm pool per task."""

    def __init__(
        self,
        *,
        cli: str | None = None,
        allow_network: bool | None = None,
        pids_limit: int = 1024,
        inject_ca: bool = True,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        warm_pool: int = 0,
        default_memory_mb: int | None = None,
    ) -> None:
        self.cli = cli or os.environ.get("AGENTRL_CONTAINER_CLI", "podman")
        self.allow_network = allow_network  # None: the task decides; True/False: user override
        self.pids_limit = pids_limit
        # docker build has no build-time mounts; podman's `-v` on build is what makes this work.
        self._podman = is_podman(self.cli)
        self._ca_dir = build_ca_dir() if inject_ca and self._podman else None
        self.output_limit = output_limit
        self.warm_pool = warm_pool
        self.default_memory_mb = default_memory_mb
        self._build_locks: dict[str, asyncio.Lock] = {}
        self._live: set[str] = set()
        self._pool: dict[str, list[PodmanSandbox]] = {}
        self._pool_tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[tuple[int, str, str]]] = set()

    # -- images ---------------------------------------------------------------------------------
    async def image_for(self, task: Task) -> str:
        """The image to run `task` in: `docker_image` when it is local or can be pulled (Harbor's
        default), else the image built from environment/Dockerfile."""
        env = task.config.environment
        if env.docker_image:
            if await self._have_or_pull(env.docker_image):
                return env.docker_image
            if task.dockerfile is None:
                raise SandboxCreateError(
                    f"{task.task_id}: docker_image {env.docker_image!r} is neither local nor pullable"
                    " and there is no environment/Dockerfile to build instead"
                )
            log.info("%s: %s unavailable; building environment/Dockerfile", task.task_id, env.docker_image)
        if task.dockerfile is None:
            raise SandboxCreateError(f"{task.task_id}: no environment/Dockerfile and no docker_image")
        tag = f"localhost/agentrl-task/{task.task_id.lower()}:{context_hash(task.environment_dir)}"
        lock = self._build_locks.setdefault(tag, asyncio.Lock())
        async with lock:
            rc, _, _ = await run_cli(self.cli, "image", "inspect", tag, timeout=60)
            if rc == 0:
                return tag
            await self._build(task, tag)
        return tag

    async def _have_or_pull(self, image: str) -> bool:
        lock = self._build_locks.setdefault(image, asyncio.Lock())
        async with lock:
            if (await run_cli(self.cli, "image", "inspect", image, timeout=60))[0] == 0:
                return True
            try:
                return (await run_cli(self.cli, "pull", "--quiet", image, timeout=600))[0] == 0
            except TimeoutError:
                return False

    async def _build(self, task: Task, tag: str) -> None:
        assert task.dockerfile is not None
        args = ["build", "--network=host", "-t", tag, "-f", str(Path(task.dockerfile).resolve())]
        bases = _from_images(task.dockerfile)
        local = [(await run_cli(self.cli, "image", "inspect", b, timeout=60))[0] == 0 for b in bases]
        if bases and all(local):
            # docker never pulls a base it has unless told to; its --pull takes no value.
            args.append("--pull=never" if self._podman else "--pull=false")
        if self._ca_dir is not None:
            args += ["-v", f"{Path(self._ca_dir).resolve()}:{BUILD_PIP_DIR}:ro"]
        args.append(str(Path(task.environment_dir).resolve()))  # the CLI runs in cli_cwd()
        timeout = task.config.environment.build_timeout_sec
        try:
            rc, out, err = await run_cli(self.cli, *args, timeout=timeout)
        except TimeoutError:
            raise ImageBuildError(
                f"building {task.task_id} took longer than {timeout:.0f}s (build_timeout_sec)"
            ) from None
        if rc != 0:
            raise ImageBuildError(
                f"building the image of {task.task_id} failed (exit {rc})", log_tail=(out + err)[-4000:]
            )

    # -- containers -----------------------------------------------------------------------------
    def _network(self, task: Task) -> str:
        allowed = (
            task.config.environment.internet_allowed if self.allow_network is None else self.allow_network
        )
        return "bridge" if allowed else "none"

    async def _start(self, task: Task, run_id: str, image: str) -> PodmanSandbox:
        env = task.config.environment
        # Container names allow [a-zA-Z0-9][a-zA-Z0-9_.-]*; run ids and task ids may hold anything.
        safe = re.sub(r"[^a-z0-9_.-]+", "-", f"{run_id[:24]}-{task.task_id[:24]}".lower())
        name = f"agentrl-{safe}-{uuid.uuid4().hex[:8]}"
        args = [
            "run",
            "-d",
            "--name",
            name,
            "--network",
            self._network(task),
            "--label",
            f"{LABEL_RUN}={run_id}",
            "--label",
            f"{LABEL_TASK}={task.task_id}",
            "--label",
            f"{LABEL_CREATED}={int(time.time())}",
            "--pids-limit",
            str(self.pids_limit),
            "--entrypoint",
            "sleep",
        ]
        if env.cpus:
            args += ["--cpus", str(env.cpus)]
        memory = env.memory_mb or self.default_memory_mb
        if memory:
            args += ["--memory", f"{memory}m", "--memory-swap", f"{memory}m"]
        if env.workdir:
            args += ["-w", env.workdir]
        for k, v in env.env.items():
            args += ["-e", f"{k}={v}"]
        args += [image, "infinity"]
        _LIVE[name] = self.cli
        self._live.add(name)
        try:
            rc, _, err = await run_cli(self.cli, *args, timeout=120)
            if rc != 0:
                raise SandboxCreateError(
                    f"starting a container for {task.task_id} failed", log_tail=err[-2000:]
                )
            sandbox = PodmanSandbox(self, name, env.workdir)
            res = await sandbox.exec(
                "mkdir -p /logs/verifier /logs/agent /logs/artifacts && chmod 777 /logs /logs/*", timeout=60
            )
            if res.exit_code != 0:
                raise SandboxCreateError(f"preparing /logs in {name} failed", log_tail=res.stderr)
            return sandbox
        except BaseException:
            await asyncio.shield(self._remove(name))
            raise

    async def create(self, task: Task, *, run_id: str) -> Sandbox:
        pooled = self._pool.get(task.task_id)
        while pooled:
            sandbox = pooled.pop()
            if await sandbox.alive():
                self._refill(task, run_id)
                return sandbox
            await sandbox.close()
        image = await self.image_for(task)
        sandbox = await self._start(task, run_id, image)
        self._refill(task, run_id)
        return sandbox

    def _refill(self, task: Task, run_id: str) -> None:
        if self.warm_pool > 0:
            self.prefetch(task, run_id=run_id)

    def prefetch(self, task: Task, *, run_id: str, count: int | None = None) -> None:
        """Start containers for an upcoming task in the background (the warm pool)."""
        want = (
            (count or self.warm_pool)
            - len(self._pool.get(task.task_id, []))
            - sum(1 for t in self._pool_tasks if t.get_name() == task.task_id)
        )
        for _ in range(max(0, want)):
            t = asyncio.create_task(self._warm_one(task, run_id), name=task.task_id)
            self._pool_tasks.add(t)
            t.add_done_callback(self._pool_tasks.discard)

    async def wait_warm(self, task: Task) -> int:
        """Wait for the pre-starts of `task` in flight; return how many sandboxes are pooled."""
        pending = [t for t in self._pool_tasks if t.get_name() == task.task_id]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return len(self._pool.get(task.task_id, []))

    async def _warm_one(self, task: Task, run_id: str) -> None:
        try:
            sandbox = await self._start(task, run_id, await self.image_for(task))
        except SandboxError as exc:
            log.warning("warm pool: could not pre-start %s: %s", task.task_id, exc)
            return
        self._pool.setdefault(task.task_id, []).append(sandbox)

    async def _remove(self, name: str) -> None:
        try:
            await run_cli(self.cli, *rm_args(self.cli), name, timeout=120)
        finally:
            self._live.discard(name)
            _LIVE.pop(name, None)

    def live_sandboxes(self) -> int:
        return len(self._live)

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for t in list(self._pool_tasks):
            t.cancel()
        if self._pool_tasks:
            await asyncio.gather(*self._pool_tasks, return_exceptions=True)
        for sandboxes in self._pool.values():
            for s in sandboxes:
                await s.close()
        self._pool.clear()
        for name in list(self._live):
            await self._remove(name)


async def reap(
    *, cli: str = "podman", run_id: str | None = None, older_than_s: float | None = None
) -> list[str]:
    """Remove agentrl containers by label: of one run, or older than a cutoff, or all."""
    args = [
        "ps",
        "-a",
        "--filter",
        f"label={LABEL_RUN}",
        "--format",
        f'{{{{.Names}}}}\t{{{{index .Labels "{LABEL_RUN}"}}}}\t{{{{index .Labels "{LABEL_CREATED}"}}}}',
    ]
    if run_id is not None:
        args[3] = f"label={LABEL_RUN}={run_id}"
    rc, out, err = await run_cli(cli, *args, timeout=120)
    if rc != 0:
        raise SandboxError(f"listing containers failed: {err.strip()[-500:]}")
    now = time.time()
    doomed = []
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) < 3:
            continue
        name, _, created = parts[:3]
        if older_than_s is not None and created.isdigit() and now - int(created) < older_than_s:
            continue
        doomed.append(name)
    for name in doomed:
        await run_cli(cli, *rm_args(cli), name, timeout=120)
    return doomed
