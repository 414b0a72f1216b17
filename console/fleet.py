"""Provides the Fleet: the one API the CLI and the console use to reach host agents.

Each host has a :class:`HostLink` that keeps one long-lived connection, follows
the agent's snapshot stream, reconnects with exponential backoff and jitter,
and exposes a visible state (connecting, up, unreachable since ..., version
mismatch). This version links the local host through the agent's Unix socket;
remote hosts (SSH) plug in behind the same API.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agents.client import AgentClient
from agents.errors import AgentError, VersionMismatch
from agents.protocol import (
    GetRun,
    Launch,
    LaunchReply,
    LaunchSpec,
    GetMetrics,
    GetSnapshot,
    ListRuns,
    Metrics,
    OutputChunk,
    ReadOutput,
    RunInfo,
    RunList,
    RunReply,
    Snapshot,
    Stop,
    StopReply,
    StopResult,
    WatchSnapshots,
)

LinkState = Literal["connecting", "up", "unreachable", "version_mismatch"]
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0


@dataclass
class HostStatus:
    """What the console shows of one host's link."""

    name: str
    state: LinkState = "connecting"
    error: str | None = None
    last_seen: float | None = None
    snapshot: Snapshot | None = None
    agent_version: str | None = None
    since: float = field(default_factory=time.time)


class HostLink:
    """One host: a connection to its agent, kept up, with its latest snapshot."""

    def __init__(self, name: str, state_dir: Path | None = None, interval_s: float = 1.0, watch: bool = True) -> None:
        self.name = name
        self.status = HostStatus(name)
        self.interval_s = interval_s
        self.watch = watch  # False: connect for requests only (the CLI), no snapshot stream
        self._state_dir = state_dir
        self._client: AgentClient | None = None
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._listeners: list[Callable[[HostStatus], None]] = []

    def subscribe(self, fn: Callable[[HostStatus], None]) -> None:
        """Call ``fn`` on every state change and snapshot."""
        self._listeners.append(fn)

    def _notify(self) -> None:
        for fn in self._listeners:
            fn(self.status)

    def _set_state(self, state: LinkState, error: str | None = None) -> None:
        if state != self.status.state:
            self.status.since = time.time()
        self.status.state = state
        self.status.error = error
        self._notify()

    async def _connect(self) -> AgentClient:
        return await AgentClient.connect_unix(state_dir=self._state_dir, autostart=True)

    def start(self) -> None:
        """Start keeping the link up (idempotent)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        """Stop the link."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._client is not None:
            await self._client.close()

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            self._set_state("connecting", self.status.error)
            try:
                client = await self._connect()
                self._client = client
                self.status.agent_version = client.hello.agent_version if client.hello else None
                self._ready.set()
                backoff = BACKOFF_MIN_S
                if not self.watch:
                    self._set_state("up")
                    await client.closed.wait()
                    raise AgentError(f"the agent closed the connection ({client.close_reason})")
                async for snap in client.stream(WatchSnapshots(interval_s=self.interval_s)):
                    assert isinstance(snap, Snapshot)
                    self.status.snapshot = snap
                    self.status.last_seen = time.time()
                    if self.status.state != "up":
                        self._set_state("up")
                    else:
                        self._notify()
                raise AgentError("the snapshot stream ended")
            except asyncio.CancelledError:
                raise
            except VersionMismatch as exc:
                self._ready.clear()
                self._set_state("version_mismatch", exc.message)
                await asyncio.sleep(BACKOFF_MAX_S)
                continue
            except (AgentError, OSError) as exc:
                self._ready.clear()
                msg = exc.message if isinstance(exc, AgentError) else str(exc)
                self._set_state("unreachable", msg)
            if self._client is not None:
                await self._client.close()
                self._client = None
            # exponential backoff with full jitter, so a fleet does not reconnect in lockstep
            await asyncio.sleep(random.uniform(0, backoff))
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def client(self, timeout: float = 15.0) -> AgentClient:
        """The live connection; waits for it, or raises AgentError saying why the host is not reachable."""
        self.start()
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise AgentError(f"host {self.name} is {self.status.state}: {self.status.error or 'no answer'}") from None
        assert self._client is not None
        return self._client


class Fleet:
    """All hosts the console follows; ``local`` is always there."""

    def __init__(self, hosts: list[str] | None = None, state_dir: Path | None = None, interval_s: float = 1.0, watch: bool = True) -> None:
        names = ["local"] + [h for h in (hosts or []) if h != "local"]
        self.links: dict[str, HostLink] = {}
        for n in names:
            if n != "local":
                raise AgentError(f"host {n!r}: this version links only the local host ('local'); remote hosts come with the SSH fleet")
            self.links[n] = HostLink(n, state_dir=state_dir, interval_s=interval_s, watch=watch)

    def start(self) -> None:
        """Connect every host."""
        for link in self.links.values():
            link.start()

    async def close(self) -> None:
        """Close every link."""
        await asyncio.gather(*(link.close() for link in self.links.values()), return_exceptions=True)

    def link(self, host: str) -> HostLink:
        """The link of one host, or a typed error naming the known ones."""
        try:
            return self.links[host]
        except KeyError:
            raise AgentError(f"unknown host {host!r}: known hosts are {', '.join(self.links)}") from None

    async def snapshot(self, host: str) -> Snapshot:
        """A fresh snapshot of one host (not the streamed one)."""
        c = await self.link(host).client()
        reply = await c.request(GetSnapshot())
        assert isinstance(reply, Snapshot)
        return reply

    async def launch(self, host: str, spec: LaunchSpec, request_id: str = "") -> LaunchReply:
        """Start a run on a host."""
        c = await self.link(host).client()
        reply = await c.request(Launch(spec=spec, request_id=request_id))
        assert isinstance(reply, LaunchReply)
        return reply

    async def stop(self, host: str, run_id: str, grace_s: float = 30.0) -> StopResult:
        """Stop a run on a host and return the verification."""
        c = await self.link(host).client()
        reply = await c.request(Stop(run_id=run_id, grace_s=grace_s))
        assert isinstance(reply, StopReply)
        return reply.result

    async def runs(self, host: str, limit: int = 1000) -> list[RunInfo]:
        """Runs a host's agent has recorded, newest first."""
        c = await self.link(host).client()
        reply = await c.request(ListRuns(limit=limit))
        assert isinstance(reply, RunList)
        return reply.runs

    async def run(self, host: str, run_id: str) -> RunInfo:
        """One run."""
        c = await self.link(host).client()
        reply = await c.request(GetRun(run_id=run_id))
        assert isinstance(reply, RunReply)
        return reply.run

    async def metrics(self, host: str, run_id: str, max_points: int = 300) -> Metrics:
        """A run's step series (loss, tokens/s, MFU), thinned to ``max_points``."""
        c = await self.link(host).client()
        reply = await c.request(GetMetrics(run_id=run_id, max_points=max_points))
        assert isinstance(reply, Metrics)
        return reply

    async def output(self, host: str, run_id: str, offset: int = 0, follow: bool = True) -> AsyncIterator[OutputChunk]:
        """A run's output from ``offset`` (negative: that many bytes before the end); with ``follow`` until the run ends."""
        c = await self.link(host).client()
        if not follow:
            reply = await c.request(ReadOutput(run_id=run_id, offset=offset))
            assert isinstance(reply, OutputChunk)
            yield reply
            return
        async for chunk in c.stream(ReadOutput(run_id=run_id, offset=offset, follow=True)):
            assert isinstance(chunk, OutputChunk)
            yield chunk
