"""`SGLangEngine`: an aiohttp client for SGLang workers, directly or through the SGLang router.

Shapes match SGLang 0.5.16 (`srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`) and the
sgl-model-gateway router (consistent-hashing policy), as restated in the project's SGLang reference.

Data plane: `POST /generate` with `input_ids`, `sampling_params`, `return_logprob: true` and a
fresh `rid` per call. Tokens and log-probs are read from `meta_info.output_token_logprobs`
(`[logprob, token_id, text]` triples, as Miles does), the finish reason from
`meta_info.finish_reason.type` and the weight version from `meta_info.weight_version`.

Stickiness: every turn of an episode goes to the same worker, so its prefix stays in that worker's
radix cache. Through a router the episode's `session_id` is sent as the `X-SMG-Routing-Key`
header, the key the router's `consistent_hashing` policy hashes. Given worker URLs directly, the
client hashes `session_id` itself onto a ring of 150 virtual nodes per worker (as the router does;
blake2b here instead of blake3, so the mapping is consistent but not the router's own).

Retries (tenacity, jittered exponential backoff) only where re-sending cannot run a generation
twice: a connection that could not be opened, and 502/503/504 answers (the request was not served:
router with no healthy worker, worker starting or overloaded). A `/generate` whose connection broke
or timed out after it was sent may still be running on the worker: it is not re-sent; the client
aborts it by rid (`/abort_request`) and raises `EngineError`, and the caller decides (the agent
loop retries the turn; the rollout retries the sample). Cancelling `generate` aborts the request
on the worker the same way.

Control plane (pause, continue, flush, weight updates, model info, abort) goes to every worker
directly: the router does not forward these paths (404). Through a router the worker list comes
from its `GET /workers` (or the older `GET /list_workers`) unless `worker_urls` is given.

Fleet semantics (one client over many servers implements the `Engine` control plane):
- `weight_version` is the version last confirmed by the servers: `refresh_weight_version()` reads
  every server's `/model_info` (they must agree), and every `update_weights` reads them back and
  raises `EngineVersionMismatch` naming each server that reports another version than requested.
- `update_weights` always sends `flush_cache` explicitly (false unless asked): SGLang's default is
  true, and a flush requested while requests run or wait (after an in_place pause) kills the server.
- `flush_cache` retries each server's `/flush_cache` once a second while it is busy (400), as Miles.
- A server that refuses connections during a control call is counted dead (`dead_workers`, logged):
  later control calls skip it after one try each, so the run goes on with the others; a server that
  answers again is used again (its weights are then overwritten by the next update).
- Re-admission through the router (`router_url` with `worker_urls`, as the cluster runtime sets
  it): a restarted server leaves the router before it starts (`agentrl.cluster.actors`), so it
  serves nothing on its launch weights; every update reaches every configured worker that answers,
  and once an update has confirmed a new version on it, `admit_workers` registers it with the router
  again (`POST /workers`).
- Data plane through the router: when a worker dies, the router replays its in-flight requests in
  full on another worker, which answers with its own weight version. A turn whose
  `meta_info.weight_version` is neither the fleet's version when it was sent nor when it came back is
  flagged (`Generation.version_mismatch`, counted in `version_mismatches`, logged), or raised as
  `EngineVersionMismatch` with `on_version_mismatch="raise"` so that the turn is retried.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from agentrl.engine.base import (
    PAUSE_MODES,
    DiskWeights,
    DistributedWeights,
    Engine,
    EngineBadRequest,
    EngineError,
    EngineVersionMismatch,
    Generation,
    LoraAdapter,
    PauseMode,
    SamplingParams,
    TensorWeights,
    WeightUpdate,
)
from agentrl.engine.keys import EngineKeyError, read_key
from agentrl.engine.routes import routes_of_reply

log = logging.getLogger("agentrl.engine.sglang")

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
_VNODES = 150
_RETRY_STATUSES = frozenset({502, 503, 504})
# Miles sends these with every /generate: keep special tokens and stop text in `text`, so text and
# token ids agree.
_TEXT_FIELDS = {"skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False}


class _NotServed(Exception):
    """The request was provably not served (no connection, or 502/503/504): safe to re-send."""

    def __init__(self, message: str, *, no_connection: bool = False) -> None:
        super().__init__(message)
        self.no_connection = no_connection


class _WorkerDown(EngineError):
    """A worker refused the connection on every attempt (the process is gone)."""

    cause = "engine_unavailable"


def _ring_hash(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "little")


def parse_weight_version(value: Any) -> int:
    """SGLang weight versions are strings ("default" until set); agentrl numbers them. A
    non-numeric version (e.g. "default") counts as 0."""
    try:
        return int(str(value))
    except ValueError:
        return 0


class SGLangEngine(Engine):
    """An `Engine` over SGLang servers: give worker URLs (`base_urls`; the client hashes sessions
    onto them) or a router (`router_url`, with `worker_urls` for the control plane, else asked of
    the router). One server is a fleet of one. Call `await refresh_weight_version()` before handing
    it to a rollout manager. See the module docstring for the fleet semantics."""

    def __init__(
        self,
        base_urls: str | list[str] | None = None,
        *,
        router_url: str | None = None,
        worker_urls: list[str] | None = None,
        request_timeout_s: float = 1800.0,
        control_timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        retries: int = 5,
        api_key_env: str | None = None,
        api_key_file: str | None = None,
        extra_sampling: dict[str, Any] | None = None,
        on_version_mismatch: Literal["flag", "raise"] = "flag",
        flush_wait_s: float = 60.0,
        routed_layers: int | None = None,
    ) -> None:
        if isinstance(base_urls, str):
            base_urls = [base_urls]
        if bool(base_urls) == bool(router_url):
            raise ValueError("SGLangEngine needs either base_urls (workers) or router_url, not both")
        self.base_urls = [u.rstrip("/") for u in base_urls or []]
        self.router_url = router_url.rstrip("/") if router_url else None
        # The LoRA adapter every request names (`lora_path`) after a `LoraAdapter` update, and the
        # adapters loaded on the servers, oldest first.
        self.lora: str | None = None
        self._loras: list[str] = []
        # R3: ask every generation for its routed experts (`return_routed_experts`; the servers
        # run with --enable-return-routed-experts); the model's decoder layer count splits them.
        self.routed_layers: int | None = routed_layers
        self._workers = [u.rstrip("/") for u in worker_urls] if worker_urls else list(self.base_urls)
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = max(1, retries)
        if api_key_env and api_key_file:
            raise ValueError("SGLangEngine takes the API key from api_key_env or api_key_file, not both")
        self._api_key_env = api_key_env
        self._api_key_file = api_key_file
        self._file_key: str | None = None
        self.extra_sampling = dict(extra_sampling or {})
        self._session: aiohttp.ClientSession | None = None
        self._rr = itertools.count()
        self._ring: list[tuple[int, str]] = sorted(
            (_ring_hash(f"{url}#{v}"), url) for url in self.base_urls for v in range(_VNODES)
        )
        self._ring_keys = [h for h, _ in self._ring]
        if on_version_mismatch not in ("flag", "raise"):
            raise ValueError("on_version_mismatch must be 'flag' or 'raise'")
        self.on_version_mismatch = on_version_mismatch
        self.flush_wait_s = flush_wait_s
        self._weight_version = 0
        self.dead_workers: dict[str, str] = {}  # url -> why it was counted dead
        self.version_mismatches = 0
        # Servers set aside (`set_aside`): out of routing and of every control call. Given back,
        # they are "returning" until the next pause, then "behind" until an update confirms the
        # fleet's version on them; neither is routed to.
        self._aside: set[str] = set()
        self._returning: set[str] = set()
        self._behind: set[str] = set()
        self._client_kwargs: dict[str, Any] = dict(
            request_timeout_s=request_timeout_s,
            control_timeout_s=control_timeout_s,
            connect_timeout_s=connect_timeout_s,
            retries=retries,
            api_key_env=api_key_env,
            api_key_file=api_key_file,
            extra_sampling=extra_sampling,
            on_version_mismatch=on_version_mismatch,
            flush_wait_s=flush_wait_s,
        )

    # --- plumbing ------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        if self._api_key_file:
            if self._file_key is None:
                try:
                    self._file_key = read_key(self._api_key_file)
                except EngineKeyError as exc:
                    raise EngineError(str(exc), cause="engine_auth") from None
            return {"Authorization": f"Bearer {self._file_key}"}
        if self._api_key_env:
            key = os.environ.get(self._api_key_env)
            if not key:
                raise EngineError(
                    f"environment variable {self._api_key_env} is empty: set it to the SGLang API key",
                    cause="engine_auth",
                )
            return {"Authorization": f"Bearer {key}"}
        return {}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=self.control_timeout_s, connect=self.connect_timeout_s),
            )
        return self._session

    def worker_for(self, session_id: str | None) -> str:
        """The worker URL a direct-mode request of this session goes to: its place on the ring,
        walking on past workers counted dead (as the router skips unhealthy ones)."""
        if self.router_url:
            return self.router_url
        out = self.dead_workers.keys() | self._not_routed()
        live = [u for u in self.base_urls if u not in out] or self.base_urls
        if session_id is None:
            return live[next(self._rr) % len(live)]
        i = bisect.bisect_left(self._ring_keys, _ring_hash(session_id))
        for k in range(len(self._ring)):
            url = self._ring[(i + k) % len(self._ring)][1]
            if url in live:
                return url
        return live[0]

    async def _call(
        self,
        method: str,
        url: str,
        *,
        json_body: Any = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        params: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """One HTTP exchange; returns (status, parsed JSON or text). Raises `_NotServed` when
        re-sending is safe, `EngineError` otherwise."""
        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self.control_timeout_s, connect=self.connect_timeout_s
        )
        try:
            async with self._http().request(
                method,
                url,
                json=json_body,
                headers={**self._headers(), **(headers or {})},
                timeout=timeout,
                params=params,
            ) as resp:
                raw = await resp.read()
                status = resp.status
                ctype = resp.content_type
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise _NotServed(f"cannot connect to {url}: {e}", no_connection=True) from e
        except TimeoutError as e:
            raise EngineError(
                f"{method} {url} timed out after {timeout.total} s", cause="engine_timeout"
            ) from e
        except aiohttp.ClientError as e:
            raise EngineError(f"{method} {url} failed: {type(e).__name__}: {e}", cause="engine_http") from e
        if status in (401, 403):
            raise EngineError(
                f"{method} {url} answered {status} ({raw[:200]!r}): the server wants an API key this client "
                f"does not have ({'none given' if not (self._api_key_file or self._api_key_env) else 'wrong key'}); "
                "give the run's engine key (engine.api_key_file)",
                cause="engine_auth",
            )
        if status in _RETRY_STATUSES:
            raise _NotServed(f"{method} {url} answered {status}: {raw[:300]!r}")
        body: Any = raw.decode("utf-8", "replace")
        if ctype == "application/json" and raw:
            try:
                body = json.loads(raw)
            except ValueError:
                pass
        return status, body

    async def _request(
        self, method: str, url: str, *, attempts: int | None = None, **kw: Any
    ) -> tuple[int, Any]:
        attempts = attempts or self.retries
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_NotServed),
                stop=stop_after_attempt(attempts),
                wait=wait_random_exponential(multiplier=0.05, max=2.0),
                reraise=True,
            ):
                with attempt:
                    return await self._call(method, url, **kw)
        except _NotServed as e:
            kind = _WorkerDown if e.no_connection else EngineError
            raise kind(f"{e} (gave up after {attempts} attempts)", cause="engine_unavailable") from e
        raise AssertionError("unreachable: tenacity either returns or raises")

    @staticmethod
    def _message(body: Any) -> str:
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict) and "message" in err:
                return str(err["message"])
            if "message" in body:
                return str(body["message"])
        return str(body)[:500]

    def _raise_for(self, status: int, body: Any, what: str) -> None:
        if status == 400:
            raise EngineBadRequest(f"{what}: {self._message(body)}")
        if status >= 300:
            raise EngineError(f"{what}: HTTP {status}: {self._message(body)}", cause=f"engine_http_{status}")

    # --- data plane ----------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        session_id: str | None = None,
        rid: str | None = None,
    ) -> Generation:
        rid = rid or uuid.uuid4().hex
        sent_version = self._weight_version
        url = self.worker_for(session_id)
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {**_TEXT_FIELDS, **sampling.to_sglang(), **self.extra_sampling},
            "return_logprob": True,
            "rid": rid,
        }
        if self.lora is not None:
            body["lora_path"] = self.lora
        if self.routed_layers is not None:
            body["return_routed_experts"] = True
        headers = {ROUTING_KEY_HEADER: session_id} if (self.router_url and session_id) else None
        try:
            status, reply = await self._request(
                "POST", f"{url}/generate", json_body=body, headers=headers, timeout_s=self.request_timeout_s
            )
        except asyncio.CancelledError:
            await self._abort_quietly(url, rid)
            raise
        except _WorkerDown as e:
            if not self.router_url:
                self._mark_dead(url, str(e))  # the next turn of this session goes to the next worker
            raise
        except EngineError as e:
            if e.cause != "engine_unavailable":  # it may have been accepted and still be running
                await self._abort_quietly(url, rid)
            raise
        self._raise_for(status, reply, "SGLang /generate")
        gen = self._parse(reply)
        if self.routed_layers is not None:
            tokens = len(input_ids) + len(gen.output_ids) - 1
            gen = dataclasses.replace(gen, routed_experts=routes_of_reply(reply, tokens, self.routed_layers))
        expected = {sent_version, self._weight_version}
        if gen.weight_version in expected:
            return gen
        # Served by a server on other weights: replayed by the router after a worker died, or a
        # worker that came back with its launch weights. Never let it pass silently.
        self.version_mismatches += 1
        message = (
            f"SGLang /generate rid {rid}: the reply's weight_version {gen.meta.get('weight_version')!r} is not "
            f"the fleet's ({' or '.join(str(v) for v in sorted(expected))}); served by another worker's weights "
            "(a replay after a worker died, or a worker that restarted)"
        )
        log.warning(message)
        if self.on_version_mismatch == "raise":
            raise EngineVersionMismatch(message)
        return dataclasses.replace(
            gen, version_mismatch=True, meta={**gen.meta, "expected_weight_version": max(expected)}
        )

    def _parse(self, reply: Any) -> Generation:
        try:
            meta = reply["meta_info"]
            finish = meta["finish_reason"] or {}
            triples = meta.get("output_token_logprobs") or []
            ids = [int(t[1]) for t in triples]
            logps = [float(t[0]) for t in triples]
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise EngineError(f"SGLang /generate reply has no usable meta_info: {str(reply)[:300]}") from e
        kind = finish.get("type")
        if kind == "abort" and finish.get("status_code") not in (None, 200):
            code = finish.get("status_code")
            if code == 400:
                raise EngineBadRequest(f"SGLang /generate: {finish.get('message')}")
            raise EngineError(f"SGLang /generate aborted with {code}: {finish.get('message')}")
        if kind not in ("stop", "length", "abort"):
            raise EngineError(f"SGLang /generate: unknown finish_reason {finish!r}")
        if "output_ids" in reply and reply["output_ids"] != ids and triples:
            raise EngineError("SGLang /generate: output_ids and output_token_logprobs disagree")
        version = meta.get("weight_version")
        return Generation(
            output_ids=ids,
            logprobs=logps,
            finish_reason=kind,
            weight_version=parse_weight_version(version),
            text=reply.get("text"),
            meta={
                "id": meta.get("id"),
                "finish": finish,
                "weight_version": version,
                "cached_tokens": meta.get("cached_tokens"),
                "prompt_tokens": meta.get("prompt_tokens"),
            },
        )

    async def _abort_quietly(self, url: str, rid: str) -> None:
        """Best-effort abort of one request on its worker (through a router: on every worker)."""
        targets = [url] if not self.router_url else await self._worker_urls_quietly()

        async def one(target: str) -> None:
            with contextlib.suppress(EngineError, _NotServed, aiohttp.ClientError, TimeoutError):
                await self._call("POST", f"{target}/abort_request", json_body={"rid": rid}, timeout_s=5.0)

        await asyncio.shield(asyncio.gather(*(one(t) for t in targets)))

    async def _worker_urls_quietly(self) -> list[str]:
        try:
            return await self.worker_urls()
        except EngineError:
            return []

    # --- control plane -------------------------------------------------------------------------

    def _not_routed(self) -> set[str]:
        return self._aside | self._returning | self._behind

    async def worker_urls(self) -> list[str]:
        """The workers behind this client (asked of the router when not given), less those set
        aside and not yet returned (`set_aside`, `rejoin`)."""
        if self._workers:
            return [u for u in self._workers if u not in self._aside and u not in self._returning]
        assert self.router_url is not None
        status, body = await self._request("GET", f"{self.router_url}/workers")
        if status == 200 and isinstance(body, dict) and "workers" in body:
            urls = [w.get("url") for w in body["workers"]]
        else:
            status, body = await self._request("GET", f"{self.router_url}/list_workers")
            self._raise_for(status, body, "router /list_workers")
            urls = body.get("urls", []) if isinstance(body, dict) else []
        # Data-parallel-aware routers list workers as base@rank; control calls go to the base.
        return sorted({u.split("@")[0].rstrip("/") for u in urls if u})

    def _mark_dead(self, url: str, why: str) -> None:
        if url not in self.dead_workers:
            log.error("SGLang worker %s is down (%s); control calls go on with the others", url, why)
        self.dead_workers[url] = why

    async def _fan_out(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        check_success: bool = False,
        only: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """The same call on every live worker (or on `only`), concurrently; {url: reply}. A worker
        that refuses the connection is counted dead and left out (one try per call while it stays
        dead); any other failure raises. Raises if no worker answers at all."""
        urls = [u.rstrip("/") for u in only] if only else await self.worker_urls()
        if not urls:
            raise EngineError("no SGLang workers to send the control call to", cause="engine_unavailable")

        async def one(url: str) -> tuple[str, Any]:
            attempts = 1 if url in self.dead_workers else None
            try:
                status, reply = await self._request(
                    method, f"{url}{path}", json_body=body, timeout_s=timeout_s, attempts=attempts
                )
            except _WorkerDown as e:
                self._mark_dead(url, str(e))
                return url, e
            if self.dead_workers.pop(url, None) is not None:
                log.warning("SGLang worker %s answers again; it rejoins the control plane", url)
            self._raise_for(status, reply, f"SGLang {path} on {url}")
            if check_success and not (isinstance(reply, dict) and reply.get("success")):
                raise EngineError(
                    f"SGLang {path} on {url} failed: {self._message(reply)}", cause="engine_weight_update"
                )
            return url, reply

        results = dict(await asyncio.gather(*(one(u) for u in urls)))
        live = {u: r for u, r in results.items() if not isinstance(r, _WorkerDown)}
        if not live:
            raise EngineError(
                f"SGLang {path}: no worker answers ({', '.join(urls)} refuse connections)",
                cause="engine_unavailable",
            )
        return live

    async def pause(self, mode: PauseMode = "abort") -> None:
        """`/pause_generation` on every worker. "abort" returns once in-flight requests have
        returned (with finish_reason abort); "in_place" / "retract" hold them until `resume`."""
        if mode not in PAUSE_MODES:
            raise EngineBadRequest(f"pause mode {mode!r}: use one of {PAUSE_MODES}")
        if self._returning:  # servers back from `set_aside` join the control plane here
            log.info("SGLang workers %s rejoin the fleet's control plane", sorted(self._returning))
            self._behind |= self._returning
            self._returning.clear()
        await self._fan_out("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._fan_out("POST", "/continue_generation", {})

    async def flush_cache(self, *, wait_s: float | None = None) -> None:
        """`/flush_cache` on every worker; a worker with requests running or queued refuses (400),
        so retry once a second for up to `wait_s` (default `flush_wait_s`), as Miles does."""
        urls = [u for u in await self.worker_urls() if u not in self.dead_workers]
        wait = self.flush_wait_s if wait_s is None else wait_s

        async def one(url: str) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait
            while True:
                status, body = await self._request("GET", f"{url}/flush_cache")
                if status == 200:
                    return
                if loop.time() >= deadline:
                    raise EngineError(
                        f"SGLang /flush_cache on {url} kept failing for {wait:.0f} s (requests still running "
                        f"or queued: pause with mode='abort' first): {self._message(body)}",
                        cause="engine_flush_busy",
                    )
                await asyncio.sleep(1.0)

        await asyncio.gather(*(one(u) for u in urls))

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """`/abort_request` on every worker: the request whose rid is exactly `rid` (SGLang 0.5.16
        ignores partial rids), or all of them."""
        if not rid and not abort_all:
            raise EngineBadRequest("abort needs a request id or abort_all=True")
        await self._fan_out("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def update_weights(
        self,
        update: WeightUpdate,
        *,
        weight_version: int,
        flush_cache: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        """`/update_weights_from_disk|tensor|distributed` on every worker, then every worker's
        `/model_info` version must be `weight_version` (else `EngineVersionMismatch` naming the
        servers). `flush_cache` is sent explicitly, false by default (see `agentrl.engine.base`)."""
        common: dict[str, Any] = {
            "flush_cache": bool(flush_cache),
            "abort_all_requests": False,
            "weight_version": str(int(weight_version)),
        }
        if isinstance(update, DiskWeights):
            path = "/update_weights_from_disk"
            body = {"model_path": update.model_path, "load_format": update.load_format, **common}
        elif isinstance(update, TensorWeights):
            path = "/update_weights_from_tensor"
            body = {
                "serialized_named_tensors": list(update.serialized_named_tensors),
                "load_format": update.load_format,
                **common,
            }
        elif isinstance(update, DistributedWeights):
            path = "/update_weights_from_distributed"
            body = {
                "names": list(update.names),
                "dtypes": list(update.dtypes),
                "shapes": [list(s) for s in update.shapes],
                "group_name": update.group_name,
                **common,
            }
        elif isinstance(update, LoraAdapter):
            await self._update_lora(update, int(weight_version), timeout_s)
            return
        else:
            raise EngineBadRequest(
                "update_weights takes DiskWeights, TensorWeights, DistributedWeights or LoraAdapter, "
                f"not {update!r}"
            )
        before = self._weight_version
        # A distributed update goes to its group's members only: a server that came up after the
        # group formed is not in it (the next push forms the group again with it).
        only = tuple(update.members) if isinstance(update, DistributedWeights) else ()
        updated = await self._fan_out("POST", path, body, timeout_s=timeout_s, check_success=True, only=only)
        await self._confirm_version(int(weight_version), list(updated))
        self._behind -= set(updated)  # on the fleet's version again: routed to (direct mode)
        if int(weight_version) != before:  # a whole new version is in: servers that caught up rejoin
            try:
                await self.admit_workers()
            except EngineError as e:  # the weights are in; a router that refuses is retried next time
                log.error("could not register caught-up workers with the router %s: %s", self.router_url, e)

    async def _update_lora(self, update: LoraAdapter, version: int, timeout_s: float) -> None:
        """`/load_lora_adapter` on every worker, `/update_weight_version` (no abort: the caller
        paused the fleet), the version read back; then requests name the new adapter, and every
        adapter older than the previous one is unloaded (the previous may still run a request that
        an in_place pause held)."""
        body = {"lora_name": update.name, "lora_path": update.path}
        updated = await self._fan_out(
            "POST", "/load_lora_adapter", body, timeout_s=timeout_s, check_success=True
        )
        version_body = {"new_version": str(version), "abort_all_requests": False}
        await self._fan_out(
            "POST", "/update_weight_version", version_body, timeout_s=timeout_s, check_success=True
        )
        await self._confirm_version(version, list(updated))
        self.lora = update.name
        self._loras.append(update.name)
        while len(self._loras) > 2:
            old = self._loras.pop(0)
            try:
                await self._fan_out("POST", "/unload_lora_adapter", {"lora_name": old}, check_success=True)
            except EngineError as e:  # it costs server memory, not correctness
                log.warning("could not unload LoRA adapter %s: %s", old, e)

    async def _confirm_version(self, version: int, urls: list[str]) -> None:
        versions = await self.weight_versions()
        wrong = {u: versions.get(u) for u in urls if versions.get(u) != version}
        if wrong:
            raise EngineVersionMismatch(
                f"after updating to weight version {version}: "
                + ", ".join(f"{u} reports {v}" for u, v in wrong.items())
            )
        self._weight_version = version

    async def refresh_weight_version(self, *, allow_laggards: bool = False) -> int:
        """Read every live server's version (they must agree) into `weight_version`. Call once
        before handing the fleet to a rollout manager: a fleet may not start at 0.

        `allow_laggards`: for a caller that pushes weights right away (a resumed trainer), servers
        behind the newest version (restarted on their launch weights) are logged instead of
        refused; the fleet takes the newest version and the push brings them to it."""
        versions = await self.weight_versions()
        if not versions:
            raise EngineError("no SGLang worker answers /model_info", cause="engine_unavailable")
        if len(set(versions.values())) != 1:
            listing = ", ".join(f"{u} reports {v}" for u, v in versions.items())
            if not allow_laggards:
                raise EngineVersionMismatch(f"SGLang servers disagree on the weight version: {listing}")
            log.warning(
                "SGLang servers disagree on the weight version (%s): the next update brings them level",
                listing,
            )
        self._weight_version = max(versions.values())
        return self._weight_version

    async def server_tp_sizes(self) -> dict[str, int]:
        """`tp_size` of every live worker (`/server_info`): a tensor update needs one payload per
        TP rank, and each TP rank is one member of a weight-update group."""
        infos = await self._fan_out("GET", "/server_info")
        return {u: int(info.get("tp_size", 1)) if isinstance(info, dict) else 1 for u, info in infos.items()}

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offsets: Mapping[str, int],
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> None:
        """`/init_weights_update_group` on every worker, each with its own `rank_offset` (the
        trainer is rank 0; a worker's TP ranks are rank_offset .. rank_offset + tp_size - 1). The
        calls return once the trainer has joined too, so run them concurrently with its join."""
        urls = [u for u in await self.worker_urls() if u not in self.dead_workers]
        missing = [u for u in urls if u not in rank_offsets]
        if missing:
            raise EngineBadRequest(f"init_weights_update_group: no rank_offset for {missing}")

        async def one(url: str) -> None:
            body = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": int(rank_offsets[url]),
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            status, reply = await self._request(
                "POST", f"{url}/init_weights_update_group", json_body=body, timeout_s=timeout_s
            )
            self._raise_for(status, reply, f"SGLang /init_weights_update_group on {url}")
            if not (isinstance(reply, dict) and reply.get("success")):
                raise EngineError(
                    f"SGLang /init_weights_update_group on {url} failed: {self._message(reply)}",
                    cause="engine_weight_update",
                )

        await asyncio.gather(*(one(u) for u in urls))

    async def destroy_weights_update_group(self, group_name: str) -> list[str]:
        """`/destroy_weights_update_group` on every live worker, best effort (a server that never
        joined answers 400 "does not exist"); returns the workers that had the group."""

        async def one(url: str) -> str | None:
            try:
                status, reply = await self._request(
                    "POST", f"{url}/destroy_weights_update_group", json_body={"group_name": group_name}
                )
            except EngineError as e:
                log.info("destroy_weights_update_group %s on %s: %s", group_name, url, e)
                return None
            return url if status == 200 and isinstance(reply, dict) and reply.get("success") else None

        urls = [u for u in await self.worker_urls() if u not in self.dead_workers]
        return [u for u in await asyncio.gather(*(one(u) for u in urls)) if u is not None]

    async def routed_workers(self) -> dict[str, str]:
        """{worker URL: router worker id} of the workers the router routes to now."""
        assert self.router_url is not None
        status, body = await self._request("GET", f"{self.router_url}/workers")
        self._raise_for(status, body, "router GET /workers")
        workers = body.get("workers", []) if isinstance(body, dict) else []
        return {
            str(w.get("url", "")).rstrip("/"): str(w.get("id", "")) for w in workers if isinstance(w, dict)
        }

    async def admit_workers(self) -> list[str]:
        """Register with the router every configured worker (`worker_urls`) that is not routed to
        but answers on the fleet's weight version (a restarted server the last update caught up);
        returns them. Without a router, or without a fixed worker list, there is nothing to do."""
        if not (self.router_url and self._workers):
            return []
        routed = await self.routed_workers()
        missing = [
            u
            for u in self._workers
            if u not in routed and u not in self.dead_workers and u not in self._aside | self._returning
        ]
        if not missing:
            return []
        versions = await self.weight_versions()
        ready = [u for u in missing if versions.get(u) == self._weight_version]
        for url in ready:
            status, reply = await self._request(
                "POST", f"{self.router_url}/workers", json_body={"url": url, "worker_type": "regular"}
            )
            if status not in (200, 201, 202, 409):  # 409: already there (a concurrent admission)
                self._raise_for(status, reply, f"router POST /workers {url}")
            log.warning(
                "SGLang worker %s serves weight version %d: registered with the router again",
                url,
                self._weight_version,
            )
        return ready

    def _serving(self) -> list[str]:
        out = self.dead_workers.keys() | self._not_routed()
        return [u for u in self._workers if u not in out]

    def can_set_aside(self, n: int) -> bool:
        """A fixed worker list (`base_urls`, or `worker_urls` with a router) in which at least one
        routed worker stays once `n` are taken out."""
        return n >= 1 and len(self._serving()) > n

    async def set_aside(self, n: int) -> SGLangEngine:
        """Take the last `n` routed workers out of the fleet for a task pinned to the current
        weight version (an eval while training goes on): they leave the router (`DELETE
        /workers/{id}`; in direct mode the ring), and pause, flush, weight updates and version
        reads skip them until `rejoin`. A request already running on one of them finishes there,
        on the version it was sent under. Returns a direct client over them alone, at this
        fleet's version (the servers are checked to report it)."""
        if not self.can_set_aside(n):
            raise EngineBadRequest(
                f"cannot set {n} SGLang worker(s) aside: {len(self._serving())} routed worker(s) "
                f"({'a fixed worker list is needed' if not self._workers else 'at least one must stay'})"
            )
        picked = self._serving()[-n:]
        self._aside |= set(picked)  # no new turn is sent to them from here on
        client = SGLangEngine(picked, **self._client_kwargs)
        try:
            versions = await client.weight_versions()
            off = {u: versions.get(u) for u in picked if versions.get(u) != self._weight_version}
            if off:
                raise EngineVersionMismatch(
                    f"workers to set aside are not on the fleet's weight version {self._weight_version}: {off}"
                )
            if self.router_url:
                for url in picked:
                    await self._leave_router(url)
        except BaseException:
            self._aside -= set(picked)
            await client.aclose()
            raise
        log.info("SGLang workers %s set aside at weight version %d", picked, self._weight_version)
        client.weight_version = self._weight_version
        return client

    async def rejoin(self, aside: Engine) -> None:
        """Give back the workers of a client `set_aside` returned (and close it). They rejoin the
        control plane at the next `pause` (a weight push runs between pause and resume, so they
        get all of it, never its last buckets alone) and routing once an update has confirmed
        the fleet's version on them (`admit_workers` through a router)."""
        urls = set(getattr(aside, "base_urls", ()))
        if not urls or not urls <= self._aside:
            raise EngineBadRequest(f"rejoin: {sorted(urls)} were not set aside by this fleet")
        await aside.aclose()
        self._aside -= urls
        self._returning |= urls
        log.info("SGLang workers %s given back; they rejoin at the next weight update", sorted(urls))

    async def _leave_router(self, url: str) -> None:
        """`DELETE /workers/{id}` on the router, then wait until it lists `url` no more."""
        assert self.router_url is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.control_timeout_s
        asked = False
        while True:
            routed = await self.routed_workers()
            if url not in routed:
                return
            if not asked:
                status, reply = await self._request("DELETE", f"{self.router_url}/workers/{routed[url]}")
                if status not in (200, 202, 204, 404):
                    self._raise_for(status, reply, f"router DELETE /workers {url}")
                asked = True
            if loop.time() >= deadline:
                raise EngineError(
                    f"the router {self.router_url} still routes to {url} {self.control_timeout_s:.0f} s "
                    "after DELETE /workers",
                    cause="engine_control",
                )
            await asyncio.sleep(0.2)

    async def model_info(self) -> dict[str, dict[str, Any]]:
        """`/model_info` of every live worker, by URL (falls back to the deprecated
        `/get_model_info` of older servers); a worker that refuses the connection is counted dead
        and left out."""
        urls = [u for u in await self.worker_urls() if u not in self.dead_workers]

        async def one(url: str) -> tuple[str, dict[str, Any]] | None:
            try:
                status, body = await self._request("GET", f"{url}/model_info")
                if status == 404:
                    status, body = await self._request("GET", f"{url}/get_model_info")
            except _WorkerDown as e:
                self._mark_dead(url, str(e))
                return None
            self._raise_for(status, body, f"SGLang /model_info on {url}")
            return url, body if isinstance(body, dict) else {}

        return dict(r for r in await asyncio.gather(*(one(u) for u in urls)) if r is not None)

    async def weight_versions(self) -> dict[str, int]:
        """The version each live worker reports in `/model_info`, by URL."""
        return {
            u: parse_weight_version(info.get("weight_version"))
            for u, info in (await self.model_info()).items()
        }

    async def health(self) -> bool:
        try:
            urls = await self.worker_urls()
            replies = await asyncio.gather(*(self._call("GET", f"{u}/health") for u in urls))
        except (EngineError, _NotServed):
            return False
        return bool(urls) and all(status == 200 for status, _ in replies)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
