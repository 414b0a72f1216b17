"""Provides the GPU ledger: every change in who holds each GPU's memory, journaled as ``gpu_hold`` events.

The supervision tick hands the ledger each attributed GPU sample it takes (and the
memory no visible process explains, per GPU); the ledger compares it with the
holds it has open and journals only what changed:

- a holder appears: ``start`` (a process, keyed by GPU uuid, pid and create time;
  or a GPU's unaccounted memory, a holder of its own);
- its memory moves by a step from what was last journaled: ``level``. The step is
  1 GiB or 10 % of the GPU's memory, whichever is larger; measured from the last
  record (not from fixed boundaries), so a hold that wobbles at a boundary writes
  nothing;
- its attribution changes (RUN -> STALE when its run ended and it lives on; or
  the container it runs in becomes known after its start): ``attribution``;
- it is gone from the sample: ``end``.

An unchanged sample writes nothing. Every record carries the whole hold (its id,
start, peak so far, run, rank, user, container), so one record alone answers
"who held GPU 5 at 02:14" and the history can fold each hold into one row.

Restart: the holds open in the journal are read back when the ledger is made and
settled at the first sample: one still held is ``continued`` (same id, start and
peak), one gone is ended with the evidence (its last record's time, and that the
restarted agent found it gone).

Retention (``GPUDECK_LEDGER_RETENTION_DAYS``, default 30): records older than that
are compacted: each hold keeps its start, its peak record, its end (or its latest
record while open); the rest become ``void`` events in place, so seqs stay gapless.
``GPUDECK_LEDGER=off`` turns the ledger off (the benchmark's peer; never for a fleet).
"""

from __future__ import annotations

import logging
import os
import time
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any

import msgspec

from gpudeck.agents.observe.procs import CT_TOLERANCE
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire import events as payloads
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import Container, Gpu, GpuProcess

log = logging.getLogger("gpudeck.agent")

KIND = "gpu_hold"
GIB = 2**30
LEVEL_MIN_BYTES = GIB
LEVEL_FRACTION = 0.10
LEDGER_ENV = "GPUDECK_LEDGER"  # "off": no ledger (bench/agent_sample.py's peer measurement)
RETENTION_ENV = "GPUDECK_LEDGER_RETENTION_DAYS"
DEFAULT_RETENTION_DAYS = 30.0
COMPACT_EVERY_S = 3600.0  # how often the tick asks for a compaction pass
REATTRIBUTE_S = 30.0  # an idle agent whose GPUs look unchanged attributes its sample in full at least this often
UNACCOUNTED = "UNACCOUNTED"

Item = tuple[str, str | None, dict[str, Any]]


class LedgerSettingError(AgentError):
    """A ledger setting in the environment cannot be read; the message names it and what to give."""

    code = "bad_config"


def enabled_from_env(env: dict[str, str] | None = None) -> bool:
    """Whether the ledger is on (``GPUDECK_LEDGER``: on by default; ``off`` / ``0`` / ``no`` turn it off)."""
    value = (env if env is not None else os.environ).get(LEDGER_ENV, "on").strip().lower()
    if value in ("", "on", "1", "yes"):
        return True
    if value in ("off", "0", "no"):
        return False
    raise LedgerSettingError(f"{LEDGER_ENV}={value!r} is neither on nor off")


def retention_from_env(env: dict[str, str] | None = None) -> float:
    """The retention in seconds from ``GPUDECK_LEDGER_RETENTION_DAYS`` (a positive number of days, default 30)."""
    text = (env if env is not None else os.environ).get(RETENTION_ENV, "").strip()
    if not text:
        return DEFAULT_RETENTION_DAYS * 86400
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days > 0 or days > 36500:
        raise LedgerSettingError(f"{RETENTION_ENV}={text!r} is not a number of days between 0 and 36500 (e.g. 30, or 0.5)")
    return days * 86400


def level_step(total_bytes: int) -> int:
    """The change that makes a ``level`` record: 1 GiB or 10 % of the GPU's memory, whichever is larger."""
    return max(LEVEL_MIN_BYTES, int(total_bytes * LEVEL_FRACTION))


def container_of(p: GpuProcess) -> Container | None:
    """The container a GPU process runs in, as its attribution found it (agents/safety/attribution.py reads it once per
    process from the table entry); None outside any container, or from a record that does not carry one."""
    value = getattr(p, "container", None)
    return value if isinstance(value, Container) else None


@dataclass
class Hold:
    """One open hold: a holder on one GPU, as last journaled (``bytes``) and as last sampled (``now_bytes``)."""

    id: str
    key: tuple
    gpu: int
    uuid: str
    attribution: str
    started: float
    pid: int | None = None
    create_time: float | None = None
    user: str | None = None
    container: Container | None = None
    run: str | None = None
    rank: int | None = None
    bytes: int | None = None  # as last journaled
    peak: int | None = None
    now_bytes: int | None = None  # as last sampled
    last_record: float = 0.0

    def record(self, change: str, **extra: Any) -> Item:
        """The journal item for one change of this hold (the hold's run in the event's run column)."""
        data: dict[str, Any] = {
            "change": change,
            "hold": self.id,
            "gpu": self.gpu,
            "uuid": self.uuid,
            "attribution": self.attribution,
            "started": self.started,
        }
        for k in ("pid", "create_time", "user", "run", "rank"):
            v = getattr(self, k)
            if v is not None:
                data[k] = v
        if self.container is not None:
            data["container"] = msgspec.to_builtins(self.container)
        if self.now_bytes is not None:
            data["bytes"] = self.now_bytes
        if self.peak is not None:
            data["peak"] = self.peak
        data.update({k: v for k, v in extra.items() if v is not None})
        return (KIND, self.run, data)


def _key_of_process(g: Gpu, p: GpuProcess) -> tuple:
    ct = round(p.create_time, 2) if p.create_time is not None else None
    return (g.uuid or str(g.index), p.pid, ct)


def _key_of_unaccounted(g: Gpu) -> tuple:
    return (g.uuid or str(g.index), UNACCOUNTED)


def _hold_from_record(data: dict[str, Any], ts: float) -> Hold | None:
    """An open hold as its latest record says (restart), or None for a record that does not read as one."""
    try:
        p = payloads.validate(KIND, data)
    except payloads.BadEvent:
        return None
    assert isinstance(p, payloads.GpuHold)
    ident = p.uuid or str(p.gpu)
    key: tuple = (ident, UNACCOUNTED) if p.attribution == UNACCOUNTED else (ident, p.pid, p.create_time)
    return Hold(
        id=p.hold,
        key=key,
        gpu=p.gpu,
        uuid=p.uuid,
        attribution=p.attribution,
        started=p.started,
        pid=p.pid,
        create_time=p.create_time,
        user=p.user,
        container=p.container,
        run=p.run,
        rank=p.rank,
        bytes=p.bytes,
        peak=p.peak,
        now_bytes=p.bytes,
        last_record=ts,
    )


class Ledger:
    """The open holds of this host's GPUs and the journal records of their changes (see the module doc)."""

    def __init__(
        self,
        journal: Journal,
        enabled: bool = True,
        retention_s: float = DEFAULT_RETENTION_DAYS * 86400,
    ) -> None:
        self.journal = journal
        self.enabled = enabled
        self.retention_s = retention_s
        self.holds: dict[tuple, Hold] = {}
        self.records = 0  # records journaled by this ledger (tests, the benchmark)
        self.compacted = 0  # records voided by compaction
        self._restored: dict[tuple, Hold] | None = None  # open in the journal at start, settled at the first sample
        self._compacted_at = 0.0
        self.sampled_at = 0.0  # monotonic time of the last sample the ledger was given
        self._quiet_mark: tuple | None = None  # the raw sample an idle agent last attributed (see unchanged())
        self._quiet_since = 0.0
        if enabled:
            self._restored = self._read_open()

    @classmethod
    def from_env(cls, journal: Journal) -> Ledger:
        """A ledger set up from the environment (``GPUDECK_LEDGER``, ``GPUDECK_LEDGER_RETENTION_DAYS``)."""
        return cls(journal, enabled=enabled_from_env(), retention_s=retention_from_env())

    def _read_open(self) -> dict[tuple, Hold]:
        """The holds whose latest record in the journal is not an end."""
        latest: dict[str, tuple[float, dict[str, Any]]] = {}
        for ev in self.journal.events_of_kind(KIND):
            hold = ev.data.get("hold")
            if isinstance(hold, str):
                latest[hold] = (ev.ts, ev.data)
        out: dict[tuple, Hold] = {}
        for ts, data in latest.values():
            if data.get("change") == "end":
                continue
            h = _hold_from_record(data, ts)
            if h is not None:
                out[h.key] = h
        return out

    # ------------------------------------------------------------------ one sample

    def due(self, every_s: float) -> bool:
        """Whether an idle agent should sample for the ledger now (its last sample is ``every_s`` old)."""
        return self.enabled and time.monotonic() - self.sampled_at >= every_s

    def unchanged(self, raw: list[Gpu], remember: bool = True) -> bool:
        """Whether an idle agent's raw (unattributed) sample is the one it last attributed: the same processes holding
        the same bytes on the same GPUs (then nothing can have changed for the ledger: attribution changes only when a
        run ends, and a tick with a live run always attributes). Attributed anyway every REATTRIBUTE_S. ``remember``: a
        sample that differs is the one the caller attributes next (False: a look only, at someone else's sample)."""
        mark = tuple((g.index, g.memory_used, tuple((p.pid, p.used_bytes) for p in g.processes)) for g in raw)
        now = time.monotonic()
        if mark == self._quiet_mark and now - self._quiet_since < REATTRIBUTE_S:
            self.sampled_at = now
            return True
        if remember:
            self._quiet_mark, self._quiet_since = mark, now
        return False

    def observe(self, gpus: list[Gpu], unaccounted: dict[int, int], now: float | None = None, idle: bool = False) -> list[Item]:
        """Compare one attributed sample with the open holds; journal and return what changed (nothing if nothing did).

        ``unaccounted``: GPU index -> bytes no visible process explains, for GPUs where that counts as a holder."""
        if not self.enabled:
            return []
        now = time.time() if now is None else now
        self.sampled_at = time.monotonic()
        if not idle:
            self._quiet_mark = None  # a tick with runs: the next idle sample is attributed in full
        items: list[Item] = []
        seen: set[tuple] = set()
        for g in gpus:
            step = level_step(g.memory_total)
            for p in g.processes:
                key = _key_of_process(g, p)
                seen.add(key)
                self._one(items, key, g, step, p.used_bytes, now, p)
            held = unaccounted.get(g.index)
            if held:
                key = _key_of_unaccounted(g)
                seen.add(key)
                self._one(items, key, g, step, held, now, None)
        if self._restored is not None:
            self._settle_restored(items, seen, now)
        for key in [k for k in self.holds if k not in seen]:
            h = self.holds.pop(key)
            what = "the process" if h.pid is not None else "the unaccounted memory"
            items.append(h.record("end", evidence=f"{what} was no longer on GPU {h.gpu} in the agent's sample"))
        if items:
            self.journal.append_many(items)
            self.records += len(items)
        return items

    def _one(self, items: list[Item], key: tuple, g: Gpu, step: int, used: int | None, now: float, p: GpuProcess | None) -> None:
        h = self.holds.get(key)
        if h is None:
            restored = self._restored_match(key) if self._restored is not None else None
            if restored is not None:
                h = restored
                h.now_bytes = used
                h.peak = max(h.peak or 0, used or 0) or h.peak
                self._fill(h, p)
                self.holds[key] = h
                items.append(h.record("continued", evidence=f"the restarted agent found it still holding GPU {g.index}"))
                h.bytes, h.last_record = used, now
                return
            h = Hold(
                id=uuidlib.uuid4().hex[:16],
                key=key,
                gpu=g.index,
                uuid=g.uuid,
                attribution=UNACCOUNTED if p is None else p.attribution,
                started=now,
                now_bytes=used,
                peak=used,
            )
            self._fill(h, p)
            self.holds[key] = h
            items.append(h.record("start"))
            h.bytes, h.last_record = used, now
            return
        h.now_bytes = used
        if used is not None and (h.peak is None or used > h.peak):
            h.peak = used
        attribution = UNACCOUNTED if p is None else p.attribution
        container = container_of(p) if p is not None else None
        if attribution != h.attribution or (container is not None and container != h.container):
            # RUN became STALE, or the container it runs in became known after its start (a process that held memory
            # before its runtime placed it): an attribution record, which readers of every version fold
            h.attribution = attribution
            self._fill(h, p)
            items.append(h.record("attribution"))
            h.bytes, h.last_record = used, now
        elif used is not None and abs(used - (h.bytes or 0)) >= step:
            items.append(h.record("level"))
            h.bytes, h.last_record = used, now

    def _restored_match(self, key: tuple) -> Hold | None:
        """The hold open at start that this key continues: the same GPU and pid, a create time within psutil's tick."""
        assert self._restored is not None
        found = self._restored.pop(key, None)
        if found is not None or len(key) != 3 or key[2] is None:
            return found
        for k in list(self._restored):
            if len(k) == 3 and k[:2] == key[:2] and k[2] is not None and abs(k[2] - key[2]) <= CT_TOLERANCE:
                found = self._restored.pop(k)
                found.key = key
                return found
        return None

    def _fill(self, h: Hold, p: GpuProcess | None) -> None:
        if p is None:
            return
        h.pid, h.create_time = p.pid, (round(p.create_time, 2) if p.create_time is not None else None)
        h.user = p.user or h.user
        h.container = container_of(p) or h.container
        h.run = p.run_id or h.run
        h.rank = p.rank if p.rank is not None else h.rank

    def _settle_restored(self, items: list[Item], seen: set[tuple], now: float) -> None:
        """Holds open in the journal at start that this first sample does not show: ended, with what is known."""
        assert self._restored is not None
        for h in self._restored.values():
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h.last_record))
            items.append(
                h.record(
                    "end",
                    evidence=(
                        f"the agent restarted and its first sample no longer showed this hold on GPU {h.gpu}: it ended "
                        f"between its last record ({when}) and now"
                    ),
                    last_seen=h.last_record,
                )
            )
        self._restored = None

    # ------------------------------------------------------------------ retention

    def compact_due(self, now: float | None = None) -> bool:
        """Whether a compaction pass is due (hourly; the tick runs it in its thread)."""
        now = time.time() if now is None else now
        return self.enabled and now - self._compacted_at >= COMPACT_EVERY_S

    def compact(self, now: float | None = None) -> int:
        """Void the records older than the retention that are none of their hold's start, peak, end or latest record;
        how many were voided."""
        now = time.time() if now is None else now
        self._compacted_at = now
        cutoff = now - self.retention_s
        old = self.journal.events_of_kind(KIND, before_ts=cutoff)
        if not old:
            return 0
        by_hold: dict[str, list[tuple[int, float, dict[str, Any]]]] = {}
        for ev in old:
            by_hold.setdefault(str(ev.data.get("hold")), []).append((ev.seq, ev.ts, ev.data))
        # a hold's newer records (past the cutoff) decide which old one is its latest, and which holds its peak
        newer: dict[str, list[tuple[int, float, dict[str, Any]]]] = {}
        first_old = old[0].seq
        for ev in self.journal.events_of_kind(KIND, after_seq=first_old):
            if ev.ts >= cutoff and str(ev.data.get("hold")) in by_hold:
                newer.setdefault(str(ev.data.get("hold")), []).append((ev.seq, ev.ts, ev.data))
        drop: list[int] = []
        for hold, recs in by_hold.items():
            every = recs + newer.get(hold, [])
            keep = {every[-1][0]}  # the latest (the end, or where an open hold stands)
            keep.update(seq for seq, _ts, d in every if d.get("change") in ("start", "end"))
            peak_rec = max(every, key=lambda r: (r[2].get("bytes") or 0, -r[0]))
            keep.add(peak_rec[0])
            drop.extend(seq for seq, _ts, _d in recs if seq not in keep)
        if drop:
            days = self.retention_s / 86400
            self.journal.void_events(drop, f"compacted: a GPU ledger record older than the retention ({days:g} days)")
            self.compacted += len(drop)
            log.info("GPU ledger: %d record(s) past the retention compacted", len(drop))
        return len(drop)
