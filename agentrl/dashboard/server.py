"""The dashboard's HTTP server (aiohttp): one static page and JSON endpoints over run directories.

    GET /                                        the page (page.html: no network, no CDN)
    GET /api/runs                                runs, chart definitions
    GET /api/runs/{run}/metrics?after=N&generation=G   plotted points appended since row N
    GET /api/runs/{run}/evals                    eval points
    GET /api/runs/{run}/episodes?offset&limit&task&status&end_reason&min_reward&max_reward
                                 &min_version&max_version&sort     one page of the episode index
    GET /api/runs/{run}/episodes/{id}            one episode: turns, result, segments (texts clipped)
    GET /api/runs/{run}/episodes/{id}/full?path=turns.0.model_text   one whole text
    GET /api/runs/{run}/episodes/{id}/tokens?segment=K&offset=N      one segment's tokens

Reading is blocking file I/O, done in worker threads; one lock per run keeps the index consistent.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from aiohttp import web

from agentrl.dashboard.records import EpisodeQuery, episode_view, full_text, segment_tokens
from agentrl.dashboard.run import CHARTS, RunView
from agentrl.dashboard.tokens import TokenDecoder, tokenizer_path


class DashboardError(ValueError):
    """A run directory the dashboard cannot show."""


def run_views(directories: list[Path]) -> list[RunView]:
    """A view per run directory, named by the directory (with its parent when names repeat)."""
    views = []
    names = [d.resolve().name for d in directories]
    for d, name in zip(directories, names, strict=True):
        if not d.is_dir():
            raise DashboardError(f"{d}: not a directory (give a run's --out directory)")
        if names.count(name) > 1:
            name = f"{d.resolve().parent.name}/{name}"
        views.append(RunView(d, name))
    return views


@dataclass
class Dashboard:
    runs: list[RunView]
    tokenizer: str | None = None
    decoder: TokenDecoder = field(default_factory=TokenDecoder)
    locks: dict[int, asyncio.Lock] = field(default_factory=dict)

    def run(self, request: web.Request) -> tuple[int, RunView]:
        try:
            i = int(request.match_info["run"])
            return i, self.runs[i]
        except (ValueError, IndexError):
            raise web.HTTPNotFound(text=f"no run {request.match_info['run']!r}") from None

    def lock(self, i: int) -> asyncio.Lock:
        return self.locks.setdefault(i, asyncio.Lock())

    async def record_path(self, request: web.Request) -> Path:
        """The record file of an episode id: a plain file name inside the run's records/ (an id
        opened from a URL needs no index)."""
        _, run = self.run(request)
        eid = request.match_info["episode"]
        path = run.records.directory / f"{eid}.jsonl"
        if "/" in eid or "\\" in eid or eid.startswith(".") or not path.is_file():
            raise web.HTTPNotFound(text=f"no episode {eid!r} in {run.name}")
        return path

    async def page(self, request: web.Request) -> web.Response:
        try:
            html = resources.files("agentrl.dashboard").joinpath("page.html").read_text(encoding="utf-8")
        except FileNotFoundError:
            raise web.HTTPInternalServerError(
                text="agentrl/dashboard/page.html is missing from this install: install agentrl from a "
                "checkout (pip install -e .) or add it to the package data"
            ) from None
        return web.Response(text=html, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def runs_index(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"runs": [{"id": i, **r.summary()} for i, r in enumerate(self.runs)], "charts": CHARTS}
        )

    async def metrics(self, request: web.Request) -> web.Response:
        i, run = self.run(request)
        q = request.query
        generation = int(q["generation"]) if q.get("generation", "").lstrip("-").isdigit() else None
        async with self.lock(i):
            data = await asyncio.to_thread(run.metrics_since, int(q.get("after") or 0), generation)
        return web.json_response(data)

    async def evals(self, request: web.Request) -> web.Response:
        i, run = self.run(request)
        async with self.lock(i):
            data = await asyncio.to_thread(run.evals)
        return web.json_response(data)

    async def episodes(self, request: web.Request) -> web.Response:
        i, run = self.run(request)
        try:
            query = EpisodeQuery.from_params(request.query)
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"bad filter: {exc}") from None
        async with self.lock(i):
            await asyncio.to_thread(run.refresh_records)
            total, page = run.records.query(query)
            index = run.records
            data = {
                "total": total,
                "indexed": len(index.entries),
                "running": sum(not e.done for e in index.entries.values()),
                "pending": index.pending,
                "malformed_records": len(index.malformed),
                "malformed_examples": dict(list(index.malformed.items())[:5]),
                "facets": index.facets(),
                "offset": query.offset,
                "limit": query.limit,
                "items": [e.to_json() for e in page],
                "has_records": index.directory.is_dir(),
            }
        return web.json_response(data)

    async def episode(self, request: web.Request) -> web.Response:
        path = await self.record_path(request)
        data = await asyncio.to_thread(episode_view, path)
        return web.json_response({"id": request.match_info["episode"], **data})

    async def full(self, request: web.Request) -> web.Response:
        path = await self.record_path(request)
        try:
            text = await asyncio.to_thread(full_text, path, request.query.get("path", ""))
        except KeyError as exc:
            raise web.HTTPNotFound(text=str(exc)) from None
        return web.json_response({"text": text})

    async def tokens(self, request: web.Request) -> web.Response:
        _, run = self.run(request)
        path = await self.record_path(request)
        try:
            segment = int(request.query.get("segment", 0))
            offset = max(int(request.query.get("offset", 0)), 0)
            data = await asyncio.to_thread(segment_tokens, path, segment, offset=offset)
        except KeyError as exc:
            raise web.HTTPNotFound(text=str(exc)) from None
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        tok = tokenizer_path(run.config(), self.tokenizer)
        data["pieces"] = await asyncio.to_thread(self.decoder.pieces, tok, data["ids"])
        data["prompt_text"] = None
        if data["pieces"] is not None:
            prompt = await asyncio.to_thread(self.decoder.pieces, tok, data["prompt_ids"])
            data["prompt_text"] = "".join(prompt or [])
        data["tokenizer"] = tok
        return web.json_response(data)


def make_app(directories: list[Path], *, tokenizer: str | None = None) -> web.Application:
    """The aiohttp application over `directories` (raises DashboardError for a missing one)."""
    dash = Dashboard(run_views(directories), tokenizer=tokenizer)
    app = web.Application()
    app.add_routes(
        [
            web.get("/", dash.page),
            web.get("/api/runs", dash.runs_index),
            web.get("/api/runs/{run}/metrics", dash.metrics),
            web.get("/api/runs/{run}/evals", dash.evals),
            web.get("/api/runs/{run}/episodes", dash.episodes),
            web.get("/api/runs/{run}/episodes/{episode}", dash.episode),
            web.get("/api/runs/{run}/episodes/{episode}/full", dash.full),
            web.get("/api/runs/{run}/episodes/{episode}/tokens", dash.tokens),
        ]
    )
    return app


def serve(
    directories: list[Path], *, host: str = "127.0.0.1", port: int = 8765, tokenizer: str | None = None
) -> None:
    """Serve until interrupted."""
    app = make_app(directories, tokenizer=tokenizer)
    print(f"agentrl dashboard: http://{host}:{port}/  ({', '.join(str(d) for d in directories)})", flush=True)
    web.run_app(app, host=host, port=port, print=None)
