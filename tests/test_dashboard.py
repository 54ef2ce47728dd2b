"""The run dashboard (`agentrl dashboard`): incremental readers, the JSON endpoints, the optional
metric sinks, and the page itself in headless Chromium on a run directory made by a real short run.

Screenshots go to $AGENTRL_TEST_ARTIFACTS/dashboard when that is set (else the test's tmp dir).
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import types
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from agentrl.agent.loop import TurnRecord
from agentrl.dashboard.records import TEXT_LIMIT, EpisodeQuery, RecordIndex, episode_view, full_text
from agentrl.dashboard.server import DashboardError, make_app
from agentrl.dashboard.sinks import MetricSinks, SinkError, flatten, open_sinks
from agentrl.dashboard.tail import JsonlTail
from agentrl.episode.record import Recorder
from agentrl.testing.dashboard import metrics_row, write_episode, write_run
from tests.conftest import BUNDLED_TASKS

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (make setup installs it: apt-get install -y chromium)",
)


# ---- incremental reading ------------------------------------------------------------------------


def test_tail_leaves_a_half_written_line_for_a_later_poll(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step"')
    tail = JsonlTail(path)
    assert tail.poll() == 2 and tail.partial == len('{"step"') and tail.malformed == 0
    with path.open("a") as fh:
        fh.write(': 3}\n{"step": 4}\n')
    assert tail.poll() == 2 and tail.partial == 0
    assert [r["step"] for r in tail.rows] == [1, 2, 3, 4]
    assert tail.poll() == 0  # nothing new: nothing read


def test_tail_skips_and_counts_malformed_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n[1, 2]\n\n{"step": 2}\n')
    tail = JsonlTail(path)
    tail.poll()
    assert [r["step"] for r in tail.rows] == [1, 2] and tail.malformed == 2


def test_tail_starts_over_when_the_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    tail = JsonlTail(path)
    tail.poll()
    path.unlink()  # what a new (not resumed) run in the same directory does
    path.write_text('{"step": 1}\n')
    tail.poll()
    assert tail.generation == 1 and [r["step"] for r in tail.rows] == [1]


# ---- the episode index --------------------------------------------------------------------------


def _running_record(record_dir: Path, name: str) -> Path:
    """A record whose episode is still going: header and one turn, no result line yet."""
    rec = Recorder(record_dir / f"{name}.jsonl")
    rec.write("header", {"task_id": "slow-task", "prompt_id": "0:9", "sample_index": 0, "created_at": 5.0})
    turn = TurnRecord(0, "thinking", {"commands": [], "error": None}, [], "", [3], 0.1, 0.0, "stop")
    rec.write("turn", asdict(turn))
    rec.close()
    return rec.path


def test_index_reads_results_without_their_token_arrays_and_follows_running_episodes(tmp_path: Path) -> None:
    records = tmp_path / "records"
    rng = random.Random(0)
    done = [write_episode(records, rng, index=i, version=i, created_at=float(i)) for i in range(6)]
    running = _running_record(records, "running")
    (records / "broken.jsonl").write_text("this is not a header\n")
    index = RecordIndex(records)
    index.refresh()
    assert set(index.entries) == {p.stem for p in done} | {"running"}
    assert "broken" in index.malformed
    by_path = {p.stem: json.loads(p.read_text().splitlines()[-1]) for p in done}
    for rid, result in by_path.items():
        e = index.entries[rid]
        assert e.done and (e.reward, e.status, e.outcome) == (
            result["reward"],
            result["status"],
            result["outcome"],
        )
    assert [index.entries[p.stem].version for p in done] == list(range(6))
    assert not index.entries["running"].done and index.entries["running"].status is None

    # the running episode finishes: only it is read again
    with running.open("a") as fh:
        fh.write(
            json.dumps({"type": "result", "status": "truncated", "end_reason": "max_turns", "reward": 0.0})
            + "\n"
        )
    assert index.refresh() == 1
    assert index.entries["running"].done and index.entries["running"].end_reason == "max_turns"


def test_a_samples_key_nested_in_the_result_still_parses(tmp_path: Path) -> None:
    # the verifier's own rewards dict may hold any key: the cut at `"samples"` must not trust it
    rec = Recorder(tmp_path / "r" / "odd.jsonl")
    rec.write("header", {"task_id": "t", "created_at": 1.0})
    rec.write("result", {"status": "completed", "reward": 0.5, "rewards": {"samples": [1]}, "samples": []})
    rec.close()
    index = RecordIndex(tmp_path / "r")
    index.refresh()
    assert index.entries["odd"].reward == 0.5 and index.entries["odd"].done


def test_an_index_slice_reads_the_newest_records_first_and_says_how_many_are_left(tmp_path: Path) -> None:
    records = tmp_path / "records"
    paths = [
        write_episode(records, random.Random(i), index=i, version=0, created_at=float(i)) for i in range(5)
    ]
    for i, p in enumerate(paths):
        os.utime(p, (1000.0 + i, 1000.0 + i))
    index = RecordIndex(records)
    assert index.refresh(budget_s=0.0) == 1 and index.pending == 4  # a slice reads at least one
    assert list(index.entries) == [paths[-1].stem]
    while index.pending:
        index.refresh(budget_s=0.0)
    assert set(index.entries) == {p.stem for p in paths} and index.refresh() == 0


def test_query_filters_sorts_and_pages(tmp_path: Path) -> None:
    records = tmp_path / "records"
    rng = random.Random(1)
    for i in range(30):
        write_episode(records, rng, index=i, version=i // 10, created_at=float(i))
    index = RecordIndex(records)
    index.refresh()
    total, page = index.query(EpisodeQuery(limit=7))
    assert total == 30 and [e.created_at for e in page] == [29.0 - k for k in range(7)]  # newest first
    total, page = index.query(EpisodeQuery(offset=28, limit=7, sort="oldest"))
    assert [e.created_at for e in page] == [28.0, 29.0]
    total, page = index.query(EpisodeQuery(min_version=1, max_version=1, min_reward=1.0, limit=100))
    assert total == sum(1 for e in index.entries.values() if e.version == 1 and e.reward == 1.0) and total > 0
    assert all(e.version == 1 and e.reward == 1.0 for e in page)
    total, page = index.query(EpisodeQuery(task="make-dirs", limit=100))
    assert total == 5 and {e.task_id for e in page} == {"make-dirs"}


def test_an_episode_view_clips_long_texts_and_full_text_returns_them(tmp_path: Path) -> None:
    path = write_episode(
        tmp_path / "records", random.Random(2), index=0, version=0, output_chars=TEXT_LIMIT * 3
    )
    view = episode_view(path)
    stdout = view["turns"][0]["outputs"][0]["stdout"]
    assert stdout["clipped"] and len(stdout["head"]) == TEXT_LIMIT and stdout["chars"] == TEXT_LIMIT * 3
    assert (
        full_text(path, stdout["path"])
        == json.loads(path.read_text().splitlines()[1])["outputs"][0]["stdout"]
    )
    assert view["segments"][0]["trained_tokens"] == sum(
        json.loads(path.read_text().splitlines()[-1])["samples"][0]["loss_mask"]
    )
    assert "samples" not in view["result"]  # token arrays only through the tokens endpoint


def test_an_episode_view_keeps_other_line_types_and_counts_only_broken_lines(tmp_path: Path) -> None:
    path = write_episode(tmp_path / "records", random.Random(3), index=0, version=0)
    lines = path.read_text().splitlines(keepends=True)
    terminal = json.dumps({"type": "terminal", "initial_state": "root@box:/app# "}) + "\n"
    path.write_text(lines[0] + terminal + "{broken\n" + "".join(lines[1:]))
    view = episode_view(path)
    assert view["malformed_lines"] == 1 and len(view["turns"]) == 3
    assert view["other"]["terminal"]["initial_state"] == "root@box:/app# "


# ---- the JSON endpoints -------------------------------------------------------------------------


@pytest.fixture
def live_run(tmp_path: Path) -> Path:
    """A synthetic run in the middle of writing: a malformed line, then a half-written one."""
    run = write_run(tmp_path / "run", episodes=120, steps=6)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write("garbage that is not json\n")
        fh.write(metrics_row(7, random.Random(0)).to_json() + "\n")
        fh.write('{"step": 8, "reward_mean": 0.5')
    return run


@pytest.fixture
async def client(live_run: Path) -> Any:
    async with TestClient(TestServer(make_app([live_run]))) as c:
        yield c


async def test_metrics_endpoint_skips_malformed_lines_with_a_count_and_reads_incrementally(
    client: Any, live_run: Path
) -> None:
    d = await (await client.get("/api/runs/0/metrics")).json()
    assert [p["step"] for p in d["points"]] == [1, 2, 3, 4, 5, 6, 7]
    assert (
        d["malformed"] == 1 and d["partial_bytes"] == len('{"step": 8, "reward_mean": 0.5') and d["next"] == 7
    )
    with (live_run / "metrics.jsonl").open("a") as fh:
        fh.write("}\n")  # the run finishes the line
    again = await (
        await client.get(f"/api/runs/0/metrics?after={d['next']}&generation={d['generation']}")
    ).json()
    assert again["points"] == [{"step": 8, "reward_mean": 0.5}] and not again["reset"]
    assert again["partial_bytes"] == 0 and again["next"] == 8


async def test_episodes_endpoint_pages_and_filters_and_opens_one_episode(client: Any) -> None:
    d = await (await client.get("/api/runs/0/episodes?limit=25")).json()
    assert d["total"] == d["indexed"] == 120 and len(d["items"]) == 25
    assert d["facets"]["versions"] == [0, 5]
    f = await (await client.get("/api/runs/0/episodes?task=fix-build&limit=500")).json()
    assert f["total"] == 20 and {e["task_id"] for e in f["items"]} == {"fix-build"}
    eid = d["items"][0]["id"]
    ep = await (await client.get(f"/api/runs/0/episodes/{eid}")).json()
    assert ep["header"]["task_id"] == d["items"][0]["task_id"] and len(ep["turns"]) == 3
    tok = await (await client.get(f"/api/runs/0/episodes/{eid}/tokens?segment=0")).json()
    assert tok["total"] == 120 and len(tok["ids"]) == len(tok["mask"]) == len(tok["logprobs"]) == 120
    assert tok["pieces"] is None  # a synthetic run names no tokenizer: ids only
    assert (await client.get("/api/runs/0/episodes/..%2Fconfig")).status == 404
    assert (await client.get("/api/runs/3/metrics")).status == 404
    assert (await client.get(f"/api/runs/0/episodes/{eid}/full?path=header.nope")).status == 404


def test_a_missing_run_directory_is_an_error_that_says_so(tmp_path: Path) -> None:
    with pytest.raises(DashboardError, match="not a directory"):
        make_app([tmp_path / "nope"])


def test_the_cli_registers_dashboard_without_importing_it() -> None:
    code = (
        "import sys, agentrl.cli;"
        "assert 'agentrl.dashboard.server' not in sys.modules, 'imported at start';"
        "from typer.testing import CliRunner;"
        "r = CliRunner().invoke(agentrl.cli.app, ['dashboard', '--help']);"
        "assert r.exit_code == 0 and '--port' in r.output, r.output"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- optional sinks -----------------------------------------------------------------------------


class FakeWandbRun:
    """The part of wandb's Run the sink uses, kept in memory."""

    def __init__(self, **init: Any) -> None:
        self.init = init
        self.logged: list[tuple[dict[str, float], int | None]] = []
        self.defined: list[tuple[str, str]] = []
        self.finished = False

    def define_metric(self, name: str, step_metric: str) -> None:
        self.defined.append((name, step_metric))

    def log(self, values: dict[str, float], step: int | None = None) -> None:
        self.logged.append((dict(values), step))

    def finish(self) -> None:
        self.finished = True


def fake_wandb() -> types.ModuleType:
    mod = types.ModuleType("wandb")
    # A spec as a real module has: libraries that probe for wandb (importlib.util.find_spec) raise
    # on a module in sys.modules without one, which made this file fail when run on its own.
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", loader=None)
    mod.runs = []  # type: ignore[attr-defined]

    def init(**kw: Any) -> FakeWandbRun:
        run = FakeWandbRun(**kw)
        mod.runs.append(run)  # type: ignore[attr-defined]
        return run

    mod.init = init  # type: ignore[attr-defined]
    return mod


def test_a_sink_asked_for_but_not_installed_fails_before_the_run(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(SinkError, match="pip install wandb"):
        open_sinks(["wandb"], tmp_path, {})
    assert open_sinks([], tmp_path, {}).sinks == []


def test_sinks_get_flattened_step_metrics_and_each_eval_once(tmp_path: Path, monkeypatch: Any) -> None:
    mod = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", mod)
    sinks: MetricSinks = open_sinks(["wandb"], tmp_path / "run", {"seed": 0})
    m = metrics_row(4, random.Random(0))
    evals = [{"label": "before", "step": 0, "pass@1": 0.25, "per_task": {"a": 1.0}}]
    sinks.log(evals, step=4, metrics=m)
    sinks.log(evals)
    sinks.close()
    run = mod.runs[0]
    steps = [(v, s) for v, s in run.logged if s is not None]
    assert steps == [(flatten({k: v for k, v in asdict(m).items() if k != "step"}), 4)]
    assert (
        steps[0][0]["extra/trainer/mismatch_kl"] == 1e-3 and "failures_by_cause/sandbox_create" in steps[0][0]
    )
    assert [v for v, s in run.logged if s is None] == [{"eval/step": 0, "eval/pass@1": 0.25}]
    assert run.init["name"] == "run" and run.finished


# ---- a real short run, served, in headless Chromium ---------------------------------------------


def _artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = os.environ.get("AGENTRL_TEST_ARTIFACTS")
    out = Path(base) / "dashboard" if base else tmp_path_factory.mktemp("dashboard-artifacts")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """Two training steps of the terminal environment through the library runtime (tiny model,
    in-memory sandboxes), with the W&B sink on (an in-memory wandb module): its directory and the
    fake wandb runs."""
    from agentrl.models.tiny import tiny_model_dir
    from agentrl.runtime import RunConfig, close_parts, resolve, train
    from agentrl.runtime.build import build_parts

    out = tmp_path_factory.mktemp("dash") / "run-a"
    cfg = resolve(
        RunConfig,
        defaults={
            "out": str(out),
            "steps": 2,
            "sinks": ["wandb"],
            "env": {
                "name": "tbench2",
                "tasks": str(BUNDLED_TASKS),
                "max_solution_chars": 64,
                "backend": "fake",
                "action_format": "fenced-bash",
                "agent": {
                    "max_turns": 2,
                    "max_new_tokens": 12,
                    "min_turn_tokens": 4,
                    "max_total_tokens": 2048,
                },
            },
            "engine": {"model": str(tiny_model_dir())},
            "rollout": {"batch_size": 4, "n_samples_per_prompt": 2, "max_in_flight": 4, "max_staleness": 1},
            "trainer": {"lr": 1e-3, "num_minibatches": 1, "logprob_chunk_size": None},
            "eval": {"samples_per_row": 1},
        },
    )
    mod = fake_wandb()
    saved = sys.modules.get("wandb")
    sys.modules["wandb"] = mod
    try:
        parts = build_parts(cfg)
        # a random-init model never solves a task: alternate rewards so the curves carry numbers
        parts.env.provider.grader = lambda sb: float(int(sb.sandbox_id.rsplit("-", 1)[-1]) % 2)

        async def go() -> None:
            try:
                await train(cfg, parts)
            finally:
                await close_parts(parts)

        asyncio.run(go())
    finally:
        if saved is None:
            sys.modules.pop("wandb", None)
        else:
            sys.modules["wandb"] = saved
    return out, mod.runs  # type: ignore[attr-defined]


class Served:
    """A dashboard server on a free loopback port, in a thread of its own."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(make_app(self.dirs))
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.runner = runner
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> str:
        self.thread.start()
        assert self.ready.wait(30)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def get_json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def chromium(url: str, profile: Path, *, screenshot: Path | None = None, height: int = 1800) -> str:
    """The page's DOM after its scripts ran (virtual time lets its fetches and timers finish),
    without the script itself."""
    base = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",  # root in a container
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=8000",
        f"--window-size=1400,{height}",
    ]
    if screenshot is not None:
        subprocess.run(
            [*base, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True
        )
        assert screenshot.stat().st_size > 10_000
    dom = subprocess.run(
        [*base, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return re.sub(r"<script>.*?</script>", "", dom, flags=re.S)  # what was rendered, not the code


def polylines(dom: str) -> dict[tuple[int, str], tuple[list[float], list[float]]]:
    """(run, series) -> (steps, values) of every curve drawn."""
    out = {}
    for m in re.finditer(
        r'<polyline [^>]*data-run="(\d+)" data-series="([^"]+)" data-steps="([^"]*)" data-values="([^"]*)"',
        dom,
    ):
        out[(int(m[1]), m[2])] = ([float(x) for x in m[3].split(",")], [float(x) for x in m[4].split(",")])
    return out


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _artifacts(tmp_path_factory)


@pytest.mark.slow
def test_a_real_runs_endpoints_carry_its_metrics_and_records(real_run: tuple[Path, list[Any]]) -> None:
    run, wandb_runs = real_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records = sorted((run / "records").glob("*.jsonl"))
    with Served([run]) as url:
        m = get_json(f"{url}/api/runs/0/metrics")
        assert [p["reward_mean"] for p in m["points"]] == [r["reward_mean"] for r in rows]
        assert [p["mismatch_kl"] for p in m["points"]] == [r["extra"]["trainer"]["mismatch_kl"] for r in rows]
        eps = get_json(f"{url}/api/runs/0/episodes?limit=500")
        assert eps["total"] == len(records) > 0 and eps["malformed_records"] == 0
        lines = [json.loads(x) for x in records[0].read_text().splitlines()]
        ep = get_json(f"{url}/api/runs/0/episodes/{records[0].stem}")
        assert [t["index"] for t in ep["turns"]] == [x["index"] for x in lines if x["type"] == "turn"]
        assert ep["result"]["reward"] == lines[-1]["reward"]
    # the runtime's sink hook: one W&B log per step, with the numbers of metrics.jsonl
    logged = [(v, s) for v, s in wandb_runs[0].logged if s is not None]
    assert [s for _, s in logged] == [1, 2] and [v["reward_mean"] for v, _ in logged] == [
        r["reward_mean"] for r in rows
    ]
    assert wandb_runs[0].finished


@pytest.mark.slow
@needs_chromium
def test_the_page_draws_the_runs_curves_with_its_numbers(
    real_run: tuple[Path, list[Any]], artifacts: Path, tmp_path: Path
) -> None:
    run, _ = real_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = json.loads((run / "evals.json").read_text())
    with Served([run]) as url:
        dom = chromium(f"{url}/", tmp_path / "profile", screenshot=artifacts / "curves.png")
    assert 'data-curves="ready"' in dom
    curves = polylines(dom)
    steps = [float(r["step"]) for r in rows]
    assert curves[(0, "reward_mean")] == (steps, [r["reward_mean"] for r in rows])
    assert curves[(0, "rollout_pass_rate")] == (steps, [r["rollout_pass_rate"] for r in rows])
    assert curves[(0, "tokens_per_s")] == (steps, [r["tokens_per_s"] for r in rows])
    assert curves[(0, "mismatch_kl")][1] == [r["extra"]["trainer"]["mismatch_kl"] for r in rows]
    assert curves[(0, "pass@1")] == ([float(e["step"]) for e in evals], [e["pass@1"] for e in evals])


@pytest.mark.slow
@needs_chromium
def test_an_episode_opens_with_its_turns_and_token_view(
    real_run: tuple[Path, list[Any]], artifacts: Path, tmp_path: Path
) -> None:
    run, _ = real_run
    record = sorted((run / "records").glob("*.jsonl"))[0]
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    turns = [x for x in lines if x["type"] == "turn"]
    with Served([run]) as url:
        dom = chromium(
            f"{url}/#episode/0/{record.stem}?tokens=0", tmp_path / "p", screenshot=artifacts / "episode.png"
        )
        listing = chromium(
            f"{url}/#episodes", tmp_path / "p2", screenshot=artifacts / "episodes.png", height=1000
        )
    assert f'data-episode="{record.stem}"' in dom and 'data-tokens="0"' in dom
    assert len(re.findall(r'class="card turn" data-turn="\d+"', dom)) == len(turns)
    from html import escape

    for t in turns:
        assert escape(t["model_text"], quote=False) in dom
    sample = lines[-1]["samples"][0]
    response = len(sample["tokens"]) - sample["prompt_length"]
    spans = re.findall(r'<span class="tok m([01])"', dom)
    assert spans.count("1") == sum(sample["loss_mask"]) and len(spans) == response
    assert 'data-episodes="ready"' in listing and listing.count('<tr class="ep"') == len(
        list(record.parent.iterdir())
    )


@pytest.mark.slow
@needs_chromium
def test_two_runs_overlay_and_a_half_written_run_still_renders_with_a_count(
    real_run: tuple[Path, list[Any]], artifacts: Path, tmp_path: Path
) -> None:
    run, _ = real_run
    copy = tmp_path / "run-b"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    with (copy / "metrics.jsonl").open("a") as fh:
        fh.write("{not json}\n")
        fh.write('{"step": 3, "reward_mean": 0.7')  # half-written: the run is still going
    (copy / "records" / "torn.jsonl").write_text('{"type": "hea\n')
    with Served([run, copy]) as url:
        dom = chromium(f"{url}/", tmp_path / "profile", screenshot=artifacts / "two-runs.png")
        listing = chromium(f"{url}/#episodes?run=1", tmp_path / "p2")
    curves = polylines(dom)
    assert curves[(0, "reward_mean")] == curves[(1, "reward_mean")]  # the copy overlays the original
    assert "1 malformed line(s) in metrics.jsonl skipped" in dom
    assert "is still being written" in dom
    assert "1 record file(s) could not be read" in listing
