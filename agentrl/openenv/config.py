"""Every setting of a served environment (`agentrl env serve`, printed by `--dry-run`)."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentrl.errors import AgentRLError
from agentrl.rollout.environment import resolve_config

SERVABLE = ("tbench2",)  # plugins with an OpenEnv schema (the terminal one: upstream tbench2_env's)
KIB = 1024


class ServeConfig(BaseModel):
    """Every setting of a served environment (printed by `agentrl env serve --dry-run`)."""

    model_config = ConfigDict(extra="forbid")

    env: dict[str, Any] = Field(
        default_factory=lambda: {"name": "tbench2"},
        description="The environment plugin's own settings (tasks, backend, ...), validated by it.",
    )
    host: str = Field("127.0.0.1", description="Address to bind: loopback unless you mean to share it.")
    port: int = Field(8000, ge=0, le=65535, description="0: any free port.")
    max_sessions: int = Field(8, ge=1, description="Concurrent sessions, hence sandboxes.")
    idle_timeout_s: float = Field(
        600.0, gt=0, description="A session whose client sends nothing this long is closed with its sandbox."
    )
    command_timeout_s: float = Field(60.0, gt=0, description="exec limit when the action names none.")
    max_command_timeout_s: float = Field(600.0, gt=0, description="Cap on an exec's own metadata.timeout_s.")
    close_timeout_s: float = Field(120.0, gt=0, description="Limit on closing one sandbox.")
    max_command_bytes: int = Field(256 * KIB, ge=1, description="Largest exec command.")
    max_file_bytes: int = Field(1024 * KIB, ge=1, description="Largest write_file content.")
    max_message_chars: int = Field(
        2048 * KIB, ge=1024, description="Largest WebSocket message answered with an error (and kept open)."
    )
    max_frame_bytes: int = Field(
        8192 * KIB, ge=1024, description="Hard cap on one WebSocket frame: larger ones close the connection."
    )
    max_http_body_bytes: int = Field(64 * KIB, ge=1024, description="Largest HTTP request body.")
    run_id: str = Field(
        default_factory=lambda: f"openenv-{uuid.uuid4().hex[:8]}",
        description="Label of every sandbox this server starts (`agentrl sandbox reap` finds them).",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value: Any) -> dict[str, Any]:
        data = value.model_dump() if isinstance(value, BaseModel) else dict(value)
        data.setdefault("name", "tbench2")
        if data["name"] not in SERVABLE:
            raise ValueError(
                f"environment {data['name']!r} has no OpenEnv schema to be served with yet; "
                f"servable: {', '.join(SERVABLE)}"
            )
        try:
            return resolve_config(data).model_dump()
        except AgentRLError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _limits(self) -> ServeConfig:
        if self.max_command_timeout_s < self.command_timeout_s:
            raise ValueError("max_command_timeout_s must be at least command_timeout_s")
        biggest = max(self.max_command_bytes, self.max_file_bytes)
        if self.max_message_chars < biggest + 4 * KIB:
            raise ValueError(
                f"max_message_chars ({self.max_message_chars}) must exceed the largest command or file "
                f"({biggest} bytes) plus the message's own fields, or those limits can never be reached"
            )
        if self.max_frame_bytes < 4 * self.max_message_chars:
            raise ValueError("max_frame_bytes must be at least 4 x max_message_chars (UTF-8 takes up to 4)")
        return self
