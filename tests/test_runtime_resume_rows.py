"""A resumed run keeps the metrics rows of the steps its checkpoint holds, and no others."""

from __future__ import annotations

import json
from pathlib import Path

from agentrl.runtime.loop import keep_metrics_through


def test_rows_after_the_checkpoint_and_a_cut_row_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "samples": 8}, {"step": 2, "samples": 8}, {"step": 3, "samples": 8}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "sam')
    keep_metrics_through(path, 2)  # the crash came after step 3's row, before its checkpoint
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    keep_metrics_through(path, 2)  # nothing more to drop: the file is left as it is
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    keep_metrics_through(tmp_path / "absent.jsonl", 2)  # no metrics yet: nothing to do
