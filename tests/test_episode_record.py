"""The one episode-record reader: strict for replay, tolerant for a record still being written,
and `load_samples` for SFT and train-only replays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.episode.record import Recorder, RecordError, load_samples, read_record
from agentrl.episode.sample import Sample, Status


def _sample(reward: float) -> dict:
    return Sample(
        prompt_id="p", tokens=[1, 2, 3], prompt_length=1, loss_mask=[1, 1], rollout_logprobs=[-0.1, -0.2],
        reward=reward, status=Status.COMPLETED,
    ).to_dict()  # fmt: skip


def _record(path: Path, reward: float) -> Path:
    rec = Recorder(path)
    rec.write("header", {"task_id": "t", "version": 1})
    rec.write("terminal", {"initial_state": "$ "})
    rec.write("turn", {"index": 0})
    rec.write("result", {"reward": reward, "samples": [_sample(reward)]})
    rec.close()
    return path


def test_a_record_reads_back_with_its_other_lines(tmp_path: Path) -> None:
    rec = read_record(_record(tmp_path / "a.jsonl", 1.0))
    assert rec.header["task_id"] == "t" and len(rec.turns) == 1 and rec.result["reward"] == 1.0
    assert rec.other["terminal"] == {"initial_state": "$ "} and rec.malformed == 0


def test_strict_refuses_a_broken_line_and_tolerant_counts_it_and_stops_at_a_partial_one(
    tmp_path: Path,
) -> None:
    path = _record(tmp_path / "a.jsonl", 1.0)
    with path.open("a") as fh:
        fh.write("not json\n" + json.dumps({"type": "turn", "index": 1}))  # last line half-written
    with pytest.raises(RecordError, match=r"a\.jsonl:5"):
        read_record(path)
    rec = read_record(path, tolerant=True)
    assert rec.malformed == 1 and len(rec.turns) == 1


def test_a_file_without_header_is_not_a_record(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text(json.dumps({"type": "turn"}) + "\n")
    with pytest.raises(RecordError, match="no header"):
        read_record(tmp_path / "x.jsonl")
    with pytest.raises(RecordError, match="no such episode record"):
        read_record(tmp_path / "missing.jsonl")


def test_load_samples_keeps_episodes_that_reached_min_reward_and_plain_sample_rows(tmp_path: Path) -> None:
    _record(tmp_path / "good.jsonl", 1.0)
    _record(tmp_path / "bad.jsonl", 0.0)
    assert [s.reward for s in load_samples([tmp_path], min_reward=1.0)] == [1.0]
    assert sorted(s.reward for s in load_samples([tmp_path])) == [0.0, 1.0]
    rows = tmp_path / "rows" / "samples.jsonl"
    rows.parent.mkdir()
    rows.write_text(json.dumps(_sample(0.5)) + "\n\n")
    assert [s.reward for s in load_samples([rows])] == [0.5]
    rows.write_text("{}\n")
    with pytest.raises(RecordError, match=r"samples\.jsonl:1"):
        load_samples([rows])
    with pytest.raises(RecordError, match="does not exist"):
        load_samples([tmp_path / "nowhere"])
