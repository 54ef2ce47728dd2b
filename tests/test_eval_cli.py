"""`agentrl eval` end to end without containers or torch: fake sandboxes, a scripted OpenAI-compatible
server on loopback, and the Harbor job directory it writes (layout, results, ATIF trajectories)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agentrl.eval.harbor import EvalConfigError, HarborEvalSettings, run_harbor_eval
from agentrl.eval.harbor_job import build_trajectory, harbor_pass_at_k, task_checksum, trial_name, turn_tokens
from agentrl.testing.sandbox import FakeSandboxProvider

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "envs" / "tbench2" / "tasks"

SOLVE = json.dumps(
    {
        "analysis": "The file is missing.",
        "plan": "Write it.",
        "commands": [{"keystrokes": "echo 'Hello, world!' > /app/hello.txt\n", "duration": 0.1}],
        "task_complete": True,
    }
)
IDLE = json.dumps({"analysis": "Looking.", "plan": "Look around.", "commands": [], "task_complete": False})


class ScriptedChat:
    """An OpenAI-compatible server: replies by the task named in the first message."""

    def __init__(self, replies: dict[str, list[str | int]], context: int = 8192) -> None:
        self.replies = replies
        self.context = context
        self.requests: list[dict[str, Any]] = []
        self.url = ""

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "scripted", "max_model_len": self.context}]}
        )

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        first = (
            body["messages"][-1]["content"] if len(body["messages"]) < 3 else body["messages"][1]["content"]
        )
        key = next(k for k in self.replies if k in first or k in json.dumps(body["messages"]))
        script = self.replies[key]
        n_assistant = sum(m["role"] == "assistant" for m in body["messages"])
        reply = script[min(n_assistant, len(script) - 1)]
        if isinstance(reply, int):
            return web.Response(status=reply, text="scripted failure")
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
                ],
            }
        )

    async def __aenter__(self) -> ScriptedChat:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


def _grader(sb: Any) -> float:
    return 1.0 if sb.files.get("/app/hello.txt") == b"Hello, world!\n" else 0.0


def _settings(tmp_path: Path, url: str, **kw: Any) -> HarborEvalSettings:
    base: dict[str, Any] = {
        "tasks": [str(TASKS)],
        "engine": "openai",
        "urls": [url],
        "backend": "fake",
        "terminal": "commands",
        "task_names": ["hello-file", "make-dirs"],
        "jobs_dir": str(tmp_path / "jobs"),
        "job_name": "job",
        "n_concurrent": 2,
        # The scripted model's context (8192) is within Terminus-2's summary threshold (8000 free):
        # Harbor would summarise before every turn; the summary tests turn it on.
        "summarize": False,
    }
    return HarborEvalSettings(**{**base, **kw})


async def test_eval_writes_a_harbor_job_with_rewards_trajectories_and_pass_at_k(tmp_path: Path) -> None:
    replies: dict[str, list[str | int]] = {"hello.txt": [SOLVE], "directories": [IDLE]}
    async with ScriptedChat(replies) as server:
        settings = _settings(tmp_path, server.url, n_attempts=2, max_turns=2)
        summary = await run_harbor_eval(settings, provider=FakeSandboxProvider(grader=_grader))
    assert summary is not None
    assert summary["per_task"] == {"hello-file": 1.0, "make-dirs": 0.0}
    assert summary["pass@1"] == pytest.approx(0.5) and summary["unscored"] == 0
    job = tmp_path / "jobs" / "job"
    config = json.loads((job / "config.json").read_text())
    assert config["n_attempts"] == 2 and config["agents"][0]["model_name"] == "scripted"
    assert config["datasets"] == [{"path": str(TASKS.resolve()), "task_names": ["hello-file", "make-dirs"]}]
    result = json.loads((job / "result.json").read_text())
    assert result["n_total_trials"] == 4 and result["finished_at"] is not None
    (evals,) = result["stats"]["evals"].values()
    assert evals["metrics"] == [{"mean": 0.5}] and evals["pass_at_k"] == {"2": 0.5}
    trials = sorted(d for d in job.iterdir() if d.is_dir())
    assert len(trials) == 4
    for trial in trials:
        tr = json.loads((trial / "result.json").read_text())
        assert tr["trial_name"] == trial.name and tr["source"] == "tasks"
        assert tr["task_checksum"] == task_checksum(Path(tr["task_id"]["path"]))
        traj = json.loads((trial / "agent" / "trajectory.json").read_text())
        steps = traj["steps"]
        assert [s["step_id"] for s in steps] == list(range(1, len(steps) + 1))
        assert steps[0]["source"] == "system" and steps[1]["source"] == "user"
        agent_steps = [s for s in steps if s["source"] == "agent"]
        if tr["task_name"] == "hello-file":
            assert tr["verifier_result"] == {"rewards": {"reward": 1.0}}
            (step,) = agent_steps
            assert step["message"] == "Analysis: The file is missing.\nPlan: Write it."
            assert [c["function_name"] for c in step["tool_calls"]] == ["bash_command", "mark_task_complete"]
            assert step["observation"]["results"][0]["source_call_id"] == "call_0_1"
            assert (trial / "verifier" / "reward.txt").read_text() == "1\n"
        else:
            # max turns ran out: verified, reward 0, no exception (Harbor's loop just ends too)
            assert tr["verifier_result"] == {"rewards": {"reward": 0.0}} and tr["exception_info"] is None
            assert len(agent_steps) == 2 and traj["extra"]["end_reason"] == "max_turns"
        assert list((trial / "agent").glob("*.jsonl")), "the agentrl episode record sits in agent/"
    assert json.loads((job / "agentrl-eval.json").read_text())["pass@2"] == pytest.approx(0.5)


async def test_an_engine_that_keeps_failing_leaves_the_episode_unscored_with_harbors_exception(
    tmp_path: Path,
) -> None:
    replies: dict[str, list[str | int]] = {"hello.txt": [SOLVE], "directories": [503]}
    async with ScriptedChat(replies) as server:
        settings = _settings(tmp_path, server.url, max_attempts=2)
        summary = await run_harbor_eval(settings, provider=FakeSandboxProvider(grader=_grader))
    assert summary is not None
    assert summary["unscored"] == 1 and summary["per_task"] == {"hello-file": 1.0, "make-dirs": None}
    job = tmp_path / "jobs" / "job"
    results = [json.loads((d / "result.json").read_text()) for d in job.iterdir() if d.is_dir()]
    # the failed first attempt's directory was removed before the retry, as Harbor's queue does
    assert sorted(r["task_name"] for r in results) == ["hello-file", "make-dirs"]
    (failed,) = [r for r in results if r["task_name"] == "make-dirs"]
    assert failed["verifier_result"] is None
    assert failed["exception_info"]["exception_type"] == "ApiConnectionError"
    assert "engine_unavailable" in failed["exception_info"]["exception_message"]
    stats = json.loads((job / "result.json").read_text())["stats"]
    assert stats["n_errored_trials"] == 1 and stats["n_retries"] == 1


async def test_the_defaults_are_terminus_2s_and_real_model_sized(tmp_path: Path) -> None:
    async with ScriptedChat({"x": [IDLE]}, context=131072) as server:
        settings = _settings(tmp_path, server.url, terminal="auto", summarize=True)
        from agentrl.eval.harbor import build_eval_engine, harbor_warnings, resolve_limits

        built = await build_eval_engine(settings)
        await built.engine.aclose()
    resolved = resolve_limits(settings, built)
    assert resolved.mode == "tmux" and resolved.max_new_tokens == 8192
    assert resolved.max_total_tokens == int(131072 * 0.85)  # chat engines: estimated token counts
    assert resolved.max_consecutive_malformed > settings.max_turns == 1_000_000
    assert harbor_warnings(settings, resolved, built, []) == []


async def test_settings_that_would_score_a_real_model_wrongly_are_warned_about(tmp_path: Path) -> None:
    from agentrl.eval.harbor import BuiltEngine, harbor_warnings, resolve_limits
    from agentrl.tasks.task import load_task

    settings = _settings(
        tmp_path, "http://127.0.0.1:1/v1", max_turns=3, max_new_tokens=64, max_agent_timeout=120
    )
    assert HarborEvalSettings(tasks=[]).summarize  # Terminus-2's default
    built = BuiltEngine(None, None, "m", 131072)
    warnings = harbor_warnings(
        settings, resolve_limits(settings, built), built, [load_task(TASKS / "hello-file")]
    )
    text = "\n".join(warnings)
    for needle in (
        "--max-turns 3",
        "--max-new-tokens 64",
        "--max-agent-timeout 120",
        "command path",
        "--no-summarize",
    ):
        assert needle in text


async def test_a_pass_at_k_above_the_attempts_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(EvalConfigError, match="--pass-at"):
        await run_harbor_eval(_settings(tmp_path, "http://127.0.0.1:1/v1", pass_at=[4], n_attempts=2))


def test_harbor_pass_at_k_counts_unrewarded_trials_as_failures() -> None:
    assert harbor_pass_at_k({"a": [1.0, None], "b": [0.0, 0.0]}) == {2: 0.5}
    assert harbor_pass_at_k({"a": [0.5, 1.0]}) == {}  # Harbor computes it for binary rewards only


def test_trial_names_are_harbors_short_name_and_seven_characters() -> None:
    name = trial_name("org/" + "a" * 40 + "-")
    stem, _, tail = name.partition("__")
    assert stem == "a" * 32 and len(tail) == 7 and tail.isalnum()


def test_turn_tokens_split_segments_into_turns() -> None:
    sample = {
        "tokens": [1, 2, 3, 10, 11, 20, 21, 12],
        "prompt_length": 3,
        "loss_mask": [1, 1, 0, 0, 1],
        "rollout_logprobs": [-0.1, -0.2, 0.0, 0.0, -0.3],
    }
    turns = turn_tokens([sample], 2)
    assert turns == [
        {"prompt_token_ids": [1, 2, 3], "completion_token_ids": [10, 11], "logprobs": [-0.1, -0.2]},
        {"prompt_token_ids": [1, 2, 3, 10, 11, 20, 21], "completion_token_ids": [12], "logprobs": [-0.3]},
    ]
    assert turn_tokens([sample], 3) is None


def test_a_parse_error_turn_has_the_raw_reply_and_no_tool_calls() -> None:
    from agentrl.eval.harbor_job import TrajectoryInfo

    record = {
        "header": {
            "session_id": "s",
            "action_format": "terminus-json",
            "terminal": "tmux",
            "created_at": 0.0,
        },
        "terminal": {"initial_state": "$ "},
        "turns": [
            {
                "index": 0,
                "model_text": "not json",
                "action": {"commands": [], "task_complete": False, "error": "No valid JSON", "warnings": []},
                "observation": "Previous response had parsing errors:",
                "engine_s": 1.0,
                "sandbox_s": 0.0,
                "finish_reason": "stop",
            }
        ],
        "result": {"end_reason": "no_action"},
    }
    info = TrajectoryInfo("m", "0", lambda r: [{"role": "user", "content": "prompt"}])
    traj = build_trajectory(record, info)
    step = traj["steps"][1]
    assert step["message"] == "not json" and "tool_calls" not in step
    assert step["metrics"]["extra"]["parse_error"] == "No valid JSON"


def test_agentrl_help_lists_eval_without_importing_torch() -> None:
    code = (
        "import sys; from agentrl.cli import main; sys.argv=['agentrl','--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'agentrl.cli.eval' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "eval" in out.stdout


def test_a_steps_trajectory_takes_its_own_turns_and_their_tokens() -> None:
    """A multi-step episode's turns number from 0 again in every step, while its samples run over
    the whole episode: step 1's trajectory has step 1's turns with the tokens at their position."""
    from agentrl.eval.harbor_job import TrajectoryInfo

    def turn(step: int, index: int, text: str) -> dict[str, Any]:
        return {
            "index": index,
            "step": step,
            "model_text": text,
            "action": {"commands": []},
            "observation": "",
        }

    # one sample, three generated runs (turns): step 0 turn 0, step 1 turns 0 and 1
    sample = {
        "tokens": [1, 2, 10, 11, 3, 20, 4, 30, 31, 32],
        "prompt_length": 2,
        "loss_mask": [1, 1, 0, 1, 0, 1, 1, 1],
        "rollout_logprobs": [-0.1] * 8,
    }
    record = {
        "header": {"session_id": "s", "action_format": "terminus-json", "created_at": 0.0},
        "turns": [turn(0, 0, "first"), turn(1, 0, "second"), turn(1, 1, "third")],
        "summaries": [{"before_turn": 1, "step": 1, "prompt": "summed up", "index": 1}],
        "result": {"samples": [sample]},
    }
    info = TrajectoryInfo("m", "0", lambda r: [{"role": "user", "content": r.get("step_name", "task")}])
    one = build_trajectory({**record, "step_name": "b"}, info, step_index=1)
    assert [s["source"] for s in one["steps"]] == ["user", "agent", "system", "user", "agent"]
    assert [s["message"] for s in one["steps"] if s["source"] == "agent"] == ["second", "third"]
    agents = [s for s in one["steps"] if s["source"] == "agent"]
    assert [a["metrics"]["completion_token_ids"] for a in agents] == [[20], [30, 31, 32]]
    assert one["final_metrics"]["total_completion_tokens"] == 4
    whole = build_trajectory(record, info)
    assert [s["message"] for s in whole["steps"] if s["source"] == "agent"] == ["first", "second", "third"]
