"""The run's engine key, and `python -m agentrl.cluster.launch`: start an SGLang server, the `smg`
router or `agentrl engine serve` with that key, never on a command line or in a log.

A cluster run's engines and router listen on every interface (the trainer and the other nodes
reach them over the network), and SGLang's control plane changes the weights
(`/update_weights_from_disk`, `/init_weights_update_group`, ...), pauses generation and aborts
requests. So every one of them requires the run's key (`Authorization: Bearer <key>`): SGLang's
`--api-key` (only `/health*`, `/metrics*` and OPTIONS stay open), and smg's `--api-key` (the
key it presents to the workers) plus `--control-plane-api-keys` (its `/workers` endpoints).

The key travels as a file path (`RecipeOptions.engine_key_file`, default `<root>/engine.key` on
the shared storage, created 0600 with a fresh random key by the driver when missing), like the
Daytona key. This launcher reads it and runs the program in its own process with the key added to
the program's arguments (`runpy` for `python -m MODULE`, the console-script entry point for
`smg`), so `/proc/<pid>/cmdline` and `ps` show only the key file's path. SGLang prints its whole
`ServerArgs`, `api_key` included, at start-up (sgl-project/sglang#37457), so the launcher also
runs the program's stdout and stderr (file descriptors 1 and 2, inherited by its children)
through a pipe that replaces the key with `<engine-key>` before the bytes reach the log.

    python -m agentrl.cluster.launch --key-file /shared/run/engine.key -- \\
        python -m sglang.launch_server --model-path ... --host 0.0.0.0 --port 30000
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import sys
import threading
from pathlib import Path

from agentrl.engine.keys import EngineKeyError, read_key

log = logging.getLogger(__name__)

REDACTED = b"<engine-key>"


def ensure_key(path: str | os.PathLike[str]) -> Path:
    """Create `path` (mode 0600, a fresh 256-bit random key) unless it exists; its path."""
    p = Path(path).expanduser()
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        try:  # whole or not at all; a driver that made it first wins and its key stays
            os.link(tmp, p)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    read_key(p)
    return p


def auth_headers(key_file: str | os.PathLike[str] | None) -> dict[str, str]:
    """The header a client of keyed engines and routers sends (none without a key file)."""
    return {"Authorization": f"Bearer {read_key(key_file)}"} if key_file else {}


def keyed(argv: list[str] | tuple[str, ...], key_file: str, python: str = "python") -> list[str]:
    """`argv` started through this launcher with the key in `key_file`."""
    return [python, "-m", "agentrl.cluster.launch", "--key-file", key_file, "--", *argv]


def _key_args(program: str, key: str) -> list[str]:
    # `--api-key=KEY`, never `--api-key KEY`: a random key may start with '-', which argparse
    # (SGLang's and smg's parsers) then reads as an option and refuses ("expected one argument").
    if program == "smg":
        return [f"--api-key={key}", "--control-plane-api-keys", f"agentrl:agentrl:admin:{key}"]
    if program in ("sglang.launch_server", "agentrl.cli"):
        return [f"--api-key={key}"]
    raise EngineKeyError(
        f"agentrl.cluster.launch does not know how to give {program!r} its key: it starts "
        f"`python -m sglang.launch_server`, `python -m agentrl.cli engine serve` and `smg`"
    )


def _redact(read_fd: int, write_fd: int, key: bytes) -> None:
    """Copy `read_fd` to `write_fd` until EOF, every occurrence of `key` replaced. A key split
    across reads is caught by holding back a tail that is a prefix of the key until more comes
    (never flushed early: output that ends in a newline holds nothing back, the key has none);
    everything else is written as it was read, so stdout and stderr sharing one log file
    interleave at the program's own write boundaries."""
    buf = b""
    while chunk := os.read(read_fd, 65536):
        buf = (buf + chunk).replace(key, REDACTED)
        hold = next((k for k in range(min(len(key) - 1, len(buf)), 0, -1) if buf.endswith(key[:k])), 0)
        if len(buf) > hold:
            os.write(write_fd, buf[: len(buf) - hold])
            buf = buf[len(buf) - hold :]
    if buf:
        os.write(write_fd, buf)


def _redact_output(key: str) -> None:
    """Fds 1 and 2 of this process (and of every child it starts) go through `_redact`; at exit
    this process closes its ends and gives the copies a moment to drain."""
    threads = []
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        stream.flush()
        original = os.dup(fd)
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        t = threading.Thread(target=_redact, args=(r, original, key.encode()), daemon=True)
        t.start()
        threads.append(t)

    def drain() -> None:
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
            with contextlib.suppress(OSError):
                os.close(fd)
        for t in threads:
            t.join(timeout=2.0)

    atexit.register(drain)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[0] != "--key-file" or args[2] != "--":
        raise SystemExit("usage: python -m agentrl.cluster.launch --key-file PATH -- PROGRAM [ARGS...]")
    key_file, command = args[1], args[3:]
    try:
        key = read_key(key_file)
        if Path(command[0]).name == "smg":
            program, rest = "smg", command[1:]
        elif len(command) >= 3 and "python" in Path(command[0]).name and command[1] == "-m":
            program, rest = command[2], command[3:]
        else:
            raise EngineKeyError(
                f"cannot start {command[0]!r} with a key: give `smg ...` or `python -m MODULE ...`"
            )
        extra = _key_args(program, key)
    except EngineKeyError as exc:
        raise SystemExit(f"agentrl.cluster.launch: {exc}") from None
    _redact_output(key)
    if program == "smg":
        from smg.cli import main as smg_main

        smg_main([*rest, *extra])
        return
    import runpy

    sys.argv = [program, *rest, *extra]
    runpy.run_module(program, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
