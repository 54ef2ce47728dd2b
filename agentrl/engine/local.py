"""`LocalEngine`: a transformers causal LM in this process, sampling with a KV cache.

Log-prob semantics follow SGLang 0.5.16 (`layers/sampler.py`): the returned log-prob of a sampled
token is taken from `log_softmax(logits / T)`, *before* top-k / top-p truncation; greedy requests
(T < 1e-6) take the argmax and report `log_softmax(logits)` (T = 1). `logprob_mode="original"` is
SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB=1`: plain `log_softmax(logits)` whatever the temperature.
At T = 1 both equal what a trainer recomputes with `log_softmax` of the raw logits.

Generation runs on one dedicated worker thread, so the model is never used by two threads at once;
weight loads queue on the same thread, so an update waits for the generation ahead of it to
finish, as SGLang's writer lock makes it. Requests that arrive while the thread is busy are decoded
together as one batch (up to `max_batch`): prompts left-padded with an attention mask and explicit
position ids, one KV cache, per-request sampling parameters and seeds. Padding changes no result
beyond float noise (measured 5e-7 on log-probs against unbatched decoding). Cancelling the
awaiting coroutine aborts its request at the next token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.engine.base import (
    PAUSE_MODES,
    DiskWeights,
    DistributedWeights,
    Engine,
    EngineBadRequest,
    EngineError,
    Generation,
    LoraAdapter,
    PauseMode,
    SamplingParams,
    TensorWeights,
    WeightUpdate,
)
from agentrl.engine.lora import NOT_ENABLED, AdapterFileError, LoraPool
from agentrl.engine.tensors import deserialize_named_tensors

_GREEDY_T = 1e-6
_GATE_POLL_S = 0.05
_ACTIVE: Any = object()  # generate(): the adapter the last LoraAdapter update made current


@dataclass
class _Request:
    rid: str
    abort: threading.Event = field(default_factory=threading.Event)
    submitted: bool = False  # past the pause gate: handed to the worker thread


@dataclass
class _Job:
    input_ids: list[int]
    sampling: SamplingParams
    request: _Request
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Generation]
    lora: str | None = None
    routed_experts: bool = False


@dataclass
class _Row:
    """One request inside a running batch."""

    job: _Job
    budget: int
    generator: Any
    stop_ids: frozenset[int]
    out_ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    done: bool = False
    routes: list[list[list[int]]] | None = None  # R3: per processed token, each layer's experts


class LocalEngine(Engine):
    """In-process engine over a transformers causal LM (see the module docstring for semantics).

    `tokenizer_or_eos_ids` is a tokenizer (its eos id, and stop strings become usable) or an
    iterable of eos token ids. The model's `generation_config.eos_token_id` is added either way.

    `cpu_threads`: intra-op threads of the engine's worker thread only (torch's setting is per
    thread, so a trainer in the same process keeps its own). By default 1 for models under 100M
    parameters on CPU: decoding them is a chain of tiny matmuls, and extra threads mostly wait on
    each other. Measured with the tiny model on the 2-core machine while other jobs ran: 19 ms per
    decoded token with 1 thread, 164 ms with 2. Otherwise torch's default.
    """

    def __init__(
        self,
        model: Any,
        tokenizer_or_eos_ids: Any,
        device: str = "cpu",
        *,
        weight_version: int = 0,
        logprob_mode: str = "processed",
        context_length: int | None = None,
        cpu_threads: int | None = None,
        max_batch: int = 16,
        enable_lora: bool = False,
        max_lora_rank: int | None = None,
        max_loaded_loras: int | None = None,
        return_routed_experts: bool = False,
    ) -> None:
        if logprob_mode not in ("processed", "original"):
            raise ValueError(f"logprob_mode={logprob_mode!r}: use 'processed' (SGLang default) or 'original'")
        self.model = model.to(device).eval()
        self.device = device
        self.logprob_mode = logprob_mode
        self.weight_version = weight_version
        self.tokenizer: Any = None
        eos: set[int] = set()
        if isinstance(tokenizer_or_eos_ids, Iterable) and not hasattr(tokenizer_or_eos_ids, "encode"):
            eos.update(int(i) for i in tokenizer_or_eos_ids)
        else:
            self.tokenizer = tokenizer_or_eos_ids
            eos.update(_as_ids(getattr(self.tokenizer, "eos_token_id", None)))
        gen_config = getattr(model, "generation_config", None)
        eos.update(_as_ids(getattr(gen_config, "eos_token_id", None)))
        self.eos_ids = frozenset(eos)
        self.context_length = context_length or int(
            getattr(model.config, "max_position_embeddings", 0) or 1 << 30
        )
        self.vocab_size = int(model.config.vocab_size)
        self.cpu_threads = cpu_threads or _default_cpu_threads(model, device)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="local-engine", initializer=_set_threads, initargs=(self.cpu_threads,)
        )
        self.max_batch = max(1, max_batch)
        self._queue: list[_Job] = []
        self.stats = {"batches": 0, "batched_requests": 0, "tokens": 0}
        self._queue_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._gate = threading.Event()  # clear while paused "in_place": running requests wait
        self._gate.set()
        # Set while a running batch is held at the gate: the worker touches no weights then, so a
        # weight load may run beside it (otherwise the load would queue behind a batch that waits
        # for the resume that follows the load).
        self._parked = threading.Event()
        self._closed = False
        # SGLang's --enable-lora: adapters by name (`agentrl.engine.lora`); None refuses them.
        self.lora = (
            LoraPool(self.model, max_rank=max_lora_rank, max_loaded=max_loaded_loras) if enable_lora else None
        )
        self.active_lora: str | None = None  # what an in-process caller's requests use by default
        # SGLang's --enable-return-routed-experts (R3): the experts each token was routed to.
        self.return_routed_experts = return_routed_experts
        self._routers: list[tuple[int, Any]] | None = None

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        session_id: str | None = None,
        rid: str | None = None,
        lora: str | None = _ACTIVE,
        routed_experts: bool | None = None,
    ) -> Generation:
        """Sample a continuation of `input_ids`. Returns finish_reason "stop", "length" or
        "abort" (with the tokens produced before the abort). Waits while the engine is paused.
        `lora`: a loaded adapter's name, None for the base weights; by default the adapter the last
        `LoraAdapter` update made current (an in-process engine syncing LoRA adapters)."""
        self._check(input_ids, sampling)
        lora = self.active_lora if lora is _ACTIVE else lora
        want_routes = self.return_routed_experts if routed_experts is None else routed_experts
        if want_routes and not self.return_routed_experts:
            raise EngineBadRequest(
                "return_routed_experts needs the engine started with return_routed_experts "
                "(agentrl engine serve --enable-return-routed-experts, as SGLang's flag)"
            )
        if lora is not None:
            if self.lora is None:
                raise EngineBadRequest(NOT_ENABLED)
            try:
                self.lora.check(lora)
            except AdapterFileError as e:
                raise EngineBadRequest(str(e)) from None
        if self._closed:
            raise EngineError("the local engine is closed", cause="engine_closed")
        rid = rid or uuid.uuid4().hex
        if rid in self._requests:
            raise EngineBadRequest(f"Duplicate request ID detected: {rid}")
        request = _Request(rid)
        self._requests[rid] = request
        self._idle.clear()
        try:
            await self._resumed.wait()
            request.submitted = True
            loop = asyncio.get_running_loop()
            job = _Job(list(input_ids), sampling, request, loop, loop.create_future(), lora, want_routes)
            with self._queue_lock:
                self._queue.append(job)
            # Each submission drains whatever is queued by then, so concurrent requests batch.
            self._executor.submit(self._drain)
            return await job.future
        finally:
            # On cancellation the worker thread notices the flag at its next token and stops.
            request.abort.set()
            self._requests.pop(rid, None)
            if not self._requests:
                self._idle.set()

    def _check(self, input_ids: list[int], sampling: SamplingParams) -> None:
        if not input_ids:
            raise EngineBadRequest("input_ids cannot be empty.")
        if any(not 0 <= int(i) < self.vocab_size for i in input_ids):
            raise EngineBadRequest(f"input_ids must be token ids in [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise EngineBadRequest(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        if sampling.temperature < 0 or sampling.temperature != sampling.temperature:
            raise EngineBadRequest(f"temperature must be >= 0, got {sampling.temperature}")
        if not 0 < sampling.top_p <= 1:
            raise EngineBadRequest(f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.top_k == 0 or sampling.top_k < -1:
            raise EngineBadRequest(f"top_k must be -1 (whole vocabulary) or >= 1, got {sampling.top_k}")
        if sampling.max_new_tokens < 0:
            raise EngineBadRequest(f"max_new_tokens must be >= 0, got {sampling.max_new_tokens}")
        if sampling.stop and self.tokenizer is None:
            raise EngineBadRequest("stop strings need a tokenizer: build LocalEngine with one")

    def _drain(self) -> None:
        with self._queue_lock:  # one adapter per batch: the oldest job's, and the jobs that share it
            lora = self._queue[0].lora if self._queue else None
            jobs = [j for j in self._queue if j.lora == lora][: self.max_batch]
            taken = {id(j) for j in jobs}
            self._queue = [j for j in self._queue if id(j) not in taken]
        ready = []
        for job in jobs:
            if job.request.abort.is_set():
                meta = {"message": "Abort in waiting queue", "id": job.request.rid}
                _deliver(job, Generation([], [], "abort", self.weight_version, meta=meta))
            else:
                ready.append(job)
        if not ready:
            return
        try:
            if self.lora is not None:
                self.lora.activate(lora)
            self._generate_batch(ready)
        except BaseException as e:  # hand every failure to the waiting callers, never lose it here
            for job in ready:
                _deliver(job, e)

    def _generate_batch(self, jobs: list[_Job]) -> None:
        """Decode several requests together: prompts left-padded, explicit position ids, one KV
        cache. Each row samples with its own parameters and generator, and is answered as soon as
        it finishes; finished rows ride along until the batch ends."""
        import torch

        rows: list[_Row] = []
        for job in jobs:
            sp = job.sampling
            # As SGLang's scheduler: never run past the context (minus the 2 positions it reserves).
            budget = max(0, min(sp.max_new_tokens, self.context_length - len(job.input_ids) - 2))
            gen = (
                torch.Generator(device=self.device).manual_seed(int(sp.seed)) if sp.seed is not None else None
            )
            row = _Row(job, budget, gen, self.eos_ids | frozenset(sp.stop_token_ids))
            if budget == 0:
                self._finish(row, "length", None)
            else:
                rows.append(row)
        if not rows:
            return
        self.stats["batches"] += 1
        self.stats["batched_requests"] += len(rows)
        width = max(len(r.job.input_ids) for r in rows)
        padded = any(len(r.job.input_ids) != width for r in rows)
        ids = torch.tensor(
            [[0] * (width - len(r.job.input_ids)) + r.job.input_ids for r in rows], device=self.device
        )
        kwargs: dict[str, Any] = {}
        if padded:
            mask = torch.tensor(
                [[0] * (width - len(r.job.input_ids)) + [1] * len(r.job.input_ids) for r in rows],
                device=self.device,
            )
            kwargs = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        capture = self._route_capture() if any(r.job.routed_experts for r in rows) else None
        try:
            with torch.no_grad():
                out = self.model(ids, use_cache=True, **kwargs)
                if capture is not None:
                    capture.collect(rows, [len(r.job.input_ids) for r in rows], width)
                cache = out.cache if "cache" in out else out.past_key_values
                while True:
                    self._wait_gate(rows)
                    for i, row in enumerate(rows):
                        if not row.done:
                            self._step(row, out.logits[i, -1].float())
                    if all(r.done for r in rows):
                        return
                    nxt = torch.tensor(
                        [[r.out_ids[-1] if r.out_ids else 0] for r in rows], device=self.device
                    )
                    if padded:
                        mask = torch.cat([kwargs["attention_mask"], torch.ones_like(nxt)], 1)
                        kwargs = {"attention_mask": mask, "position_ids": kwargs["position_ids"][:, -1:] + 1}
                    out = self.model(nxt, cache=cache, use_cache=True, **kwargs)
                    if capture is not None:
                        capture.collect(rows, [1] * len(rows), 1)
                    cache = out.cache if "cache" in out else out.past_key_values
        finally:
            if capture is not None:
                capture.close()

    def _step(self, row: _Row, logits: Any) -> None:
        sp = row.job.sampling
        if row.job.request.abort.is_set():
            self._finish(row, "abort", None)
            return
        token, logp = self._sample(logits, sp, row.generator)
        row.out_ids.append(token)
        self.stats["tokens"] += 1
        row.logps.append(logp)
        if token in row.stop_ids:
            self._finish(row, "stop", token)
        elif sp.stop and (hit := self._stop_string(row.out_ids, sp.stop)):
            self._finish(row, "stop", hit)
        elif len(row.out_ids) >= row.budget:
            self._finish(row, "length", None)

    def _finish(self, row: _Row, reason: str, matched: int | str | None) -> None:
        """Answer one request. Its version is the one loaded now, as SGLang reads
        `weight_version` when it builds the response: a request paused in place across a weight
        load reports the new version (its later tokens came from the new weights)."""
        version = self.weight_version
        row.done = True
        meta: dict[str, Any] = {"id": row.job.request.rid, "prompt_tokens": len(row.job.input_ids)}
        if reason == "stop":
            meta["matched"] = matched
        elif reason == "length":
            meta["length"] = row.budget
        routes = None
        if row.job.routed_experts and row.routes is not None:
            routes = row.routes[: len(row.job.input_ids) + len(row.out_ids) - 1]
        _deliver(
            row.job, Generation(row.out_ids, row.logps, reason, version, meta=meta, routed_experts=routes)
        )

    def _route_capture(self) -> _RouteCapture:
        if self._routers is None:
            self._routers = _moe_routers(self.model)
        return _RouteCapture(self._routers, int(self.model.config.num_hidden_layers),
                             int(self.model.config.num_experts_per_tok))  # fmt: skip

    def _wait_gate(self, rows: list[_Row]) -> None:
        """Hold the batch while paused in place; a row aborted meanwhile is ended at its next step."""
        if self._gate.is_set():
            return
        self._parked.set()
        try:
            while not self._gate.wait(_GATE_POLL_S):
                if all(r.done or r.job.request.abort.is_set() for r in rows):
                    return
        finally:
            self._parked.clear()

    async def prompt_logprobs(self, input_ids: list[int], *, lora: str | None = _ACTIVE) -> list[float]:
        """log p(input_ids[j] | input_ids[:j]) for j >= 1 from the raw logits (no temperature), as
        SGLang's `input_token_logprobs`, with the request's adapter (`lora`, as `generate`: a name
        already checked there, None for the base weights, by default the current adapter).
        Queues with generation on the worker thread."""
        if not input_ids:
            raise EngineBadRequest("input_ids cannot be empty.")
        lora = self.active_lora if lora is _ACTIVE else lora
        fn = functools.partial(self._prompt_logprobs_sync, list(input_ids), lora)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _prompt_logprobs_sync(self, input_ids: list[int], lora: str | None) -> list[float]:
        import torch

        if self.lora is not None:
            self.lora.activate(lora)
        with torch.no_grad():
            ids = torch.tensor([input_ids], device=self.device)
            logits = self.model(ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1)
        return logp.gather(1, ids[0, 1:, None])[:, 0].tolist()

    def _stop_string(self, out_ids: list[int], stops: tuple[str, ...]) -> str | None:
        text = self.tokenizer.decode(out_ids[-32:], skip_special_tokens=False)
        return next((s for s in stops if s in text), None)

    def _sample(self, logits: Any, sampling: SamplingParams, gen: Any) -> tuple[int, float]:
        import torch

        if sampling.temperature < _GREEDY_T:
            logp = torch.log_softmax(logits, -1)
            token = int(torch.argmax(logits))
            return token, float(logp[token])
        logp = torch.log_softmax(logits / sampling.temperature, -1)
        probs = logp.exp()
        if 0 < sampling.top_k < probs.numel():
            kth = torch.topk(probs, sampling.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if sampling.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, 0)
            drop = (cum - sorted_p) > sampling.top_p * cum[-1]
            sorted_p = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        token = int(torch.multinomial(probs, 1, generator=gen))
        if self.logprob_mode == "original":
            return token, float(torch.log_softmax(logits, -1)[token])
        return token, float(logp[token])

    # --- control plane -------------------------------------------------------------------------

    def abort_requests(
        self, rid: str | None = None, *, abort_all: bool = False, submitted_only: bool = False
    ) -> int:
        """Flag the request whose id is exactly `rid` (SGLang 0.5.16's tokenizer manager drops any
        rid that is not a live request's own, `tokenizer_manager.py` `abort_request`), or every
        request. Returns how many were flagged; unknown ids are ignored."""
        hit = 0
        for request in list(self._requests.values()):
            if submitted_only and not request.submitted:
                continue
            if abort_all or (rid and request.rid == rid):
                request.abort.set()
                hit += 1
        return hit

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        self.abort_requests(rid, abort_all=abort_all)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def busy(self) -> bool:
        """A request is running or queued for the model (SGLang: in the scheduler's running batch or
        waiting queue). Requests held at the pause gate do not count: SGLang holds them in the
        tokenizer manager, before the scheduler."""
        return any(r.submitted for r in self._requests.values())

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for no request to be running or queued for the model."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.busy:
            if loop.time() >= deadline:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(_GATE_POLL_S, max(0.0, deadline - loop.time()))):
                    await self._idle.wait()
        return True

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def pause(self, mode: PauseMode = "abort", *, timeout: float = 60.0) -> None:
        """Stop admitting requests. "in_place" / "retract": running requests wait between tokens
        until `resume` (this engine keeps their KV cache in both modes). "abort": running and
        queued requests finish now with finish_reason "abort"; returns once none is in flight."""
        if mode not in PAUSE_MODES:
            raise EngineBadRequest(f"pause mode {mode!r}: use 'abort', 'retract' or 'in_place'")
        self._resumed.clear()
        if mode != "abort":
            self._gate.clear()
            return
        # Requests that arrive now wait at the gate (as on SGLang); only submitted ones end.
        async with asyncio.timeout(timeout):
            while self.busy:
                self.abort_requests(abort_all=True, submitted_only=True)
                await asyncio.sleep(0.01)

    async def resume(self) -> None:
        self._gate.set()
        self._resumed.set()

    async def flush_cache(self) -> None:
        """This engine keeps no prefix cache across requests (only each request's own KV cache), so
        there is nothing to drop; but as SGLang's `Scheduler.flush_cache` it refuses while a
        request is running or queued, so callers meet the real rule here too."""
        if self.busy:
            raise EngineError(
                "flush_cache refused: requests are running or queued (SGLang 0.5.16 "
                "Scheduler.flush_cache); pause with mode='abort' first",
                cause="engine_flush_busy",
            )

    async def load_state_dict(self, state_dict: Mapping[str, Any], weight_version: int | None = None) -> int:
        """Copy weights in (names as in `model.state_dict()`; a subset is fine) and bump the weight
        version (to `weight_version` when given). Queues behind the requests already submitted,
        except that a batch held by an in-place pause loads beside it (as SGLang, whose update runs
        at once while paused): the rest of that batch then runs on the new weights. Returns the
        new version."""
        fn = functools.partial(self._load_sync, dict(state_dict), weight_version)
        if not self._gate.is_set():
            # Paused in place: a batch may be running towards the gate. Give it a moment to park,
            # then load beside it; if nothing is running, the worker queue is free anyway.
            for _ in range(int(5 / _GATE_POLL_S)):
                if self._parked.is_set() or not self._requests:
                    break
                await asyncio.sleep(_GATE_POLL_S / 5)
            if self._parked.is_set():
                return await asyncio.to_thread(fn)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _load_sync(self, state_dict: dict[str, Any], weight_version: int | None) -> int:
        import torch

        own = self.model.state_dict()
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise EngineBadRequest(
                f"unknown parameter names {unknown[:5]}: names must match model.state_dict()"
            )
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise EngineBadRequest(
                    f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(own[name].shape)}"
                )
        folded = self.lora.without_adapter() if self.lora is not None else None  # load the base weights
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor.to(own[name].device, own[name].dtype))
        if self.lora is not None:
            self.lora.activate(folded)
        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        return self.weight_version

    async def load_from_disk(self, model_path: str | Path, weight_version: int | None = None) -> int:
        """Load weights from a directory of safetensors: either files whose names match
        `model.state_dict()`, or a `save_pretrained` checkpoint (converted through transformers)."""
        state = await asyncio.to_thread(_read_weights, Path(model_path), self.model)
        return await self.load_state_dict(state, weight_version)

    async def update_weights(
        self, update: WeightUpdate, *, weight_version: int, flush_cache: bool = False
    ) -> None:
        """`DiskWeights` (see `load_from_disk`), `TensorWeights` with exactly one entry (this
        engine is one TP rank; see `agentrl.engine.tensors`) or `LoraAdapter` (with `enable_lora`). `DistributedWeights` needs a process
        group: serve this engine with `agentrl engine serve` for that. With `flush_cache` and a
        request running or queued this refuses before loading (a real server would die there)."""
        if flush_cache and self.busy:
            await self.flush_cache()  # raises: the reason and the fix are in its message
        if isinstance(update, DiskWeights):
            if update.load_format not in (None, "auto", "safetensors"):
                raise EngineBadRequest(f"load_format {update.load_format!r}: LocalEngine reads safetensors")
            await self.load_from_disk(update.model_path, weight_version)
        elif isinstance(update, TensorWeights):
            if update.load_format not in (None, "safetensors"):
                raise EngineBadRequest(
                    f"load_format {update.load_format!r}: LocalEngine takes agentrl's safe format"
                )
            if len(update.serialized_named_tensors) != 1:
                raise EngineBadRequest(
                    f"serialized_named_tensors has {len(update.serialized_named_tensors)} entries; this "
                    "engine is one TP rank and takes exactly one"
                )

            pairs = await asyncio.to_thread(deserialize_named_tensors, update.serialized_named_tensors[0])
            await self.load_state_dict(dict(pairs), weight_version)
        elif isinstance(update, LoraAdapter):
            await self.load_lora_adapter(update.name, update.path)
            previous, self.active_lora = self.active_lora, update.name
            self.weight_version = int(weight_version)
            for old in [n for n in self.lora_names() if n not in (update.name, previous)]:
                await self.unload_lora_adapter(old)
        elif isinstance(update, DistributedWeights):
            raise EngineBadRequest(
                "LocalEngine in this process has no weight-update process group: use "
                "load_state_dict, or serve it with `agentrl engine serve` for distributed updates"
            )
        else:
            raise EngineBadRequest(
                f"update_weights takes DiskWeights, TensorWeights, DistributedWeights or LoraAdapter, not {update!r}"
            )

    async def load_lora_adapter(self, name: str, path: str | Path) -> None:
        """SGLang's `/load_lora_adapter`: read a PEFT LoRA directory and serve it as `name`."""
        if self.lora is None:
            raise EngineBadRequest(NOT_ENABLED)
        pool = self.lora
        try:  # on the worker thread: it alone touches the weights
            await asyncio.get_running_loop().run_in_executor(self._executor, pool.load, name, str(path))
        except AdapterFileError as e:
            raise EngineBadRequest(str(e)) from None

    async def unload_lora_adapter(self, name: str) -> None:
        """SGLang's `/unload_lora_adapter`."""
        if self.lora is None:
            raise EngineBadRequest(NOT_ENABLED)
        if self.active_lora == name:
            self.active_lora = None
        pool = self.lora
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, pool.unload, name)
        except AdapterFileError as e:
            raise EngineBadRequest(str(e)) from None

    def lora_names(self) -> dict[str, str]:
        """Loaded adapters: name -> the path each was loaded from."""
        return dict(self.lora.paths) if self.lora is not None else {}

    async def weight_versions(self) -> dict[str, int]:
        return {"local": self.weight_version}

    async def health(self) -> bool:
        return not self._closed

    async def aclose(self) -> None:
        self._closed = True
        self.abort_requests(abort_all=True)
        self._gate.set()
        await asyncio.to_thread(self._executor.shutdown, True)


def _deliver(job: _Job, result: Generation | BaseException) -> None:
    def resolve() -> None:
        if job.future.done():  # the caller was cancelled
            return
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the caller's event loop is gone; nobody is waiting for this answer
        pass


def _default_cpu_threads(model: Any, device: str) -> int | None:
    if not str(device).startswith("cpu"):
        return None
    return 1 if sum(p.numel() for p in model.parameters()) < 100_000_000 else None


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_weights(path: Path, model: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    if not path.is_dir():
        raise EngineBadRequest(f"model_path {path} is not a directory of safetensors files")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineBadRequest(f"no *.safetensors files in {path}")
    state = dict(itertools.chain.from_iterable(load_file(str(f)).items() for f in files))
    if set(state) <= set(model.state_dict()):
        return state
    # A save_pretrained checkpoint stores some weights in the hub layout (e.g. one tensor per MoE
    # expert); transformers converts them to the runtime layout on load.
    try:
        fresh = type(model).from_pretrained(path, dtype=next(model.parameters()).dtype)
    except Exception as e:  # any loader failure means the directory is not a usable checkpoint
        raise EngineBadRequest(f"cannot load weights from {path}: {e}") from e
    return fresh.state_dict()


def _moe_routers(model: Any) -> list[tuple[int, Any]]:
    """(layer index, router) of every MoE layer: DeepSeek-V3-style gates (`layers[i].mlp.gate`,
    whose forward returns (logits, weights, indices): glm_moe_dsa, deepseek_v3, glm4_moe)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    found = [
        (i, layer.mlp.gate) for i, layer in enumerate(layers) if hasattr(getattr(layer, "mlp", None), "gate")
    ]
    if not found:
        raise EngineBadRequest(
            "return_routed_experts: this model has no DeepSeek-V3-style MoE gates (layers[i].mlp.gate) "
            "to read the routed experts from"
        )
    return found


class _RouteCapture:
    """Forward hooks on the MoE routers of one batch: after each forward, every row's processed
    tokens get each layer's chosen experts (-1 on dense layers)."""

    def __init__(self, routers: list[tuple[int, Any]], num_layers: int, top_k: int) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self.seen: dict[int, Any] = {}
        self.hooks = [
            gate.register_forward_hook(lambda m, args, out, i=i: self.seen.__setitem__(i, out[2]))
            for i, gate in routers
        ]

    def collect(self, rows: list[_Row], lengths: list[int], width: int) -> None:
        """The last forward covered `width` positions per row, of which each row's last
        `lengths[r]` are its tokens (left padding before them)."""
        per_layer = {i: t.reshape(len(rows), width, -1).tolist() for i, t in self.seen.items()}
        dense = [-1] * self.top_k
        for r, row in enumerate(rows):
            if row.routes is None:
                row.routes = []
            for pos in range(width - lengths[r], width):
                row.routes.append(
                    [per_layer[i][r][pos] if i in per_layer else dense for i in range(self.num_layers)]
                )
        self.seen.clear()

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
