"""Provides the agent's reader of run telemetry (the JSON lines trainers append, see trainers/telemetry.py).

The file is read incrementally from the last offset each supervision tick;
a torn last line waits for the rest, a line that is not JSON is counted and
skipped. The summary keeps what the console shows (step, loss, tokens/s, MFU,
each rank's manifest and last heartbeat); the supervisor journals the records
that matter for history (manifest, checkpoint, eval, done, error, and steps
at a bounded rate).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from agents.protocol import RankTelemetry, RunTelemetry

MAX_READ = 4 << 20  # bytes per poll; the rest waits for the next tick
MAX_LINE = 1 << 20


class TelemetryTail:
    """Follows one run's telemetry.jsonl and folds it into a RunTelemetry."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self.offset = offset  # file offset just past the last complete line read
        self.summary = RunTelemetry()

    def poll(self) -> list[tuple[dict, int]]:
        """New complete records since the last poll, each with the file offset just past it."""
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self.offset:  # truncated or replaced: start over
                    self.offset = 0
                if size == self.offset:
                    return []
                fh.seek(self.offset)
                data = fh.read(MAX_READ)
        except OSError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) > MAX_LINE:  # one endless line: skip it
                self.offset += len(data)
                self.summary.bad_lines += 1
            return []  # a torn last line waits for its newline
        out: list[tuple[dict, int]] = []
        pos = self.offset
        for raw in data[: end + 1].split(b"\n")[:-1]:
            pos += len(raw) + 1
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                self.summary.bad_lines += 1
                continue
            if not isinstance(rec, dict) or "type" not in rec:
                self.summary.bad_lines += 1
                continue
            self._fold(rec)
            out.append((rec, pos))
        self.offset = pos
        return out

    def _fold(self, rec: dict) -> None:
        s = self.summary
        kind = rec.get("type")
        ts = _num(rec.get("ts"))
        rank = rec.get("rank")
        rank = rank if isinstance(rank, int) else 0
        r = s.ranks.get(str(rank))
        if r is None:
            r = s.ranks[str(rank)] = RankTelemetry(rank=rank)
        if ts is not None:
            r.last_seen = max(r.last_seen or 0.0, ts)
            s.last_ts = max(s.last_ts or 0.0, ts)
        if kind == "manifest":
            r.role = _str(rec.get("role"))
            r.device = _str(rec.get("device"))
            r.gpu_uuid = _str(rec.get("gpu_uuid"))
            r.pid = rec.get("pid") if isinstance(rec.get("pid"), int) else None
            s.world_size = rec.get("world_size") if isinstance(rec.get("world_size"), int) else s.world_size
            s.params_total = rec.get("params_total") if isinstance(rec.get("params_total"), int) else s.params_total
            s.params_trainable = rec.get("params_trainable") if isinstance(rec.get("params_trainable"), int) else s.params_trainable
            s.start = _str(rec.get("start")) or s.start
            s.config_hash = _str(rec.get("config_hash")) or s.config_hash
            for name in ("dataset_samples", "dataset_tokens"):
                v = rec.get(name)
                if isinstance(v, int) and not isinstance(v, bool):
                    setattr(s, name, v)
        elif kind == "step":
            step = rec.get("step")
            if isinstance(step, int):
                r.step = step
                if s.step is None or step >= s.step:
                    new_step = s.step != step
                    s.step = step
                    # ranks report different parts of a step (split DFlash: target ranks have no loss):
                    # a field a rank does not report keeps the value another rank gave
                    for name in ("loss", "tokens_per_s", "mfu", "queue_depth"):
                        value = _num(rec.get(name))
                        if value is not None:
                            setattr(s, name, value)
                    if new_step and s.tokens_per_s is not None:
                        s.tps_history = (s.tps_history + [s.tokens_per_s])[-60:]
        elif kind == "heartbeat":
            step = rec.get("step")
            if isinstance(step, int):
                r.step = step
        elif kind == "checkpoint":
            s.last_checkpoint = rec.get("step") if isinstance(rec.get("step"), int) else s.last_checkpoint
        elif kind == "eval":
            if _num(rec.get("tau")) is not None:
                s.tau = _num(rec.get("tau"))
        elif kind == "done":
            s.done = True
        elif kind == "error":
            s.error = _str(rec.get("message"))


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _str(v: object) -> str | None:
    return v[:500] if isinstance(v, str) else None


def step_series(path: Path, max_points: int = 300) -> tuple[list[int], list[float | None], list[float | None], list[float | None], int]:
    """(steps, loss, tokens_per_s, mfu, total) from a telemetry file, thinned evenly to ``max_points``.

    Ranks report the same step; a figure one rank leaves out (split DFlash target
    ranks have no loss) is taken from another.
    """
    by_step: dict[int, list[float | None]] = {}
    try:
        fh = open(path, "rb")
    except OSError:
        return [], [], [], [], 0
    with fh:
        for raw in fh:
            if b'"step"' not in raw:
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(rec, dict) or rec.get("type") != "step" or not isinstance(rec.get("step"), int):
                continue
            row = by_step.setdefault(rec["step"], [None, None, None])
            for i, name in enumerate(("loss", "tokens_per_s", "mfu")):
                v = _num(rec.get(name))
                if v is not None:
                    row[i] = v
    steps = sorted(by_step)
    total = len(steps)
    if total > max_points > 0:
        stride = total / max_points
        steps = [steps[int(i * stride)] for i in range(max_points - 1)] + [steps[-1]]
    return steps, [by_step[s][0] for s in steps], [by_step[s][1] for s in steps], [by_step[s][2] for s in steps], total
