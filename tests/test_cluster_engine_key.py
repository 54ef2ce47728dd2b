"""The run's engine key: engines and router refuse requests without it, and it never shows on a
command line or in a log.

- `EngineServer(api_key=...)` answers as SGLang's `--api-key` does (sglang/srt/utils
  `add_api_key_middleware`; `decide_request_auth` in sglang/srt/utils/auth.py with no admin key):
  /health*, /metrics* and OPTIONS pass, everything else needs `Authorization: Bearer <key>`, else
  401 `{"error": "Unauthorized"}`.
- `SGLangEngine(api_key_file=...)` sends it; a server that refuses the client is an `engine_auth`
  error at once (never retried, never a dead worker).
- `python -m agentrl.cluster.launch` starts `agentrl engine serve` and the real `smg` router with
  the key from a file: neither process's command line holds it, their output has it redacted, the
  router's `/workers` (control plane) and data plane refuse callers without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

KEY = "k3y-" + "x" * 40


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call(method: str, url: str, key: str | None = None, body: object = None, auth: str | None = None):
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    elif key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# --- the key file and the launcher's pieces ------------------------------------------------------


def test_ensure_key_creates_a_private_random_key_once(tmp_path: Path) -> None:
    from agentrl.cluster.launch import ensure_key
    from agentrl.engine.keys import read_key

    path = ensure_key(tmp_path / "sub" / "engine.key")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    first = read_key(path)
    assert len(first) >= 40 and ensure_key(path) == path and read_key(path) == first
    assert read_key(ensure_key(tmp_path / "other.key")) != first


def test_a_missing_or_malformed_key_file_is_a_clear_error(tmp_path: Path) -> None:
    from agentrl.engine.keys import EngineKeyError, read_key

    with pytest.raises(EngineKeyError, match="cannot read the engine key file"):
        read_key(tmp_path / "absent")
    (tmp_path / "two").write_text("a b\n")
    with pytest.raises(EngineKeyError, match="one key on one line"):
        read_key(tmp_path / "two")
    (tmp_path / "colon").write_text("a:b\n")
    with pytest.raises(EngineKeyError, match="must not contain ':'"):
        read_key(tmp_path / "colon")


def test_the_launcher_refuses_a_program_it_cannot_key(tmp_path: Path) -> None:
    (tmp_path / "k").write_text(KEY)
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cluster.launch", "--key-file", str(tmp_path / "k"), "--", "bash", "-c", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0 and "cannot start 'bash' with a key" in out.stderr
    assert KEY not in out.stderr + out.stdout


@pytest.mark.parametrize("key", ["-" + "x" * 42, "--" + "y" * 41, KEY])
def test_a_key_that_starts_with_a_dash_reaches_every_program_as_its_value(key: str) -> None:
    """token_urlsafe draws '-' first one time in 64: the key must still be the flag's value in
    smg's own parser, SGLang's (argparse, `--api-key` with type=str) and `agentrl engine serve`'s."""
    import argparse

    import typer.main

    from agentrl.cli.engine import app
    from agentrl.cluster.launch import _key_args

    smg = pytest.importorskip("smg.launch_router")
    router = smg.parse_router_args(["--worker-urls", "http://127.0.0.1:1", *_key_args("smg", key)])
    assert router.api_key == key
    assert [k[2] for k in router.control_plane_api_keys] == [key]  # (id, name, key, role)

    sglang = argparse.ArgumentParser()
    sglang.add_argument("--model-path", type=str)
    sglang.add_argument("--api-key", type=str, default=None)
    assert sglang.parse_args(["--model-path", "/m", *_key_args("sglang.launch_server", key)]).api_key == key

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    ctx = serve.make_context("serve", ["--model", "/m", *_key_args("agentrl.cli", key)])
    assert ctx.params["api_key"] == key


def test_redaction_catches_a_key_split_across_reads() -> None:
    import threading

    from agentrl.cluster.launch import REDACTED, _redact

    r, w = os.pipe()
    r2, w2 = os.pipe()
    t = threading.Thread(target=_redact, args=(r, w2, KEY.encode()))
    t.start()
    text = f"server_args=ServerArgs(api_key='{KEY}', x=1)\nagain {KEY}".encode()
    for i in range(0, len(text), 7):  # 7-byte writes split the key everywhere
        os.write(w, text[i : i + 7])
        time.sleep(0.001)
    os.close(w)
    t.join(5)
    os.close(w2)
    with os.fdopen(r2, "rb") as fh:
        got = fh.read()
    assert KEY.encode() not in got and got.count(REDACTED) == 2 and got.endswith(b"again " + REDACTED)


# --- the server and the client, in process -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    from agentrl.models.tiny import load_tiny

    return load_tiny()


async def test_server_with_api_key_answers_as_sglang_does(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentrl.engine.base import EngineError
    from agentrl.engine.local import LocalEngine
    from agentrl.engine.server import EngineServer
    from agentrl.engine.sglang import SGLangEngine

    model, tok = tiny
    engine = LocalEngine(model, tok)
    gen = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    async with EngineServer(engine, port=0, api_key=KEY) as srv:
        u = srv.url

        def calls():  # type: ignore[no-untyped-def]
            return {
                "health": _call("GET", f"{u}/health"),
                "health_generate": _call("GET", f"{u}/health_generate"),
                "options": _call("OPTIONS", f"{u}/generate"),
                "no key": _call("POST", f"{u}/generate", body=gen),
                "wrong key": _call("POST", f"{u}/generate", key="nope", body=gen),
                "lowercase scheme": _call("POST", f"{u}/generate", auth=f"bearer {KEY}", body=gen),
                "models": _call("GET", f"{u}/v1/models"),
                "update": _call("POST", f"{u}/update_weights_from_disk", body={"model_path": "/x"}),
                "pause": _call("POST", f"{u}/pause_generation", body={}),
                "server_info": _call("GET", f"{u}/server_info"),
                "keyed": _call("POST", f"{u}/generate", key=KEY, body=gen),
            }

        got = await asyncio.to_thread(calls)
        assert got["health"][0] == 200 and got["health_generate"][0] == 200
        assert got["options"][0] != 401
        for what in ("no key", "wrong key", "lowercase scheme", "models", "update", "pause", "server_info"):
            assert got[what] == (401, b'{"error": "Unauthorized"}'), what
        assert got["keyed"][0] == 200 and json.loads(got["keyed"][1])["meta_info"]["completion_tokens"] == 2

        key_file = tmp_path / "engine.key"
        key_file.write_text(KEY + "\n")
        key_file.chmod(0o600)
        client = SGLangEngine(u, api_key_file=str(key_file), retries=3)
        bare = SGLangEngine(u, retries=3)
        # `agentrl eval --engine sglang --api-key-env VAR` against a keyed fleet.
        from agentrl.eval.harbor import HarborEvalSettings, build_eval_engine
        from agentrl.models.tiny import tiny_model_dir

        monkeypatch.setenv("RUN_ENGINE_KEY", KEY)
        settings = HarborEvalSettings(
            tasks=[], engine="sglang", urls=[u], tokenizer=str(tiny_model_dir()), api_key_env="RUN_ENGINE_KEY"
        )
        built = await build_eval_engine(settings)
        try:
            assert await client.refresh_weight_version() == 0
            assert await built.engine.refresh_weight_version() == 0 and built.context is not None
            with pytest.raises(EngineError, match="answered 401") as info:
                await bare.refresh_weight_version()
            assert info.value.cause == "engine_auth" and not bare.dead_workers
        finally:
            await client.aclose()
            await bare.aclose()
            await built.engine.aclose()
    await engine.aclose()


# --- the launcher with real processes and the real router ----------------------------------------

SMG = (
    str(Path(sys.executable).parent / "smg")
    if (Path(sys.executable).parent / "smg").exists()
    else shutil.which("smg")
)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _wait(check, what: str, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if check():
                return
        time.sleep(0.3)
    raise AssertionError(f"{what} not reached within {timeout:.0f} s")


@pytest.mark.slow
@pytest.mark.skipif(SMG is None, reason="smg (the SGLang router, `pip install smg`) is not installed")
def test_launched_server_and_router_need_the_key_which_no_cmdline_or_log_shows(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from agentrl.cluster.actors import leave_router
    from agentrl.cluster.launch import ensure_key, keyed
    from agentrl.engine.keys import read_key
    from agentrl.models.tiny import tiny_model_dir

    key_file = str(ensure_key(tmp_path / "engine.key"))
    key = read_key(key_file)
    port, rport = _port(), _port()
    worker, router = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{rport}"
    serve = [sys.executable, "-m", "agentrl.cli", "engine", "serve", "--model", str(tiny_model_dir()),
             "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    route = [SMG, "launch", "--host", "127.0.0.1", "--port", str(rport), "--worker-urls", worker,
             "--policy", "consistent_hashing", "--worker-startup-check-interval", "1",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_port()), "--log-level", "info"]  # fmt: skip
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("serve", "router")}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        "serve": subprocess.Popen(keyed(serve, key_file, sys.executable), stdout=logs["serve"],
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True),
        "router": subprocess.Popen(keyed(route, key_file, sys.executable), stdout=logs["router"],
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True),
    }  # fmt: skip
    try:
        _wait(lambda: _call("GET", f"{worker}/health")[0] == 200, "the keyed server")
        _wait(
            lambda: any(
                w["url"] == worker and w.get("is_healthy")
                for w in json.loads(_call("GET", f"{router}/workers", key=key)[1])["workers"]
            ),
            "the keyed router with its worker registered",
        )
        seen = {int(d) for d in os.listdir("/proc") if d.isdigit()}
        for pid in seen:  # every process on the host, the servers' children included
            with contextlib.suppress(OSError):
                assert key not in _cmdline(pid), _cmdline(pid)[:200]
        assert key_file in _cmdline(procs["serve"].pid)  # (smg renames its process "smg::router")
        gen = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        assert _call("GET", f"{worker}/v1/models")[0] == 401
        assert _call("GET", f"{router}/workers")[0] == 401
        assert _call("POST", f"{router}/workers", body={"url": "http://127.0.0.1:1"})[0] == 401
        assert _call("POST", f"{router}/generate", body=gen)[0] == 401
        status, body = _call("POST", f"{router}/generate", key=key, body=gen)
        assert status == 200 and json.loads(body)["meta_info"]["completion_tokens"] == 2
        assert "is off the router" in leave_router(router, worker, key_file=key_file, timeout_s=30)
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 15)
            p.wait(30)
        for fh in logs.values():
            fh.close()
    for name in logs:
        text = (tmp_path / f"{name}.log").read_text(errors="replace")
        assert key not in text, name
    assert "agentrl engine serving" in (tmp_path / "serve.log").read_text()


def test_launcher_gives_sglang_its_key_in_process_and_redacts_what_it_and_its_children_print(
    tmp_path: Path,
) -> None:
    """A stand-in `sglang.launch_server` that prints its arguments the way SGLang logs its
    ServerArgs (sgl-project/sglang#37457), from the server process and from a spawned child."""
    pkg = tmp_path / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        "import multiprocessing as mp, sys\n"
        "def child(args):\n"
        "    print('scheduler server_args=' + repr(args), flush=True)\n"
        "if __name__ == '__main__':\n"
        "    args = sys.argv[1:]\n"
        "    print('server_args=' + repr(args), flush=True)\n"
        "    print('stderr ' + args[-1], file=sys.stderr, flush=True)\n"
        "    p = mp.get_context('spawn').Process(target=child, args=(args,))\n"
        "    p.start(); p.join()\n"
    )
    (tmp_path / "k").write_text(KEY + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cluster.launch", "--key-file", str(tmp_path / "k"), "--",
         "python", "-m", "sglang.launch_server", "--model-path", "/m", "--port", "30000"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert KEY not in out.stdout + out.stderr
    assert "server_args=['--model-path', '/m', '--port', '30000', '--api-key=<engine-key>']" in out.stdout
    assert "scheduler server_args=" in out.stdout and out.stdout.count("<engine-key>") == 2
    assert "stderr --api-key=<engine-key>" in out.stderr
