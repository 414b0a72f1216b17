"""Provides ``gpudeck status``'s views: the snapshot filter (--user, --run, --pid), the JSON shape, and the frames of
``--watch`` (redrawn in place on a terminal)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from gpudeck.agents.wire.protocol import GpuProcess, ProcInfo, RunInfo, Snapshot, to_builtins
from gpudeck.console.core.sanitize import redact_run, terminal_text
from gpudeck.console.present.formats import HostStatus, format_status, why_down


def snapshot_json(snap: Snapshot, show_secrets: bool) -> dict[str, Any]:
    """A snapshot as ``status --json`` prints it: its live runs' ``--env`` secrets redacted unless ``show_secrets``."""
    out: dict[str, Any] = to_builtins(snap)
    if not show_secrets:
        out["runs"] = [redact_run(r) for r in out.get("runs") or []]
    return out


def _matches_run(run_id: str | None, name: str | None, ref: str) -> bool:
    return bool(run_id and run_id.startswith(ref)) or (name is not None and name == ref)


@dataclass(frozen=True)
class StatusFilter:
    """``status --user U --run RUN --pid PID``: every filter given must hold; the GPUs themselves are all kept."""

    user: str | None = None
    run: str | None = None
    pid: int | None = None

    @property
    def given(self) -> bool:
        """Whether any filter was asked for."""
        return self.user is not None or self.run is not None or self.pid is not None

    def label(self) -> str:
        """``user=alice, run=r-1`` (empty with no filter)."""
        return ", ".join(f"{k}={v}" for k, v in (("user", self.user), ("run", self.run), ("pid", self.pid)) if v is not None)

    def apply(self, snap: Snapshot) -> Snapshot:
        """The snapshot with only the GPU processes and live runs that match."""
        if not self.given:
            return snap
        names = {r.id: r.name for r in snap.runs}

        def proc_ok(p: GpuProcess | ProcInfo) -> bool:
            return (
                (self.user is None or p.user == self.user)
                and (self.run is None or _matches_run(p.run_id, names.get(p.run_id or ""), self.run))
                and (self.pid is None or p.pid == self.pid)
            )

        def run_ok(r: RunInfo) -> bool:
            return (
                (self.user is None or r.spec.operator == self.user)
                and (self.run is None or _matches_run(r.id, r.name, self.run))
                and (self.pid is None or any(m.pid == self.pid for m in r.members))
            )

        gpus = [msgspec.structs.replace(g, processes=[p for p in g.processes if proc_ok(p)]) for g in snap.gpus]
        return msgspec.structs.replace(
            snap, gpus=gpus, runs=[r for r in snap.runs if run_ok(r)], processes=[p for p in snap.processes if proc_ok(p)]
        )

    def nothing_matched(self, snaps: list[Snapshot]) -> str | None:
        """When a filter was given and no live run or GPU process of the (filtered) snapshots matches it: what to say."""
        if not self.given or not snaps:
            return None
        if any(s.runs or s.processes or any(g.processes for g in s.gpus) for s in snaps):
            return None
        where = "the host" if len(snaps) == 1 else f"the {len(snaps)} hosts that answered"
        hint = " (a run that ended is in `gpudeck history`)" if self.run is not None else ""
        return f"no live run or GPU process matches {self.label()} on {where}{hint}"


def watch_frame(rows: list[HostStatus], filt: StatusFilter, interval: float, now: float | None = None) -> str:
    """One ``status --watch`` frame (rows already filtered): the header line, then each host's status."""
    label = filt.label()
    head = f"every {interval:g} s" + (f", only {label}" if label else "") + f"  {time.strftime('%H:%M:%S', time.localtime(now))}"
    body = "\n\n".join(
        format_status(r.snapshot, r.host) if r.snapshot else f"host {r.host}  UNREACHABLE: {why_down(r.host, r.error)}" for r in rows
    )
    return terminal_text(f"{head}\n{body}")


CLEAR_SCREEN = "\x1b[2J"


def redraw(frame: str) -> str:
    """A frame drawn in place on a terminal: cursor home, each line cleared to its end, the rest of the screen cleared."""
    return "\x1b[H" + "\n".join(line + "\x1b[K" for line in frame.split("\n")) + "\x1b[J"
