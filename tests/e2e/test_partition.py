"""Partitions for real: two fleet hosts in network namespaces, one cut off or degraded while its agent writes thousands of events.

The console is this test process, in the root namespace, running the real
:class:`~gpudeck.console.fleet.fleet.Fleet` with a real :class:`~gpudeck.console.history.replica.History`;
each host is sshd + agent inside its own namespace behind a veth link
(``tests/netns_harness.py``). After every fault the history must hold each of
the host's events exactly once, in order, with no gaps, and equal to the
agent's own journal. Each test prints its figures.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpudeck.agents.wire.protocol import LaunchSpec
from gpudeck.console.core import config as cfg
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.history.replica import History
from tests.agent_harness import stop_runs, until
from tests.netns_harness import NetnsUnavailable, NsSshHost, netns_pool, require_netns, tcp_sockets
from tests.sshd_harness import ConsoleSide

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PY = sys.executable

# a run that writes telemetry records the agent journals one event each (eval), paced, gated by a file
BURST = r"""
import json, os, sys, time
n, gate, code, per_s = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
while gate != "-" and not os.path.exists(gate):
    time.sleep(0.05)
print("burst starts", n, flush=True)
with open(os.environ["GPUDECK_TELEMETRY"], "a") as fh:
    chunk = max(1, int(per_s / 10))
    for i in range(n):
        fh.write(json.dumps({"ts": time.time(), "rank": 0, "type": "eval", "step": i, "tau": i / n}) + "\n")
        if i % chunk == chunk - 1:
            fh.flush()
            time.sleep(0.1)
print("burst done", n, flush=True)
sys.exit(code)
"""


@pytest.fixture
def fleet_hosts() -> Iterator[tuple[ConsoleSide, list[NsSshHost]]]:
    try:
        require_netns(need_impair=True)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with netns_pool() as pool:
        c = ConsoleSide()
        hosts: list[NsSshHost] = []
        try:
            for name in ("hosta", "hostb"):
                h = NsSshHost(name, c.pub, pool.create())
                c.add(h)  # registered before start, so cleanup stops a half-started host too
                hosts.append(h)
                h.start()
            yield c, hosts
        finally:
            for h in hosts:
                stop_runs(h.agent)
            c.cleanup()


def _fleet(c: ConsoleSide, history: History, names: tuple[str, ...] = ("hosta", "hostb")) -> Fleet:
    conf = cfg.Config(hosts=tuple(cfg.HostSettings(n) for n in names), path=c.gpudeck_home / "config.toml")
    return Fleet(config=conf, ssh=c.ssh_options(), history=history, interval_s=0.5, state_dir=c.gpudeck_home / "agent")


def agent_journal(h: NsSshHost) -> tuple[str, list[tuple[int, str, str | None, Any]]]:
    """The agent's own journal, read from its file: (epoch, [(seq, kind, run_id, data)])."""
    db = sqlite3.connect(h.agent.state_dir / "journal.db", timeout=10)
    try:
        epoch = db.execute("SELECT value FROM meta WHERE key='epoch'").fetchone()[0]
        rows = db.execute("SELECT seq, kind, run_id, data FROM events ORDER BY seq").fetchall()
    finally:
        db.close()
    return epoch, [(s, k, r, json.loads(d)) for s, k, r, d in rows]


def history_events(history: History, host: str, epoch: str) -> list[tuple[int, str, str | None, Any]]:
    rows = history._exec("SELECT seq, kind, run_id, data FROM events WHERE host=? AND epoch=? ORDER BY seq", (host, epoch))
    return [(s, k, r, json.loads(d)) for s, k, r, d in rows]


def replica_check(history: History, h: NsSshHost) -> dict[str, int]:
    """Every agent event in history exactly once, in order, no gaps, same content; returns the counts."""
    epoch, journal = agent_journal(h)
    seqs = history.seqs(h.name, epoch)
    held = history_events(history, h.name, epoch)
    dupes = len(seqs) - len(set(seqs))
    gaps = (seqs[-1] - len(set(seqs))) if seqs else 0
    assert dupes == 0, f"{h.name}: {dupes} duplicate seqs"
    assert seqs == list(range(1, len(seqs) + 1)), f"{h.name}: gaps in {seqs[:5]}..{seqs[-5:]}"
    assert held == journal, f"{h.name}: history differs from the agent's journal (history {len(held)} events, journal {len(journal)})"
    return {"events": len(seqs), "duplicates": dupes, "gaps": gaps}


def _spec(args: list[str], name: str) -> LaunchSpec:
    return LaunchSpec(argv=[PY, "-c", BURST, *args], name=name)


ECHO = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 7007)); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    while (d := c.recv(100)):
        c.sendall(d)
    c.close()
"""


def _rtt(addr: str, n: int = 10, timeout: float = 5.0) -> list[float]:
    import socket

    with socket.create_connection((addr, 7007), timeout=timeout) as c:
        out = []
        for _ in range(n):
            t = time.monotonic()
            c.sendall(b"x")
            assert c.recv(10) == b"x"
            out.append(time.monotonic() - t)
        return out


def test_the_harness_cuts_degrades_and_heals_a_link_for_real() -> None:
    """The fault injector itself: a drop blackholes, down refuses at once, the impairment delays, heal restores, teardown removes all."""
    import socket
    import subprocess as sp

    try:
        require_netns(need_impair=True)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with netns_pool() as pool:
        ns = pool.create()
        srv = sp.Popen(ns.exec_argv([PY, "-c", ECHO, ns.ns_addr]), stdout=sp.PIPE, text=True)
        assert srv.stdout is not None and srv.stdout.readline().strip() == "listening"
        clean = statistics.median(_rtt(ns.ns_addr))
        imp = ns.impair(delay_ms=200, loss_pct=0)
        slow = statistics.median(_rtt(ns.ns_addr, n=5))
        ns.heal()
        ns.cut("drop")
        t = time.monotonic()
        with pytest.raises(OSError):
            socket.create_connection((ns.ns_addr, 7007), timeout=1.5)
        blackhole_s = time.monotonic() - t
        ns.heal()
        ns.cut("down")
        t = time.monotonic()
        with pytest.raises(OSError):
            socket.create_connection((ns.ns_addr, 7007), timeout=5)
        down_s = time.monotonic() - t
        ns.heal()
        healed = statistics.median(_rtt(ns.ns_addr))
        name, host_if = ns.name, ns.host_if
        print(
            f"\nharness ({imp.via}): rtt {clean * 1000:.2f} ms clean, {slow * 1000:.0f} ms with 200 ms delay, {healed * 1000:.2f} ms healed; "
            f"drop: connect timed out after {blackhole_s:.1f} s; down: refused after {down_s:.2f} s"
        )
        assert slow >= 0.19 and clean < 0.05 and healed < 0.05
        assert blackhole_s >= 1.4 and down_s < 1.0
    out = (
        sp.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        + sp.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    )
    assert name not in out and host_if not in out, "the namespace or its veth outlived the test"


async def test_a_host_cut_off_past_the_keepalive_while_it_writes_thousands_of_events_loses_nothing(fleet_hosts, tmp_path: Path) -> None:
    c, (hosta, hostb) = fleet_hosts
    history = History(c.gpudeck_home / "history.db")
    fleet = _fleet(c, history)
    states: dict[str, list[tuple[float, str]]] = {"hosta": [], "hostb": []}
    for name, link in fleet.links.items():
        link.subscribe(
            lambda st, name=name: (
                states[name].append((time.monotonic(), st.state)) if not states[name] or states[name][-1][1] != st.state else None
            )
        )
    fleet.start()
    n_burst = 4000
    try:
        await until(lambda: all(fleet.links[h].status.state == "up" for h in ("hosta", "hostb")), 60, "both hosts up")
        # hosta ticks all along (the control); hostb's burst waits for the cut
        ticker = (await fleet.launch("hosta", _spec(["600", "-", "0", "10"], "ticker"))).run.id
        gate = tmp_path / "go"
        burst = (await fleet.launch("hostb", _spec([str(n_burst), str(gate), "3", "1000"], "burst"))).run.id
        short = (
            await fleet.launch(
                "hostb",
                LaunchSpec(
                    argv=[PY, "-c", f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)\ntime.sleep(1)"],
                    name="short",
                ),
            )
        ).run.id
        await until(
            lambda: history.event_count("hostb") >= 4 and _state(history, "hostb", burst) == "running", 30, "hostb's runs in history"
        )
        await until(lambda: fleet.links["hosta"].status.synced_seq > 0, 30, "hosta synced")
        # no agent listens on TCP, in its own namespace or elsewhere (the ssh links are sshd's)
        assert tcp_sockets(hosta.agent.pid) == [] and tcp_sockets(hostb.agent.pid) == []

        b_synced_at_cut = fleet.links["hostb"].status.synced_seq
        a_synced_at_cut = fleet.links["hosta"].status.synced_seq
        t_cut = time.monotonic()
        hostb.ns.cut("drop")  # a blackhole: no RST, no ICMP; only keepalives and the snapshot watchdog notice
        gate.touch()
        await until(lambda: fleet.links["hostb"].status.state == "unreachable", 60, "hostb seen unreachable")
        detection_s = time.monotonic() - t_cut
        # the burst and the short run end on hostb while nobody can see it
        await until(
            lambda: _agent_state(hostb, burst) == "failed" and _agent_state(hostb, short) == "succeeded", 60, "hostb's runs to end", 0.5
        )
        keepalive = c.ssh_options().keepalive_s * c.ssh_options().keepalive_count
        await until(lambda: time.monotonic() - t_cut > max(2 * keepalive, 15.0), 60, "the outage to outlast the keepalive")
        assert _state(history, "hostb", burst) == "running"  # the console could not know yet
        a_progress = fleet.links["hosta"].status.synced_seq - a_synced_at_cut
        a_age = time.time() - (fleet.links["hosta"].status.last_seen or 0)
        assert a_progress > 10, f"hosta stopped syncing while hostb was cut off ({a_progress} events)"
        assert a_age < 3.0, f"hosta's snapshots stalled ({a_age:.1f} s old)"
        assert all(s == "up" for t, s in states["hosta"] if t > t_cut), states["hosta"]

        t_heal = time.monotonic()
        outage_s = t_heal - t_cut
        hostb.ns.heal()
        _, journal = agent_journal(hostb)
        last = journal[-1][0]
        await until(lambda: fleet.links["hostb"].status.state == "up", 90, "hostb back up")
        reconnect_s = time.monotonic() - t_heal
        await until(lambda: fleet.links["hostb"].status.synced_seq >= last, 60, "hostb's journal replayed into history")
        catchup_s = time.monotonic() - t_heal

        b = replica_check(history, hostb)
        replayed = fleet.links["hostb"].status.synced_seq - b_synced_at_cut
        row = history.find(burst, "hostb")
        assert row.state == "failed" and row.exit_code == 3, row
        evals = [e for e in history.events("hostb", burst, limit=100000) if e.kind == "telemetry" and e.data["record"]["type"] == "eval"]
        assert [e.data["record"]["step"] for e in evals] == list(range(n_burst)), "an eval record is missing, doubled or out of order"
        ends = [e for e in history.events("hostb", burst) if e.kind == "run_state" and e.data["state"] in ("failed", "succeeded")]
        assert len(ends) == 1
        assert history.find(short, "hostb").state == "succeeded"
        await fleet.stop("hosta", ticker, grace_s=2)
        await until(lambda: fleet.links["hosta"].status.synced_seq >= agent_journal(hosta)[1][-1][0], 30, "hosta synced")
        a = replica_check(history, hosta)
        print(
            f"\npartition (blackhole, {c.ssh_options().keepalive_s:g} s x {c.ssh_options().keepalive_count} keepalive): outage {outage_s:.1f} s, "
            f"detection {detection_s:.1f} s, reconnect {reconnect_s:.1f} s after heal, history caught up {catchup_s:.1f} s after heal; "
            f"hostb events replayed {replayed} (journal {b['events']}, eval records {len(evals)}), duplicates {b['duplicates']}, gaps {b['gaps']}; "
            f"hosta synced {a_progress} events during the outage (journal {a['events']}, duplicates {a['duplicates']}, gaps {a['gaps']})"
        )
        assert replayed >= n_burst
    finally:
        await fleet.close()
        history.close()


async def test_ten_percent_loss_and_200ms_delay_keep_the_console_usable_and_lose_nothing(fleet_hosts) -> None:
    c, (hosta, hostb) = fleet_hosts
    history = History(c.gpudeck_home / "history.db")
    fleet = _fleet(c, history)
    fleet.start()
    latencies: dict[str, list[float]] = {}
    bound_s = 30.0  # no console request may take longer than this on the degraded link

    async def timed(what: str, coro):  # type: ignore[no-untyped-def]
        t = time.monotonic()
        async with asyncio.timeout(bound_s):
            out = await coro
        latencies.setdefault(what, []).append(time.monotonic() - t)
        return out

    try:
        await until(lambda: all(fleet.links[h].status.state == "up" for h in ("hosta", "hostb")), 60, "both hosts up")
        connects0 = fleet.links["hostb"].status.connects
        imp = hostb.ns.impair(delay_ms=200, loss_pct=10, seed=7)
        t0 = time.monotonic()
        long = (await timed("launch", fleet.launch("hostb", LaunchSpec(argv=["sleep", "300"], name="long")))).run.id
        burst = (await timed("launch", fleet.launch("hostb", _spec(["1500", "-", "0", "500"], "lossy-burst")))).run.id
        for _ in range(5):
            await timed("snapshot", fleet.snapshot("hostb"))
            await timed("runs", fleet.runs("hostb"))
            await timed("run", fleet.run("hostb", burst))
        await until(lambda: _agent_state(hostb, burst) == "succeeded", 60, "the burst to finish on hostb", 0.5)
        chunks = [ch async for ch in fleet.output("hostb", burst, offset=0, follow=False)]
        assert "burst done 1500" in chunks[0].data
        res = await timed("stop", fleet.stop("hostb", long, grace_s=2))
        assert res.state == "stopped" and not res.survivors
        await until(
            lambda: fleet.links["hostb"].status.synced_seq >= agent_journal(hostb)[1][-1][0], 60, "history to catch up over the lossy link"
        )
        catchup_s = time.monotonic() - t0
        b = replica_check(history, hostb)  # checked while still degraded: nothing waits for the heal
        imp = hostb.ns.heal() or imp
        all_lat = sorted(x for v in latencies.values() for x in v)
        reconnects = fleet.links["hostb"].status.connects - connects0
        print(
            f"\nlossy link ({imp.via}: delay {imp.delay_ms:g} ms, loss {imp.loss_pct:g}%, {imp.packets} packets seen, {imp.dropped} dropped): "
            f"{len(all_lat)} requests, p50 {statistics.median(all_lat):.2f} s, max {all_lat[-1]:.2f} s "
            f"({', '.join(f'{k} max {max(v):.2f} s' for k, v in latencies.items())}); reconnects {reconnects}; "
            f"history complete {catchup_s:.1f} s after the degradation began: {b['events']} events, duplicates {b['duplicates']}, gaps {b['gaps']}"
        )
        assert imp.via == "netem" or imp.packets > 100, "the impairment saw no traffic: it was not in the path"
        assert all_lat[-1] < bound_s
        row = history.find(burst, "hostb")
        assert row.state == "succeeded"
        evals = [e for e in history.events("hostb", burst, limit=100000) if e.kind == "telemetry" and e.data["record"]["type"] == "eval"]
        assert len(evals) == 1500
        replica_check(history, hosta)
    finally:
        await fleet.close()
        history.close()


def _state(history: History, host: str, rid: str) -> str | None:
    try:
        return history.find(rid, host).state
    except Exception:
        return None


def _agent_state(h: NsSshHost, rid: str) -> str | None:
    db = sqlite3.connect(h.agent.state_dir / "journal.db", timeout=10)
    try:
        row = db.execute("SELECT state FROM runs WHERE id=?", (rid,)).fetchone()
    finally:
        db.close()
    return row[0] if row else None
