"""The terminal environment's OpenEnv schema: the upstream `tbench2_env` action, observation and state
(meta-pytorch/OpenEnv `envs/tbench2_env/models.py`), field for field, so its clients work unchanged.

Upstream fields and meanings are kept; agentrl adds only conventions inside the free-form parts:

- `TerminalAction.metadata["timeout_s"]`: the limit of one `exec` (capped by the server).
- `TerminalObservation.info`: for `exec`, `exit_code`, `timed_out`, `duration_s` and the separate
  `stdout` / `stderr` (`output` is their concatenation, as upstream); for `evaluate`, the verifier's
  `outcome`, `tests_passed`, `rewards` and `cause`; for `reset`, the task's time limits; and for every
  refused or failed action `failure` (`"request"`: the action was malformed or not allowed now;
  `"policy"`: the agent's own commands broke its sandbox, reward 0; `"infra"`: the sandbox or
  verifier failed, no reward) with a stable `cause`.

Small string fields carry a `max_length` (a violation is an ordinary validation error); the sizes of
`command` and `content` are limits of the server's configuration, checked when the action runs, so
an oversized value is answered with its size and the limit instead of being echoed back.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

ACTION_TYPES = ("exec", "write_file", "evaluate", "close")
# Upstream's streaming-process actions: named in the answer to them, not served here.
UPSTREAM_ONLY = ("write", "view", "wait", "kill")


class TerminalAction(Action):
    """One step: `exec` a shell command, `write_file`, `evaluate` (run the task's tests) or `close`."""

    action_type: str = Field("exec", max_length=64, description="exec | write_file | evaluate | close")
    command: str = Field("", description="Shell command (exec); size capped by the server.")
    session_id: str | None = Field(None, max_length=255, description="Upstream's process id (unused).")
    block: bool = Field(True, description="Run to completion; false (background processes) is refused.")
    wait_seconds: float | None = Field(None, description="Upstream's wait action (unused).")
    file_path: str = Field("", max_length=4096, description="Absolute path in the sandbox (write_file).")
    content: str = Field("", description="File content (write_file); size capped by the server.")


class TerminalObservation(Observation):
    """What a step returns; `reward` is set by `evaluate` only (None elsewhere)."""

    instruction: str = Field("", description="The task's instruction.md.")
    output: str = Field("", description="stdout + stderr of exec; the verifier log of evaluate.")
    success: bool = Field(True, description="exec: exit 0 and no timeout; others: the action worked.")
    error: str = Field("", description="Why the action was refused or failed.")
    task_id: str = ""
    task_path: str = ""
    session_id: str | None = None
    action_type: str = ""
    info: dict[str, Any] = Field(default_factory=dict)


class TerminalState(State):
    """The session's state (`state` message)."""

    task_id: str = ""
    task_path: str = ""
    session_id: str = ""
    terminal_ready: bool = False
    last_action_type: str = ""
    last_command: str = ""
    last_output: str = ""
