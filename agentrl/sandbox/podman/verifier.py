"""The podman verifier: the task's tests run in a container of their own, over the agent's files.

- A private view. The verification container's root is a fresh overlay whose lower layer is the
  agent's container file system (everything the agent left is there to be graded) and whose upper
  layer is the verifier's own (what the tests write stays out of the agent's container). It shares
  only the agent container's network namespace, so services the agent left running answer the tests
  on localhost; its PID, mount and IPC namespaces are new, so no process the agent started can see
  it, reach into its files through /proc, or find /tests and /logs/verifier: both are host
  directories bind-mounted into the verification container alone.
- No tool from the container takes part in its own steps: the tests are copied on the host with
  their modes set there, `test.sh` is the container's command (its interpreter is the task's, and
  provenance covers it), its output is read on the host through a bounded pipe, and the reward files
  are read from the host directory (regular files only, at most `REWARD_FILE_LIMIT` bytes).
- Provenance: fanotify on the verifier's overlay records every file the verification opened or
  executed; those the agent made (present in the agent container's writable layer, not written by
  the verifier itself) are reported for `agentrl.sandbox.provenance.agent_code` to judge.
- The same limits as the agent's container (cpus, memory, pids), the static init as PID 1, and a
  name and label so that a crash leaves nothing `agentrl sandbox reap` cannot find.

Needs a rootful podman on Linux (an overlay mount and fanotify need CAP_SYS_ADMIN on the host);
elsewhere `PodmanSandbox.run_tests` returns None and the verifier runs inside the sandbox as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from agentrl.sandbox.base import (
    REWARD_FILE_LIMIT,
    SandboxPolicyError,
    SandboxTransportError,
    TestRun,
    printable,
    tail,
)
from agentrl.sandbox.podman.cli import (
    INIT_PATH,
    LABEL_CREATED,
    LABEL_RUN,
    _tree_bytes,
    cli_cwd,
    find_init,
    rm_args,
    run_cli,
)
from agentrl.sandbox.podman.fanotify import OpenWatch
from agentrl.sandbox.provenance import Opened, module_name

STORAGE_CHECK_S = 2.0  # how often the verifier's own layer is measured against the storage limit
OUTPUT_TAIL = 64 * 1024  # bytes of the tests' output kept (the rest is read and dropped)
RESULT_NAMES = ("reward.json", "reward.txt")


def available() -> bool:
    return OpenWatch.available() and shutil.which("mount") is not None


class _Container(Protocol):
    cli: str
    sandbox_id: str
    limit_args: tuple[str, ...]
    storage_limit_mb: int | None

    async def _running(self) -> bool: ...


async def run_private_tests(
    sb: _Container, tests_dir: Path, *, timeout: float, env: dict[str, str], user: str | int | None
) -> TestRun:
    info = await _inspect(sb)
    graph = info.get("GraphDriver", {}).get("Data", {})
    merged, agent_upper = graph.get("MergedDir", ""), graph.get("UpperDir", "")
    if not (os.path.isdir(merged) and os.path.isdir(agent_upper)):
        raise SandboxTransportError(f"the file system of {sb.sandbox_id} is not mounted on this host")
    config = info.get("Config", {})
    workdir = config.get("WorkingDir") or "/"
    tmp = Path(tempfile.mkdtemp(prefix="agentrl-verify-", dir=cli_cwd()))
    root, upper = tmp / "root", tmp / "upper"
    for d in (root, upper, tmp / "work"):
        d.mkdir()
    mounted = False
    try:
        tests, logs = tmp / "tests", tmp / "logs"
        shutil.copytree(tests_dir, tests, symlinks=True)
        for path in [tests, *tests.rglob("*")]:  # readable by any verifier user, own modes kept
            if not path.is_symlink():
                mode = path.stat().st_mode & 0o7777
                path.chmod(0o777 if path.is_dir() else mode | (0o755 if path == tests / "test.sh" else 0o644))
        logs.mkdir(mode=0o777)
        logs.chmod(0o777)
        options = f"lowerdir={merged},upperdir={upper},workdir={tmp / 'work'}"
        rc, _, err = await _host("mount", "-t", "overlay", "overlay", "-o", options, str(root))
        if rc != 0:
            raise SandboxTransportError(
                f"mounting the verifier's view of {sb.sandbox_id} failed: {tail(err, 300)}"
            )
        mounted = True
        # The mount points the tests need, made plain directories in the verifier's own layer
        # (whatever the agent left at those paths: a file, a link to the host's root).
        await asyncio.to_thread(_plain_dirs, str(root), ["tests", "logs", "logs/verifier"])
        name = f"{sb.sandbox_id}-verifier"
        args = [
            "run", "--rm", "--name", name,
            # the agent's network namespace (a compose task's services answer there as to main)
            "--network", f"container:{sb.sandbox_id}",
            "--label", f"{LABEL_RUN}={config.get('Labels', {}).get(LABEL_RUN, '')}",
            "--label", f"{LABEL_CREATED}={int(time.time())}",
            "-v", f"{tests}:/tests", "-v", f"{logs}:/logs/verifier", "-w", workdir,
            *sb.limit_args,
        ]  # fmt: skip
        init = find_init()
        args += ["-v", f"{init}:{INIT_PATH}:ro", "--entrypoint", INIT_PATH] if init else ["--init"]
        if user is not None or config.get("User"):
            args += ["--user", str(user if user is not None else config["User"])]
        for item in config.get("Env") or []:
            if not item.startswith(tuple(f"{k}=" for k in env)):
                args += ["-e", item]
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        args += ["--rootfs", str(root), *(["--", "/tests/test.sh"] if init else ["/tests/test.sh"])]
        limit = sb.storage_limit_mb * 2**20 if sb.storage_limit_mb else None
        started = time.time()  # wall clock: compared with the layer's inode change times
        with OpenWatch(str(root)) as watch:
            exit_code, timed_out, output, overrun = await _run(sb.cli, args, name, timeout, str(upper), limit)
        if overrun is not None:
            raise SandboxPolicyError(
                f"the verification wrote {overrun / 2**20:.0f} MiB, over the task's storage limit of "
                f"{sb.storage_limit_mb} MiB; it was stopped",
                cause="storage_exceeded",
            )
        if watch.lost:
            raise SandboxTransportError("the verifier's file accesses could not all be recorded")
        if exit_code == 125 and not timed_out:
            # podman could not start the container: the root it was given is the agent's work (a
            # mount point it broke), unless the agent's container is gone (infrastructure).
            if not await sb._running():
                raise SandboxTransportError(f"container {sb.sandbox_id} is gone: {tail(output, 300)}")
            raise SandboxPolicyError(
                f"the verifier could not start in the agent's file system: {printable(tail(output, 300))}",
                cause="verifier_inputs",
            )
        files = await asyncio.to_thread(_read_results, logs)
        files["test-stdout.txt"] = output
        opened = await asyncio.to_thread(
            _agent_made, watch.opened, agent_upper, str(upper), graph.get("LowerDir", ""), started
        )
        provided = await asyncio.to_thread(_provided, opened, workdir, graph.get("LowerDir", ""), str(upper))
        return TestRun(exit_code, timed_out, files, opened, provided, workdir)
    finally:
        if mounted:
            rc, _, _ = await _host("umount", str(root))
            if rc != 0:
                await _host("umount", "-l", str(root))
        await asyncio.to_thread(shutil.rmtree, tmp, True)


async def _inspect(sb: _Container) -> dict[str, Any]:
    rc, out, err = await run_cli(sb.cli, "inspect", "--format", "{{json .}}", sb.sandbox_id, timeout=60)
    if rc != 0:
        raise SandboxTransportError(f"`inspect {sb.sandbox_id}` failed: {tail(err.strip(), 300)}")
    data = json.loads(out)
    return data[0] if isinstance(data, list) else data


async def _host(*argv: str) -> tuple[int, str, str]:
    proc = await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, timeout=60, check=False
    )
    return proc.returncode, proc.stdout, proc.stderr


async def _run(
    cli: str, args: list[str], name: str, timeout: float, layer: str, limit: int | None
) -> tuple[int | None, bool, str, int | None]:
    """Run the verification container: its exit code (None after a timeout), whether it timed
    out, its output's last `OUTPUT_TAIL` bytes (bounded in memory whatever the tests print) and,
    when the verifier's own layer grew past `limit` bytes (measured on the host every
    `STORAGE_CHECK_S`), its size. A timeout or an overrun kills and removes the container."""
    proc = await asyncio.create_subprocess_exec(
        cli, *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=cli_cwd(),
    )  # fmt: skip
    assert proc.stdout is not None
    kept_chunks: collections.deque[bytes] = collections.deque()
    kept = 0
    overrun: int | None = None

    async def drain() -> None:
        nonlocal kept
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            kept_chunks.append(chunk)
            kept += len(chunk)
            while kept - len(kept_chunks[0]) >= OUTPUT_TAIL:
                kept -= len(kept_chunks.popleft())

    async def watch_storage() -> None:
        nonlocal overrun
        while limit is not None:
            await asyncio.sleep(STORAGE_CHECK_S)
            used = await asyncio.to_thread(_tree_bytes, layer, limit)
            if used > limit:
                overrun = used
                return

    timed_out = False
    watcher = asyncio.ensure_future(watch_storage())
    runner: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(drain(), proc.wait()))
    try:
        done, _ = await asyncio.wait([runner, watcher], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        timed_out = not done
    finally:
        watcher.cancel()
        if proc.returncode is None:
            await asyncio.shield(run_cli(cli, *rm_args(cli), name, timeout=120))
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(runner, 30)  # the output's end, after the container's
    text = b"".join(kept_chunks)[-OUTPUT_TAIL:].decode(errors="replace")
    return (None if timed_out else proc.returncode), timed_out, text, overrun


def _plain_dirs(root: str, rels: list[str]) -> None:
    """Make each `rels` path under `root` a real directory, never following a link (each step
    holds a directory descriptor, so a name swapped meanwhile cannot send it out of `root`)."""
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel in rels:
            fd = os.dup(top)
            try:
                for part in rel.split("/"):
                    try:
                        st = os.lstat(part, dir_fd=fd)
                        if not stat.S_ISDIR(st.st_mode):
                            os.unlink(part, dir_fd=fd)
                            raise FileNotFoundError
                    except FileNotFoundError:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    os.close(fd)
                    fd = nxt
            finally:
                os.close(fd)
    finally:
        os.close(top)


def _read_results(logs: Path) -> dict[str, str]:
    files = {}
    for name in RESULT_NAMES:
        try:
            fd = os.open(logs / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            data = fh.read(REWARD_FILE_LIMIT + 1)
        files[name] = (
            f"<{REWARD_FILE_LIMIT + 1} bytes or more: too large for a reward file>"
            if len(data) > REWARD_FILE_LIMIT
            else data.decode(errors="replace")
        )
    return files


def _agent_made(
    opened: dict[str, bool], agent_upper: str, verifier_upper: str, lower: str, started: float
) -> list[Opened]:
    """The opened files that come from the agent's writable layer (created or changed by the
    agent, before or during verification), not from the image or the verifier's own writes.

    A file whose content is the image's and whose inode last changed before the verification
    started only had its owner or mode changed: the image's code. One changed during verification
    counts whatever its content now (a process of the agent's may have put the original back
    after the tests loaded its own), and so does one deleted since the tests opened it (a
    whiteout at it or at a directory above it)."""
    found = []
    for path, executed in opened.items():
        if os.path.lexists(verifier_upper + path):
            continue
        changed = _whiteout_above(agent_upper, path)
        if not changed:
            try:
                st = os.lstat(agent_upper + path)
            except (OSError, ValueError):
                continue
            if stat.S_ISDIR(st.st_mode):
                continue
            changed = not (
                stat.S_ISREG(st.st_mode)
                and st.st_ctime < started
                and _same_as_image(agent_upper + path, st.st_size, path, lower)
            )
        if changed:
            found.append(Opened(path, executed))
    return found


def _whiteout_above(layer: str, path: str) -> bool:
    """Whether `path` or a directory above it is deleted in the writable `layer` (a whiteout:
    a 0/0 character device), looked at without following links."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts) + 1):
        try:
            st = os.lstat(os.path.join(layer, *parts[:depth]))
        except (OSError, ValueError):
            return False
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            return True
        if not stat.S_ISDIR(st.st_mode):
            return False
    return False


def _same_as_image(copy: str, size: int, path: str, lower: str) -> bool:
    for layer in lower.split(":"):
        if not layer or not os.path.lexists(layer + path):
            continue
        original = layer + path
        if os.path.islink(original) or not os.path.isfile(original) or os.path.getsize(original) != size:
            return False
        with open(copy, "rb") as a, open(original, "rb") as b:
            while chunk := a.read(1 << 20):
                if chunk != b.read(1 << 20):
                    return False
        return True
    return False


def _provided(opened: list[Opened], workdir: str, lower: str, verifier_upper: str) -> frozenset[str]:
    """Which top-level module names of the agent's files under `workdir` exist as top-level modules
    elsewhere (in the image's layers or what the verifier installed, outside `workdir`): those
    files shadow them."""
    root = workdir.rstrip("/")
    names = {n for o in opened if o.path.startswith(root + "/") and (n := module_name(o.path, root))}
    if not names:
        return frozenset()
    found = set()
    for layer in lower.split(":"):
        if layer:
            found |= names & _top_level_modules(layer, root)
    return frozenset(found | (names & _top_level_modules.__wrapped__(verifier_upper, root)))


@functools.lru_cache(maxsize=512)
def _top_level_modules(layer: str, workdir: str) -> frozenset[str]:
    """Every module name a Python could import at the top level from some directory of `layer`
    (outside `workdir`): files `name.py` / `name.*.so` and packages `name/__init__.py` in a
    directory that is not itself a package. Cached: an image layer never changes."""
    names: set[str] = set()
    skip = {os.path.join(layer, workdir.lstrip("/")) if workdir else None} | {
        os.path.join(layer, d) for d in ("proc", "sys", "dev")
    }
    for top, subdirs, files in os.walk(layer):
        subdirs[:] = [d for d in subdirs if os.path.join(top, d) not in skip]
        if "__init__.py" in files:
            parent = os.path.dirname(top)
            if not os.path.exists(os.path.join(parent, "__init__.py")):
                names.add(os.path.basename(top))
            continue
        for f in files:
            if f.endswith((".py", ".pyc")) or ".so" in f:
                names.add(f.split(".", 1)[0])
    return frozenset(names)
