"""Benchmark: one host snapshot as the console gets it over the agent's socket, and where its time goes.

A real agent (SIMULATED GPUs: ``GPUDECK_SIMULATE_GPUS``, 8 by default) and, with ``--peer-tree DIR``, a second one
built from another version's code (``DIR/gpudeck/agents``...), measured in turns in the same run. For each agent,
interleaved round by round so that the host's load falls on every figure alike:

  * ``ping``: the request path alone (client encode, socket, framing, dispatch, reply, client decode), and
    ``ping pumped`` the same through a client fed by a reader task (below);
  * ``snapshot``: ``GetSnapshot`` through ``AgentClient.request`` (what the console's CLI does);
  * ``snapshot pumped``: the same through a client fed by a reader task (``AgentClient(reader, writer)``, how
    ``connect_unix`` fed it before the transport pushed bytes to it itself);
  * ``snapshot raw``: the same request on a blocking socket, the reply's bytes not decoded (the client's share is
    the difference);
  * ``snapshot fresh``: ``GetSnapshot(max_age_s=0)`` through ``AgentClient.request``: a sample made for the request
    (the build in the sampler thread and the hops to it and back; an agent older than ``max_age_s`` ignores the
    field and samples for every request anyway);
With ``--poll-seconds S``, then a client that asks each agent for a snapshot once a second (``gpudeck status`` in a
``watch -n 1``) for S seconds: each agent's CPU over that window (from /proc) and the request's round trip.
And in this process, for the snapshot bytes the agent sent: ``decode`` (``decode_reply``) and ``encode`` (the
agent's ``encode``). The ratios are peer / this tree. One line per figure.

Usage: python bench/agent_snapshot.py [-n 2000] [--gpus 8:H200:141] [--peer-tree DIR] [--poll-seconds 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudeck.agents.wire.client import AgentClient
from gpudeck.agents.wire.protocol import GetSnapshot, Ping, Snapshot, decode_reply, encode


class Agent:
    """A real agent process on a private state folder; code from ``tree`` (None: this checkout)."""

    def __init__(self, label: str, tree: str | None, gpus: str) -> None:
        self.label = label
        self.home = Path(tempfile.mkdtemp(prefix="gd-snap-", dir="/tmp"))
        self.state = self.home / "agent"
        path = [tree] if tree else [str(ROOT)]
        env = {**os.environ, "GPUDECK_HOME": str(self.home), "GPUDECK_SIMULATE_GPUS": gpus, "PYTHONPATH": os.pathsep.join(path)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpudeck.agents", "serve", "--state-dir", str(self.state)],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client: AgentClient | None = None
        self.raw: socket.socket | None = None
        self.pumped: AgentClient | None = None
        self.times: dict[str, list[float]] = {
            "ping": [],
            "ping pumped": [],
            "snapshot": [],
            "snapshot pumped": [],
            "snapshot raw": [],
            "snapshot fresh": [],
        }
        self.last = b""

    async def connect(self) -> None:
        for _ in range(1200):
            try:
                self.client = await AgentClient.connect_unix(state_dir=self.state, autostart=False)
                break
            except Exception:
                await asyncio.sleep(0.05)
        if self.client is None:
            raise SystemExit(f"the {self.label} agent did not start")
        reader, writer = await asyncio.open_unix_connection(str(self.state / "sock" / "agent.sock"), limit=1 << 20)
        self.pumped = AgentClient(reader, writer)
        await self.pumped.say_hello()
        self.raw = socket.socket(socket.AF_UNIX)
        self.raw.connect(str(self.state / "sock" / "agent.sock"))
        self.raw.sendall(b'{"type":"hello","request_id":"h"}\n')
        self._line()

    def _line(self) -> bytes:
        assert self.raw is not None
        buf = bytearray()
        while not buf.endswith(b"\n"):
            buf += self.raw.recv(1 << 20)
        return bytes(buf)

    async def _raw_snapshot(self) -> None:
        assert self.raw is not None
        self.raw.sendall(b'{"type":"get_snapshot","request_id":"r"}\n')
        self.last = self._line()

    async def round(self, turn: int) -> None:
        """The two pings, then the four snapshots, each in an order that rotates with ``turn`` (no figure always goes first)."""
        assert self.client is not None and self.raw is not None and self.pumped is not None
        pings = [("ping", self.client), ("ping pumped", self.pumped)]
        for name, client in pings[turn % 2 :] + pings[: turn % 2]:
            t0 = time.perf_counter()
            await client.request(Ping())
            self.times[name].append((time.perf_counter() - t0) * 1000)
        ways = [
            ("snapshot", lambda: self.client.request(GetSnapshot())),  # type: ignore[union-attr]
            ("snapshot pumped", lambda: self.pumped.request(GetSnapshot())),  # type: ignore[union-attr]
            ("snapshot raw", self._raw_snapshot),
            ("snapshot fresh", lambda: self.client.request(GetSnapshot(max_age_s=0))),  # type: ignore[union-attr]
        ]
        for name, way in ways[turn % 4 :] + ways[: turn % 4]:
            t0 = time.perf_counter()
            await way()
            self.times[name].append((time.perf_counter() - t0) * 1000)

    async def close(self) -> None:
        for c in (self.client, self.pumped):
            if c is not None:
                await c.close()
        if self.raw is not None:
            self.raw.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, every thread


async def _polled(agents: list[Agent], seconds: float) -> None:
    """Every agent asked for one snapshot a second, in turns: its CPU over the window and the round trips."""
    await asyncio.sleep(3.0)  # the warm-up's requests are 3 s past: only the slow poller's pace counts
    cpu0 = [_cpu_s(a.proc.pid) for a in agents]
    rtts: list[list[float]] = [[] for _ in agents]
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for a, xs in zip(agents, rtts):
            assert a.client is not None
            r0 = time.perf_counter()
            await a.client.request(GetSnapshot())
            xs.append((time.perf_counter() - r0) * 1000)
        await asyncio.sleep(1.0)
    dt = time.monotonic() - t0
    cpu = [(_cpu_s(a.proc.pid) - c) / dt * 100 for a, c in zip(agents, cpu0)]
    for i, (a, xs) in enumerate(zip(agents, rtts)):
        ratio = (
            f"  ({cpu[i] / cpu[0]:.2f}x / {statistics.median(xs) / statistics.median(rtts[0]):.2f}x this tree's)" if i and cpu[0] else ""
        )
        print(
            f"agent_snapshot {a.label:<12} polled once a second for {dt:.0f} s: CPU {cpu[i]:.3f}% of one core, "
            f"snapshot p50 {statistics.median(xs):.3f} ms  n={len(xs)}{ratio}",
            flush=True,
        )


def _timed(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1000 / n


async def main_async(args: argparse.Namespace) -> None:
    agents = [Agent("this tree", None, args.gpus)]
    if args.peer_tree:
        agents.append(Agent(f"peer ({args.peer_tree})", args.peer_tree, args.gpus))
    try:
        for a in agents:
            await a.connect()
        for turn in range(51):  # warm-up: caches, the process table's first full read
            for a in agents:
                await a.round(turn)
        for a in agents:
            a.times = {k: [] for k in a.times}
        for turn in range(args.n):
            for a in agents:
                await a.round(turn)
        base = agents[0]
        for a in agents:
            for name, xs in a.times.items():
                med = statistics.median(xs)
                ratio = f"  ({med / statistics.median(base.times[name]):.2f}x this tree's)" if a is not base else ""
                p99 = statistics.quantiles(xs, n=100)[98]
                print(f"agent_snapshot {a.label:<12} {name:<15} p50 {med:7.3f} ms  p99 {p99:7.3f} ms  n={len(xs)}{ratio}", flush=True)
        if args.poll_seconds > 0:
            await _polled(agents, args.poll_seconds)
        raw = base.last
        snap = decode_reply(raw)
        assert isinstance(snap, Snapshot)
        n = max(200, args.n // 4)
        print(
            f"agent_snapshot in-process, the {len(raw)}-byte snapshot ({len(snap.gpus)} SIMULATED GPUs, {len(snap.processes)} GPU processes, "
            f"{len(snap.runs)} runs): decode_reply {_timed(lambda: decode_reply(raw), n):.3f} ms, encode {_timed(lambda: encode(snap), n):.3f} ms",
            flush=True,
        )
    finally:
        for a in agents:
            await a.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=2000, help="rounds (each: two pings, four snapshots) per agent")
    ap.add_argument("--gpus", default="8:H200:141", help="GPUDECK_SIMULATE_GPUS of the agents")
    ap.add_argument("--poll-seconds", type=float, default=0.0, help="then one snapshot a second from each agent this long (CPU, p50)")
    ap.add_argument("--peer-tree", default=None, help="a folder holding gpudeck/agents of another version: measured in the same run")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
