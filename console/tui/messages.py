"""Provides the messages the console's thread workers post back to the UI (the live-screen protocol is console/tui/screens/base.py)."""

from __future__ import annotations

from textual.message import Message

from gpudeck.console.core.records import RunRecord


class HistoryLoaded(Message):
    """A history query finished in a thread: its rows, or the error that says how to fix the filter."""

    def __init__(self, query: str, rows: list[RunRecord], error: str | None = None, seconds: float = 0.0) -> None:
        super().__init__()
        self.query = query
        self.rows = rows
        self.error = error
        self.seconds = seconds
        self.total: int | None = None  # the runs the whole history holds, where the reader counted them (past its limit)


class RecordLoaded(Message):
    """A run's full history record (or None: the history does not hold it)."""

    def __init__(self, host: str, run_id: str, record: RunRecord | None, error: str | None = None) -> None:
        super().__init__()
        self.host = host
        self.run_id = run_id
        self.record = record
        self.error = error
