"""Provides the Fleet: the one API the CLI and the console use to reach host agents.

Each host has a :class:`HostLink` that keeps one long-lived connection — the
local agent's Unix socket for ``local``, ``gpudeck agent dial`` over SSH for
every other host — follows the agent's snapshot stream, reconnects with
exponential backoff and full jitter, and exposes a visible state
(connecting, up, unreachable since ..., version mismatch). One slow or dead
host never delays another: every link is its own task and every request has
a deadline.

When the Fleet has a :class:`~gpudeck.console.history.replica.History`, each link also pulls
its agent's journal into it, from the last ``(epoch, seq)`` the history holds,
so runs that started and ended while the console was away are recorded too.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpudeck.agents.wire.client import AgentClient
from gpudeck.agents.wire.errors import AgentError, AgentUnavailable, VersionMismatch
from gpudeck.agents.wire.protocol import (
    EnvFingerprint,
    Error,
    Event,
    EventBatch,
    Fingerprint,
    FingerprintReply,
    GetEvents,
    GetMetrics,
    GetRun,
    GetSnapshot,
    Launch,
    LaunchReply,
    LaunchSpec,
    LeftoverList,
    ListLeftovers,
    ListRuns,
    Metrics,
    NamespaceInfo,
    OutputChunk,
    Preflight,
    PreflightReply,
    PreflightResult,
    ReadOutput,
    RebuildEnv,
    Reclaim,
    Reply,
    RunInfo,
    RunList,
    RunReply,
    Snapshot,
    Stop,
    StopReply,
    StopResult,
    TriageReply,
    TriageRun,
    VerifyReply,
    VerifyRun,
    WatchSnapshots,
)
from gpudeck.console.core import config as cfg
from gpudeck.console.core.records import HostStatus, LinkState, SyncResult
from gpudeck.console.fleet.ssh_options import HostKeyError, SshOptions
from gpudeck.console.history.replica import History, HistoryError

if TYPE_CHECKING:
    from gpudeck.console.fleet.transport import SshLink

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
REQUEST_TIMEOUT_S = 60.0  # a request with no answer by then fails (a stop waits its grace on top)
STALL_FACTOR = 5.0  # no snapshot for this many intervals (at least STALL_MIN_S): the link is dead
STALL_MIN_S = 10.0
EVENT_BATCH = 5000
# A caught-up event pull waits this long for the next event (it answers at once when one comes). Long, because
# liveness is the snapshot stream's job (a stall drops the link, which ends the pull): an idle host's pull
# coming back empty is pure cost, a request and a reply per host every EVENT_POLL_S (the agent caps it at 300 s).
EVENT_POLL_S = 300.0
# Hosts pulling a backlog (a batch came back full) at once, fleet-wide. A console started after a night away would
# otherwise hold every host's 5,000-event batch in memory together and decode them all on the event loop while the
# fleet's connections are still being made (issue 33: at 256 hosts with 12 h of journal each, 776 MiB and 45 s until
# every host was shown). A caught-up host's long poll never waits for this. 16, not 8 (bench/RESULTS.md 33-sync, 1,024
# SIMULATED hosts with 12 h of journal, the console on a CPU of its own): the sync 36,787 -> 44,615 events/s, every host
# shown in 6.1 s rather than 5.8, console RSS 301 -> 318 MiB; 32 gave 46,140 events/s for 361 MiB and 7.3 s.
CATCH_UP_AT_ONCE = 16
# Hosts whose snapshots share one phase of the interval. Every agent sends on the wall clock's grid, so a fleet's
# snapshots arrive together, and the console's event loop reads them all in one turn: at 1,024 hosts a key press
# waited behind a thousand SSH reads and decodes (bench/RESULTS.md 35-phase). A fleet bigger than this is spread over
# ceil(hosts / SNAPSHOT_GROUP) phases, evenly over the interval; a smaller one keeps one picture taken at one instant.
SNAPSHOT_GROUP = 128
REFUSED_STATES = ("host_key", "version_mismatch")


FDS_BESIDE_HOSTS = 256  # descriptors the console needs besides one per host: history, terminal, its own files


def room_for_hosts(hosts: int) -> None:
    """Raise the soft RLIMIT_NOFILE towards the hard limit when one descriptor per host would not fit (the agent does the
    same): a login's soft limit is often 1,024, which a fleet of about 1,000 hosts fills (issue 33, docs/scale.md)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hosts + FDS_BESIDE_HOSTS
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(hard, max(want, min(hard, 65536)))
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            pass  # the connections past the limit will say "Too many open files"


class _Writing:
    """One host's batch on its way into the history (the writer thread), told to the link once written."""

    def __init__(self, link: HostLink, epoch: str, events: list[Event]) -> None:
        assert link.history is not None
        self.link, self.events = link, events
        self.future = asyncio.wrap_future(link.history.submit(link.name, epoch, events))

    async def done(self, result: SyncResult) -> None:
        """Wait for the write (raises what the history raised), then tell the policies and listeners."""
        # shielded: a link cancelled while it waits leaves the write going, and tell_when_written tells it
        n = await asyncio.shield(self.future)
        self.link.batch_written(self.events, n, result)

    def tell_when_written(self, result: SyncResult) -> None:
        """The link stopped waiting (it ended, or it failed): a write that succeeds is still told, once."""

        def told(fut: asyncio.Future) -> None:
            if not fut.cancelled() and fut.exception() is None:
                self.link.batch_written(self.events, fut.result(), result)

        if self.future.done():
            told(self.future)
        else:
            self.future.add_done_callback(told)


class FleetWatcher(Protocol):
    """What follows a watching fleet: each host's new journal events and each link-state change (console/ops/rank_death.py)."""

    def on_events(self, host: str, events: list[Event]) -> None:
        """New journal events from ``host``, in order."""

    def on_link_state(self, st: HostStatus) -> None:
        """A host's link changed state."""


class HostLink:
    """One host: a connection to its agent, kept up, with its latest snapshot."""

    def __init__(
        self,
        settings: cfg.HostSettings,
        *,
        ssh: SshOptions | None = None,
        state_dir: Path | None = None,
        interval_s: float = 1.0,
        watch: bool = True,
        history: History | None = None,
        meanwhile: Callable[[], object] | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.is_local = settings.name == cfg.LOCAL
        self.status = HostStatus(self.name, transport="unix" if self.is_local else "ssh")
        self.interval_s = interval_s
        self.watch = watch  # False: connect for requests only (the CLI), no snapshot stream
        self.history = history
        self._meanwhile = meanwhile  # called while an SSH connect waits for the far side to start (connect_ssh)
        self._ssh = ssh or SshOptions()
        self._state_dir = state_dir
        self._client: AgentClient | None = None
        self._ssh_link: SshLink | None = None
        self._ready = asyncio.Event()
        self._refused = (
            asyncio.Event()
        )  # client() stops waiting: a refusal retrying will not fix (host key, version), or, for a request-only link, a failed attempt
        self._task: asyncio.Task | None = None
        self._sync_task: asyncio.Task | None = None
        self._pending_task: asyncio.Task | None = None
        self._listeners: list[Callable[[HostStatus], None]] = []
        self._sync_listeners: list[Callable[[str, int], None]] = []
        self.on_events: Callable[[str, list], None] | None = None  # the Fleet's multi-node watch
        self.catch_up: asyncio.Semaphore | None = None  # the Fleet's bound on hosts pulling a backlog at once
        self.phase_s = 0.0  # where in each interval this host's snapshots go out (the Fleet spreads a big fleet)

    def subscribe(self, fn: Callable[[HostStatus], None]) -> None:
        """Call ``fn`` on every state change and snapshot."""
        self._listeners.append(fn)

    def on_synced(self, fn: Callable[[str, int], None]) -> None:
        """Call ``fn(host, new_events)`` after each batch of events reaches the history."""
        self._sync_listeners.append(fn)

    def _notify(self) -> None:
        for fn in self._listeners:
            fn(self.status)

    def _set_state(self, state: LinkState, error: str | None = None) -> None:
        if state != self.status.state:
            self.status.since = time.time()
        if state == "up":
            self.status.down_since = None
        elif state != "connecting" and self.status.down_since is None:
            self.status.down_since = self.status.since
        self.status.state = state
        self.status.error = error
        if state in REFUSED_STATES or (state == "unreachable" and not self.watch):
            # a request-only link (the CLI) says at once what the first attempt met, rather than retry for 15 s
            self._refused.set()
        elif state == "up":
            self._refused.clear()
        self._notify()

    async def _connect(self) -> AgentClient:
        if self.is_local:
            return await AgentClient.connect_unix(state_dir=self._state_dir, autostart=True, alias=self.name)
        from gpudeck.console.fleet.transport import connect_ssh  # asyncssh comes with it: only a remote host needs it

        link = await connect_ssh(self.name, self.settings.command, self._ssh, meanwhile=self._meanwhile)
        self._ssh_link = link
        return link.client

    def start(self) -> None:
        """Start keeping the link up (idempotent)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        """Stop the link."""
        for t in (self._sync_task, self._pending_task, self._task):
            if t is not None:
                t.cancel()
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
        await self._drop()

    async def _drop(self) -> None:
        self._ready.clear()
        if self._sync_task is not None:
            self._sync_task.cancel()
            self._sync_task = None
        client, link = self._client, self._ssh_link
        self._client = self._ssh_link = None
        if link is not None:
            await link.close()
        elif client is not None:
            await client.close()

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            self._set_state("connecting", self.status.error)
            try:
                client = await self._connect()
                self._client = client
                hello = client.hello
                self.status.agent_version = hello.agent_version if hello else None
                self.status.epoch = hello.epoch if hello else None
                self.status.connects += 1
                self._ready.set()
                backoff = BACKOFF_MIN_S
                if self.history is not None and self.watch:
                    self._sync_task = asyncio.ensure_future(self._follow_events(client))
                if self.history is not None:
                    self._pending_task = asyncio.ensure_future(self._apply_pending_stops(client))
                if not self.watch:
                    self._set_state("up")
                    await client.closed.wait()
                    raise AgentUnavailable(f"the agent connection closed ({client.close_reason})")
                await self._watch(client)
            except asyncio.CancelledError:
                raise
            except VersionMismatch as exc:
                await self._drop()
                self._set_state("version_mismatch", exc.message)
                await asyncio.sleep(BACKOFF_MAX_S)
                continue
            except HostKeyError as exc:
                await self._drop()
                self._set_state("host_key", exc.message)
                await asyncio.sleep(BACKOFF_MAX_S)  # a refused key is not retried fast: it will not fix itself
                continue
            except (AgentError, OSError) as exc:
                msg = exc.message if isinstance(exc, AgentError) else str(exc)
                await self._drop()
                self._set_state("unreachable", msg)
            except Exception as exc:  # a library's error nobody foresaw: this host is retried like any other failure,
                # never left down for good by a task that ended with the exception unseen
                await self._drop()
                self._set_state("unreachable", f"{type(exc).__name__}: {exc}")
            if self.history is not None:
                await self._note_state()
            # exponential backoff with full jitter, so a fleet does not reconnect in lockstep
            await asyncio.sleep(random.uniform(backoff / 2, backoff))
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _note_state(self) -> None:
        """Record the link's state in the history, best effort: the history may be busy past its timeout (a writer
        committing a backlog, another process holding the file), and a failed note must not end the reconnect loop
        (issue 33: a restarting host's link never came back because this raised "database is locked" there)."""
        assert self.history is not None
        try:
            await asyncio.to_thread(self.history.note_host, self.name, self.status.state, self.status.error)
        except (sqlite3.Error, HistoryError, OSError) as exc:  # the state is on the link itself; the next change records it again
            log.debug("%s: the history did not take the link's state (%s): %s", self.name, self.status.state, exc)

    async def _watch(self, client: AgentClient) -> None:
        """Follow the snapshot stream: items arrive by callback from the reader (no task hop per snapshot); a
        check every few seconds notices a stalled link."""
        stall = max(STALL_MIN_S, STALL_FACTOR * self.interval_s)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future = loop.create_future()
        static: dict[int, tuple[str, str, int, float | None]] = {}
        namespace: list[NamespaceInfo | None] = [None]  # the agent's PID namespace, also sent once
        self.status.last_seen = time.time()

        def on_item(msg: Reply | None) -> None:
            if isinstance(msg, Snapshot):
                if msg.compact:  # refill what the agent sent once
                    for g in msg.gpus:
                        g.uuid, g.name, g.memory_total, g.power_limit_w = static.get(g.index, ("", "", 0, None))
                    msg.namespace = msg.namespace or namespace[0]
                else:
                    static.clear()
                    static.update({g.index: (g.uuid, g.name, g.memory_total, g.power_limit_w) for g in msg.gpus})
                    namespace[0] = msg.namespace
                self.status.snapshot = msg
                self.status.last_seen = time.time()
                if self.status.state != "up":
                    self._set_state("up")
                else:
                    self._notify()
            elif not ended.done():
                why = "the snapshot stream ended" if msg is not None else f"the agent connection closed ({client.close_reason})"
                if isinstance(msg, Error):
                    why = f"the agent refused the snapshot stream: {msg.message}"
                ended.set_exception(AgentUnavailable(why))

        rid = await client.watch(WatchSnapshots(interval_s=self.interval_s, compact=True, phase_s=self.phase_s), on_item)
        # while the stream runs it is the keepalive: a snapshot a second, and a stall noticed within `stall`
        # (sooner than SSH keepalives would, and it proves the agent is alive, not only sshd); asyncssh's own
        # keepalive would re-arm a timer for every packet received
        ssh_conn = self._ssh_link.conn if self._ssh_link is not None else None
        if ssh_conn is not None:
            ssh_conn.set_keepalive(0)
        period = min(stall / 2, 5.0)
        timer: asyncio.TimerHandle | None = None

        def on_grid() -> float:
            # every link's check falls on the same instants of the loop's clock, so a fleet's checks run in one
            # wake-up of the event loop each period instead of one each, spread across it
            return (loop.time() // period + 1) * period

        def check() -> None:  # a timer, not a task waking up: hundreds of hosts make it add up
            nonlocal timer
            quiet = time.time() - (self.status.last_seen or 0)
            if quiet > stall:
                if not ended.done():
                    ended.set_exception(AgentUnavailable(f"no snapshot for {quiet:.0f} s: the link is stalled or the host is down"))
            else:
                timer = loop.call_at(on_grid(), check)

        timer = loop.call_at(on_grid(), check)
        try:
            await ended  # raises why the stream ended
        finally:
            timer.cancel()
            if not ended.done():
                ended.cancel()
            if ssh_conn is not None:
                ssh_conn.set_keepalive(self._ssh.keepalive_s, self._ssh.keepalive_count)
            await client.unwatch(rid)

    async def _apply_pending_stops(self, client: AgentClient) -> None:
        """Stop what was asked to stop while this host was cut off (a node of a multi-node run, say)."""
        assert self.history is not None
        for run_id, grace in await asyncio.to_thread(self.history.pending_stops, self.name):
            try:
                await client.request(Stop(run_id=run_id, grace_s=grace), timeout=grace + REQUEST_TIMEOUT_S)
            except AgentError:
                pass  # gone already, or not known here: nothing left to stop
            except TimeoutError:
                continue  # keep it pending for the next connection
            await asyncio.to_thread(self.history.clear_pending_stop, self.name, run_id)

    # ------------------------------------------------------------------ history sync

    async def _follow_events(self, client: AgentClient) -> None:
        """Pull the journal into the history and keep following it while the link is up."""
        try:
            await self.sync_events(client, follow=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an agent error, or the history's (SQLite busy, disk full): never silently
            # the link's own loop notices a dead connection; a sync failure alone closes it so it is retried (before, a
            # history error ended this task and the host's history stopped while its snapshots went on)
            why = exc.message if isinstance(exc, AgentError) else f"{type(exc).__name__}: {exc}"
            self.status.error = f"history sync: {why}"
            if self._client is client:
                await client.close()

    async def sync_events(self, client: AgentClient, follow: bool = False) -> SyncResult:
        """Pull events after the history's cursor for this host; with ``follow`` keep going.

        One batch is pulled at a time (a long poll when caught up), and while a host is behind the next one is pulled
        while the history writes the last (at most one written, one on its way: a console that falls behind slows the
        agent's sending instead of queueing replies in memory).
        """
        assert self.history is not None
        hello = client.hello
        assert hello is not None
        cur = await asyncio.to_thread(self.history.cursor, self.name, hello.epoch, hello.agent_version, hello.host)
        result = SyncResult(host=self.name, ok=True, last_seq=cur.last_seq, epoch=hello.epoch, new_epoch=cur.new_epoch)
        after = cur.last_seq
        self.status.synced_seq = after
        # behind: more may be waiting (at first, and after a full batch): pulled without waiting, and (in a Fleet) at
        # most CATCH_UP_AT_ONCE hosts catch up at a time, each holding its place until it has caught up and what it pulled
        # is written (so at most two batches each are decoded in memory: fleet-wide, a bounded amount); caught up, a
        # follower long-polls outside the bound
        behind = True
        bound = self.catch_up
        holding = False  # this host's place among the hosts catching up
        writing: _Writing | None = None  # the batch the history is writing while the next one is pulled
        try:
            while True:
                if behind and bound is not None and not holding:
                    await bound.acquire()
                    holding = True
                if writing is not None and not behind:
                    # caught up: what was pulled is written and told before the next pull, a long poll
                    await writing.done(result)
                    writing = None
                if holding and not behind:
                    assert bound is not None
                    bound.release()
                    holding = False
                wait = 0.0 if behind or not follow else EVENT_POLL_S
                try:
                    batch = await client.request(
                        GetEvents(after_seq=after, limit=EVENT_BATCH, wait_s=wait), timeout=wait + REQUEST_TIMEOUT_S
                    )
                except TimeoutError:
                    raise AgentUnavailable(f"no answer to an event pull within {wait + REQUEST_TIMEOUT_S:.0f} s") from None
                assert isinstance(batch, EventBatch)
                if writing is not None:  # the one before, written meanwhile: its events go to the policies first
                    await writing.done(result)
                    writing = None
                events = self._follows(batch, hello.epoch, after)
                got, top = len(batch.events), batch.last_seq
                # the next pull of a caught-up host is a long poll (minutes): this batch, thousands of decoded events,
                # must not live that long in the loop's variable (issue 33: with the backlog going in faster, the
                # busy hosts that had just caught up held theirs together, +120-140 MiB of console RSS)
                del batch
                if events is None:
                    continue  # a gap: ask again from what we hold
                if events:
                    writing = _Writing(self, hello.epoch, events)
                    after = events[-1].seq
                del events
                behind = got >= EVENT_BATCH
                if not follow and (not got or after >= top):
                    if writing is not None:
                        await writing.done(result)
                        writing = None
                    return result
        finally:
            if holding:
                assert bound is not None
                bound.release()
            if writing is not None:
                writing.tell_when_written(result)  # the link ended first: the batch still lands, the policies still hear of it

    def _follows(self, batch: EventBatch, epoch: str, after: int) -> list[Event] | None:
        """The batch's events when they follow what is held; None when they do not (a gap)."""
        if batch.epoch != epoch:
            raise AgentUnavailable(f"the agent's journal epoch changed ({epoch} -> {batch.epoch}): reconnecting")
        events = batch.events
        if events and events[0].seq != after + 1:
            return None
        return events

    def batch_written(self, events: list[Event], n: int, result: SyncResult) -> None:
        """One batch is in the history: ``n`` of its events new there."""
        if self.on_events is not None and n:
            self.on_events(self.name, events)
        result.new_events += n
        result.last_seq = events[-1].seq
        self.status.synced_seq = result.last_seq
        for fn in self._sync_listeners:
            fn(self.name, n)

    async def client(self, timeout: float = 15.0) -> AgentClient:
        """The live connection; waits for it, or raises AgentError saying why the host is not reachable."""
        self.start()
        ready = asyncio.ensure_future(self._ready.wait())
        refused = asyncio.ensure_future(self._refused.wait())
        try:
            # a refusal that retrying will not fix (an unknown or changed host key, another protocol) is said at once
            await asyncio.wait([ready, refused], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            refused.cancel()
        if not self._ready.is_set():
            if self.status.state == "host_key":
                raise HostKeyError(self.status.error or f"{self.name}: the SSH host key was refused")
            if self.status.state == "version_mismatch":
                raise VersionMismatch(self.status.error or f"{self.name}: the agent speaks another protocol version")
            why = self.status.error or f"no answer within {timeout:.0f} s"
            why = why.removeprefix(f"{self.name}: ")  # the transport's messages start with the host's name too
            raise AgentUnavailable(f"host {self.name} is {self.status.state}: {why}")
        assert self._client is not None
        return self._client


class Fleet:
    """All hosts the console follows; ``local`` is always there."""

    # the policies following this fleet (console/ops/rank_death.py); an immutable default, so a fleet made without
    # __init__ (a test's or a benchmark's stand-in) has none rather than no attribute
    _watchers: tuple[FleetWatcher, ...] = ()
    _catch_up: asyncio.Semaphore | None = None

    def __init__(
        self,
        hosts: list[str] | None = None,
        *,
        config: cfg.Config | None = None,
        state_dir: Path | None = None,
        interval_s: float = 1.0,
        watch: bool = True,
        history: History | None = None,
        ssh: SshOptions | None = None,
        meanwhile: Callable[[], object] | None = None,
    ) -> None:
        """``meanwhile``: called on each SSH connect while the far side starts (see :func:`~gpudeck.console.fleet.transport.connect_ssh`)."""
        self.config = config or cfg.load(extra_hosts=hosts)
        if config is not None and hosts:
            self.config = cfg.Config(
                hosts=tuple([*config.hosts, *(cfg.HostSettings(name=h) for h in hosts if h not in config.names)]), path=config.path
            )
        self.history = history
        self._extra_hosts = list(hosts or [])  # named on the command line: kept when the config file changes
        self._link_args: dict[str, Any] = dict(
            ssh=ssh, state_dir=state_dir, interval_s=interval_s, watch=watch, history=history, meanwhile=meanwhile
        )
        self.links: dict[str, HostLink] = {s.name: HostLink(s, **self._link_args) for s in self.config.hosts}
        self._catch_up = asyncio.Semaphore(CATCH_UP_AT_ONCE)
        for link in self.links.values():
            link.catch_up = self._catch_up
        self._spread_phases()
        self._watch_tasks: set[asyncio.Task] = set()
        if history is not None and watch:
            for link in self.links.values():
                link.on_events = self._on_events
                link.subscribe(self._on_link_state)

    def start(self) -> None:
        """Connect every host."""
        room_for_hosts(len(self.links))
        for link in self.links.values():
            link.start()

    def reload_config(self) -> tuple[list[str], list[str], list[str]]:
        """Read the config file again (``gpudeck hosts add/remove`` or an edit changed it): new hosts get a link, started;
        removed ones are closed; a host whose ``[host.NAME]`` settings changed (``command =``, ``env``, ...) gets a new
        link with them at once (the old one is closed: its retry backoff would keep it down for minutes). Hosts named on
        the command line stay. Returns (added, removed, changed); raises cfg.ConfigError."""
        fresh = cfg.load(self.config.path, extra_hosts=self._extra_hosts)
        changed = [h for h in fresh.hosts if h.name in self.links and self.links[h.name].settings != h]
        added = [h for h in fresh.hosts if h.name not in self.links]
        removed = [name for name in self.links if name not in fresh.names]
        self.config = fresh
        for settings in changed:
            self.spawn(self.links.pop(settings.name).close())
        for settings in [*added, *changed]:
            link = HostLink(settings, **self._link_args)
            link.catch_up = self._catch_up
            if self.history is not None and link.watch:
                link.on_events = self._on_events
                link.subscribe(self._on_link_state)
            self.links[settings.name] = link
            link.start()
        for name in removed:
            self.spawn(self.links.pop(name).close())
        self._spread_phases()  # for the links that connect from now on
        return [h.name for h in added], removed, [h.name for h in changed]

    def _spread_phases(self) -> None:
        """Give each host its snapshot phase: the links in their order (the config's at start; hosts added or changed by
        a reload come last) dealt over ceil(hosts / SNAPSHOT_GROUP) phases, evenly over the interval (one phase, 0, for
        a fleet of SNAPSHOT_GROUP hosts or fewer). A link asks for its phase when its stream starts, so after a reload
        a running stream keeps its old phase until it reconnects: the phases spread load, and nothing depends on them."""
        phases = -(-len(self.links) // SNAPSHOT_GROUP) or 1
        for i, link in enumerate(self.links.values()):
            link.phase_s = (i % phases) * link.interval_s / phases

    # ------------------------------------------------------------------ watchers (the policies of console/ops/ that follow the fleet)

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run ``coro`` as a task the fleet keeps (a reference, so it is not collected) and cancels when it closes."""
        task = asyncio.ensure_future(coro)
        self._watch_tasks.add(task)
        task.add_done_callback(self._watch_tasks.discard)

    def add_watcher(self, watcher: FleetWatcher) -> None:
        """Tell ``watcher`` every host's new journal events and link states (only a watching fleet with a history
        follows them: a request-only fleet has nothing to tell)."""
        self._watchers = (*self._watchers, watcher)

    def _on_events(self, host: str, events: list) -> None:
        for w in self._watchers:
            w.on_events(host, events)

    def _on_link_state(self, st: HostStatus) -> None:
        for w in self._watchers:
            w.on_link_state(st)

    async def close(self) -> None:
        """Close every link."""
        for t in list(self._watch_tasks):
            t.cancel()
        await asyncio.gather(*(link.close() for link in self.links.values()), return_exceptions=True)

    def link(self, host: str) -> HostLink:
        """The link of one host, or a typed error naming the known ones."""
        try:
            return self.links[host]
        except KeyError:
            raise AgentError(
                f"unknown host {host!r}: known hosts are {', '.join(self.links)}; `gpudeck hosts add {host}` adds it"
            ) from None

    async def _request(self, host: str, msg: object, timeout: float = REQUEST_TIMEOUT_S) -> Reply:
        c = await self.link(host).client()
        try:
            return await c.request(msg, timeout=timeout)
        except TimeoutError:
            raise AgentUnavailable(f"host {host} did not answer {type(msg).__name__} within {timeout:.0f} s") from None

    async def snapshot(self, host: str) -> Snapshot:
        """A fresh snapshot of one host (not the streamed one)."""
        reply = await self._request(host, GetSnapshot())
        assert isinstance(reply, Snapshot)
        return reply

    async def launch(self, host: str, spec: LaunchSpec, request_id: str = "") -> LaunchReply:
        """Start a run on a host."""
        reply = await self._request(host, Launch(spec=spec, request_id=request_id), timeout=REQUEST_TIMEOUT_S * 5)
        assert isinstance(reply, LaunchReply)
        return reply

    async def stop(self, host: str, run_id: str, grace_s: float = 30.0, reason: str = "") -> StopResult:
        """Stop a run on a host and return the verification (``reason``: recorded as the cause, for policy stops)."""
        reply = await self._request(host, Stop(run_id=run_id, grace_s=grace_s, reason=reason), timeout=grace_s + REQUEST_TIMEOUT_S)
        assert isinstance(reply, StopReply)
        return reply.result

    async def runs(self, host: str, limit: int = 1000) -> list[RunInfo]:
        """Runs a host's agent has recorded, newest first."""
        reply = await self._request(host, ListRuns(limit=limit))
        assert isinstance(reply, RunList)
        return reply.runs

    async def run(self, host: str, run_id: str) -> RunInfo:
        """One run."""
        reply = await self._request(host, GetRun(run_id=run_id))
        assert isinstance(reply, RunReply)
        return reply.run

    async def metrics(self, host: str, run_id: str, max_points: int = 300) -> Metrics:
        """A run's step series (loss, tokens/s, MFU), thinned to ``max_points``."""
        reply = await self._request(host, GetMetrics(run_id=run_id, max_points=max_points))
        assert isinstance(reply, Metrics)
        return reply

    async def output(self, host: str, run_id: str, offset: int = 0, follow: bool = True) -> AsyncIterator[OutputChunk]:
        """A run's output from ``offset`` (negative: that many bytes before the end); with ``follow`` until the run ends."""
        c = await self.link(host).client()
        if not follow:
            reply = await c.request(ReadOutput(run_id=run_id, offset=offset), timeout=REQUEST_TIMEOUT_S)
            assert isinstance(reply, OutputChunk)
            yield reply
            return
        async for chunk in c.stream(ReadOutput(run_id=run_id, offset=offset, follow=True)):
            assert isinstance(chunk, OutputChunk)
            yield chunk

    async def preflight(self, host: str, spec: LaunchSpec) -> PreflightResult:
        """Pre-flight a spec on a host without starting anything."""
        reply = await self._request(host, Preflight(spec=spec), timeout=REQUEST_TIMEOUT_S * 3)
        assert isinstance(reply, PreflightReply)
        return reply.result

    async def leftovers(self, host: str, include_live: bool = False) -> LeftoverList:
        """What ``reclaim`` would offer on a host: orphans of ended runs, FOREIGN/zombie/D-state GPU holders, ghosts."""
        reply = await self._request(host, ListLeftovers(include_live=include_live))
        assert isinstance(reply, LeftoverList)
        return reply

    async def reclaim(self, host: str, pids: list[int], grace_s: float = 10.0, include_live: bool = False) -> StopResult:
        """Stop exactly these pids on a host (TERM, grace, KILL, verify through NVML)."""
        reply = await self._request(
            host, Reclaim(pids=pids, grace_s=grace_s, include_live=include_live), timeout=grace_s + REQUEST_TIMEOUT_S
        )
        assert isinstance(reply, StopReply)
        return reply.result

    async def fingerprint(self, host: str, python: str, env: dict[str, str] | None = None) -> EnvFingerprint:
        """A python environment on a host, fingerprinted now (``env`` on top of the agent's, as a run gets it)."""
        reply = await self._request(host, Fingerprint(python=python, env=env or {}))
        assert isinstance(reply, FingerprintReply)
        return reply.env

    async def rebuild_env(self, host: str, env: EnvFingerprint, timeout: float = 1800.0) -> FingerprintReply:
        """Recreate a recorded environment on a host; the reply's env is the new one, proven to match."""
        reply = await self._request(host, RebuildEnv(env=env), timeout=timeout)
        assert isinstance(reply, FingerprintReply)
        return reply

    async def verify(self, host: str, run_id: str) -> VerifyReply:
        """Claims vs observed for a run."""
        reply = await self._request(host, VerifyRun(run_id=run_id))
        assert isinstance(reply, VerifyReply)
        return reply

    async def triage(self, host: str, run_id: str) -> TriageReply:
        """Every rank's evidence of a live run, gathered now and stored with it (agents/health/triage.py)."""
        reply = await self._request(host, TriageRun(run_id=run_id))
        assert isinstance(reply, TriageReply)
        return reply

    async def sync_history(self, timeout: float = 20.0, hosts: list[str] | None = None) -> list[SyncResult]:
        """One pass: pull every reachable host's new events into the history (hosts in parallel)."""
        assert self.history is not None, "sync_history needs a Fleet with a History"

        async def one(name: str) -> SyncResult:
            link = self.link(name)
            try:
                c = await link.client(timeout=timeout)
                async with asyncio.timeout(timeout):
                    return await link.sync_events(c, follow=False)
            except TimeoutError:
                return SyncResult(host=name, ok=False, error=f"no answer within {timeout:.0f} s")
            except AgentError as exc:
                return SyncResult(host=name, ok=False, error=exc.message)

        return list(await asyncio.gather(*(one(h) for h in (hosts or list(self.links)))))
