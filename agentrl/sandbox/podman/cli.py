"""The container CLI (podman, or docker's compatible CLI): running it with bounded output, labels,
the static init, build contexts' content hashes, and copying files out of a container under a size cap."""

from __future__ import annotations

import asyncio
import atexit
import functools
import hashlib
import io
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from agentrl.sandbox.base import (
    DEFAULT_OUTPUT_LIMIT,
    SandboxError,
)

log = logging.getLogger(__name__)


_UNRESOLVED_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*\S*\$", re.IGNORECASE | re.MULTILINE)


LABEL_RUN = "agentrl.run-id"


LABEL_TASK = "agentrl.task-id"


LABEL_CREATED = "agentrl.created-at"


# On the layers of one image build (every intermediate image gets it too): a failed build's are
# pruned by it.
LABEL_BUILD = "agentrl.build"


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


INIT_PATH = "/run/agentrl-init"


_INIT_CANDIDATES = (
    "/usr/libexec/podman/catatonit",
    "/usr/libexec/catatonit/catatonit",
    "/usr/local/libexec/podman/catatonit",
    "/usr/bin/catatonit",
)


@functools.cache
def find_init() -> str | None:
    """A static catatonit on the host (where podman's own `--init` finds it), or None."""
    for path in (*_INIT_CANDIDATES, shutil.which("catatonit")):
        if path and os.access(path, os.X_OK):
            return os.path.realpath(path)
    return None


# Containers this process started and has not removed; removed synchronously at interpreter exit.
_LIVE: dict[str, str] = {}


def _remove_live_at_exit() -> None:
    # containers first: a compose task's network ("net:NAME") goes after what was on it
    for name, cli in sorted(_LIVE.items(), key=lambda item: item[0].startswith("net:")):
        args = (
            ["network", "rm", "-f", name.removeprefix("net:")]
            if name.startswith("net:")
            else [*rm_args(cli), name]
        )
        subprocess.run([cli, *args], capture_output=True, timeout=60, check=False, cwd=cli_cwd())
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


def _bounded(head: bytes, tail: bytes, size: int) -> str:
    """Head and tail of an output of `size` bytes, with a marker for what was cut in between."""
    omitted = size - len(head) - len(tail)
    if omitted <= 0 and not tail:
        return head.decode(errors="replace")
    return (
        f"{head.decode(errors='replace')}\n[... {max(omitted, 0)} bytes omitted ...]\n"
        f"{tail.decode(errors='replace')}"
    )


class _HeadTail:
    """Keeps the first and last `half` bytes of a stream and counts the rest (bounded memory)."""

    def __init__(self, half: int) -> None:
        self.half = half
        self.head = bytearray()
        self.tail = bytearray()
        self.size = 0

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[: max(0, len(self.tail) - self.half)]

    def text(self) -> str:
        return _bounded(bytes(self.head), bytes(self.tail), self.size)


async def init_and_layer(cli: str, container: str) -> tuple[int | None, str | None, str]:
    """One inspect for both: a container's init's host pid (None if it does not run) and its
    writable layer on the host (None where the storage driver shows none), with the CLI's error."""
    rc, out, err = await run_cli(
        cli, "inspect", "--format", "{{.State.Pid}}\t{{.GraphDriver.Data.UpperDir}}", container, timeout=60
    )
    pid, _, upper = out.strip().partition("\t")
    alive = rc == 0 and pid.isdigit() and pid != "0"
    return (int(pid) if alive else None), (upper if rc == 0 and os.path.isdir(upper) else None), err


async def run_cli_bounded(
    cli: str, *args: str, timeout: float, limit: int = DEFAULT_OUTPUT_LIMIT
) -> tuple[int, str, str]:
    """`run_cli` for commands whose output the agent controls: stdout and stderr are streamed and
    kept as head + tail within `limit` characters each, so host memory stays bounded."""
    proc = await asyncio.create_subprocess_exec(
        cli,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cli_cwd(),
    )
    out, err = _HeadTail(limit // 2), _HeadTail(limit // 2)

    async def pump(stream: asyncio.StreamReader | None, sink: _HeadTail) -> None:
        assert stream is not None
        while chunk := await stream.read(64 * 1024):
            sink.feed(chunk)

    try:
        await asyncio.wait_for(
            asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err), proc.wait()), timeout
        )
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    return proc.returncode or 0, out.text(), err.text()


FETCH_LIMIT = 1 << 20


class _StreamFile(io.RawIOBase):
    """A blocking file over an asyncio stream, for `tarfile` running in a worker thread."""

    def __init__(self, stream: asyncio.StreamReader, loop: asyncio.AbstractEventLoop) -> None:
        self.stream, self.loop = stream, loop

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = asyncio.run_coroutine_threadsafe(self.stream.read(len(buffer)), self.loop).result()
        buffer[: len(data)] = data
        return len(data)


def _untar_tails(fileobj: io.RawIOBase, names: list[str], dst: Path) -> list[str]:
    """Write the last `FETCH_LIMIT` bytes of each regular file `names` of a tar stream to `dst`;
    read the stream to its end (so `cp` exits)."""
    found = []
    wanted = {f"./{n}" for n in names} | set(names)
    with tarfile.open(fileobj=io.BufferedReader(fileobj), mode="r|") as tar:
        for member in tar:
            if member.name not in wanted or not member.isreg():
                continue
            src = tar.extractfile(member)
            assert src is not None
            tail = bytearray()
            while chunk := src.read(1 << 16):
                tail += chunk
                del tail[: max(0, len(tail) - FETCH_LIMIT)]
            name = member.name.removeprefix("./")
            (dst / name).write_bytes(bytes(tail))
            found.append(name)
    while fileobj.read(1 << 16):
        pass
    return found


def _tree_bytes(root: str, stop_above: int) -> int:
    """Disk bytes under `root` (allocated blocks; links not followed), stopping once over `stop_above`."""
    total = 0
    stack = [root]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                if total > stop_above:
                    return total
    return total
