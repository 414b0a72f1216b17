"""Provides the host snapshot: GPUs with every process attributed to a run, or not.

Attribution of a GPU process: ``RUN`` (a member of a live run), ``STALE`` (it
carries the tag of a run that has ended: an orphan or leftover worker),
``FOREIGN`` (no gpudeck run), ``NO_SUCH_PROCESS`` (NVML reports the pid, the
OS cannot see it: another container's process, or one the driver still holds).
Memory no listed process explains is in ``Snapshot.unaccounted`` per GPU, with
whether it counts as a holder and where to look
(:mod:`gpudeck.agents.safety.unaccounted`); ``Snapshot.namespace`` says which
PID namespace the agent sees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from gpudeck.agents.observe import namespace as pid_namespace
from gpudeck.agents.observe.gpus import GpuSource
from gpudeck.agents.observe.procs import CT_TOLERANCE, ProcTable, StaticFacts, read_stat
from gpudeck.agents.runs.supervisor import Supervisor
from gpudeck.agents.safety import unaccounted
from gpudeck.agents.wire.protocol import SNAPSHOT_MAX_AGE_S, GpuProcess, ProcInfo, Snapshot, encode, encode_safe


class SnapshotBuilder:
    """Builds snapshots from the sampler, the process table and the supervisor."""

    def __init__(self, host: str, epoch: str, gpus: GpuSource, procs: ProcTable, supervisor: Supervisor) -> None:
        self.host = host
        self.epoch = epoch
        self.gpus = gpus
        self.procs = procs
        self.supervisor = supervisor
        self.static = StaticFacts()  # user and command line, read again after an exec
        self.storage_error: str | None = None  # set by the agent while the journal cannot be written
        self.namespace = pid_namespace.current()  # read once: an agent does not change PID namespace

    def attribute(self, p: GpuProcess) -> None:
        """Fill in a GPU process's attribution, run, rank, user and command line (the supervisor's one rule)."""
        self._attribute_by_tag(p)
        # the run's group (or its recorded members) places a process whose environment lost the tag
        self.supervisor.attribution.correct(p, self.procs.lookup(p.pid) if p.attribution != "NO_SUCH_PROCESS" else None)

    def _attribute_by_tag(self, p: GpuProcess) -> None:
        entry = self.procs.lookup(p.pid)  # read now if newer than the last tick
        if entry is None:
            p.attribution = "NO_SUCH_PROCESS"
            return
        p.create_time = entry.create_time
        # status is read fresh: a zombie or a disk-sleep process holding GPU memory is what an operator must see
        st = read_stat(p.pid)
        if st is not None and abs(st.create_time - entry.create_time) > CT_TOLERANCE:
            st = None
        p.user, p.cmdline = self.static.get(p.pid, entry.create_time, st)
        p.status = st.status if st is not None else "gone"
        if entry.run_id is None:
            p.attribution = "FOREIGN"
            return
        p.run_id = entry.run_id
        p.rank = entry.rank
        state = self.supervisor.run_state(entry.run_id)
        p.attribution = "RUN" if state in ("starting", "running", "stopping") else "STALE"

    def _member_info(self, pid: int, create_time: float, run_id: str, rank: int | None, local_rank: int | None) -> ProcInfo | None:
        """A run member's process row: static parts cached, dynamic parts from one /proc read."""
        st = read_stat(pid)
        if st is None or abs(st.create_time - create_time) > CT_TOLERANCE:
            return None
        static = self.static.get(pid, create_time, st)
        return ProcInfo(
            pid=pid,
            ppid=st.ppid,
            pgid=st.pgid,
            sid=st.sid,
            user=static[0],
            create_time=create_time,
            status=st.status,
            rss=st.rss,
            cpu_seconds=round(st.cpu_seconds, 2),
            cmdline=static[1],
            run_id=run_id,
            rank=rank,
            local_rank=local_rank,
        )

    def build(self, with_processes: bool = True) -> Snapshot:
        """A snapshot now."""
        t0 = time.perf_counter()
        gpus = self.gpus.sample()
        for g in gpus:
            for p in g.processes:
                self.attribute(p)
        runs = self.supervisor.live_runs()
        procs: list[ProcInfo] = []
        if with_processes:
            for run in runs:
                for m in run.members:
                    if m.role == "shim":
                        continue
                    info = self._member_info(m.pid, m.create_time, run.id, m.rank, m.local_rank)
                    if info is not None:
                        procs.append(info)
        return Snapshot(
            host=self.host,
            ts=time.time(),
            epoch=self.epoch,
            gpus=gpus,
            gpu_error=self.gpus.error,
            simulated=self.gpus.simulated,
            storage_error=self.storage_error or self.supervisor.journal.storage_error,
            runs=runs,
            processes=procs,
            last_seq=self.supervisor.journal.committed_seq,
            sample_ms=round((time.perf_counter() - t0) * 1000, 3),
            namespace=self.namespace,
            unaccounted=unaccounted.unaccounted(gpus, self.namespace, self.gpus.simulated),
        )


_REPLY_HEAD = b'{"type":"snapshot","request_id":'
AHEAD_AGE = 0.8  # a sample made ahead is meant to be at most this share of SNAPSHOT_MAX_AGE_S old when asked for


class StateKey(NamedTuple):
    """What a snapshot showed of the agent's own state; a cached one answers only while this is unchanged."""

    events: int  # events emitted so far (every run created, changed or ended, every alert)
    last_seq: int  # the journal's committed seq (the snapshot's ``last_seq``)
    epoch: str
    storage_error: str | None
    journal_note: str | None
    live: tuple[tuple[str, str], ...]  # (run id, state) of every live run


class EncodedSnapshot:
    """One sample, encoded once, answered to any number of requests: the JSON line after the ``request_id``.

    ``key`` is what the snapshot showed of the agent's state when its sample began (:meth:`SnapshotCache.state_key`);
    ``taken`` the monotonic clock then (its age is measured from before the sample, never from after)."""

    __slots__ = ("key", "taken", "tail", "snap")

    def __init__(self, key: StateKey, taken: float, snap: Snapshot) -> None:
        self.key = key
        self.taken = taken
        snap.request_id = ""
        line = encode(snap)
        head = _REPLY_HEAD + b'""'
        # the tag and request_id lead every Snapshot line (msgspec writes the tag, then the fields in order); were
        # that ever not so, each reply is encoded whole instead (slower, never wrong)
        self.tail: bytes | None = line[len(head) :] if line.startswith(head) else None
        self.snap = snap if self.tail is None else None  # kept only for that: it holds the live runs' records

    def reply(self, request_id: str) -> bytes:
        """The line that answers ``request_id``."""
        if self.snap is not None:
            self.snap.request_id = request_id
            return encode(self.snap)
        return _REPLY_HEAD + encode_safe(request_id) + (self.tail or b"")


class SnapshotCache:
    """The agent's latest snapshot, encoded, and when it may answer a ``GetSnapshot`` instead of a new sample.

    It may while it is younger than the request's ``max_age_s`` (at most SNAPSHOT_MAX_AGE_S) and the state it showed
    is still the state: no event was emitted or committed since, the same runs are live in the same states, the
    journal's epoch and problems are the same. Anything else samples again, so a reply never shows a run's state, a
    launch, a stop or an event older than the request. Read and written on the event loop only; the samples are
    made in the agent's sampler thread (:meth:`sample`)."""

    def __init__(self, builder: SnapshotBuilder, journal_note: Callable[[], str | None]) -> None:
        self.builder = builder
        self.journal_note = journal_note
        self.events = 0  # events emitted (the registry's on_event): a change of any run's state or record
        self.latest: EncodedSnapshot | None = None
        # how clients ask (GetSnapshot): the tick samples ahead for a client that asks at a steady pace
        self.asked: float | None = None  # the monotonic time of the last request
        self.gap: float | None = None  # between the last two
        self.pending = False  # a request came since the tick last sampled ahead

    def state_key(self) -> StateKey:
        """What a snapshot shows that must never be older than the request (the rest is a sample of the host)."""
        b = self.builder
        journal = b.supervisor.journal
        return StateKey(
            events=self.events,
            last_seq=journal.committed_seq,
            epoch=b.epoch,
            storage_error=b.storage_error or journal.storage_error,
            journal_note=self.journal_note(),
            live=tuple((lr.id, lr.info.state) for lr in b.supervisor.runs.live()),
        )

    def fresh(self, max_age_s: float, key: StateKey) -> EncodedSnapshot | None:
        """The latest sample if it may answer a request with this bound now, else None."""
        c = self.latest
        if c is None or max_age_s <= 0 or c.key != key or time.monotonic() - c.taken > min(max_age_s, SNAPSHOT_MAX_AGE_S):
            return None
        return c

    def note_request(self) -> None:
        """A GetSnapshot came (what :meth:`due` predicts the next one from)."""
        now = time.monotonic()
        if self.asked is not None:
            self.gap = now - self.asked
        self.asked = now
        self.pending = True

    def due(self, warm_s: float) -> bool:
        """Whether the tick should sample ahead now, for the next GetSnapshot: a request came since it last did, the
        last two came at most ``warm_s`` apart, and the next (expected one gap after the last) would find a sample
        taken now young enough, with room to spare (else a later tick does it). So a client asking at a steady
        pace costs one sample a request, as a sample made for each request did, and each finds it ready; one
        asking faster than ticks come, one a tick; nobody asking, none."""
        if not self.pending or self.asked is None or self.gap is None or self.gap > warm_s:
            return False
        now = time.monotonic()
        next_at = self.asked + self.gap
        if next_at - now > AHEAD_AGE * SNAPSHOT_MAX_AGE_S:
            return False  # taken now, it would be too old by then: a later tick samples (ticks are closer than that)
        self.pending = False
        return True

    def keep(self, got: EncodedSnapshot) -> None:
        """Hold a new sample for the next requests (never in place of a younger one)."""
        if self.latest is None or got.taken >= self.latest.taken:
            self.latest = got

    def sample(self, key: StateKey) -> EncodedSnapshot:
        """A new sample, encoded (in the sampler thread: the build and the encode stay off the event loop)."""
        taken = time.monotonic()
        snap = self.builder.build()
        snap.journal_note = key.journal_note
        return EncodedSnapshot(key, taken, snap)
