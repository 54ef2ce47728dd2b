"""tbench2's data for the GLM-5.2 recipe: the task set downloaded (against a loopback stand-in of
the Hugging Face hub) and split into training tasks and held-out eval tasks."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest

from envs.tbench2.environment import BUNDLED_TASKS, valid_tasks
from envs.tbench2.hub import TASKS_REPO, TasksHubError, download_tasks, held_out, split_tasks
from tests.http_standin import serve

COMMIT = "1" * 40


class TreeHub(http.server.BaseHTTPRequestHandler):
    """The three calls of huggingface_hub's `snapshot_download` for a dataset repository:
    `/api/datasets/<repo>[/revision/<rev>]` (its commit), `/api/datasets/<repo>/tree/<rev>` (every
    file, recursively) and `/datasets/<repo>/resolve/<rev>/<path>` (a file), from `files`."""

    repo = TASKS_REPO
    files: dict[str, bytes] = {}

    def _route(self) -> tuple[str, Any]:
        path = unquote(urlparse(self.path).path)
        api = f"/api/datasets/{self.repo}"
        if path in (api, f"{api}/revision/main"):
            return "json", {
                "id": self.repo,
                "sha": COMMIT,
                "siblings": [{"rfilename": f} for f in self.files],
            }
        if path.startswith(f"{api}/tree/"):
            entries = [
                {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for f, b in self.files.items()
            ]
            return "json", entries
        prefix = f"/datasets/{self.repo}/resolve/"
        if path.startswith(prefix):
            name = path[len(prefix) :].split("/", 1)[1]
            if name in self.files:
                return "file", self.files[name]
        return "missing", None

    def _send(self, head: bool) -> None:
        kind, value = self._route()
        if kind == "missing":
            self.send_error(404)
            return
        body = json.dumps(value).encode() if kind == "json" else value
        self.send_response(200)
        self.send_header("Content-Type", "application/json" if kind == "json" else "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._send(head=True)

    def do_GET(self) -> None:
        self._send(head=False)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    with serve(TreeHub) as url:
        yield url


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_task_set_is_downloaded_and_split_into_training_and_held_out_tasks(
    tmp_path: Path, hub: str
) -> None:
    pytest.importorskip("huggingface_hub")
    tasks = {t.task_id: t.path for t in valid_tasks(BUNDLED_TASKS)}
    TreeHub.files = {
        f"{name}/{rel}": body for name, path in tasks.items() for rel, body in _tree(path).items()
    }
    source = download_tasks(tmp_path / "terminal-bench-2", endpoint=hub)
    got = {k: v for k, v in _tree(source).items() if not k.startswith(".cache/")}  # the hub's own notes
    assert got == TreeHub.files and not any(p.is_symlink() for p in source.rglob("*"))
    said: list[str] = []
    trains, evals = split_tasks(
        source,
        tmp_path / "data" / "tbench2",
        tmp_path / "data" / "tbench2-eval",
        eval_count=4,
        report=said.append,
    )
    assert len(evals) == 4 and not set(trains) & set(evals) and set(trains) | set(evals) == set(tasks)
    assert evals == sorted(held_out(list(tasks), 4, 0))
    for name in evals:  # each held-out task is copied whole, and only into the eval directory
        assert _tree(tmp_path / "data" / "tbench2-eval" / name) == _tree(tasks[name])
        assert not (tmp_path / "data" / "tbench2" / name).exists()
    assert sorted(p.name for p in (tmp_path / "data" / "tbench2").iterdir()) == trains
    assert {t.task_id for t in valid_tasks(tmp_path / "data" / "tbench2-eval")} == set(evals)
    assert said == [
        f"{len(trains)} tasks -> {tmp_path / 'data' / 'tbench2'}",
        f"4 tasks -> {tmp_path / 'data' / 'tbench2-eval'}",
    ]
    # prepare again: the split stands; another seed holds out other tasks.
    again = split_tasks(
        source, tmp_path / "data" / "tbench2", tmp_path / "data" / "tbench2-eval", eval_count=4
    )
    assert again == (trains, evals)
    other = split_tasks(source, tmp_path / "b" / "train", tmp_path / "b" / "eval", eval_count=4, seed=1)[1]
    assert set(other) != set(evals)


def test_a_task_set_that_cannot_be_split_says_why(tmp_path: Path, hub: str) -> None:
    pytest.importorskip("huggingface_hub")
    TreeHub.files = {}
    TreeHub.repo = "someone/else"
    try:
        with pytest.raises(
            TasksHubError, match=f"(?s)cannot download the dataset {TASKS_REPO}.*--tasks-source"
        ):
            download_tasks(tmp_path / "tb2", endpoint=hub)
    finally:
        TreeHub.repo = TASKS_REPO
    tasks_all = valid_tasks(BUNDLED_TASKS)
    count = len(tasks_all)
    with pytest.raises(TasksHubError, match=f"cannot hold out {count} of the {count} valid tasks"):
        split_tasks(BUNDLED_TASKS, tmp_path / "t", tmp_path / "e", eval_count=count)
    with pytest.raises(TasksHubError, match="no task set to split"):
        split_tasks(tmp_path / "nothing", tmp_path / "t", tmp_path / "e")
    (tmp_path / "half").mkdir()
    with pytest.raises(TasksHubError, match="exists without its other half"):
        split_tasks(BUNDLED_TASKS, tmp_path / "half", tmp_path / "e", eval_count=2)
    # A task whose link points out of it would carry a host file into a sandbox image.
    src = tmp_path / "src"
    first, last = sorted(valid_tasks(BUNDLED_TASKS), key=lambda t: t.task_id)[:: len(tasks_all) - 1]
    shutil.copytree(first.path, src / first.task_id)
    shutil.copytree(last.path, src / last.task_id)
    (src / first.task_id / "environment" / "secret").symlink_to("/etc/hostname")
    with pytest.raises(TasksHubError, match="links outside its task"):
        split_tasks(src, tmp_path / "t2", tmp_path / "e2", eval_count=1)
    assert not (tmp_path / "t2").exists() and not (tmp_path / "e2").exists()


def test_prepare_writes_the_directories_the_recipe_trains_and_evaluates_on(tmp_path: Path) -> None:
    from agentrl.cluster.recipe import env_data, plan_recipe
    from tests.test_recipe_glm52 import SPECS

    env_data("tbench2").prepare(tmp_path / "data", source=str(BUNDLED_TASKS), eval_count=3, seed=0)
    spec = SPECS["tbench2"]
    sets = dict(s.split("=", 1) for s in plan_recipe(spec.options(root=str(tmp_path)), spec).run_overrides)
    assert len(valid_tasks(sets["env.eval_tasks"])) == 3
    assert len(valid_tasks(sets["env.tasks"])) == len(valid_tasks(BUNDLED_TASKS)) - 3


def test_task_ids_keep_only_the_named_tasks_and_refuse_an_unknown_one() -> None:
    from agentrl.errors import AgentRLError
    from envs.tbench2.environment import select_tasks

    chosen = select_tasks(BUNDLED_TASKS, 64, ["hello-file", "make-dirs"])
    assert sorted(t.task_id for t in chosen) == ["hello-file", "make-dirs"]
    # both filters apply: a named task whose solution is too long is not kept
    long_ones = [
        t.task_id
        for t in valid_tasks(BUNDLED_TASKS)
        if t.task_id not in {x.task_id for x in select_tasks(BUNDLED_TASKS, 64)}
    ]
    assert long_ones
    with pytest.raises(AgentRLError, match="no task in"):
        select_tasks(BUNDLED_TASKS, 64, long_ones[:1])
    with pytest.raises(AgentRLError, match="no-such-task"):
        select_tasks(BUNDLED_TASKS, None, ["hello-file", "no-such-task"])
