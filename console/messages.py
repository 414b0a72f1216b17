"""Provides the messages the console's workers post back to the UI."""

from __future__ import annotations

from textual.message import Message

from console.fleet import HostStatus


class HostUpdated(Message):
    """A host's link state or snapshot changed."""

    def __init__(self, status: HostStatus) -> None:
        super().__init__()
        self.status = status
