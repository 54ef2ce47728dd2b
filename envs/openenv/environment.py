"""`OpenEnvEnvironment`: episodes on a remote OpenEnv environment server, trained on like local ones.

Two protocols:

- `tbench2`: the upstream `tbench2_env` schema (`agentrl env serve tbench2`, or upstream's own
  server). `reset(task_id)` gives the instruction; the agent loop runs unchanged on the command
  path through `RemoteSandbox` (each command an `exec` step); `evaluate` gives the reward. The
  server's classification comes through: a command that broke the sandbox, or a tampered or hung
  verifier, is a policy outcome (reward 0 and its cause); a failed sandbox or verifier is an
  `InfraError` with the server's cause.
- `text`: any OpenEnv environment whose actions carry text: `reset(**row reset)`, the observation's
  `observation_field` is the user message, each reply goes out as `{action_field: reply,
  **action_extra}`, until `done`; the reward is the sum (or last) of the step rewards.

One WebSocket session per episode, never silently reconnected (`agentrl.openenv.client`): a
dropped connection, a time limit, a full server or a server error is an infrastructure failure
(`openenv_*` causes), retried by the rollout manager in a new session, never a reward of 0.
Token-in/token-out as everywhere: the trainer sees exactly the engine's ids and log-probs.

Rows: `task_ids` (tbench2) or `rows_file` (text: JSONL rows with the reset arguments under
`reset` or `metadata.reset`), else the server's Task API (`/{env}/tasks` of `split`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentrl.agent.acting import Batch
from agentrl.agent.actions import Command, TextFormat, ToolsFormat
from agentrl.agent.loop import AgentConfig, EndReason, run_turns
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import Engine, SamplingParams
from agentrl.episode.run import segment_samples
from agentrl.episode.sample import Episode, Status
from agentrl.errors import InputError
from agentrl.rollout.environment import EnvContext, EnvironmentPluginError, Split
from agentrl.sandbox.base import SandboxPolicyError
from agentrl.tasks.rows import read_jsonl

log = logging.getLogger("agentrl.envs.openenv")


class OpenEnvConfig(BaseModel):
    """Settings of the OpenEnv consumer (every one printed by `--dry-run`)."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["openenv"] = "openenv"
    url: str = Field("http://127.0.0.1:8000", description="The environment server (http:// or ws://).")
    protocol: Literal["tbench2", "text", "mcp"] = Field(
        "tbench2",
        description="tbench2: the tbench2_env schema (terminal tasks); text: text actions; mcp: the "
        "server's MCP tools (list_tools / call_tool), called through the tool-call action format.",
    )
    task_ids: list[str] | None = Field(None, description="tbench2 rows (None: the server's Task API).")
    eval_task_ids: list[str] | None = Field(None, description="tbench2 eval rows (None: task_ids).")
    rows_file: str | None = Field(None, description="text rows, JSONL (None: the server's Task API).")
    eval_rows_file: str | None = Field(None, description="text eval rows (None: rows_file).")
    split: str = Field("train", description="Task API split of the training rows.")
    eval_split: str | None = Field(None, description="Task API split of the eval rows (None: split).")
    # tbench2: the agent loop
    action_format: str = "terminus-json"
    system_prompt: str | None = None
    agent: AgentConfig = Field(default_factory=AgentConfig)
    max_agent_timeout_s: float | None = Field(
        None, description="Cap on each task's agent time limit (as the server reports it at reset)."
    )
    # text: the action and observation fields
    action_field: str = Field("message", description="text: the action field that carries the reply.")
    action_extra: dict[str, Any] = Field(default_factory=dict, description="text: fixed action fields.")
    observation_field: str = Field("text", description="text: the observation field shown to the model.")
    reward_mode: Literal["sum", "last"] = Field("sum", description="text: episode reward from step rewards.")
    rejected_reward: float = Field(
        0.0, description="text: reward of an episode whose reply the server rejected (a policy outcome)."
    )
    # time limits
    connect_timeout_s: float = Field(30.0, gt=0)
    max_sessions: int | None = Field(
        None,
        ge=1,
        description="Sessions this run opens on the server at once (None: learn the room "
        "from the server's CAPACITY_REACHED answers).",
    )
    capacity_wait_s: float = Field(
        900.0,
        gt=0,
        description="How long an episode waits for a session on a full server before the "
        "wait counts as an infrastructure failure.",
    )
    reset_timeout_s: float = Field(900.0, gt=0, description="reset (a sandbox start, maybe an image build).")
    step_timeout_s: float = Field(300.0, gt=0, description="text: one step.")
    step_grace_s: float = Field(30.0, gt=0, description="tbench2: allowance over a command's own limit.")
    evaluate_timeout_s: float | None = Field(
        None, gt=0, description="tbench2: evaluate (None: the task's verifier limit + 300 s)."
    )
    max_message_mb: float = Field(16.0, gt=0, description="Largest server message the client accepts.")

    @field_validator("agent")
    @classmethod
    def _command_path(cls, agent: AgentConfig) -> AgentConfig:
        if agent.terminal == "tmux":
            raise ValueError("agent.terminal=tmux: a remote OpenEnv session runs commands (use commands)")
        return agent


class OpenEnvEnvironment:
    """Rows from the config or the server's Task API; a runner per engine."""

    def __init__(self, config: OpenEnvConfig, context: EnvContext) -> None:
        try:
            import openenv.core.env_client  # noqa: F401
        except ImportError:
            raise EnvironmentPluginError(
                "the openenv environment needs the openenv package: pip install 'agentrl[openenv]' "
                "then pip install --no-deps 'openenv>=0.10,<0.11'"
            ) from None
        self.config = config
        self.context = context
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._check_schema()
        from agentrl.openenv.client import SessionGate  # needs the openenv package, checked above

        # The sessions this run holds on the server: every runner of this environment shares them.
        self.gate = SessionGate(limit=config.max_sessions, wait_s=config.capacity_wait_s)

    # -- the server --------------------------------------------------------------------------

    @property
    def http_url(self) -> str:
        url = self.config.url.rstrip("/")
        for ws, http in (("ws://", "http://"), ("wss://", "https://")):
            if url.startswith(ws):
                return http + url[len(ws) :]
        return url

    def _get(self, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        url = f"{self.http_url}{path}"
        try:
            with httpx.Client(timeout=self.config.connect_timeout_s, trust_env=False) as http:
                resp = http.post(url, json=body) if body is not None else http.get(url)
        except httpx.HTTPError as exc:
            raise EnvironmentPluginError(
                f"cannot reach the OpenEnv server at {self.http_url} ({exc}): start it first (e.g. "
                "`agentrl env serve tbench2`) or fix env.url"
            ) from None
        if resp.status_code != 200:
            raise EnvironmentPluginError(f"{url} answered {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    def _check_schema(self) -> None:
        """Fail at build, not in every episode, when the server does not speak the protocol."""
        schema = self._get("/schema")
        action = (schema.get("action") or {}).get("properties") or {}
        observation = (schema.get("reset_observation") or schema.get("observation") or {}).get(
            "properties"
        ) or {}
        c = self.config
        if c.protocol == "tbench2":
            missing = [f for f in ("action_type", "command") if f not in action]
            missing += [f"observation.{f}" for f in ("instruction", "output") if f not in observation]
            if missing:
                raise EnvironmentPluginError(
                    f"{c.url} does not speak the tbench2_env schema (no {', '.join(missing)}): "
                    "use env.protocol=text for other environments"
                )
            return
        if c.protocol == "mcp":  # MCP actions (list_tools / call_tool) are the package's own
            return
        if c.action_field not in action:
            raise EnvironmentPluginError(
                f"{c.url}'s actions have no field {c.action_field!r} (they have {', '.join(sorted(action)) or 'none'}): "
                "set env.action_field"
            )
        kind = action[c.action_field].get("type")
        if kind not in (None, "string"):
            raise EnvironmentPluginError(f"{c.url}'s action field {c.action_field!r} is {kind}, not text")
        if c.observation_field not in observation:
            raise EnvironmentPluginError(
                f"{c.url}'s observations have no field {c.observation_field!r} (they have "
                f"{', '.join(sorted(observation)) or 'none'}): set env.observation_field"
            )

    def _task_api_rows(self, split: str) -> list[dict[str, Any]]:
        try:  # openenv 0.10's Task API; servers on the openenv-core 0.3 line have none
            names = self._get("/list_environments")
            if not names:
                raise EnvironmentPluginError(f"{self.http_url} lists no environment")
            tasks = self._get(f"/{names[0]}/tasks", {"split": split})["tasks"]
        except EnvironmentPluginError as exc:
            what = "env.task_ids" if self.config.protocol == "tbench2" else "env.rows_file"
            raise EnvironmentPluginError(f"{exc}\nthe server has no Task API: give {what}") from None
        rows = []
        for i, spec in enumerate(tasks):
            spec = spec if isinstance(spec, dict) else {"task": spec}
            if self.config.protocol == "tbench2":
                rows.append(_task_row(str(spec.get("task_id") or spec.get("id"))))
            else:
                task_id = str(spec.get("task_id") or spec.get("id") or f"{split}-{i}")
                rows.append(_text_row(task_id, {"split": split, "index": i}, spec))
        if not rows:
            raise EnvironmentPluginError(f"{self.http_url} has no task in split {split!r}")
        return rows

    # -- rows --------------------------------------------------------------------------------

    def rows(self, split: Split) -> list[dict[str, Any]]:
        if split not in self._rows:
            self._rows[split] = self._load_rows(split)
        return self._rows[split]

    def _load_rows(self, split: Split) -> list[dict[str, Any]]:
        c = self.config
        if c.protocol == "tbench2":
            ids = c.eval_task_ids if split == "eval" and c.eval_task_ids else c.task_ids
            if ids:
                return [_task_row(t) for t in ids]
        else:
            path = c.eval_rows_file if split == "eval" and c.eval_rows_file else c.rows_file
            if path:
                rows = read_jsonl(path)
                for i, row in enumerate(rows):
                    reset = row.get("reset", (row.get("metadata") or {}).get("reset", {}))
                    if not isinstance(reset, dict):
                        raise EnvironmentPluginError(
                            f"{path} row {i}: `reset` must be an object of reset arguments"
                        )
                return rows
        return self._task_api_rows((c.eval_split or c.split) if split == "eval" else c.split)

    # -- runners -----------------------------------------------------------------------------

    def runner(self, engine: Engine, *, run_id: str, record_dir: Path | None = None) -> Any:
        tok = self.context.tokenizer
        if self.config.protocol == "tbench2":
            from envs.openenv.terminal import RemoteTerminalRunner  # needs the openenv package

            renderer = ChatRenderer.for_format(tok, self.config.action_format) if tok is not None else None
            return RemoteTerminalRunner(
                self.config,
                engine,
                client_options=self.client_options(),
                sampling=self.sampling,
                renderer=renderer,
                run_id=run_id,
                gate=self.gate,
            )
        if tok is None:
            raise EnvironmentPluginError(
                "the text protocol generates token-in/token-out: it needs a tokenizer"
            )
        renderer = ChatRenderer(tok, observation_role="tool" if self.config.protocol == "mcp" else "user")
        return RemoteTextRunner(self, engine, renderer=renderer, run_id=run_id)

    def sampling(self, max_new_tokens: int, seed: int | None) -> SamplingParams:
        c = self.context
        return SamplingParams(
            temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_new_tokens=max_new_tokens, seed=seed
        )

    def client_options(self) -> dict[str, Any]:
        c = self.config
        return {
            "base_url": c.url,
            "connect_timeout_s": c.connect_timeout_s,
            # Each call has its own limit (RemoteSession); the package's own must never cut first.
            "message_timeout_s": 7 * 24 * 3600.0,
            "max_message_size_mb": c.max_message_mb,
        }

    async def aclose(self) -> None:
        return None


def _task_row(task_id: str) -> dict[str, Any]:
    return {"prompt": [], "label": None, "metadata": {"task_id": task_id}}


def _text_row(task_id: str, reset: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": [], "label": None, "metadata": {"task_id": task_id, "reset": reset, "task": spec}}


class RemoteTextRunner:
    """One row -> one multi-turn episode on a remote OpenEnv server (the `EpisodeRunner`
    protocol): each reply is one text action (`protocol` text), or the reply's tool calls are
    `call_tool` actions on the server's MCP tools (`protocol` mcp: the tools come from its
    `list_tools`, their schemas go into the prompt, a reply without a call ends the episode)."""

    def __init__(
        self, env: OpenEnvEnvironment, engine: Engine, *, renderer: ChatRenderer, run_id: str
    ) -> None:
        self.env = env
        self.engine = engine
        self.renderer = renderer
        self.run_id = run_id
        self.config = env.config

    def _text(self, observation: Any) -> str:
        value = observation.get(self.config.observation_field) if isinstance(observation, dict) else None
        if value is None:
            from agentrl.openenv.client import OpenEnvInfraError

            raise OpenEnvInfraError(
                f"{self.config.url}: an observation without {self.config.observation_field!r}",
                cause="openenv_protocol",
            )
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    async def run(
        self,
        row: dict[str, Any],
        *,
        group_id: str,
        sample_index: int,
        attempt: int = 0,
        eval: bool = False,
        seed: int | None = None,
    ) -> Episode:
        from agentrl.openenv.client import TextClient, episode_session

        c = self.config
        meta = row.get("metadata") or {}
        reset = row.get("reset", meta.get("reset", {}))
        task_id = str(meta.get("task_id") or row.get("id") or group_id)
        session_id = f"{self.run_id}:{group_id}:{sample_index}:{attempt}"
        opened = episode_session(
            self.env.gate, lambda: TextClient(**self.env.client_options()), url=c.url,
            connect_timeout_s=c.connect_timeout_s, reset_timeout_s=c.reset_timeout_s, task=task_id, **reset,
        )  # fmt: skip
        async with opened as (session, first, waited):
            if first.done:
                raise InputError(f"{c.url} ended the episode of {task_id} at reset: nothing to act on")
            actor: _StepActor | _ToolActor
            renderer = self.renderer
            if c.protocol == "mcp":
                tools = await _list_tools(session, c)
                action_format: Any = ToolsFormat(tools)
                renderer = renderer.with_tools([_function_schema(t) for t in tools])
                actor = _ToolActor(self, session)
                instruction = _instruction(row, first.observation, c.observation_field, c.url)
            else:
                action_format, actor = TextFormat(), _StepActor(self, session)
                instruction = self._text(first.observation)
            run = await run_turns(
                engine=self.engine,
                actor=actor,
                renderer=renderer,
                action_format=action_format,
                instruction=instruction,
                config=c.agent,
                sampling=self.env.sampling(c.agent.max_new_tokens, seed),
                session_id=session_id,
                system_prompt=c.system_prompt,
            )
        if run.infra_error is not None:
            raise run.infra_error
        rejected = run.policy_error is not None  # the server refused what the model wrote
        rewards = actor.rewards
        if rejected:
            reward, end, status = c.rejected_reward, "action_rejected", Status.FAILED_POLICY
        else:
            reward = (sum(rewards) if c.reward_mode == "sum" else rewards[-1]) if rewards else 0.0
            end = run.end_reason.value
            finished = (EndReason.ENV_DONE, EndReason.TASK_COMPLETE)  # the server ended it, or the agent
            status = Status.COMPLETED if run.end_reason in finished else Status.TRUNCATED
        t = run.timings
        timings = {
            "engine_s": t["engine_s"],
            "env_s": t["sandbox_s"],
            "total_s": t["agent_s"],
            "capacity_wait_s": waited,
        }
        samples = segment_samples(
            run.segments,
            reward=reward,
            status=status,
            end_reason=end,
            prompt_id=group_id,
            sample_index=sample_index,
            task_id=task_id,
            timings=timings,
        )
        return Episode(
            segments=samples,
            reward=reward,
            status=status if samples else Status.FAILED_POLICY,
            turn_versions=[v for turn in run.turns for v in turn.weight_versions],
            end_reason=end,
            failure_cause="action_rejected" if rejected else None,
            task_id=task_id,
            prompt_id=group_id,
            sample_index=sample_index,
            attempt=attempt,
            timings=timings,
            metadata={
                "step_rewards": rewards,
                "turns": len(run.turns),
                "version_mismatches": run.version_mismatches,
            },
        )


class _StepActor:
    """The agent loop's actor for a remote text environment: each reply is one `step`."""

    mode = "text"

    def __init__(self, runner: RemoteTextRunner, session: Any) -> None:
        self.runner = runner
        self.session = session
        self.rewards: list[float] = []
        self.last = ""  # the last observation

    async def initial_state(self) -> str | None:
        return None

    async def screen(self) -> str:
        return self.last

    async def alive(self) -> bool:
        return True

    async def act(self, commands: list[Command], deadline: float | None) -> Batch:
        from agentrl.openenv.client import OpenEnvRequestError

        c = self.runner.config
        try:
            result = await self.session.step(
                {**c.action_extra, c.action_field: commands[0].keystrokes}, timeout_s=c.step_timeout_s
            )
        except OpenEnvRequestError as exc:
            log.info("%s rejected a reply: %s", c.url, exc)
            raise SandboxPolicyError(f"{c.url} rejected the reply: {exc}") from exc
        if result.reward is not None:
            self.rewards.append(float(result.reward))
        text = "" if result.done else self.runner._text(result.observation)
        self.last = text
        return Batch([], text, done=bool(result.done))

    async def close(self) -> None:
        return None


async def _list_tools(session: Any, c: OpenEnvConfig) -> list[dict[str, Any]]:
    """The server's MCP tools (`list_tools`): name, description, input schema each."""
    from agentrl.openenv.client import OpenEnvInfraError

    result = await session.step({"type": "list_tools"}, timeout_s=c.step_timeout_s)
    tools = result.observation.get("tools") if isinstance(result.observation, dict) else None
    if not tools:
        raise OpenEnvInfraError(
            f"{c.url} lists no MCP tools ({result.observation!r:.200}): use env.protocol=text or tbench2",
            cause="openenv_protocol",
        )
    return [t for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)]


def _function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool as the function schema chat templates render (`tools=`)."""
    parameters = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
    function = {"name": tool["name"], "description": tool.get("description", ""), "parameters": parameters}
    return {"type": "function", "function": function}


def _instruction(row: dict[str, Any], observation: Any, field: str, url: str) -> str:
    """What the agent is asked: the row's instruction (or prompt), else the reset observation's
    `field`."""
    task = (row.get("metadata") or {}).get("task") or {}
    for value in (
        row.get("instruction"),
        task.get("instruction"),
        row.get("prompt") or None,
        task.get("prompt"),
    ):
        if isinstance(value, str) and value:
            return value
    value = observation.get(field) if isinstance(observation, dict) else None
    if isinstance(value, str) and value:
        return value
    raise InputError(
        f"{url}: the row gives no instruction and the reset observation has no {field!r}: give rows "
        "with an `instruction` (env.rows_file) or set env.observation_field"
    )


def _tool_text(observation: dict[str, Any]) -> str:
    """A `call_tool` observation as the model reads it: the result's text content (MCP
    `CallToolResult.content`), its data, or the error."""
    error = observation.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else error
        return f"error: {message}"
    result = observation.get("result")
    if isinstance(result, dict):
        texts = [
            c.get("text", "")
            for c in result.get("content") or []
            if isinstance(c, dict) and c.get("type") == "text"
        ]
        if texts:
            return ("error: " if result.get("is_error") or result.get("isError") else "") + "\n".join(texts)
        if result.get("data") is not None:
            result = result["data"]
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


class _ToolActor(_StepActor):
    """The agent loop's actor for an MCP environment: each tool call of a reply is one `call_tool`
    step; the outputs are joined in order; the server's reward and done as for text steps."""

    async def act(self, commands: list[Command], deadline: float | None) -> Batch:
        from agentrl.openenv.client import OpenEnvRequestError

        c = self.runner.config
        outputs = []
        for command in commands:
            call = json.loads(command.keystrokes)
            action = {"type": "call_tool", "tool_name": call["name"], "arguments": call["arguments"]}
            try:
                result = await self.session.step(action, timeout_s=c.step_timeout_s)
            except OpenEnvRequestError as exc:  # arguments the server's schema refuses: the model's
                outputs.append(f"error: {c.url} refused the call: {exc}")
                continue
            if result.reward is not None:
                self.rewards.append(float(result.reward))
            outputs.append(_tool_text(result.observation) if isinstance(result.observation, dict) else "")
            if result.done:
                return Batch([], "\n".join(outputs), done=True)
        self.last = "\n".join(outputs)
        return Batch([], self.last)


class _Plugin:
    name = "openenv"
    Config = OpenEnvConfig

    def build(self, config: OpenEnvConfig, context: EnvContext) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(config, context)


plugin = _Plugin()
