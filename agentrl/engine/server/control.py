"""The control plane of the SGLang-compatible server: flush, abort, pause / continue, weight
versions and the three weight-update paths (disk, tensor, distributed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from agentrl.engine.base import EngineBadRequest, EngineError
from agentrl.engine.server.common import (
    _BadRequest,
    _error,
    _Fatal,
    _validation_error,
)
from agentrl.engine.tensors import deserialize_named_tensors
from agentrl.engine.weight_group import WeightGroup


class ControlPlane:
    """The control-plane endpoints of `EngineServer`."""

    # --- control plane -------------------------------------------------------------------------

    async def flush_cache(self, request: web.Request) -> web.Response:
        timeout = float(request.query.get("timeout", 0) or 0)
        if not await self.engine.wait_idle(timeout):
            return web.Response(status=400, text="Flush cache failed.\n", content_type="text/plain")
        await self.engine.flush_cache()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n",
            content_type="text/plain",
        )

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _BadRequest(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        return body

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _error(str(e))
        # Exact rids only (0.5.16 tokenizer_manager.py abort_request); empty rid without abort_all
        # is ignored there too.
        self.engine.abort_requests(str(body.get("rid") or "") or None, abort_all=bool(body.get("abort_all")))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            await self.engine.pause(mode=body.get("mode") or "abort")
        except (_BadRequest, EngineBadRequest) as e:
            return _error(str(e))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _version(self, value: Any) -> int:
        if value is None:
            return self.engine.weight_version
        try:
            return int(str(value))
        except ValueError:
            raise _BadRequest(
                f"weight_version {value!r}: agentrl engines number weight versions; send an integer string"
            ) from None

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            if body.get("new_version") is None:
                raise _BadRequest("new_version is required")
            version = self._version(body["new_version"])
        except _BadRequest as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if body.get("abort_all_requests", True):
            self.engine.abort_requests(abort_all=True)
        self.engine.weight_version = version
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": str(version)}
        )

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's `/load_lora_adapter` (`LoadLoRAAdapterReqInput`: lora_name, lora_path)."""
        return await self._lora_call(request, load=True)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's `/unload_lora_adapter` (`UnloadLoRAAdapterReqInput`: lora_name)."""
        return await self._lora_call(request, load=False)

    async def _lora_call(self, request: web.Request, *, load: bool) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _validation_error(str(e))
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or (load and not isinstance(path, str)):
            return _validation_error("lora_name (and for a load, lora_path) must be strings")
        try:
            if load:
                await self.engine.load_lora_adapter(name, path)
            else:
                await self.engine.unload_lora_adapter(name)
        except EngineBadRequest as e:
            return web.json_response(
                {"success": False, "error_message": str(e), "loaded_adapters": self.engine.lora_names()},
                status=400,
            )
        return web.json_response(
            {"success": True, "error_message": "", "loaded_adapters": self.engine.lora_names()}
        )

    async def _apply_update(
        self, body: dict[str, Any], load: Callable[[int], Awaitable[None]], *, ok: str, fail: str
    ) -> web.Response:
        """The shared path of every update_weights_* call (SGLang `tokenizer_control_mixin.py` and
        `scheduler_components/weight_updater.py`): abort first if asked; while not paused take the
        writer lock (wait for in-flight requests); load; then flush the cache if `flush_cache`
        (default true), which is fatal while a request is running or queued."""
        try:
            version = self._version(body.get("weight_version"))
        except _BadRequest as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if body.get("abort_all_requests"):
            self.engine.abort_requests(abort_all=True)
        lock = contextlib.nullcontext() if self.engine.paused else self._lock.write()
        async with lock:
            try:
                await load(version)
            except (_BadRequest, EngineBadRequest, EngineError) as e:
                return web.json_response({"success": False, "message": f"{fail}: {e}"}, status=400)
            if body.get("flush_cache", True) and self.engine.busy:
                raise _Fatal(
                    "AssertionError: Cache flush failed after updating weights (an update with "
                    "flush_cache=true while requests are running or queued, e.g. after an in_place "
                    "pause; SGLang 0.5.16 scheduler_components/weight_updater.py "
                    "flush_cache_after_weight_update). Send flush_cache=false after an in_place pause."
                )
        message = ok
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            if not body.get("model_path"):
                return _validation_error("model_path is required")
        except _BadRequest as e:
            return _validation_error(str(e))

        async def load(version: int) -> None:
            await self.engine.load_from_disk(body["model_path"], weight_version=version)

        response = await self._apply_update(
            body, load, ok="Succeeded to update model weights.", fail="Failed to update weights"
        )
        # 0.5.16's disk update answers (UpdateWeightFromDiskReqOutput) also carry num_paused_requests.
        payload = json.loads(response.body)  # type: ignore[arg-type]
        return web.json_response({**payload, "num_paused_requests": 0}, status=response.status)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _validation_error(str(e))
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries or not all(isinstance(x, str) for x in entries):
            return _validation_error("serialized_named_tensors must be a non-empty list of base64 strings")
        fmt = body.get("load_format")
        if fmt not in (None, "direct", "flattened_bucket"):
            raise _Fatal(f"Unknown load_format={fmt}: the scheduler dies (SGLang weight_updater.py)")
        if fmt == "flattened_bucket":
            return web.json_response(
                {
                    "success": False,
                    "message": "load_format 'flattened_bucket' is not served by agentrl's server",
                },
                status=400,
            )
        if len(entries) < self.tp_size:
            raise _Fatal(
                f"IndexError: serialized_named_tensors has {len(entries)} entries for {self.tp_size} TP "
                "ranks (SGLang managers/tp_worker.py indexes it by tp_rank): send one entry per TP rank"
            )
        if len(entries) > self.tp_size:
            # SGLang would silently ignore the extra entries; a client that sends them has the TP
            # size wrong, so refuse instead of loading what may be the wrong shard.
            return web.json_response(
                {
                    "success": False,
                    "message": f"serialized_named_tensors has {len(entries)} entries but this server has "
                    f"tp_size {self.tp_size}: send exactly one entry per TP rank",
                },
                status=400,
            )

        async def load(version: int) -> None:
            ranks = [await asyncio.to_thread(deserialize_named_tensors, e) for e in entries]
            # Each rank loads its own entry; this server holds one copy of the model, so every
            # rank's entry must carry the same tensors.
            for r, pairs in enumerate(ranks[1:], start=1):
                same = len(pairs) == len(ranks[0]) and all(
                    n == n0 and t.shape == t0.shape and bool((t == t0).all())
                    for (n, t), (n0, t0) in zip(pairs, ranks[0], strict=True)
                )
                if not same:
                    raise _BadRequest(
                        f"TP rank {r}'s entry differs from rank 0's; this server holds one copy"
                    )
            await self.engine.load_state_dict(dict(ranks[0]), weight_version=version)

        return await self._apply_update(body, load, ok="Success", fail="Failed to update weights from tensor")

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            for key in ("master_address", "master_port", "rank_offset", "world_size"):
                if key not in body:
                    return _validation_error(f"{key} is required")
            group = str(body.get("group_name") or "weight_update_group")
            backend = str(body.get("backend") or "nccl")
            if self.engine.device == "cpu" and backend == "nccl":
                raise _BadRequest("backend 'nccl' needs a GPU; this server runs on CPU: use 'gloo'")
            if group in self._groups:
                raise _BadRequest(f"group {group!r} already exists")
            # Each TP rank joins as rank_offset + tp_rank (weight_updater.py init_weights_update_group).
            members = await asyncio.gather(
                *(
                    asyncio.to_thread(
                        WeightGroup,
                        master_address=str(body["master_address"]),
                        master_port=int(body["master_port"]),
                        rank=int(body["rank_offset"]) + tp_rank,
                        world_size=int(body["world_size"]),
                        group_name=group,
                        backend=backend,
                        timeout_s=float(body.get("timeout_s") or 300.0),
                    )
                    for tp_rank in range(self.tp_size)
                )
            )
        except (_BadRequest, EngineBadRequest, RuntimeError, ValueError, TypeError) as e:
            message = f"Failed to initialize custom process group: {e}."
            return web.json_response({"success": False, "message": message}, status=400)
        self._groups[group] = list(members)
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _validation_error(str(e))
        members = self._groups.pop(str(body.get("group_name") or "weight_update_group"), None)
        if members is None:
            return web.json_response(
                {"success": False, "message": "The group to be destroyed does not exist."}, status=400
            )
        for m in members:
            m.destroy()
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except _BadRequest as e:
            return _validation_error(str(e))
        for key in ("names", "dtypes", "shapes"):
            if key not in body:
                return _validation_error(f"{key} is required")
        group = str(body.get("group_name") or "weight_update_group")
        members = self._groups.get(group)
        if members is None:
            raise _Fatal(
                f"AssertionError: Group {group} not in {list(self._groups)}. Please call "
                "`init_weights_update_group` first. (model_runner_components/weight_updater.py)"
            )
        if body.get("load_format") not in (None,):
            return web.json_response(
                {"success": False, "message": f"load_format {body['load_format']!r} is not served here"},
                status=400,
            )

        def receive(member: WeightGroup) -> list[tuple[str, Any]]:
            import torch

            out = []
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, str(dtype)), device=self.engine.device)
                member.broadcast(tensor, src=0)
                out.append((str(name), tensor))
            return out

        async def load(version: int) -> None:
            try:
                received = await asyncio.gather(*(asyncio.to_thread(receive, m) for m in members))
            except (RuntimeError, ValueError, TypeError, AttributeError) as e:
                raise _BadRequest(str(e)) from e
            await self.engine.load_state_dict(dict(received[0]), weight_version=version)

        return await self._apply_update(
            body,
            load,
            ok="Succeeded to update parameter online.",
            fail="Failed to update parameter online; the full weights of the ModelRunner are partially "
            "updated. Please discard the whole weights",
        )
