"""Every file opened or executed on one file system, watched from the host with fanotify(7).

The verifier's view of a sandbox is an overlay mount of its own (`verifier.py`), so a mark on that
file system sees exactly what the verification opened, whichever process did it and by whatever
path or name. Needs CAP_SYS_ADMIN on the host (rootful podman); `OpenWatch.available()` says.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading

FAN_CLOEXEC = 0x1
FAN_UNLIMITED_QUEUE = 0x10
FAN_MARK_ADD = 0x1
FAN_MARK_FILESYSTEM = 0x100
FAN_OPEN = 0x20
FAN_OPEN_EXEC = 0x1000
FAN_Q_OVERFLOW = 0x4000
AT_FDCWD = -100
_EVENT = struct.Struct("<IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid


class WatchError(OSError):
    """The file system could not be watched (no fanotify, no privilege, or events were lost)."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
    libc.fanotify_mark.argtypes = [
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_uint64,
        ctypes.c_int,
        ctypes.c_char_p,
    ]
    return libc


class OpenWatch:
    """`with OpenWatch(root) as watch: ...` then `watch.opened`: each path opened on the file
    system mounted at `root` (relative to it, starting with "/"), True where it was executed."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.opened: dict[str, bool] = {}
        self.lost = False
        self._fd = -1
        self._thread: threading.Thread | None = None
        self._stop_r, self._stop_w = -1, -1

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and hasattr(ctypes.CDLL(None), "fanotify_init")

    def __enter__(self) -> OpenWatch:
        libc = _libc()
        flags = os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC
        self._fd = libc.fanotify_init(FAN_CLOEXEC | FAN_UNLIMITED_QUEUE, flags)
        if self._fd < 0:
            raise WatchError(ctypes.get_errno(), f"fanotify_init: {os.strerror(ctypes.get_errno())}")
        mask = FAN_OPEN | FAN_OPEN_EXEC
        if (
            libc.fanotify_mark(
                self._fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, mask, AT_FDCWD, self.root.encode()
            )
            < 0
        ):
            err = ctypes.get_errno()
            os.close(self._fd)
            raise WatchError(err, f"fanotify_mark {self.root}: {os.strerror(err)}")
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._read, name="agentrl-openwatch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop watching once every event already queued is read."""
        if self._thread is None:
            return
        os.write(self._stop_w, b"x")
        self._thread.join()
        self._thread = None
        for fd in (self._fd, self._stop_r, self._stop_w):
            os.close(fd)

    def _read(self) -> None:
        import select

        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        poll.register(self._stop_r, select.POLLIN)
        stopping = False
        while True:
            ready = dict(poll.poll(None if not stopping else 0))
            if self._stop_r in ready:
                stopping = True
                poll.unregister(self._stop_r)
            if self._fd not in ready:
                if stopping:
                    return
                continue
            buf = os.read(self._fd, 256 * 1024)
            for offset in range(0, len(buf), _EVENT.size):
                length, _, _, _, mask, fd, _ = _EVENT.unpack_from(buf, offset)
                if length != _EVENT.size:  # no info records asked for: every event is this size
                    raise AssertionError(f"unexpected fanotify event length {length}")
                if mask & FAN_Q_OVERFLOW:
                    self.lost = True
                if fd < 0:
                    continue
                try:
                    path = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    path = ""
                finally:
                    os.close(fd)
                if path.startswith(self.root + "/"):
                    path = path[len(self.root) :]
                if path.startswith("/"):
                    self.opened[path] = self.opened.get(path, False) or bool(mask & FAN_OPEN_EXEC)
