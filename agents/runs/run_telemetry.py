"""Provides a live run's telemetry: its new records folded into its summary, and journaled once for history."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gpudeck.agents.runs.liverun import LiveRun

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor

MAX_REJECTIONS_JOURNALED = 20  # per run: the first refused telemetry lines are journaled; later ones are only counted
STEP_EVENT_EVERY_S = 10.0  # step records reach the journal at most this often per run (all other records always) ...
# ... after the first STEP_EVENTS_ALL of them, which all do: a short run's figures (the tokens/s median over the recorded
# steps) are over every step, not over its first (warm-up) and last step alone; a long run's are a sample every 10 s
STEP_EVENTS_ALL = 100


def poll(sup: Supervisor, lr: LiveRun, *, ending: bool = False) -> None:
    """Fold new telemetry into a live run's summary; journal what history needs, exactly once.

    ``ending``: the run has ended (its last read): its last step record is journaled even within STEP_EVENT_EVERY_S of
    the one before, so the history's last step and loss are the run's, not those of up to 10 s earlier."""
    run = lr.info
    if lr.tail is None:
        last = sup.journal.last_event(run.id, "telemetry")
        lr.start_journal_at(int(last.data.get("offset", 0)) if last else 0)
    tail = lr.telemetry_tail()
    records = tail.poll(final=run.state not in ("starting", "running", "stopping"))
    run.telemetry = tail.summary
    items: list[tuple[str, str | None, dict]] = []
    for rej in tail.take_rejections():
        tail.summary.last_rejection = rej.describe()
        if lr.rejections_journaled < MAX_REJECTIONS_JOURNALED:
            lr.count_rejection_journaled()
            items.append(("telemetry_rejected", run.id, {"line": rej.line, "offset": rej.offset, "reason": rej.reason[:500]}))
    if not records and not items and not (ending and lr.held_step is not None):
        return
    floor = lr.journaled_offset
    now = time.monotonic()
    held = lr.held_step  # a step record left out: journaled before any later record (offsets stay in order) or at the end
    for rec, offset in records:
        if offset <= floor or rec.get("type") == "heartbeat":
            continue
        if rec.get("type") == "step":
            if lr.step_events >= STEP_EVENTS_ALL and now - lr.last_step_event < STEP_EVENT_EVERY_S:
                held = (rec, offset)
                continue
            lr.note_step_event(now)
            held = None
        elif held is not None:
            items.append(("telemetry", run.id, {"record": held[0], "offset": held[1]}))
            held = None
        items.append(("telemetry", run.id, {"record": rec, "offset": offset}))
    if ending and held is not None and held[1] > floor:
        items.append(("telemetry", run.id, {"record": held[0], "offset": held[1]}))
        held = None
    if items:
        for ev in sup.journal.append_many(items):
            sup.runs.emit(ev)
        offsets = [d["offset"] for kind, _r, d in items if kind == "telemetry"]
        if offsets:
            lr.note_journaled(offsets[-1])
    lr.hold_step(held)  # (not when the journal refused them: the step is still to be written)
