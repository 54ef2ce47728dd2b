"""Lint many task directories quickly, turning every defect into a row, never a traceback."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrl.errors import TaskFormatError
from agentrl.tasks.task import Task


@dataclass
class LintResult:
    task: Task
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def lint_task(task: Task) -> LintResult:
    result = LintResult(task)
    try:
        result.warnings = task.validate()
    except TaskFormatError as exc:
        result.errors.append(str(exc))
    except OSError as exc:
        result.errors.append(f"{task.path}: cannot read: {exc}")
    return result


def lint_tasks(tasks: list[Task]) -> list[LintResult]:
    return [lint_task(t) for t in tasks]
