"""`JsonlTail`: read a JSONL file that another process is still appending to, by byte offset.

Each `poll()` reads only what was appended since the last one. A line without its newline yet is
half-written: it is left for a later poll (and counted as `partial`), never parsed. A complete
line that is not a JSON object is skipped and counted in `malformed`. When the file is replaced
or shrinks (a new run in the same directory unlinks `metrics.jsonl`), the tail starts over and
bumps `generation` so readers know to drop what they had.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonlTail:
    """The parsed rows of one JSONL file, kept up to date incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.malformed = 0
        self.partial = 0  # bytes of a last line still being written (0: none)
        self.generation = 0
        self._offset = 0
        self._inode: int | None = None

    def _reset(self) -> None:
        self.rows = []
        self.malformed = 0
        self.partial = 0
        self._offset = 0
        self.generation += 1

    def poll(self) -> int:
        """Read what was appended; returns the number of new rows."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._inode is not None:
                self._inode = None
                self._reset()
            return 0
        if (self._inode is not None and st.st_ino != self._inode) or st.st_size < self._offset:
            self._reset()
        self._inode = st.st_ino
        if st.st_size == self._offset:
            return 0
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read(st.st_size - self._offset)
        end = data.rfind(b"\n")
        self.partial = len(data) - (end + 1)
        if end < 0:
            return 0
        self._offset += end + 1
        before = len(self.rows)
        for line in data[:end].split(b"\n"):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                self.malformed += 1
                continue
            if isinstance(row, dict):
                self.rows.append(row)
            else:
                self.malformed += 1
        return len(self.rows) - before
