"""The job directory `agentrl eval` writes, read by Harbor 0.25 itself: its pydantic models
(JobConfig, JobResult, TrialConfig, TrialResult, the ATIF `Trajectory`), its task checksum and its
viewer's HTTP API (`harbor view`), run in Harbor's own Python 3.12 environment (built once and
cached, as `tests/test_terminus_harbor_diff.py` builds it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agentrl.eval.harbor import run_harbor_eval
from agentrl.eval.harbor_job import AGENT_NAME
from agentrl.testing.sandbox import FakeSandboxProvider
from tests.test_eval_cli import IDLE, SOLVE, ScriptedChat, _grader, _settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# Runs in the harbor venv: `python - JOBS_DIR JOB_NAME`; prints one JSON report.
HARBOR_CHECK = r"""
import json, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from fastapi.testclient import TestClient
from harbor.models.job.config import JobConfig
from harbor.models.job.result import JobResult
from harbor.models.task.task import Task
from harbor.models.trajectories.trajectory import Trajectory
from harbor.models.trial.config import TrialConfig
from harbor.models.trial.result import TrialResult
from harbor.viewer.server import create_app

jobs, name = Path(sys.argv[1]), sys.argv[2]
job = jobs / name
report = {"trials": {}, "evals": {}}
JobConfig.model_validate(json.loads((job / "config.json").read_text()))
result = JobResult.model_validate_json((job / "result.json").read_text())
report["n_total_trials"] = result.n_total_trials
for key, ev in result.stats.evals.items():
    report["evals"][key] = {"metrics": ev.metrics, "pass_at_k": ev.pass_at_k, "n_errors": ev.n_errors}
client = TestClient(create_app(jobs))
report["viewer_jobs"] = [j["name"] for j in client.get("/api/jobs").json()["items"]]
report["viewer_config"] = client.get(f"/api/jobs/{name}/config").status_code
for d in sorted(p for p in job.iterdir() if p.is_dir()):
    TrialConfig.model_validate_json((d / "config.json").read_text())
    tr = TrialResult.model_validate_json((d / "result.json").read_text())
    traj = Trajectory.model_validate_json((d / "agent" / "trajectory.json").read_text())
    viewed = client.get(f"/api/jobs/{name}/trials/{d.name}/trajectory")
    report["trials"][d.name] = {
        "task": tr.task_name,
        "rewards": tr.verifier_result.rewards if tr.verifier_result else None,
        "failure_cause": tr.failure_cause.value if tr.failure_cause else None,
        "reward_valid": tr.reward_valid,
        "checksum_equal": Task(Path(tr.task_id.path)).checksum == tr.task_checksum,
        "sources": [s.source for s in traj.steps],
        "tool_calls": [[c.function_name for c in s.tool_calls or []] for s in traj.steps],
        "viewer_trial": client.get(f"/api/jobs/{name}/trials/{d.name}").status_code,
        "viewer_steps": len(viewed.json()["steps"]) if viewed.status_code == 200 else None,
    }
print(json.dumps(report, default=str))
"""


def harbor_check(jobs_dir: Path, job_name: str, script: str = HARBOR_CHECK) -> Any:
    """Harbor's own reading of a job directory (see HARBOR_CHECK)."""
    from tests.test_terminus_harbor_diff import _harbor_python

    python = _harbor_python()
    out = subprocess.run(
        [str(python), "-", str(jobs_dir), job_name],
        input=script,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


async def test_harbor_reads_the_job_its_trajectories_and_its_checksums(tmp_path: Path) -> None:
    replies: dict[str, list[str | int]] = {"hello.txt": [SOLVE], "directories": [IDLE, 503]}
    async with ScriptedChat(replies) as server:
        settings = _settings(tmp_path, server.url, n_attempts=2, max_turns=3, max_attempts=1)
        summary = await run_harbor_eval(settings, provider=FakeSandboxProvider(grader=_grader))
    assert summary is not None and summary["unscored"] == 2
    report = harbor_check(tmp_path / "jobs", "job")
    assert report["viewer_jobs"] == ["job"] and report["viewer_config"] == 200
    assert report["n_total_trials"] == 4
    (ev,) = report["evals"].values()
    assert ev["n_errors"] == 2 and ev["metrics"] == [{"mean": 0.5}]
    trials = report["trials"].values()
    assert len(trials) == 4
    for t in trials:
        assert t["checksum_equal"] and t["viewer_trial"] == 200 and t["viewer_steps"] == len(t["sources"])
        assert t["sources"][:2] == ["system", "user"] and set(t["sources"][2:]) == {"agent"}
        if t["task"] == "hello-file":
            assert t["rewards"] == {"reward": 1.0} and t["failure_cause"] is None
            assert t["tool_calls"][2] == ["bash_command", "mark_task_complete"]
        else:
            # the engine failed: Harbor classifies it as the model provider's failure, no reward
            assert t["rewards"] is None and t["failure_cause"] == "model_provider_failed"


async def test_harbor_reads_a_trajectory_whose_context_was_summarised(tmp_path: Path) -> None:
    long = json.dumps({"analysis": "x" * 4000, "plan": "Look.", "commands": [], "task_complete": False})
    async with ScriptedChat({"directories": [long]}) as server:
        settings = _settings(
            tmp_path,
            server.url,
            task_names=["make-dirs"],
            max_turns=3,
            summarize=True,
            summarize_threshold=5000,
        )
        summary = await run_harbor_eval(settings, provider=FakeSandboxProvider(grader=_grader))
    assert summary is not None and summary["unscored"] == 0
    # About 6960 tokens of context: two 1000-token replies leave fewer than 5000 free before turn 2,
    # which a summary's three calls precede.
    assert len(server.requests) == 3 + 3
    (t,) = harbor_check(tmp_path / "jobs", "job")["trials"].values()
    assert t["viewer_trial"] == 200 and t["viewer_steps"] == len(t["sources"])
    assert t["sources"] == ["system", "user", "agent", "agent", "system", "user", "agent"]
    # The three sub-calls' trajectories beside it, as Terminus-2 writes them, read by Harbor's model
    # and referred to from the main trajectory's summarization step.
    (subs,) = harbor_check(tmp_path / "jobs", "job", HARBOR_SUBAGENTS_CHECK)
    assert subs["files"] == [
        f"trajectory.summarization-1-{n}.json" for n in ("answers", "questions", "summary")
    ]
    assert subs["refs"] == [
        f"trajectory.summarization-1-{n}.json" for n in ("summary", "questions", "answers")
    ]
    assert subs["agents"]["summary"] == f"{AGENT_NAME}-summarization-summary"  # Harbor: terminus-2-...
    # summary and answers are sent the agent's history (copied), questions only its own prompt
    assert subs["copied"] == {"answers": True, "questions": False, "summary": True}
    assert all(n > 0 for n in subs["completion_tokens"].values())


HARBOR_SUBAGENTS_CHECK = r"""
import json, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from harbor.models.trajectories.trajectory import Trajectory
job = Path(sys.argv[1]) / sys.argv[2]
out = []
for d in sorted(p for p in job.iterdir() if p.is_dir()):
    main = Trajectory.model_validate_json((d / "agent" / "trajectory.json").read_text())
    refs = [r.trajectory_path for s in main.steps if s.observation for x in s.observation.results
            for r in x.subagent_trajectory_ref or []]
    files = sorted(p.name for p in (d / "agent").glob("trajectory.summarization-*.json"))
    subs = {f.split("-")[-1][:-5]: Trajectory.model_validate_json((d / "agent" / f).read_text()) for f in files}
    out.append({
        "files": files, "refs": refs,
        "agents": {k: t.agent.name for k, t in subs.items()},
        "copied": {k: any(s.is_copied_context for s in t.steps) for k, t in subs.items()},
        "completion_tokens": {k: t.final_metrics.total_completion_tokens for k, t in subs.items()},
    })
print(json.dumps(out))
"""


HARBOR_STEPS_CHECK = r"""
import json, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from harbor.models.trial.result import TrialResult
from harbor.models.trajectories.trajectory import Trajectory
job = Path(sys.argv[1]) / sys.argv[2]
out = []
for d in sorted(p for p in job.iterdir() if p.is_dir()):
    tr = TrialResult.model_validate_json((d / "result.json").read_text())
    out.append({
        "rewards": tr.verifier_result.rewards if tr.verifier_result else None,
        "mode": tr.verifier_environment_mode,
        "steps": [(s.step_name, s.verifier_result.rewards if s.verifier_result else None) for s in tr.step_results or []],
        "agents": {
            s.step_name: {
                "sources": [x.source for x in t.steps],
                "first": t.steps[1].message if len(t.steps) > 1 else t.steps[0].message,
            }
            for s in tr.step_results or []
            for t in [Trajectory.model_validate_json((d / "steps" / s.step_name / "agent" / "trajectory.json").read_text())]
        },
        "root_trajectory": (d / "agent" / "trajectory.json").exists(),
    })
print(json.dumps(out))
"""


@pytest.mark.container
async def test_a_multi_step_task_evaluates_with_harbors_step_results(tmp_path: Path) -> None:
    def reply(cmd: str) -> str:
        cmds = [{"keystrokes": cmd + "\n", "duration": 0.1}] if cmd else []
        return json.dumps({"analysis": "a", "plan": "p", "commands": cmds, "task_complete": not cmd})

    # step 1 solved, step 2 not: the mean of 1 and 0
    replies: dict[str, list[str | int]] = {
        "holding exactly one line": [reply("echo first > /app/notes.txt"), reply("")],
        "inbox": [reply("true"), reply("")],
    }
    async with ScriptedChat(replies, context=131072) as server:
        settings = _settings(
            tmp_path, server.url, task_names=["two-step-notes"], backend="podman", max_turns=3
        )
        summary = await run_harbor_eval(settings)
    assert summary is not None and summary["unscored"] == 0
    (trial,) = harbor_check(tmp_path / "jobs", "job", HARBOR_STEPS_CHECK)
    agents = trial.pop("agents")
    assert trial == {
        "rewards": {"reward": 0.5},
        "mode": None,
        "steps": [["write", {"reward": 1.0}], ["append", {"reward": 0.0}]],
        "root_trajectory": False,  # Harbor's multi-step layout: a trajectory per step, none at the root
    }
    # each step's own conversation, opened by its own instruction
    assert agents["write"]["sources"][-2:] == ["agent", "agent"] and agents["append"]["sources"][-2:] == [
        "agent",
        "agent",
    ]
    assert "holding exactly one line" in agents["write"]["first"] and "inbox" in agents["append"]["first"]
    assert "inbox" not in agents["write"]["first"]
    (trial_dir,) = [d for d in (tmp_path / "jobs" / "job").iterdir() if d.is_dir()]
    steps = trial_dir / "steps"
    assert (steps / "write" / "verifier" / "reward.txt").read_text() == "1\n"
    assert (steps / "append" / "verifier" / "reward.txt").read_text() == "0\n"
    assert "passed" in (steps / "write" / "verifier" / "test-stdout.txt").read_text()
    assert (
        json.loads((steps / "append" / "artifacts" / "manifest.json").read_text())[0]["source"]
        == "/logs/artifacts"
    )


# Runs in the harbor venv: Harbor's own LLM client (LiteLLM, as Terminus-2 calls it with
# `collect_rollout_details`) against `agentrl engine serve`'s OpenAI endpoint.
LITELLM_CHECK = r"""
import asyncio, json, logging, os, sys, warnings
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
warnings.simplefilter("ignore")
logging.disable(logging.CRITICAL)
import litellm
from harbor.llms.lite_llm import LiteLLM

async def main(url):
    llm = LiteLLM("openai/tiny", api_base=url, collect_rollout_details=True)
    resp = await litellm.acompletion(
        model="openai/tiny", api_base=url, api_key="none", max_tokens=8, logprobs=True,
        messages=[{"role": "user", "content": "List the files."}],
        extra_body={"return_token_ids": True}, drop_params=True,
    )
    prompt_ids, completion_ids = llm._extract_token_ids(resp)
    print(json.dumps({
        "finish": resp["choices"][0]["finish_reason"],
        "logprobs": llm._extract_logprobs(resp),
        "usage": [resp["usage"].prompt_tokens, resp["usage"].completion_tokens],
        "token_ids": [prompt_ids, completion_ids],
    }))

asyncio.run(main(sys.argv[1]))
"""


async def test_harbors_llm_client_talks_to_engine_serve() -> None:
    pytest.importorskip("torch")
    import asyncio

    from agentrl.engine.local import LocalEngine
    from agentrl.engine.server import EngineServer
    from agentrl.models.tiny import load_tiny
    from tests.test_terminus_harbor_diff import _harbor_python

    python = _harbor_python()
    model, tok = load_tiny()
    async with EngineServer(LocalEngine(model, tok), model_path="tiny", port=0) as server:
        proc = await asyncio.create_subprocess_exec(
            str(python), "-", f"{server.url}/v1",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(LITELLM_CHECK.encode()), 300)
    assert proc.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["finish"] == "length" and report["usage"][1] == 8
    assert len(report["logprobs"]) == 8 and all(lp <= 0 for lp in report["logprobs"])
    # `return_token_ids` is vLLM's: SGLang 0.5.16 ignores it, and so does its stand-in
    assert report["token_ids"] == [None, None]


async def test_compose_and_separate_verifier_tasks_evaluate_into_a_job_harbor_reads(tmp_path: Path) -> None:
    def reply(cmd: str) -> str:
        cmds = [{"keystrokes": cmd + "\n", "duration": 0.5}] if cmd else []
        return json.dumps({"analysis": "a", "plan": "p", "commands": cmds, "task_complete": not cmd})

    kv = Path(__file__).resolve().parents[1] / "envs/tbench2/tasks/kv-service-count/solution/solve.sh"
    replies: dict[str, list[str | int]] = {
        "`region,amount`": [
            reply("mkdir -p /app/out && echo 7967 > /app/out/total.txt && echo 37 > /app/out/count.txt"),
            reply(""),
        ],
        "key-value service": [reply(f"bash /dev/stdin <<'EOS'\n{kv.read_text()}EOS"), reply("")],
    }
    async with ScriptedChat(replies, context=131072) as server:
        settings = _settings(
            tmp_path,
            server.url,
            task_names=["sales-total-artifact", "kv-service-count"],
            backend="podman",
            max_turns=3,
        )
        summary = await run_harbor_eval(settings)
    assert summary is not None and summary["unscored"] == 0
    report = harbor_check(tmp_path / "jobs", "job")
    rewards = {t["task"]: t["rewards"] for t in report["trials"].values()}
    assert rewards == {"sales-total-artifact": {"reward": 1.0}, "kv-service-count": {"reward": 1.0}}
    (sales,) = [d for d in (tmp_path / "jobs" / "job").iterdir() if d.name.startswith("sales-total")]
    # Harbor's layout: the source path under artifacts/, and its manifest
    assert (sales / "artifacts" / "app" / "out" / "total.txt").read_text() == "7967\n"
    assert "total.txt" in (sales / "artifacts" / "logs" / "artifacts" / "listing.txt").read_text()
    manifest = json.loads((sales / "artifacts" / "manifest.json").read_text())
    assert [(m["source"], m["destination"], m["type"], m["status"]) for m in manifest] == [
        ("/logs/artifacts", "artifacts/logs/artifacts", "directory", "ok"),
        ("/app/out", "artifacts/app/out", "directory", "ok"),
    ]
    # The verifier environment mode as Harbor resolves it: separate for the task with its own.
    modes = {d.name.split("__")[0]: json.loads((d / "result.json").read_text())["verifier_environment_mode"]
             for d in (tmp_path / "jobs" / "job").iterdir() if (d / "result.json").is_file() and d.name != "result.json"}  # fmt: skip
    assert modes == {"sales-total-artifact": "separate", "kv-service-count": "shared"}
