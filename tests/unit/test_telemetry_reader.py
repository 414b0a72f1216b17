"""The agent's telemetry reader: torn lines, garbage, split-DFlash records without a loss."""

from __future__ import annotations

import json
from pathlib import Path

from agents.telemetry import TelemetryTail


def test_torn_lines_wait_and_garbage_is_counted(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    tail = TelemetryTail(f)
    assert tail.poll() == []  # no file yet
    f.write_bytes(b'{"ts": 1, "rank": 0, "type": "step", "step": 1, "loss": 3.0}\n{"ts": 2, "rank": 0, "ty')
    got = tail.poll()
    assert [r["step"] for r, _ in got] == [1]
    with open(f, "ab") as fh:
        fh.write(b'pe": "step", "step": 2, "loss": 2.5}\nnot json\n[1,2]\n')
    got = tail.poll()
    assert [r["step"] for r, _ in got] == [2]
    assert tail.summary.bad_lines == 2 and tail.summary.loss == 2.5
    assert got[-1][1] == f.stat().st_size - len(b"not json\n[1,2]\n")


def test_split_ranks_without_loss_keep_the_drafters_loss(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    lines = [
        {"ts": 1, "rank": 2, "type": "step", "step": 5, "loss": 1.25, "tokens_per_s": 100.0, "role": "drafter"},
        {"ts": 1, "rank": 0, "type": "step", "step": 5, "loss": None, "queue_depth": 3, "role": "target"},
    ]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tail = TelemetryTail(f)
    tail.poll()
    s = tail.summary
    assert s.step == 5 and s.loss == 1.25 and s.queue_depth == 3 and s.tokens_per_s == 100.0
    assert s.tps_history == [100.0]
    assert set(s.ranks) == {"0", "2"}
