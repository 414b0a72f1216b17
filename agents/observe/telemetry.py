"""Provides the agent's reader of run telemetry (the JSON lines trainers append, see trainers/common/telemetry.py).

The file is read incrementally from the last offset each supervision tick;
a torn last line waits for the rest (or is read as it is once the run has
ended: ``poll(final=True)``). Every line is hostile input, written by the run:
it is decoded with explicit limits (:func:`decode_line`) and either accepted
or rejected by itself, with the reason kept (``take_rejections``), never an
exception out of :meth:`TelemetryTail.poll`. The limits:

- a line is at most ``MAX_LINE`` bytes (1 MiB); a longer one is skipped up to
  its newline, as one rejection;
- valid UTF-8 JSON, one object with a string ``type`` (at most 64 characters);
- nesting at most ``MAX_DEPTH`` (64) arrays and objects deep;
- every integer, anywhere in the record, within SQLite's 64-bit range (a
  larger one could not be stored in the history); floats finite (JSON has no
  NaN or infinity; a literal past 1e308 is refused);
- the fields the summary and the history read are typed (:class:`TelemetryLine`:
  ``step`` an integer, ``loss`` a number, ``rank`` 0..65535 ...);
  other fields are kept as they are;
- at most ``MAX_RANKS`` distinct ranks per run (the summary has one entry each).

The file itself is opened without following a symbolic link and read only if it
is a regular file (a run that puts a FIFO or a link to /dev/zero there gets a
rejection, not a stuck agent).

The summary keeps what the console shows (step, loss, tokens/s, MFU, each
rank's manifest and last heartbeat); the supervisor journals the records that
matter for history (manifest, checkpoint, eval, done, error, and steps at a
bounded rate).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import msgspec

from gpudeck.agents.wire.protocol import RankTelemetry, RunTelemetry

MAX_READ = 4 << 20  # bytes per poll; the rest waits for the next tick
MAX_LINE = 1 << 20  # bytes in one line
MAX_DEPTH = 64  # arrays and objects inside each other
MAX_RANK = 65535
MAX_RANKS = 4096  # distinct ranks one run's summary keeps
STEP_WINDOW = 20  # recent steps kept for the step period and each rank's compute / wait times
MAX_REJECTIONS_KEPT = 100  # pending rejections held for take_rejections(); the count goes on
INT_MIN, INT_MAX = -(2**63), 2**63 - 1

Int64 = Annotated[int, msgspec.Meta(ge=INT_MIN, le=INT_MAX)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]


class TelemetryLine(msgspec.Struct, kw_only=True):
    """The fields of a telemetry record that the agent reads, typed; any other field is kept untyped."""

    type: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    ts: float | None = None
    rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)] | None = None
    step: Int64 | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    queue_depth: float | None = None
    mem_peak_gib: float | None = None
    tau: float | None = None
    compute_s: float | None = None
    wait_s: float | None = None
    pid: Int64 | None = None
    world_size: Int64 | None = None
    params_total: Int64 | None = None
    params_trainable: Int64 | None = None
    dataset_samples: Int64 | None = None
    dataset_tokens: Int64 | None = None
    final_step: Int64 | None = None
    role: Text | None = None
    device: Text | None = None
    gpu_uuid: Text | None = None
    start: Text | None = None
    config_hash: Text | None = None
    message: str | None = None


class TelemetryRejection(msgspec.Struct, frozen=True, kw_only=True):
    """One telemetry line the reader refused, and why."""

    line: int  # 1-based line number in the file
    offset: int  # byte offset where the line starts
    reason: str

    def describe(self) -> str:
        """``telemetry line 812 rejected: nesting deeper than 64``."""
        return f"telemetry line {self.line} rejected: {self.reason}"


class LineRejected(ValueError):
    """A telemetry line outside the limits; the message is the reason."""


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_ANY = msgspec.json.Decoder()


def _depth(raw: bytes) -> int:
    """How deep arrays and objects nest in ``raw`` (brackets inside strings do not count)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0  # the common case: too few brackets to nest that deep
    depth = deepest = 0
    for ch in _NOT_BRACKET.sub(b"", _STRING.sub(b'""', raw)):
        if ch in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _walk(value: Any, path: str = "$") -> None:
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, bool) or v is None or isinstance(v, (str, float)):
            continue
        if isinstance(v, int):
            if not INT_MIN <= v <= INT_MAX:
                raise LineRejected(f"integer at {p} out of range (more than 64 bits: SQLite cannot store it)")
        elif isinstance(v, dict):
            stack.extend((x, f"{p}.{k}"[:200]) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))


def decode_line(raw: bytes) -> tuple[dict[str, Any], TelemetryLine]:
    """One telemetry line as (the record as written, its typed fields); :class:`LineRejected` says why not."""
    obj = decode_object(raw)
    try:
        typed = msgspec.convert(obj, TelemetryLine)
    except msgspec.ValidationError as exc:
        raise LineRejected(f"field {exc}") from None
    return obj, typed


def decode_object(raw: bytes) -> dict[str, Any]:
    """A JSON object a run wrote (a telemetry line, an exit record), within the same limits; LineRejected if not."""
    if len(raw) > MAX_LINE:
        raise LineRejected(f"longer than {MAX_LINE} bytes")
    if _depth(raw) > MAX_DEPTH:
        raise LineRejected(f"nesting deeper than {MAX_DEPTH}")
    try:
        obj = _ANY.decode(raw)
    except msgspec.ValidationError as exc:  # a number literal past what a float or a 64-bit int holds
        raise LineRejected(f"number out of range ({exc})") from None
    except msgspec.DecodeError as exc:
        raise LineRejected(f"not valid UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise LineRejected(f"not a JSON object (a {type(obj).__name__})")
    _walk(obj)
    return obj


def _open_regular(path: Path) -> int:
    """A read-only fd for ``path`` if it is a regular file reached without following a link (else OSError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link (not followed)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


class TelemetryTail:
    """Follows one run's telemetry.jsonl and folds it into a RunTelemetry."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self.offset = offset  # file offset just past the last complete line read
        self.summary = RunTelemetry()
        self.rejected = 0  # every line refused so far (also summary.bad_lines)
        self._pending: list[TelemetryRejection] = []
        self._line = 0 if offset == 0 else -1  # lines before offset; -1: not counted yet
        self._skipping = False  # inside a line longer than MAX_LINE: drop bytes up to its newline
        self._skip_start = (0, 0)
        self._file_refused = False
        self._periods: list[float] = []  # seconds per step between the recent new steps

    def take_rejections(self) -> list[TelemetryRejection]:
        """The lines refused since the last call (at most MAX_REJECTIONS_KEPT; ``rejected`` counts all)."""
        out, self._pending = self._pending, []
        return out

    def _reject(self, line: int, offset: int, reason: str) -> None:
        self.rejected += 1
        self.summary.bad_lines += 1
        if len(self._pending) < MAX_REJECTIONS_KEPT:
            self._pending.append(TelemetryRejection(line=line, offset=offset, reason=reason))

    def _count_lines_before(self, fd: int) -> None:
        n, pos = 0, 0
        while pos < self.offset:
            chunk = os.pread(fd, min(1 << 20, self.offset - pos), pos)
            if not chunk:
                break
            n += chunk.count(b"\n")
            pos += len(chunk)
        self._line = n

    def poll(self, final: bool = False) -> list[tuple[dict, int]]:
        """New complete records since the last poll, each with the file offset just past it.

        ``final``: the run has ended; a last line without a newline is read as it is.
        """
        try:
            fd = _open_regular(self.path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            if not self._file_refused:  # said once, not every tick
                self._file_refused = True
                self._reject(max(self._line, 0) + 1, self.offset, f"the file cannot be read as a regular file ({exc.strerror or exc})")
            return []
        self._file_refused = False
        try:
            size = os.fstat(fd).st_size
            if size < self.offset:  # truncated or replaced: start over
                self.offset, self._line, self._skipping = 0, 0, False
            if self._line < 0:
                self._count_lines_before(fd)
            if size == self.offset:
                return []
            data = os.pread(fd, MAX_READ, self.offset)
        except OSError:
            return []
        finally:
            os.close(fd)
        return list(self._take(data, final))

    def _take(self, data: bytes, final: bool) -> Iterator[tuple[dict, int]]:
        pos = self.offset
        view = memoryview(data)
        start = 0
        while start < len(data):
            nl = data.find(b"\n", start)
            if nl < 0:
                rest = len(data) - start
                if self._skipping:
                    pos += rest
                elif rest > MAX_LINE:
                    self._line += 1
                    self._skipping, self._skip_start = True, (self._line, pos)
                    pos += rest
                elif final:
                    self._line += 1
                    rec = self._accept(bytes(view[start:]), pos)
                    pos += rest
                    if rec is not None:
                        yield rec[0], pos
                self.offset = pos  # a torn last line (not final) waits for its newline
                if self._skipping and final:
                    self._skipping = False
                    self._reject(*self._skip_start, f"longer than {MAX_LINE} bytes")
                return
            raw = view[start:nl]
            line_start = pos
            pos += len(raw) + 1
            start = nl + 1
            if self._skipping:  # the end of an over-long line
                self._skipping = False
                self._reject(*self._skip_start, f"longer than {MAX_LINE} bytes")
                self.offset = pos
                continue
            self._line += 1
            self.offset = pos
            if not bytes(raw).strip():
                continue
            rec = self._accept(bytes(raw), line_start)
            if rec is not None:
                yield rec[0], pos

    def _accept(self, raw: bytes, line_start: int) -> tuple[dict, TelemetryLine] | None:
        try:
            obj, typed = decode_line(raw)
        except LineRejected as exc:
            self._reject(self._line, line_start, str(exc))
            return None
        rank = typed.rank or 0
        if str(rank) not in self.summary.ranks and len(self.summary.ranks) >= MAX_RANKS:
            self._reject(self._line, line_start, f"rank {rank}: more than {MAX_RANKS} ranks in one run")
            return None
        self._fold(obj)
        return obj, typed

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
            r.host = _str(rec.get("host"))
            r.stack_signal = _str(rec.get("stack_signal"))
            r.flight_recorder = _str(rec.get("flight_recorder"))
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
                compute, wait = _num(rec.get("compute_s")), _num(rec.get("wait_s"))
                if compute is not None and compute >= 0:
                    r.compute_recent = (r.compute_recent + [compute])[-STEP_WINDOW:]
                    r.wait_recent = (r.wait_recent + [wait if wait is not None and wait >= 0 else 0.0])[-STEP_WINDOW:]
                if ts is not None and (s.step is None or step > s.step):
                    if s.step is not None and s.last_step_ts is not None and ts > s.last_step_ts:
                        self._periods = (self._periods + [(ts - s.last_step_ts) / (step - s.step)])[-STEP_WINDOW:]
                        s.step_period_s = round(statistics.median(self._periods), 4)
                    s.last_step_ts = ts
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
        fh = os.fdopen(_open_regular(path), "rb")
    except OSError:
        return [], [], [], [], 0
    with fh:
        for raw in fh:
            if b'"step"' not in raw:
                continue
            try:
                rec, _typed = decode_line(raw.rstrip(b"\n"))
            except LineRejected:
                continue
            if rec.get("type") != "step" or not isinstance(rec.get("step"), int):
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
