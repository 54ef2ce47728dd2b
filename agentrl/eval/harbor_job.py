"""Evaluation results in Harbor's job layout, with trajectories in ATIF, so Harbor's own tools
(`harbor view`, `harbor jobs summarize`, its pydantic models) read what `agentrl eval` wrote.

Layout (Harbor 0.25's `harbor/job.py`, `harbor/models/trial/paths.py`)::

    <jobs_dir>/<job_name>/
        config.json            JobConfig (defaults left out, as Harbor writes it)
        result.json            JobResult: stats per agent/model/dataset, written at start and end
        job.log
        agentrl-eval.json      agentrl's own summary: pass@k over scored episodes, unscored counts
        <task>__<7 chars>/     one trial per (task, attempt)
            config.json        TrialConfig
            result.json        TrialResult (rewards, exception, phase timings, token counts)
            exception.txt      when the trial recorded an exception
            agent/trajectory.json    ATIF-v1.6 (Harbor's `harbor/models/trajectories`)
            agent/<episode record>.jsonl   agentrl's episode record (replayable)
            verifier/test-stdout.txt, verifier/reward.txt | reward.json
            artifacts/         the task's artifacts as collected, and manifest.json
            steps/<name>/verifier/, steps/<name>/artifacts/   a multi-step task's, per step

Semantics follow Harbor where they can: `result.json` of the job holds Harbor's statistics (its
`Mean` metric and its pass@k, where a trial without a reward counts 0), while `agentrl-eval.json`
and the printed table hold agentrl's (`agentrl.eval.passk`: an episode that failed for
infrastructure reasons after every retry is unscored, never 0). A retried trial's directory is
removed before the retry, as Harbor's queue does.

Trajectories are built from agentrl's episode record (`agentrl.episode.run.Recorder`): the first
prompt as a `user` step (a `system` step first on the command path), then one `agent` step per turn
with Terminus-2's message ("Analysis: ...\\nPlan: ..."), one `bash_command` tool call per command
(`call_<turn>_<i>`, and `mark_task_complete`), the observation the model was shown next, and, for
token-in/token-out engines, the turn's prompt and completion token ids and log-probs.

Nothing here imports torch or Harbor: plain JSON, checked against Harbor's models by the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import string
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from agentrl.agent.actions import limit_terminal_output
from agentrl.agent.prompts import initial_prompt
from agentrl.episode.record import read_record
from agentrl.eval.passk import pass_at_k

ATIF_VERSION = "ATIF-v1.6"
AGENT_NAME = "agentrl-terminus-2"

# agentrl failure causes -> the exception type Harbor records for the same failure, so Harbor's
# error policy (`harbor/models/trial/error_policy.py`) classifies it the same way. The agentrl
# type and cause stay in the message.
HARBOR_EXCEPTIONS = {
    "image_build": "SandboxBuildFailedError",
    "sandbox_create": "EnvironmentStartTimeoutError",
    "sandbox": "RuntimeRequestError",
    "sandbox_transport": "RuntimeRequestError",
    "sandbox_quota": "RuntimeRequestError",
    "shell_unresponsive": "RuntimeRequestError",
    "shell_protocol": "RuntimeRequestError",
    "storage_exceeded": "SandboxLikelyOutOfMemoryError",
    "healthcheck": "HealthcheckError",
    "engine": "ApiError",
    "engine_unavailable": "ApiConnectionError",
    "engine_http": "ApiError",
    "engine_closed": "ApiConnectionError",
    "engine_timeout": "Timeout",
    "engine_auth": "AuthenticationError",
    "engine_bad_request": "BadRequestError",
    "verifier_error": "RewardFileNotFoundError",
    "verifier_timeout": "VerifierTimeoutError",
    "timeout": "VerifierTimeoutError",
}
_SHORTUUID = string.digits + string.ascii_letters


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(t: datetime) -> str:
    return t.isoformat()


def task_checksum(task_dir: Path) -> str:
    """Harbor's task checksum: `dirhash` sha256 over names and contents (empty directories left
    out), as `harbor/models/task/task.py` computes it (without `.harborignore` filtering)."""

    def node(path: Path) -> str | None:
        entries = []
        for child in sorted(path.iterdir()):
            if child.is_dir():
                digest = node(child)
                if digest is None:
                    continue
                props = [f"dirhash:{digest}", f"name:{child.name}"]
            else:
                props = [f"data:{hashlib.sha256(child.read_bytes()).hexdigest()}", f"name:{child.name}"]
            entries.append("\0".join(sorted(props)))
        if not entries:
            return None
        return hashlib.sha256("\0\0".join(sorted(entries)).encode()).hexdigest()

    return node(task_dir) or hashlib.sha256(b"").hexdigest()


def trial_name(task_name: str) -> str:
    """Harbor's trial name: the task's short name cut to 32 characters, then 7 random ones."""
    short = task_name.split("/")[-1][:32].rstrip("_-")
    return f"{short}__{''.join(secrets.choice(_SHORTUUID) for _ in range(7))}"


def harbor_pass_at_k(rewards_by_task: dict[str, list[float | None]]) -> dict[int, float]:
    """Harbor's pass@k (`harbor/utils/pass_at_k.py`): binary rewards only, an unrewarded trial
    counts 0, k in {2, 4, 8, ...} and {5, 10, ...} up to the fewest trials of any task."""
    if not rewards_by_task:
        return {}
    successes: dict[str, list[int]] = {}
    for task, rewards in rewards_by_task.items():
        values = [0.0 if r is None else r for r in rewards]
        if any(v not in (0, 1) for v in values):
            return {}
        successes[task] = [int(v) for v in values]
    fewest = min(len(v) for v in successes.values())
    ks = {k for k in (2**i for i in range(1, 32)) if k <= fewest} | set(range(5, fewest + 1, 5))
    return {
        k: sum(pass_at_k(len(v), sum(v), k) for v in successes.values()) / len(successes) for k in sorted(ks)
    }


# --- trajectories ------------------------------------------------------------------------------


def _analysis_plan(text: str) -> str | None:
    """Terminus-2's step message, "Analysis: ...\\nPlan: ..." (empty parts left out), when the
    reply holds a JSON object with those fields; None otherwise (the raw text is used)."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            start = text.find("{", start + 1)
            continue
        if not isinstance(obj, dict):
            return None
        parts = [
            f"{label}: {obj[key]}"
            for key, label in (("analysis", "Analysis"), ("plan", "Plan"))
            if isinstance(obj.get(key), str) and obj[key]
        ]
        return "\n".join(parts) if parts else None
    return None


def turn_tokens(samples: list[dict[str, Any]], n_turns: int) -> list[dict[str, Any]] | None:
    """Per turn: the prompt ids it was generated from, its completion ids and their log-probs,
    read from an episode's token segments (each run of trained tokens is one turn's generation).
    None when the runs do not line up one to one with the turns."""
    per_turn: list[dict[str, Any]] = []
    for sample in samples:
        tokens, plen = sample["tokens"], sample["prompt_length"]
        mask, logps = sample["loss_mask"], sample["rollout_logprobs"]
        i = 0
        while i < len(mask):
            if not mask[i]:
                i += 1
                continue
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            per_turn.append(
                {
                    "prompt_token_ids": tokens[: plen + i],
                    "completion_token_ids": tokens[plen + i : plen + j],
                    "logprobs": logps[i:j],
                }
            )
            i = j
    return per_turn if len(per_turn) == n_turns else None


@dataclass
class TrajectoryInfo:
    """What the trajectory needs beyond the record."""

    model_name: str
    agent_version: str
    # The conversation before the first reply, from the record (its terminal's first state).
    first_messages: Callable[[dict[str, Any]], list[dict[str, str]]]
    extra: dict[str, Any] = field(default_factory=dict)


def build_trajectory(
    record: dict[str, Any],
    info: TrajectoryInfo,
    step_index: int | None = None,
    subagents: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An ATIF trajectory (Harbor's `Trajectory` model, `extra` keys forbidden everywhere): the
    whole episode's, or (`step_index`) one step's of a multi-step task, as Harbor writes one per step.
    `subagents` gets the summarisation sub-calls' trajectories by file name, to be written beside it."""
    header = record["header"] or {}
    started = header.get("created_at")
    clock = datetime.fromtimestamp(started, UTC) if started else _now()
    steps: list[dict[str, Any]] = []
    for msg in info.first_messages(record):
        source = "system" if msg["role"] == "system" else "user"
        steps.append(
            {"step_id": len(steps) + 1, "timestamp": _iso(clock), "source": source, "message": msg["content"]}
        )
    result = record.get("result") or {}
    all_turns = record["turns"]
    # Token ids are the episode's samples, turn by turn over the whole episode (every step's).
    tokens = turn_tokens(result.get("samples") or [], len(all_turns))
    totals = {"prompt": 0, "completion": 0}
    summaries = record.get("summaries") or []
    if step_index is not None:
        summaries = [x for x in summaries if x.get("step", 0) == step_index]
    for position, turn in enumerate(all_turns):
        if step_index is not None and turn.get("step", 0) != step_index:
            continue
        clock += timedelta(seconds=float(turn.get("engine_s") or 0.0))
        k = turn["index"]
        for summary in (x for x in summaries if x.get("before_turn") == k):
            subs, refs = _subagent_trajectories(summary, steps, header.get("session_id"), info, clock)
            if subagents is not None:
                subagents.update(subs)
            steps += _summary_steps(summary, len(steps), clock, refs)
        action = turn.get("action") or {}
        text = turn.get("model_text") or ""
        step: dict[str, Any] = {
            "step_id": len(steps) + 1,
            "timestamp": _iso(clock),
            "source": "agent",
            "model_name": info.model_name,
            "message": text if action.get("error") else (_analysis_plan(text) or text),
        }
        calls: list[dict[str, Any]] = []
        if not action.get("error"):
            calls = [
                {
                    "tool_call_id": f"call_{k}_{i}",
                    "function_name": "bash_command",
                    "arguments": {"keystrokes": c["keystrokes"], "duration": c["duration"]},
                }
                for i, c in enumerate(action.get("commands") or [], start=1)
            ]
            if action.get("task_complete"):
                calls.append(
                    {
                        "tool_call_id": f"call_{k}_task_complete",
                        "function_name": "mark_task_complete",
                        "arguments": {},
                    }
                )
            step["tool_calls"] = calls or None
        observed: dict[str, Any] = {"content": turn.get("observation") or ""}
        n_commands = len(action.get("commands") or [])
        if calls and n_commands == 1:
            observed["source_call_id"] = f"call_{k}_1"
        step["observation"] = {"results": [observed]}
        metrics: dict[str, Any] = {}
        if tokens is not None:
            t = tokens[position] if position < len(tokens) else None
            if t is not None:
                metrics = {
                    "prompt_tokens": len(t["prompt_token_ids"]),
                    "completion_tokens": len(t["completion_token_ids"]),
                    **t,
                }
                totals["prompt"] += metrics["prompt_tokens"]
                totals["completion"] += metrics["completion_tokens"]
        extra = {"finish_reason": turn.get("finish_reason"), "sandbox_s": turn.get("sandbox_s")}
        if turn.get("weight_versions"):
            extra["weight_versions"] = turn["weight_versions"]
        if action.get("warnings"):
            extra["parser_warnings"] = action["warnings"]
        if action.get("error"):
            extra["parse_error"] = action["error"]
        metrics["extra"] = {k2: v for k2, v in extra.items() if v is not None}
        step["metrics"] = metrics
        step["llm_call_count"] = 1
        steps.append({k2: v for k2, v in step.items() if v is not None})
        clock += timedelta(seconds=float(turn.get("sandbox_s") or 0.0))
    final: dict[str, Any] = {"total_steps": len(steps)}
    if tokens is not None:
        final.update(total_prompt_tokens=totals["prompt"], total_completion_tokens=totals["completion"])
    extra = {
        "end_reason": result.get("end_reason"),
        "status": result.get("status"),
        "failure_cause": result.get("failure_cause"),
        "terminal": header.get("terminal"),
        **info.extra,
    }
    return {
        "schema_version": ATIF_VERSION,
        "session_id": header.get("session_id"),
        "agent": {
            "name": AGENT_NAME,
            "version": info.agent_version,
            "model_name": info.model_name,
            "extra": {
                "parser": "json"
                if header.get("action_format") == "terminus-json"
                else header.get("action_format")
            },
        },
        "steps": steps,
        "final_metrics": final,
        "extra": {k: v for k, v in extra.items() if v is not None},
    }


def _summary_steps(
    summary: dict[str, Any], done: int, clock: datetime, refs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Where a context summary replaced the history, as Terminus-2 records it: a `system` step that
    says so (`context_management`: compaction, replace) and refers to the sub-calls' trajectories,
    then the `user` step of the new prompt."""
    note = {k: v for k, v in summary.items() if k not in ("prompt", "calls")}
    note["calls"] = [
        {k: v for k, v in c.items() if k not in ("prompt", "reply")} for c in summary.get("calls") or []
    ]
    system: dict[str, Any] = {
        "step_id": done + 1,
        "timestamp": _iso(clock),
        "source": "system",
        "message": "Performed context summarization and handoff to continue task.",
        "extra": {"context_management": {"type": "compaction", "boundary": "replace"}, "summary": note},
    }
    if refs:
        system["observation"] = {"results": [{"subagent_trajectory_ref": refs}]}
    return [
        system,
        {
            "step_id": done + 2,
            "timestamp": _iso(clock),
            "source": "user",
            "message": summary.get("prompt") or "",
        },
    ]


# Terminus-2's words for each sub-call in its refs (`terminus_2.py`, `_summarize`).
SUBAGENT_NOTES = {
    "summary": "Step 1 - Summary generation",
    "questions": "Step 2 - Question asking",
    "answers": "Step 3 - Answer providing",
}


def _subagent_trajectories(
    summary: dict[str, Any],
    before: list[dict[str, Any]],
    session: str | None,
    info: TrajectoryInfo,
    clock: datetime,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Harbor's `trajectory.summarization-<n>-<name>.json` per sub-call of a full summary (the
    agent's history it was sent: the main trajectory's steps so far, marked copied, metrics
    removed; its own prompt and its reply), by file name, and the main trajectory's refs to them."""
    n = summary.get("index")
    out: dict[str, dict[str, Any]] = {}
    refs: list[dict[str, Any]] = []
    if summary.get("kind") != "full" or n is None:
        return out, refs
    for call in summary.get("calls") or []:
        name = str(call.get("name"))
        copied = [
            {k: v for k, v in step.items() if k not in ("metrics", "llm_call_count")}
            | {"is_copied_context": True}
            for step in (before if call.get("copied") else [])
        ]
        steps = [*copied, {"source": "user", "message": call.get("prompt") or ""}]
        steps.append({
            "source": "agent", "model_name": info.model_name, "message": call.get("reply") or "",
            "metrics": {"prompt_tokens": call.get("prompt_tokens"), "completion_tokens": call.get("output_tokens")},
            "llm_call_count": 1,
        })  # fmt: skip
        for i, step in enumerate(steps, start=1):
            step["step_id"], step["timestamp"] = i, step.get("timestamp") or _iso(clock)
        path = f"trajectory.summarization-{n}-{name}.json"
        refs.append({"session_id": f"{session}-summarization-{n}-{name}", "trajectory_path": path,
                     "extra": {"summary": f"Context summarization {n}: {SUBAGENT_NOTES.get(name, name)}"}})  # fmt: skip
        out[path] = {
            "schema_version": ATIF_VERSION,
            "session_id": f"{session}-summarization-{n}-{name}",
            "agent": {
                "name": f"{AGENT_NAME}-summarization-{name}",
                "version": info.agent_version,
                "model_name": info.model_name,
                "extra": {"parent_session_id": session, "summarization_index": n},
            },
            "steps": steps,
            "final_metrics": {
                "total_prompt_tokens": call.get("prompt_tokens"),
                "total_completion_tokens": call.get("output_tokens"),
                "total_steps": len(steps),
            },
        }
    return out, refs


# --- job and trials ----------------------------------------------------------------------------


def _write_verifier(where: Path, tail: str | None, rewards: dict[str, float] | None) -> None:
    """A verifier directory as Harbor downloads it: the test output's tail and the reward file."""
    where.mkdir(parents=True, exist_ok=True)
    if tail:
        (where / "test-stdout.txt").write_text(tail, encoding="utf-8")
    if rewards is not None:
        if list(rewards) == ["reward"]:
            (where / "reward.txt").write_text(f"{rewards['reward']:g}\n", encoding="utf-8")
        else:
            _write_json(where / "reward.json", rewards)


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=4, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def exception_info(
    exc: BaseException, *, cause: str | None = None, when: datetime | None = None
) -> dict[str, Any]:
    """Harbor's ExceptionInfo for an agentrl failure (type name mapped to Harbor's where one fits)."""
    cause = cause or getattr(exc, "cause", None)
    harbor_type = HARBOR_EXCEPTIONS.get(cause or "", type(exc).__name__)
    if cause and cause.startswith("engine_http") and harbor_type == type(exc).__name__:
        harbor_type = "ApiError"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = f"{type(exc).__name__}" + (f" (cause {cause})" if cause else "") + f": {exc}"
    return {
        "exception_type": harbor_type,
        "exception_message": message,
        "exception_traceback": tb,
        "occurred_at": _iso(when or _now()),
    }


@dataclass
class TrialOutcome:
    """What a finished trial reports to the job."""

    name: str
    task_name: str
    source: str
    rewards: dict[str, float] | None
    exception_type: str | None
    n_input_tokens: int | None
    n_output_tokens: int | None


class HarborJob:
    """One `agentrl eval` run as a Harbor job directory. `config` is Harbor's JobConfig as a dict;
    `agent_config`, `environment_config` are the per-trial AgentConfig / EnvironmentConfig dicts."""

    def __init__(
        self,
        jobs_dir: Path,
        job_name: str,
        *,
        config: dict[str, Any],
        agent_config: dict[str, Any],
        environment_config: dict[str, Any],
        agent_info: dict[str, Any],
        n_total_trials: int,
    ) -> None:
        self.dir = Path(jobs_dir) / job_name
        if self.dir.exists() and any(self.dir.iterdir()):
            raise FileExistsError(f"{self.dir} exists and is not empty: pick another --job-name")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.id = str(uuid.uuid4())
        self.started_at = _now()
        self.config = config
        self.agent_config = agent_config
        self.environment_config = environment_config
        self.agent_info = agent_info
        self.n_total_trials = n_total_trials
        self.outcomes: dict[str, TrialOutcome] = {}
        self.n_retries = 0
        self.running: set[str] = set()
        _write_json(self.dir / "config.json", config)
        self.write_result(final=False)

    def evals_key(self, source: str) -> str:
        model = (self.agent_info.get("model_info") or {}).get("name")
        return (
            f"{self.agent_info['name']}__{model}__{source}"
            if model
            else f"{self.agent_info['name']}__{source}"
        )

    def stats(self, *, final: bool) -> dict[str, Any]:
        evals: dict[str, dict[str, Any]] = {}
        by_task: dict[str, dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
        totals: dict[str, int | None] = {"n_input_tokens": None, "n_output_tokens": None}
        n_errored = 0
        for o in self.outcomes.values():
            key = self.evals_key(o.source)
            ev = evals.setdefault(
                key,
                {
                    "n_trials": 0,
                    "n_errors": 0,
                    "metrics": [],
                    "pass_at_k": {},
                    "reward_stats": {},
                    "exception_stats": {},
                },
            )
            if o.rewards is not None:
                ev["n_trials"] += 1
                for name, value in o.rewards.items():
                    ev["reward_stats"].setdefault(name, {}).setdefault(str(value), []).append(o.name)
            if o.exception_type is not None:
                ev["n_errors"] += 1
                n_errored += 1
                ev["exception_stats"].setdefault(o.exception_type, []).append(o.name)
            by_task[key][o.task_name].append(None if not o.rewards else next(iter(o.rewards.values())))
            for field_name, count in (
                ("n_input_tokens", o.n_input_tokens),
                ("n_output_tokens", o.n_output_tokens),
            ):
                if count is not None:
                    totals[field_name] = (totals[field_name] or 0) + count
        if final:
            for key, ev in evals.items():
                rewards = [r for task in by_task[key].values() for r in task]
                # Harbor's Mean metric over single-key rewards: an unrewarded trial counts 0.
                ev["metrics"] = [{"mean": sum(r or 0.0 for r in rewards) / len(rewards)}] if rewards else []
                ev["pass_at_k"] = {str(k): v for k, v in harbor_pass_at_k(by_task[key]).items()}
        completed = len(self.outcomes)
        return {
            "n_completed_trials": completed,
            "n_errored_trials": n_errored,
            "n_running_trials": len(self.running),
            "n_pending_trials": max(self.n_total_trials - completed - len(self.running), 0),
            "n_cancelled_trials": sum(o.exception_type == "CancelledError" for o in self.outcomes.values()),
            "n_retries": self.n_retries,
            "evals": evals,
            **totals,
        }

    def write_result(self, *, final: bool) -> None:
        now = _now()
        result = {
            "id": self.id,
            "started_at": _iso(self.started_at),
            "updated_at": _iso(now),
            "finished_at": _iso(now) if final else None,
            "n_total_trials": self.n_total_trials,
            "stats": self.stats(final=final),
        }
        _write_json(self.dir / "result.json", result)

    def log(self, line: str) -> None:
        with (self.dir / "job.log").open("a", encoding="utf-8") as fh:
            fh.write(f"{_iso(_now())} {line}\n")

    def trial(
        self,
        task_name: str,
        task_path: Path,
        source: str,
        previous: Trial | None = None,
        verifier_mode: str | None = "shared",
    ) -> Trial:
        """A new trial directory. A retry (`previous` given) removes the failed attempt's
        directory first, as Harbor's queue does before a retry. `verifier_mode`: the task's
        resolved verifier environment mode ("shared" / "separate"; None for a multi-step task)."""
        if previous is not None:
            self.outcomes.pop(previous.name, None)
            shutil.rmtree(previous.dir, ignore_errors=True)
            self.n_retries += 1
        trial = Trial(self, task_name, task_path, source)
        trial.verifier_mode = verifier_mode
        self.running.add(trial.name)
        return trial

    def finished(self, trial: Trial, outcome: TrialOutcome) -> None:
        self.running.discard(trial.name)
        self.outcomes[trial.name] = outcome
        self.write_result(final=False)

    def close(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            _write_json(self.dir / "agentrl-eval.json", summary)
        self.write_result(final=True)


class Trial:
    """One trial directory; `finish` writes its result, trajectory and verifier files."""

    def __init__(self, job: HarborJob, task_name: str, task_path: Path, source: str) -> None:
        self.job = job
        self.task_name = task_name
        self.task_path = Path(task_path).resolve()
        self.source = source
        self.verifier_mode: str | None = "shared"
        self.name = trial_name(task_name)
        while (job.dir / self.name).exists():
            self.name = trial_name(task_name)
        self.dir = job.dir / self.name
        self.agent_dir = self.dir / "agent"
        self.verifier_dir = self.dir / "verifier"
        for d in (self.agent_dir, self.verifier_dir, self.dir / "artifacts"):
            d.mkdir(parents=True, exist_ok=True)
        self.started_at = _now()
        self.config = {
            "task": {"path": str(self.task_path), "source": source},
            "trial_name": self.name,
            "trials_dir": str(job.dir),
            "agent": job.agent_config,
            "environment": job.environment_config,
            "verifier": {},
            "job_id": job.id,
        }
        _write_json(self.dir / "config.json", self.config)

    def record_path(self) -> Path | None:
        found = sorted(self.agent_dir.glob("*.jsonl"))
        return found[0] if found else None

    def finish(
        self,
        *,
        info: TrajectoryInfo,
        error: BaseException | None = None,
        timeout_s: float | None = None,
    ) -> TrialOutcome:
        finished_at = _now()
        path = self.record_path()
        record = None
        if path is not None:
            rec = read_record(path, tolerant=True)
            record = {"header": rec.header or None, "terminal": rec.other.get("terminal")}
            record |= {
                "turns": rec.turns,
                "result": rec.result,
                "summaries": rec.summaries,
                "steps": rec.steps,
            }
        result_line = (record or {}).get("result") or {}
        timings = result_line.get("timings") or {}
        rewards = result_line.get("rewards") if result_line.get("reward") is not None else None
        if rewards == {} and result_line.get("reward") is not None:
            rewards = {"reward": result_line["reward"]}
        if rewards is not None and result_line.get("outcome") == "tampered":
            rewards = {"reward": 0.0}
        exc_info = None
        if error is not None:
            exc_info = exception_info(error, when=finished_at)
        elif result_line.get("end_reason") == "timeout" and timeout_s is not None:
            # Harbor records the agent's timeout and still verifies (the reward stays valid).
            exc_info = {
                "exception_type": "AgentTimeoutError",
                "exception_message": f"Agent execution timed out after {timeout_s:g} seconds",
                "exception_traceback": "",
                "occurred_at": _iso(finished_at),
            }
        elif result_line.get("failure_cause") and result_line.get("status") == "failed_policy":
            cause = result_line["failure_cause"]
            exc_info = {
                "exception_type": HARBOR_EXCEPTIONS.get(cause, "VerifierOutputParseError"),
                "exception_message": f"agentrl scored the episode 0: {cause}",
                "exception_traceback": "",
                "occurred_at": _iso(finished_at),
            }
        if exc_info is not None:
            (self.dir / "exception.txt").write_text(
                exc_info["exception_traceback"] or exc_info["exception_message"], encoding="utf-8"
            )
        n_in = n_out = None
        step_tokens: dict[int, tuple[int | None, int | None]] = {}
        if record is not None and record["header"] is not None and not record["steps"]:
            subagents: dict[str, dict[str, Any]] = {}
            trajectory = build_trajectory(record, info, subagents=subagents)
            _write_json(self.agent_dir / "trajectory.json", trajectory)
            for name, sub in subagents.items():
                _write_json(self.agent_dir / name, sub)
            final = trajectory["final_metrics"]
            n_in, n_out = final.get("total_prompt_tokens"), final.get("total_completion_tokens")
        elif record is not None and record["header"] is not None:
            # Harbor's multi-step layout: one trajectory per step, in steps/<name>/agent/.
            for step in record["steps"]:
                k = step.get("index", 0)
                if not step.get("name") or not any(t.get("step", 0) == k for t in record["turns"]):
                    continue
                per_step = {
                    **record,
                    "terminal": {"initial_state": step.get("initial_state")},
                    "step_name": step["name"],
                }
                subagents = {}
                trajectory = build_trajectory(per_step, info, step_index=k, subagents=subagents)
                where = self.dir / "steps" / str(step["name"]) / "agent"
                _write_json(where / "trajectory.json", trajectory)
                for name, sub in subagents.items():
                    _write_json(where / name, sub)
                final = trajectory["final_metrics"]
                step_tokens[k] = (final.get("total_prompt_tokens"), final.get("total_completion_tokens"))
            if step_tokens and all(None not in v for v in step_tokens.values()):
                n_in = sum(v[0] or 0 for v in step_tokens.values())
                n_out = sum(v[1] or 0 for v in step_tokens.values())
        _write_verifier(self.verifier_dir, result_line.get("verifier_log_tail"), rewards)
        for step in (record or {}).get("steps") or []:
            if step.get("name"):  # Harbor's steps/<name>/verifier/ (artifacts/ is the episode's)
                where = self.dir / "steps" / str(step["name"]) / "verifier"
                _write_verifier(where, step.get("log_tail"), step.get("rewards"))
        t0 = self.started_at
        create_s = timings.get("create_s")
        agent_s = timings.get("agent_s")
        verifier_s = timings.get("verifier_s")
        env_end = t0 + timedelta(seconds=create_s) if create_s is not None else None
        agent_end = env_end + timedelta(seconds=agent_s) if env_end and agent_s is not None else None
        steps = [
            {
                "step_name": step.get("name"),
                "agent_result": (
                    {"n_input_tokens": step_tokens[k][0], "n_output_tokens": step_tokens[k][1]}
                    if (k := step.get("index", 0)) in step_tokens
                    else None
                ),
                "verifier_result": {"rewards": step["rewards"]} if step.get("rewards") is not None else None,
                "exception_info": (
                    {
                        "exception_type": "StepSetupError",
                        "exception_message": step["setup_error"],
                        "exception_traceback": "",
                        "occurred_at": _iso(finished_at),
                    }
                    if step.get("setup_error")
                    else None
                ),
                "agent_execution": None,
                "verifier": None,
            }
            for step in ((record or {}).get("steps") or [])
        ]
        metadata = {
            k: result_line.get(k)
            for k in ("end_reason", "status", "outcome", "failure_cause")
            if result_line.get(k)
        }
        if record is not None:
            metadata["n_episodes"] = len(record["turns"])
            summaries = record.get("summaries") or []
            metadata["summarization_count"] = max((x.get("index") or 0 for x in summaries), default=0)
            calls = [c for x in summaries for c in x.get("calls") or []]
            if calls and n_in is not None and n_out is not None:  # Harbor's totals count the sub-calls
                n_in += sum(c["prompt_tokens"] for c in calls)
                n_out += sum(c["output_tokens"] for c in calls)
            metadata["record"] = str(path.relative_to(self.dir)) if path else None
        result = {
            "id": str(uuid.uuid4()),
            "task_name": self.task_name,
            "trial_name": self.name,
            "trial_uri": self.dir.resolve().as_uri(),
            "task_id": {"path": str(self.task_path)},
            "source": self.source,
            "task_checksum": task_checksum(self.task_path),
            "config": self.config,
            "agent_info": self.job.agent_info,
            "agent_result": {"n_input_tokens": n_in, "n_output_tokens": n_out, "metadata": metadata},
            "verifier_result": {"rewards": rewards} if rewards is not None else None,
            "verifier_environment_mode": None if steps else self.verifier_mode,
            "step_results": steps or None,
            "exception_info": exc_info,
            "started_at": _iso(t0),
            "finished_at": _iso(finished_at),
            "environment_setup": {"started_at": _iso(t0), "finished_at": _iso(env_end)} if env_end else None,
            "agent_setup": None,
            "agent_execution": {"started_at": _iso(env_end), "finished_at": _iso(agent_end)}
            if env_end and agent_end
            else None,
            "verifier": (
                {
                    "started_at": _iso(finished_at - timedelta(seconds=verifier_s)),
                    "finished_at": _iso(finished_at),
                }
                if verifier_s is not None
                else None
            ),
        }
        _write_json(self.dir / "result.json", result)
        outcome = TrialOutcome(
            self.name,
            self.task_name,
            self.source,
            rewards,
            exc_info["exception_type"] if exc_info else None,
            n_in,
            n_out,
        )
        self.job.finished(self, outcome)
        return outcome


def first_messages(
    *,
    mode: str,
    instruction: str,
    initial_state: str | None,
    system_prompt: str | None,
    format_system_prompt: str,
    prompt_template: str | None,
) -> list[dict[str, str]]:
    """The conversation before the first reply, as `agentrl.agent.loop` builds it: on the terminal
    path Terminus-2's one user message (after a system message only if one was configured), on the
    command path a system message and the instruction."""
    if mode == "tmux" and initial_state is not None:
        first = initial_prompt(instruction, limit_terminal_output(initial_state), prompt_template)
        head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return [*head, {"role": "user", "content": first}]
    return [
        {"role": "system", "content": system_prompt or format_system_prompt},
        {"role": "user", "content": instruction},
    ]
