"""Faults for real: the agent killed -9 mid-launch, mid-stop and mid-write; the console killed -9 mid-sync;
runs that ignore SIGTERM and fork, or hang in disk sleep; a full disk under the agent's state.

Every test uses real processes, the real journal file and real signals, and
checks the record afterwards against what actually happened. Disk sleep is a
real D state: a FUSE file system (spoken to over ``/dev/fuse`` directly, no
library) that never answers a READ, so the reader sits in
``request_wait_answer`` where not even SIGKILL ends it until the file system
goes away. A ``SIGSTOP``-ped process is tested too, as the stand-in where FUSE
is not available — it is *not* a D state (SIGKILL still ends it), and the test
says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import sqlite3
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.errors import AgentError, AgentUnavailable
from gpudeck.agents.wire.protocol import Launch, LaunchSpec, Ping, Reclaim, Stop
from tests.agent_harness import ROOT, AgentProc, kill_tagged, wait_for

pytestmark = pytest.mark.slow
PY = sys.executable


# ---------------------------------------------------------------------- journal and process evidence


def _db(state_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(state_dir / "journal.db", timeout=10, isolation_level=None)


def journal_runs(state_dir: Path) -> dict[str, dict[str, Any]]:
    db = _db(state_dir)
    try:
        cur = db.execute("SELECT id, state, cause, exit_code, signal, request_id, run_dir, members FROM runs")
        cols = [d[0] for d in cur.description]
        return {r[0]: dict(zip(cols, r)) for r in cur.fetchall()}
    finally:
        db.close()


def journal_events(state_dir: Path, run_id: str | None = None) -> list[tuple[int, str, str | None, dict]]:
    db = _db(state_dir)
    try:
        if run_id is None:
            rows = db.execute("SELECT seq, kind, run_id, data FROM events ORDER BY seq").fetchall()
        else:
            rows = db.execute("SELECT seq, kind, run_id, data FROM events WHERE run_id=? ORDER BY seq", (run_id,)).fetchall()
    finally:
        db.close()
    return [(s, k, r, json.loads(d)) for s, k, r, d in rows]


def integrity(path: Path) -> str:
    db = sqlite3.connect(path, timeout=10)
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()


def replica_state(state_dir: Path, run_id: str) -> str | None:
    """The run's state as a replica (the console's history) rebuilds it: the newest run_state / run_adopted event."""
    state = None
    for _s, kind, _r, data in journal_events(state_dir, run_id):
        if kind in ("run_state", "run_adopted") and data.get("state"):
            state = data["state"]
    return state


def processes_of(state_dir: Path) -> dict[str, list[int]]:
    """Every live process started for a run of this state dir, by run id (found by the run folder in its environment)."""
    runs_root = str(state_dir / "runs") + os.sep
    out: dict[str, list[int]] = {}
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.Error, OSError):
            continue
        if env.get("GPUDECK_RUN_DIR", "").startswith(runs_root):
            out.setdefault(env.get("GPUDECK_RUN_ID", "?"), []).append(p.info["pid"])
    return out


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def read_pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def check_nothing_half_made(state_dir: Path) -> dict[str, int]:
    """No run folder without a journal row, no row without its folder and spec, no process without a live record."""
    rows = journal_runs(state_dir)
    runs_dir = state_dir / "runs"
    folders = {p.name for p in runs_dir.iterdir()} if runs_dir.exists() else set()
    started = {rid for rid, r in rows.items() if r["state"] != "preflight_failed"}
    assert folders <= set(rows), f"run folders without a journal row: {sorted(folders - set(rows))}"
    missing = [rid for rid in started if not (runs_dir / rid / "spec.json").exists()]
    assert not missing, f"journal rows without their run folder/spec: {missing}"
    procs = processes_of(state_dir)
    unrecorded = {rid: pids for rid, pids in procs.items() if rid not in rows}
    assert not unrecorded, f"processes of runs the journal does not know: {unrecorded}"
    dead_record = {
        rid: pids for rid, pids in procs.items() if rid in rows and rows[rid]["state"] not in ("starting", "running", "stopping")
    }
    stray = {rid: [p for p in pids if not gone(p)] for rid, pids in dead_record.items()}
    return {
        "rows": len(rows),
        "folders": len(folders),
        "live_processes": sum(len(v) for v in procs.values()),
        "ended_with_processes": len([s for s in stray.values() if s]),
    }


@pytest.fixture
def home() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gd-f-", dir="/tmp"))
    yield d
    # a last sweep over this test's runs (by the run folder in their environment, by pid)
    for rid in processes_of(d / "agent"):
        kill_tagged(rid)
    shutil.rmtree(d, ignore_errors=True)


def _stop_all(a: AgentProc) -> None:
    try:
        for r in a.cli_json("runs"):
            if r["state"] in ("starting", "running", "stopping"):
                a.cli("stop", r["id"], "--grace", "1", check=False)
    except Exception:
        pass
    a.stop()
    a.stop_autostarted()


# ---------------------------------------------------------------------- kill -9 of the agent


def _children(pid: int) -> list[int]:
    """Direct children of a process, from the kernel's per-thread lists (cheap enough to poll every half millisecond)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def _kill_when(a: AgentProc, request_id: str, when: str, timeout: float = 30.0) -> str | None:
    """Kill -9 the agent at a point of a launch: ``row`` (the run is recorded, nothing started yet) or ``shim``
    (the run's shim has been forked but has not reported its start: it is frozen with SIGSTOP the moment it
    appears and let go once the agent is dead). Returns the run's journal state at the moment of the kill."""
    db = _db(a.state_dir)
    deadline = time.monotonic() + timeout
    frozen: list[int] = []
    try:
        while time.monotonic() < deadline:
            if when == "shim":
                kids = _children(a.pid)
                if kids:
                    for k in kids:
                        os.kill(k, signal.SIGSTOP)
                    frozen = kids
                    break
            else:
                row = db.execute("SELECT id, state FROM runs WHERE request_id=?", (request_id,)).fetchone()
                if row is not None:
                    break
            time.sleep(0.0005)
        os.kill(a.pid, signal.SIGKILL)
        assert a.proc is not None
        a.proc.wait(10)
        for k in frozen:
            os.kill(k, signal.SIGCONT)
        row = db.execute("SELECT state FROM runs WHERE request_id=?", (request_id,)).fetchone()
        return row[0] if row else None
    finally:
        db.close()


async def _launch_and_kill(a: AgentProc, spec: LaunchSpec, key: str, when: str) -> tuple[str | None, BaseException | None]:
    c = await a.client()
    task = asyncio.ensure_future(c.request(Launch(spec=spec, request_id=key), timeout=60))
    state = await asyncio.to_thread(_kill_when, a, key, when)
    try:
        await task
        err = None
    except AgentError as exc:
        err = exc
    await c.close()
    return state, err


@pytest.mark.timeout(180)
async def test_agent_kill9_during_a_launch_leaves_no_run_half_started_without_a_record(home: Path) -> None:
    a = AgentProc(home)
    outcomes: list[str] = []
    try:
        for i, when in enumerate(["row", "shim", "row", "shim"]):
            a.start()
            key = f"kill-launch-{i}"
            spec = LaunchSpec(argv=["sh", "-c", "sleep 3; exit 7"], name=f"k{i}", cwd="/")
            state_at_kill, err = await _launch_and_kill(a, spec, key, when)
            a.start()
            # the restarted agent waits up to REPLY_DURABLE_S for adoption's records to be on disk before it serves; on a
            # busy machine (a fresh-clone CI run, 2026-12-05) the file can lag that: read it until it settles (a hang
            # limit, not a speed one), then check that nothing was left 'starting'
            try:
                wait_for(
                    lambda: not any(x["state"] == "starting" for x in journal_runs(a.state_dir).values()),
                    timeout=60,
                    what="the restarted agent's adoption to settle every run left 'starting'",
                )
            except AssertionError:
                pass  # the assertion below says what was left
            rows = journal_runs(a.state_dir)
            run = next((r for r in rows.values() if r["request_id"] == key), None)
            procs = processes_of(a.state_dir)
            figures = check_nothing_half_made(a.state_dir)
            assert not any(r["state"] == "starting" for r in rows.values()), "a run was left 'starting' after the restart"
            if run is not None:
                if run["state"] == "failed":
                    assert "interrupted" in (run["cause"] or "") or "launch failed" in (run["cause"] or ""), run
                    assert run["id"] not in procs, f"a run recorded as never started has processes: {procs[run['id']]}"
                else:
                    assert run["state"] == "running", run
                # the client's retry is safe: the same key gives the same run, nothing new starts
                c = await a.client()
                try:
                    again = await c.request(Launch(spec=spec, request_id=key), timeout=60)
                finally:
                    await c.close()
                assert again.run.id == run["id"] and again.duplicate  # type: ignore[attr-defined]
                assert set(processes_of(a.state_dir)) <= set(rows), "the retry started an unrecorded run"
            outcomes.append(
                f"{when}: at kill {state_at_kill}, reply {type(err).__name__ if err else 'ok'}, after restart {run['state'] if run else 'no record'} "
                f"({figures['rows']} journal rows, {figures['folders']} run folders, {figures['live_processes']} run processes alive, all recorded)"
            )
            a.stop()
        print(
            "\nagent kill -9 during launch:\n  " + "\n  ".join(outcomes) + f"\n  integrity_check: {integrity(a.state_dir / 'journal.db')}"
        )
        assert integrity(a.state_dir / "journal.db") == "ok"
    finally:
        _stop_all(a)


@pytest.mark.timeout(120)
async def test_a_run_forked_as_the_agent_dies_still_gets_its_real_exit_status(home: Path) -> None:
    """The shim's start report goes into a pipe nobody reads once the agent is gone; the run's exit must still be recorded."""
    a = AgentProc(home)
    try:
        results = []
        for i in range(2):
            a.start()
            key = f"shim-window-{i}"
            await _launch_and_kill(a, LaunchSpec(argv=["sh", "-c", "sleep 2; exit 7"], name=f"s{i}", cwd="/"), key, "shim")
            a.start()
            run = next((r for r in journal_runs(a.state_dir).values() if r["request_id"] == key), None)
            if run is None or run["state"] == "failed" and "interrupted" in (run["cause"] or ""):
                results.append("not started")
                a.stop()
                continue
            final = wait_for(
                lambda: (r := journal_runs(a.state_dir)[run["id"]])["state"] not in ("running", "starting") and r,
                timeout=30,
                what="the run to end",
            )
            results.append(f"{final['state']}: {final['cause']}")
            a.stop()
        print("\nruns forked while the agent died:", results)
        ended = [r for r in results if r != "not started"]
        assert ended, "no attempt caught the shim's start window"
        assert all(r.startswith("failed: exit code 7") for r in ended), results
    finally:
        _stop_all(a)


# a run whose processes ignore the first SIGTERM and end on the second (so a resumed stop can finish it)
TWICE = r"""
import os, signal, sys, time
count = [0]
def on_term(_s, _f):
    count[0] += 1
    if count[0] >= 2:
        os._exit(0)
signal.signal(signal.SIGTERM, on_term)
pids = [os.getpid()]
r, w = os.pipe()
if os.fork() == 0:
    os.write(w, str(os.getpid()).encode()); os.close(w)
    while True:
        time.sleep(0.1)
os.close(w)
pids.append(int(os.read(r, 32)))
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(" ".join(map(str, pids)))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(0.1)
"""

# a run that ignores SIGTERM entirely, with children (inheriting SIG_IGN) and a setsid grandchild
DEAF = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids = [os.getpid()]
r, w = os.pipe()
for kind in ("child", "child", "setsid"):
    if os.fork() == 0:
        if kind == "setsid":
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
        os.write(w, (str(os.getpid()) + "\n").encode())
        while True:
            time.sleep(0.1)
os.close(w)
buf = b""
while buf.count(b"\n") < 3:
    buf += os.read(r, 64)
pids += [int(x) for x in buf.split()]
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(" ".join(map(str, pids)))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(0.1)
"""


def _wait_members(a: AgentProc, rid: str, pids: list[int]) -> None:
    def seen() -> bool:
        row = journal_runs(a.state_dir).get(rid)
        return bool(row) and set(pids) <= {m["pid"] for m in json.loads(row["members"] or "[]")}

    wait_for(seen, timeout=30, what="the agent to record every process of the run as a member")


@pytest.mark.timeout(120)
async def test_agent_kill9_during_a_stop_the_restarted_agent_finishes_it(home: Path, tmp_path: Path) -> None:
    a = AgentProc(home).start()
    try:
        pidfile = tmp_path / "pids"
        rid = a.cli_json("launch", "--name", "twice", "--", PY, "-c", TWICE, str(pidfile))["id"]
        pids = wait_for(lambda: pidfile.exists() and read_pids(pidfile), what="the run's processes")
        _wait_members(a, rid, pids)
        c = await a.client()
        stop = asyncio.ensure_future(c.request(Stop(run_id=rid, grace_s=30), timeout=90))
        await asyncio.to_thread(wait_for, lambda: journal_runs(a.state_dir)[rid]["state"] == "stopping", 10.0, 0.02, "the stop to begin")
        time.sleep(0.5)  # SIGTERM has been sent (and ignored once)
        a.kill9()
        with pytest.raises(AgentUnavailable):
            await stop  # the operator is told the stop did not finish, never a made-up result
        await c.close()
        assert not any(gone(p) for p in pids), "the run died with the agent"
        t0 = time.monotonic()
        a.start()
        row = wait_for(
            lambda: (r := journal_runs(a.state_dir)[rid])["state"] == "stopped" and r,
            timeout=30,
            what="the restarted agent to finish the stop",
        )
        took = time.monotonic() - t0
        assert all(gone(p) for p in pids)
        events = journal_events(a.state_dir, rid)
        adopted = [d for _s, k, _r, d in events if k == "run_adopted"]
        ends = [d for _s, k, _r, d in events if k == "run_state" and d.get("state") == "stopped"]
        assert adopted and adopted[-1].get("resume_stop") is True
        assert len(ends) == 1 and ends[0].get("stop"), "the finished stop is not in the journal with its result"
        assert replica_state(a.state_dir, rid) == "stopped"
        assert integrity(a.state_dir / "journal.db") == "ok"
        stopped = {p["pid"]: p["how"] for p in ends[0]["stop"]["stopped"]}
        print(f"\nagent kill -9 during a stop: restarted agent finished it in {took:.1f} s: {row['cause']}; processes {stopped}")
    finally:
        _stop_all(a)


@pytest.mark.timeout(120)
async def test_a_stop_that_finished_while_the_agent_was_down_is_recorded_as_stopped_in_the_event_log(home: Path, tmp_path: Path) -> None:
    a = AgentProc(home).start()
    try:
        pidfile = tmp_path / "pids"
        rid = a.cli_json("launch", "--name", "deaf", "--", PY, "-c", DEAF, str(pidfile))["id"]
        pids = wait_for(lambda: pidfile.exists() and read_pids(pidfile), what="the run's processes")
        _wait_members(a, rid, pids)
        c = await a.client()
        stop = asyncio.ensure_future(c.request(Stop(run_id=rid, grace_s=30), timeout=90))
        await asyncio.to_thread(wait_for, lambda: journal_runs(a.state_dir)[rid]["state"] == "stopping", 10.0, 0.02, "the stop to begin")
        a.kill9()
        with pytest.raises(AgentUnavailable):
            await stop
        await c.close()
        for p in pids:  # the operator finishes the job by hand while no agent runs
            os.kill(p, signal.SIGKILL)
        wait_for(lambda: all(gone(p) for p in pids), what="the processes to die")
        a.start()
        row = journal_runs(a.state_dir)[rid]
        assert row["state"] == "stopped", row
        assert replica_state(a.state_dir, rid) == "stopped", (
            f"the journal row says stopped, the event log (what history replays) says {replica_state(a.state_dir, rid)}"
        )
    finally:
        _stop_all(a)


# writes telemetry as fast as it can: every eval record becomes one journal event
FLOOD = r"""
import json, os, sys, time
n = int(sys.argv[1])
with open(os.environ["GPUDECK_TELEMETRY"], "a") as fh:
    for i in range(n):
        fh.write(json.dumps({"ts": time.time(), "rank": 0, "type": "eval", "step": i, "tau": 1.0}) + "\n")
        if i % 500 == 499:
            fh.flush()
            time.sleep(0.02)
"""


@pytest.mark.timeout(180)
async def test_agent_kill9_during_heavy_event_writes_loses_no_acknowledged_event_and_journals_each_record_once(home: Path) -> None:
    a = AgentProc(home).start()
    n = 20000
    try:
        c = await a.client()
        got: list = []
        from gpudeck.agents.wire.protocol import GetEvents

        async def follow() -> None:
            try:
                async for batch in c.stream(GetEvents(after_seq=0, follow=True)):
                    got.extend(batch.events)  # type: ignore[attr-defined]
            except AgentError:
                pass

        follower = asyncio.ensure_future(follow())
        rid = a.cli_json("launch", "--name", "flood", "--", PY, "-c", FLOOD, str(n))["id"]
        t0 = time.monotonic()
        while sum(1 for e in got if e.kind == "telemetry") < 3000:
            assert time.monotonic() - t0 < 60, "the agent did not journal the flood"
            await asyncio.sleep(0.01)
        a.kill9()
        await asyncio.wait_for(follower, 10)
        await c.close()
        acked = list(got)
        assert integrity(a.state_dir / "journal.db") == "ok"
        journal = journal_events(a.state_dir)
        seqs = [s for s, *_ in journal]
        assert seqs == list(range(1, len(seqs) + 1)), "a gap in the journal after kill -9"
        by_seq = {s: (k, r, d) for s, k, r, d in journal}
        missing = [e.seq for e in acked if e.seq not in by_seq]
        assert not missing, f"{len(missing)} events the agent had sent are gone after kill -9"
        assert all(by_seq[e.seq] == (e.kind, e.run_id, e.data) for e in acked), "an acknowledged event changed"
        at_kill = len(journal)
        a.start()
        wait_for(lambda: journal_runs(a.state_dir)[rid]["state"] not in ("running", "starting"), timeout=60, what="the flood to finish")
        time.sleep(1.0)  # one more tick for the last records
        steps = [
            d["record"]["step"]
            for _s, k, _r, d in journal_events(a.state_dir, rid)
            if k == "telemetry" and d["record"].get("type") == "eval"
        ]
        print(
            f"\nagent kill -9 during heavy writes: {len(acked)} events acknowledged before the kill, {at_kill} in the journal at the kill, "
            f"all present; after restart {len(steps)} of {n} records journaled, duplicates {len(steps) - len(set(steps))}; integrity ok"
        )
        assert steps == list(range(n)), f"telemetry records lost or doubled across the restart ({len(steps)} journaled of {n})"
    finally:
        _stop_all(a)


# ---------------------------------------------------------------------- kill -9 of the console


def _fill_journal(state_dir: Path, runs: int, per_run: int) -> int:
    """A busy agent's journal: run lifecycles with telemetry, members and alerts, committed as the agent commits them."""
    j = Journal(state_dir / "journal.db", "busyhost")
    try:
        t = time.time() - 86400
        for i in range(runs):
            rid = f"r-{i:08x}"
            spec = {"argv": ["python", "-m", "gpudeck.trainers.fsdp_lm", "--fresh"], "kind": "fsdp", "name": f"run{i}", "operator": "ada"}
            items: list[tuple[str, str | None, dict]] = [
                ("run_created", rid, {"state": "starting", "spec": spec, "name": f"run{i}"}),
                ("run_state", rid, {"state": "running", "pid": 1000 + i, "started": t + i}),
                ("members", rid, {"added": [{"pid": 2000 + i, "rank": 0}, {"pid": 3000 + i, "rank": 1}]}),
            ]
            items += [
                (
                    "telemetry",
                    rid,
                    {
                        "record": {
                            "type": "step",
                            "rank": 0,
                            "step": s,
                            "loss": 1.0 / (s + 1),
                            "tokens_per_s": 1000.0 + s,
                            "ts": t + i + s,
                        },
                        "offset": s,
                    },
                )
                for s in range(per_run)
            ]
            items += [("alert", rid, {"alert": {"kind": "gpu_idle", "message": "GPU 0 idle", "ts": t + i}})]
            items += [
                (
                    "run_state",
                    rid,
                    {
                        "state": "failed" if i % 3 else "succeeded",
                        "cause": "exit code 1" if i % 3 else "exit code 0",
                        "exit_code": 1 if i % 3 else 0,
                        "ended": t + i + per_run,
                    },
                )
            ]
            j.append_many(items)
        return j.last_seq
    finally:
        j.close()


def _history_count(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        c = sqlite3.connect(db, timeout=1)
        try:
            return int(c.execute("SELECT COUNT(*) FROM events").fetchone()[0])
        finally:
            c.close()
    except sqlite3.Error:
        return 0


def _table(db: Path, sql: str) -> list[tuple]:
    c = sqlite3.connect(db, timeout=10)
    try:
        return c.execute(sql).fetchall()
    finally:
        c.close()


@pytest.mark.timeout(240)
def test_console_kill9_during_history_sync_catches_up_with_no_duplicates(home: Path) -> None:
    state_dir = home / "agent"
    state_dir.mkdir(parents=True)
    os.chmod(state_dir, 0o700)
    total = _fill_journal(state_dir, runs=200, per_run=120)
    a = AgentProc(home).start()
    hist = home / "history.db"
    try:
        env = {**a.env, "HOME": str(home)}
        argv = [PY, "-m", "gpudeck.console.cli.main", "history", "--json", "limit:1"]
        t0 = time.monotonic()
        p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        at_kill = 0
        while p.poll() is None:
            at_kill = _history_count(hist)
            if at_kill >= 5000:
                break
            time.sleep(0.005)
        assert p.poll() is None, f"the sync finished before it could be killed ({at_kill} events): make the journal bigger"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        at_kill = _history_count(hist)
        assert 0 < at_kill < total, at_kill
        assert integrity(hist) == "ok"
        cp = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
        assert cp.returncode == 0, cp.stderr
        took = time.monotonic() - t0
        epoch = _table(state_dir / "journal.db", "SELECT value FROM meta WHERE key='epoch'")[0][0]
        seqs = [r[0] for r in _table(hist, f"SELECT seq FROM events WHERE host='local' AND epoch='{epoch}' ORDER BY seq")]
        journal_total = len(journal_events(state_dir))
        assert seqs == list(range(1, journal_total + 1)), (
            f"history has {len(seqs)} events, the journal {journal_total}; duplicates {len(seqs) - len(set(seqs))}"
        )
        # the runs table after crash + resume equals one built in a single pass from the same journal
        from gpudeck.console.history.replica import History

        ref_path = home / "reference.db"
        ref = History(ref_path)
        try:
            ref.cursor("local", epoch)
            from gpudeck.agents.wire.protocol import Event

            evs = [Event(seq=s, ts=0.0, kind=k, run_id=r, data=d) for s, k, r, d in journal_events(state_dir)]
            ts = {r[0]: r[1] for r in _table(state_dir / "journal.db", "SELECT seq, ts FROM events")}
            for e in evs:
                e.ts = ts[e.seq]
            for i in range(0, len(evs), 5000):
                ref.submit("local", epoch, evs[i : i + 5000]).result(60)
        finally:
            ref.close()
        cols = "host, id, state, cause, exit_code, created, started, ended, members, ranks_seen, last_step, alert_count, alerts"
        got = _table(hist, f"SELECT {cols} FROM runs ORDER BY id")
        want = _table(ref_path, f"SELECT {cols} FROM runs ORDER BY id")
        assert got == want, "the history's runs differ from a single-pass replica after the console was killed mid-sync"
        assert _table(hist, "SELECT COUNT(*) FROM metrics") == _table(ref_path, "SELECT COUNT(*) FROM metrics")
        assert integrity(hist) == "ok"
        print(
            f"\nconsole kill -9 during history sync: {at_kill} of {journal_total} events held at the kill; after restart {len(seqs)} held, "
            f"duplicates {len(seqs) - len(set(seqs))}, gaps {journal_total - len(set(seqs))}; {len(got)} runs identical to a single-pass replica; {took:.1f} s"
        )
    finally:
        _stop_all(a)


# ---------------------------------------------------------------------- stubborn and stuck runs


@pytest.mark.timeout(60)
def test_a_run_that_ignores_sigterm_and_forks_is_stopped_and_the_stop_says_sigkill_was_needed(home: Path, tmp_path: Path) -> None:
    a = AgentProc(home).start()
    try:
        pidfile = tmp_path / "pids"
        rid = a.cli_json("launch", "--name", "deaf", "--", PY, "-c", DEAF, str(pidfile))["id"]
        pids = wait_for(lambda: pidfile.exists() and read_pids(pidfile), what="the run's processes")
        assert len(pids) == 4
        _wait_members(a, rid, pids)
        grace = 1.0
        t0 = time.monotonic()
        cp = a.cli("stop", rid, "--grace", str(grace), "--json")
        took = time.monotonic() - t0
        res = json.loads(cp.stdout)
        assert all(gone(p) for p in pids)
        assert sorted(res["needed_kill"]) == sorted(pids), res
        hows = {p["pid"]: p["how"] for p in res["stopped"]}
        assert all(hows[p] == "SIGKILL" for p in pids), hows
        assert not res.get("survivors")
        row = journal_runs(a.state_dir)[rid]
        assert row["state"] == "stopped" and f"{len(pids)} process(es) ignored SIGTERM" in row["cause"] and "SIGKILL" in row["cause"], row
        print(
            f"\nSIGTERM-deaf forking run: stopped in {took:.1f} s (grace {grace:g} s); needed SIGKILL: {res['needed_kill']}; cause: {row['cause']}"
        )
    finally:
        _stop_all(a)


_FUSE_INIT, _FUSE_LOOKUP, _FUSE_GETATTR, _FUSE_OPEN, _FUSE_READ, _FUSE_RELEASE, _FUSE_FLUSH = 26, 1, 3, 14, 15, 18, 25
_FUSE_OPENDIR, _FUSE_RELEASEDIR, _FUSE_FORGET, _FUSE_BATCH_FORGET, _FUSE_INTERRUPT, _FUSE_DESTROY = 27, 29, 2, 42, 36, 38
_IN_HDR = struct.Struct("=IIQQIIIHH")
_OUT_HDR = struct.Struct("=IiQ")
_ATTR = struct.Struct("=QQQQQQIIIIIIIIII")


def serve_stuck_fs(mountpoint: str, log_path: str) -> None:
    """A FUSE file system that never answers: READ of ``stuck`` and LOOKUP of ``hang`` wait forever (a dead NFS server).

    Speaks the kernel's FUSE protocol over ``/dev/fuse`` directly and mounts with mount(2) (root), so it needs
    neither libfuse nor fusermount. When this process dies the kernel aborts the connection and every waiter wakes.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"gdstuck", mountpoint.encode(), b"fuse.gdstuck", 0, opts) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount of the stuck FUSE file system failed: {os.strerror(e)}")
    log = open(log_path, "a", buffering=1)

    def attr(ino: int, mode: int, size: int) -> bytes:
        now = int(time.time())
        return _ATTR.pack(ino, size, 1, now, now, now, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)

    def reply(unique: int, body: bytes = b"", err: int = 0) -> None:
        os.write(fd, _OUT_HDR.pack(_OUT_HDR.size + len(body), -err, unique) + body)

    log.write("mounted\n")
    while True:
        try:
            buf = os.read(fd, (1 << 20) + 4096)
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                continue
            break  # ENODEV: unmounted
        _ln, op, unique, node, _uid, _gid, pid, _x, _y = _IN_HDR.unpack_from(buf)
        arg = buf[_IN_HDR.size : _ln]
        if op == _FUSE_INIT:
            reply(unique, struct.pack("=IIIIHHIIHHII", 7, 31, 0, 0, 16, 12, 4096, 1, 0, 0, 0, 0) + b"\0" * 24)
        elif op == _FUSE_LOOKUP:
            name = arg.split(b"\0")[0]
            if name == b"stuck":
                reply(unique, struct.pack("=QQQQII", 2, 0, 0, 0, 0, 0) + attr(2, stat.S_IFREG | 0o444, 1 << 20))
            elif name == b"hang":
                log.write(f"LOOKUP hang from pid {pid}: held\n")  # never answered
            else:
                reply(unique, err=errno.ENOENT)
        elif op == _FUSE_GETATTR:
            body = attr(1, stat.S_IFDIR | 0o755, 0) if node == 1 else attr(2, stat.S_IFREG | 0o444, 1 << 20)
            reply(unique, struct.pack("=QII", 0, 0, 0) + body)
        elif op in (_FUSE_OPEN, _FUSE_OPENDIR):
            reply(unique, struct.pack("=QIi", 0, 1, 0))  # FOPEN_DIRECT_IO: every read comes here
        elif op == _FUSE_READ:
            log.write(f"READ from pid {pid}: held\n")  # never answered: the reader waits in the kernel
        elif op in (_FUSE_RELEASE, _FUSE_RELEASEDIR, _FUSE_FLUSH):
            reply(unique)
        elif op in (_FUSE_FORGET, _FUSE_BATCH_FORGET, _FUSE_INTERRUPT):
            pass  # no reply expected (an INTERRUPT is ignored on purpose: the server is "dead")
        elif op == _FUSE_DESTROY:
            reply(unique)
            break
        else:
            reply(unique, err=errno.ENOSYS)


class StuckFs:
    """The stuck FUSE file system mounted at a temp dir for one test; ``release`` kills it and unmounts."""

    def __init__(self) -> None:
        self.mnt = Path(tempfile.mkdtemp(prefix="gd-stuck-", dir="/tmp"))
        self.log = self.mnt.with_name(self.mnt.name + ".log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> StuckFs:
        if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
            raise RuntimeError("needs root and /dev/fuse")
        self.proc = subprocess.Popen(
            [
                PY,
                "-c",
                "import sys; from tests.e2e.test_faults import serve_stuck_fs; serve_stuck_fs(sys.argv[1], sys.argv[2])",
                str(self.mnt),
                str(self.log),
            ],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.log.exists() and "mounted" in self.log.read_text():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"the FUSE server exited: {self.proc.stderr.read().decode()[-1000:] if self.proc.stderr else ''}")
            time.sleep(0.05)
        raise RuntimeError("the FUSE server did not mount")

    def held(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def release(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # the kernel aborts the connection: every waiter gets ENOTCONN
            self.proc.wait(10)
        subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
        shutil.rmtree(self.mnt, ignore_errors=True)
        self.log.unlink(missing_ok=True)


@pytest.fixture
def stuck_fs() -> Iterator[StuckFs]:
    try:
        fs = StuckFs().start()
    except RuntimeError as exc:
        pytest.skip(f"no FUSE here ({exc}); the SIGSTOP stand-in test still runs")
    try:
        yield fs
    finally:
        fs.release()


def _proc_state(pid: int) -> str:
    try:
        return next(ln.split(None, 1)[1].strip() for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:"))
    except (OSError, StopIteration):
        return "gone"


@pytest.mark.timeout(120)
async def test_stop_and_reclaim_of_a_process_in_real_disk_sleep_report_it_and_return(home: Path, stuck_fs: StuckFs) -> None:
    a = AgentProc(home).start()
    try:
        reader = f"open({str(stuck_fs.mnt / 'stuck')!r}, 'rb').read(1)"
        rid = a.cli_json("launch", "--name", "dstate", "--", PY, "-c", reader)["id"]
        wait_for(lambda: "READ from pid" in stuck_fs.held(), timeout=20, what="the run to block in the FUSE read")
        pid = int(stuck_fs.held().split("READ from pid ")[1].split(":")[0])
        _wait_members(a, rid, [pid])
        grace = 1.0
        t0 = time.monotonic()
        cp = a.cli("stop", rid, "--grace", str(grace), "--json", check=False, timeout=90)
        took = time.monotonic() - t0
        res = json.loads(cp.stdout)
        state = _proc_state(pid)
        assert state.startswith("D"), f"the process is not in disk sleep ({state}): the test did not make a D state"
        assert cp.returncode == 1, "stop must exit 1 when a process survived"
        surv = {s["pid"]: s for s in res["survivors"]}
        assert pid in surv and surv[pid]["status"] == "disk-sleep", res
        assert pid in res["needed_kill"]
        row = journal_runs(a.state_dir)[rid]
        assert row["state"] == "stopped" and "survived SIGKILL" in row["cause"] and "disk-sleep" in row["cause"], row
        # asking again returns at once with the same truth (it does not loop or wait forever)
        t1 = time.monotonic()
        again = json.loads(a.cli("stop", rid, "--grace", "0", "--json", check=False, timeout=60).stdout)
        took_again = time.monotonic() - t1
        assert pid in {s["pid"] for s in again.get("survivors", [])}, again
        print(
            f"\nreal D state (FUSE read never answered, wchan {Path(f'/proc/{pid}/wchan').read_text() or '?'}): stop returned in {took:.1f} s "
            f"(grace {grace:g} s) with survivor {pid} status {surv[pid]['status']}; cause: {row['cause']}; a second stop returned in {took_again:.1f} s"
        )
    finally:
        stuck_fs.release()
        _stop_all(a)


@pytest.mark.timeout(120)
async def test_reclaim_of_a_leftover_in_real_disk_sleep_reports_it_and_returns(home: Path, stuck_fs: StuckFs) -> None:
    a = AgentProc(home).start()
    try:
        reader = f"import os\nif os.fork() == 0:\n    open({str(stuck_fs.mnt / 'stuck')!r}, 'rb').read(1)\n"
        rid = a.cli_json("launch", "--name", "dleft", "--", PY, "-c", reader)["id"]
        wait_for(lambda: "READ from pid" in stuck_fs.held(), timeout=20, what="the orphan to block in the FUSE read")
        pid = int(stuck_fs.held().split("READ from pid ")[1].split(":")[0])
        wait_for(lambda: journal_runs(a.state_dir)[rid]["state"] == "succeeded", timeout=20, what="the leader to exit")
        c = await a.client()
        try:
            t0 = time.monotonic()
            res = (await c.request(Reclaim(pids=[pid], grace_s=1.0), timeout=60)).result  # type: ignore[attr-defined]
            took = time.monotonic() - t0
        finally:
            await c.close()
        assert pid in {s.pid for s in res.survivors} and next(s for s in res.survivors if s.pid == pid).status == "disk-sleep", res
        print(f"\nreclaim of a D-state leftover: returned in {took:.1f} s, survivor {pid} (disk-sleep): {res.message}")
    finally:
        stuck_fs.release()
        _stop_all(a)


@pytest.mark.timeout(90)
async def test_a_launch_into_a_hung_file_system_does_not_freeze_the_agent(home: Path, stuck_fs: StuckFs) -> None:
    a = AgentProc(home).start()
    try:
        c = await a.client()
        other = await a.client()
        try:
            launch = asyncio.ensure_future(c.request(Launch(spec=LaunchSpec(argv=["true"], cwd=str(stuck_fs.mnt / "hang"))), timeout=60))
            await asyncio.to_thread(wait_for, lambda: "LOOKUP hang" in stuck_fs.held(), 20, 0.05, "the launch to touch the hung directory")
            try:
                await other.request(Ping(), timeout=5)  # another client must still be served
            except TimeoutError:
                raise AssertionError(
                    "the agent did not answer a Ping within 5 s while one launch's cwd hung: its event loop is blocked"
                ) from None
        finally:
            stuck_fs.release()  # the hung lookup fails now; the launch finishes one way or another
            try:
                await asyncio.wait_for(launch, 30)
            except (AgentError, TimeoutError):
                pass
            await c.close()
            await other.close()
    finally:
        _stop_all(a)


@pytest.mark.timeout(60)
def test_sigstop_stand_in_for_a_stuck_process_is_stopped_with_sigkill_and_reported(home: Path, tmp_path: Path) -> None:
    """SIGSTOP is the usual stand-in for a stuck process, but it is not a D state: SIGKILL still ends it (the FUSE test makes a real one)."""
    a = AgentProc(home).start()
    try:
        pidfile = tmp_path / "pids"
        rid = a.cli_json("launch", "--name", "frozen", "--", PY, "-c", DEAF, str(pidfile))["id"]
        pids = wait_for(lambda: pidfile.exists() and read_pids(pidfile), what="the run's processes")
        _wait_members(a, rid, pids)
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        wait_for(lambda: all(_proc_state(p).startswith("T") for p in pids), what="the processes to stop")
        t0 = time.monotonic()
        res = json.loads(a.cli("stop", rid, "--grace", "1", "--json").stdout)
        took = time.monotonic() - t0
        assert all(gone(p) for p in pids)
        assert sorted(res["needed_kill"]) == sorted(pids) and not res.get("survivors"), res
        print(
            f"\nSIGSTOP stand-in (NOT a D state: SIGKILL ends a stopped process): stop returned in {took:.1f} s, needed SIGKILL: {res['needed_kill']}"
        )
    finally:
        _stop_all(a)


# ---------------------------------------------------------------------- disk full


@contextlib.contextmanager
def _small_fs(at: Path, size: str = "8m") -> Iterator[Path]:
    """A small tmpfs mounted at ``at`` for one test (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    at.mkdir(parents=True, exist_ok=True)
    cp = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(at)], capture_output=True, text=True)
    if cp.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {cp.stderr.strip()}")
    try:
        yield at
    finally:
        for rid in processes_of(at if at.name == "agent" else at / "agent"):
            kill_tagged(rid)
        subprocess.run(["umount", "-l", str(at)], capture_output=True)


@pytest.fixture
def small_home(home: Path) -> Iterator[Path]:
    """GPUDECK_HOME on the big disk, its ``agent`` state dir on an 8 MiB tmpfs: only the agent's disk fills up."""
    with _small_fs(home / "agent"):
        yield home


def _fill(path: Path, leave: int) -> int:
    """Fill the file system holding ``path`` until at most ``leave`` bytes are free; returns the bytes written."""
    fd = os.open(path / f"filler-{leave}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    n = 0
    try:
        for chunk in (1 << 20, 1 << 16, 4096):
            block = b"\0" * chunk
            while shutil.disk_usage(path).free - chunk >= leave:
                try:
                    n += os.write(fd, block)
                except OSError:
                    break
        while leave == 0:
            try:
                n += os.write(fd, b"\0" * 4096)
            except OSError:
                break
    finally:
        os.close(fd)
    return n


@pytest.mark.timeout(150)
def test_disk_full_in_the_state_dir_fails_the_launch_clearly_leaves_nothing_half_written_and_recovers(small_home: Path) -> None:
    a = AgentProc(small_home).start()
    outcomes = []
    try:
        first = a.cli_json("launch", "--name", "before", "--", "true")["id"]
        wait_for(lambda: journal_runs(a.state_dir)[first]["state"] == "succeeded", what="the first run to end")
        refused = 0
        for leave in (0, 16384, 65536, 262144):
            _fill(small_home / "agent", leave)
            free = shutil.disk_usage(small_home / "agent").free
            cp = a.cli("launch", "--name", f"full-{leave}", "--", "true", check=False)
            rid = None
            if cp.returncode != 0:
                refused += 1
                msg = cp.stderr.strip()
                assert "space" in msg.lower() and ("free" in msg.lower() or "full" in msg.lower()), (
                    f"the error does not say what to do: {msg}"
                )
                outcomes.append(f"{free:>7} B free: launch refused: {msg.splitlines()[-1][:150]}")
            else:
                rid = cp.stdout.strip()
                assert rid.startswith("r-"), f"launch exited 0 without a run id: {cp}"
                time.sleep(1.5)  # `true` is over by now; can the agent record that on a full disk?
                outcomes.append(f"{free:>7} B free: launched {rid}; journal says {journal_runs(a.state_dir)[rid]['state']} 1.5 s later")
            check_nothing_half_made(a.state_dir)
            assert a.proc is not None and a.proc.poll() is None, "the agent died on a full disk"
            assert a.cli("runs", "--json").returncode == 0, "the agent stopped answering on a full disk"
            for f in (small_home / "agent").glob("filler-*"):
                f.unlink()
            if rid is not None:
                t0 = time.monotonic()
                try:
                    final = wait_for(
                        lambda: (r := journal_runs(a.state_dir)[rid])["state"] not in ("starting", "running") and r,
                        timeout=20,
                        what="the run's end to be recorded once space is back",
                    )
                except AssertionError as exc:
                    raise AssertionError(
                        f"{exc}: {journal_runs(a.state_dir)[rid]}; files {[(f.name, f.stat().st_size) for f in (a.state_dir / 'runs' / rid).iterdir()]}; agent log: {a.log()[-1500:]}"
                    ) from None
                ends = [
                    d
                    for _s, k, _r, d in journal_events(a.state_dir, rid)
                    if k == "run_state" and d.get("state") in ("succeeded", "failed", "lost")
                ]
                assert len(ends) == 1, ends  # the run's end is recorded once, whatever the disk did meanwhile
                outcomes[-1] += f", recorded {final['state']} {time.monotonic() - t0:.1f} s after space was freed"
        assert refused >= 1, "the disk was never full enough to refuse a launch"
        assert integrity(a.state_dir / "journal.db") == "ok"
        after = a.cli_json("launch", "--name", "after", "--", "true")["id"]
        wait_for(lambda: journal_runs(a.state_dir)[after]["state"] == "succeeded", what="a launch once space is back")
        check_nothing_half_made(a.state_dir)
        print(
            "\ndisk full (the agent's state dir on an 8 MiB tmpfs):\n  "
            + "\n  ".join(outcomes)
            + "\n  space freed: a new launch succeeded; integrity_check ok; nothing half-written"
        )
    finally:
        _stop_all(a)


@pytest.mark.timeout(90)
def test_a_run_that_ends_while_the_state_dir_is_full_keeps_its_exit_status(small_home: Path, tmp_path: Path) -> None:
    a = AgentProc(small_home).start()
    try:
        gate = tmp_path / "go"  # outside the full file system
        rid = a.cli_json("launch", "--name", "ends-when-full", "--", "sh", "-c", f"while [ ! -e '{gate}' ]; do sleep 0.05; done; exit 5")[
            "id"
        ]
        wait_for(lambda: journal_runs(a.state_dir)[rid]["state"] == "running", what="the run to start")
        _fill(small_home / "agent", 0)
        gate.touch()
        time.sleep(2.0)  # it ends now, with nowhere to write its exit status
        for f in (small_home / "agent").glob("filler-*"):
            f.unlink()
        final = wait_for(
            lambda: (r := journal_runs(a.state_dir)[rid])["state"] not in ("starting", "running") and r,
            timeout=20,
            what="the run's end to be recorded",
        )
        print(f"\na run that ended on a full disk was recorded as {final['state']}: {final['cause']}")
        assert final["state"] == "failed" and final["exit_code"] == 5, final
        assert "agent was down" not in (final["cause"] or ""), final
    finally:
        _stop_all(a)


@pytest.mark.timeout(90)
def test_the_cli_on_a_full_home_says_so_instead_of_a_traceback(home: Path) -> None:
    with _small_fs(home):
        a = AgentProc(home).start()
        try:
            _fill(home, 0)
            cp = a.cli("launch", "--name", "on-full-home", "--", "true", check=False)
            print(
                f"\nlaunch with GPUDECK_HOME full: exit {cp.returncode}, stderr: {cp.stderr.strip().splitlines()[-1] if cp.stderr.strip() else ''}"
            )
            assert cp.returncode != 0
            assert "Traceback" not in cp.stderr, cp.stderr[-600:]
            assert "space" in cp.stderr.lower(), cp.stderr
        finally:
            for f in home.glob("filler-*"):
                f.unlink()
            _stop_all(a)
