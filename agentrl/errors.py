"""Typed errors shared across agentrl. Each message says what went wrong and what to do."""

from __future__ import annotations


class AgentRLError(Exception):
    """Base of every error agentrl raises on purpose."""


class InputError(AgentRLError):
    """A prompt row that cannot be run at all (a broken task, a malformed row): not the policy's
    doing and not a passing infrastructure fault, so it is neither scored nor retried; the run goes
    on without it and counts it (`bad_input`). Fix the data."""


class TaskFormatError(InputError):
    """A task directory or its `task.toml` does not follow the Harbor / terminal-bench-2 format."""

    def __init__(self, file: str, field: str | None, message: str, hint: str = "") -> None:
        self.file = file
        self.field = field
        self.message = message
        self.hint = hint
        where = f"{file}" + (f" [{field}]" if field else "")
        super().__init__(f"{where}: {message}" + (f" ({hint})" if hint else ""))


class InfraError(AgentRLError):
    """A failure of infrastructure (sandbox, engine, verifier machinery), never a policy outcome.

    `cause` is a short stable label used for counting failures by cause in metrics.
    """

    cause: str = "infra"

    def __init__(self, message: str, *, cause: str | None = None, log_tail: str = "") -> None:
        if cause is not None:
            self.cause = cause
        self.log_tail = log_tail
        text = message if not log_tail else f"{message}\n--- log tail ---\n{log_tail}"
        super().__init__(text)
