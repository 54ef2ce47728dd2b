"""What runs inside a container, read from the host's /proc: listening sockets, terminals, and the
kill of every process in a container's PID namespace before verification."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

log = logging.getLogger(__name__)


def _listening_inodes(pid: int) -> set[str]:
    """Socket inodes in LISTEN state in the network namespace of `pid` (TCP, TCP6, unix)."""
    found: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as fh:
                next(fh, None)
                for line in fh:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A":
                        found.add(cols[9])
        except OSError:
            continue
    try:
        with open(f"/proc/{pid}/net/unix") as fh:
            next(fh, None)
            for line in fh:
                cols = line.split()
                if len(cols) > 6 and int(cols[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
                    found.add(cols[6])
    except (OSError, ValueError):
        pass
    return found


def _is_listener(pid: int, listening: set[str]) -> bool:
    try:
        fds = os.scandir(f"/proc/{pid}/fd")
    except OSError:
        return False
    with fds:
        for fd in fds:
            try:
                link = os.readlink(fd.path)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in listening:
                return True
    return False


def _is_tmux(pid: int) -> bool:
    """A tmux server (the agent's terminal, or one it started): never kept as a service, since it
    can start processes of its own (hooks, `run-shell`) after the others are gone."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            comm = fh.read().strip()
    except OSError:
        comm = ""
    return os.path.basename(exe).split(" ")[0] == "tmux" or comm.startswith("tmux")


def _stat_fields(pid: int) -> list[str]:
    """`/proc/PID/stat` after the command name: state, ppid, pgrp, session, tty_nr, tpgid, ..."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()
    except OSError:
        return []


def _terminal_holders(servers: set[int]) -> set[int]:
    """For servers with a controlling terminal: their session leader and, when it is a tmux
    pane's shell, the tmux server (its parent)."""
    found: set[int] = set()
    for pid in servers:
        fields = _stat_fields(pid)
        if len(fields) < 5 or fields[4] == "0" or not fields[3].isdigit():
            continue
        leader = int(fields[3])
        if leader in servers or leader <= 1:
            continue
        found.add(leader)
        parent = _stat_fields(leader)
        if len(parent) > 1 and parent[1].isdigit() and _is_tmux(int(parent[1])):
            found.add(int(parent[1]))
    return found


def _kill_namespace(init_pid: int, keep_listeners: bool = True) -> bool:
    """SIGSTOP, then SIGKILL, every host process in the PID namespace of `init_pid` but the init
    itself (and, with `keep_listeners`, the servers listening on a socket but tmux: tasks ask for
    services the tests talk to; such a server's terminal, if it has one, is stopped rather than
    killed, see `_terminal_holders`), sweeping until none is left. False when this host cannot see that
    namespace (another user's, a remote engine): the caller kills from inside instead."""
    try:
        ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    except OSError:
        return False
    kept: set[int] = set()
    holders: set[int] = set()
    listening = _listening_inodes(init_pid) if keep_listeners else set()

    def members() -> list[int]:
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and int(entry.name) not in kept and int(entry.name) != init_pid:
                try:
                    if os.readlink(f"/proc/{entry.name}/ns/pid") != ns:
                        continue
                except OSError:
                    continue  # gone, a zombie, or not ours to inspect
                # A zombie (of a stopped terminal's shell, say) is dead already.
                if _stat_fields(int(entry.name))[:1] not in (["Z"], ["X"]):
                    found.append(int(entry.name))
        return found

    if listening:
        kept.update(p for p in members() if _is_listener(p, listening) and not _is_tmux(p))
        # A server in a terminal's foreground dies of SIGHUP when its terminal goes (its session
        # leader, the pane's shell, or the tmux server holding the pty): those are stopped, never
        # killed, so they cannot act (a tmux hook, say) and the server keeps serving.
        holders = _terminal_holders(kept)
        for pid in holders:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        kept.update(holders)
    for _ in range(100):
        alive = members()
        if not alive:
            # The kernel continues a stopped process group that its peers' deaths leave orphaned
            # (SIGHUP + SIGCONT): a terminal holder must stay stopped, so stop it again.
            for pid in holders:
                if _stat_fields(pid)[:1] not in (["T"], ["t"], ["Z"], ["X"], []):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGSTOP)
            return True
        stopped: set[int] = set()
        while new := [p for p in alive if p not in stopped]:  # frozen before any can fork again
            for pid in new:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGSTOP)
            stopped.update(new)
            alive = members()
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return not members()
