"""Progress bars for long work: image builds, oracle sweeps, episodes, training steps.

One implementation for every command. A bar goes to stderr, and only when stderr is a terminal
(`AGENTRL_PROGRESS=1` forces it on, `=0` off), so stdout, JSON output, log files and pipes never see
it. Callers write `with progress_bar("episodes", total=n) as bar: ... bar.advance(note=...)`; when
the bar is off the same object does nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

ENV = "AGENTRL_PROGRESS"


def progress_enabled() -> bool:
    """Whether bars are drawn: `AGENTRL_PROGRESS` (1/0) when set, else whether stderr is a TTY."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None) and stream.isatty())


class Bar:
    """One bar; a no-op when progress is off."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress = progress
        self._task = task

    def advance(self, n: float = 1, *, note: str | None = None) -> None:
        if self._progress is not None:
            fields = {} if note is None else {"description": _inert(note)}
            self._progress.update(self._task, advance=n, **fields)

    def note(self, text: str) -> None:
        """Say what is going on now (shown beside the bar)."""
        if self._progress is not None:
            self._progress.update(self._task, description=_inert(text))

    def total(self, total: float | None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, total=total)


def _inert(text: str) -> str:
    """Task ids and error text shown as they are: no rich markup, no terminal escapes."""

    return escape("".join(c if c.isprintable() else "?" for c in text))[:120]


_active: list[Any] = []  # the Progress on screen: a bar opened inside another is a row of it


@contextlib.contextmanager
def progress_bar(label: str, total: float | None, *, enabled: bool | None = None) -> Iterator[Bar]:
    """A bar `label [====    ] 3/8 0:00:12 left 0:00:20 <note>` on stderr for the duration of the block;
    `total` None draws a pulsing bar (work of unknown length). It disappears when the block ends.
    A bar opened while another is shown (an eval inside a training run) is a second row."""
    if not (progress_enabled() if enabled is None else enabled):
        yield Bar()
        return
    if _active:
        progress = _active[-1]
        task = progress.add_task("", total=total, label=_inert(label))
        try:
            yield Bar(progress, task)
        finally:
            progress.remove_task(task)
        return

    console = Console(file=sys.stderr, force_terminal=True if os.environ.get(ENV) else None)
    columns: list[Any] = [
        TextColumn("{task.fields[label]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
    ]
    # What the command prints to stdout goes above the bar when both share a terminal; piped, it
    # passes untouched (a redirect would send it to stderr).
    shared = bool(getattr(sys.stdout, "isatty", None) and sys.stdout.isatty())
    progress = Progress(*columns, console=console, transient=True, redirect_stdout=shared)
    task = progress.add_task("", total=total, label=_inert(label))
    with progress:
        _active.append(progress)
        try:
            yield Bar(progress, task)
        finally:
            _active.pop()
