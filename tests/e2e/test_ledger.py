"""Issue 32, the GPU ledger, end to end on SIMULATED GPUs with real processes and a real agent, through the real CLI:

- a run's holder starts, grows past a level step (a re-exec: same pid, more memory), and ends when the run stops;
  ``gpudeck ledger HOST:GPU --at`` before, during and after; ``--run`` gives its footprint; ``--since`` a timeline;
- an agent ``kill -9`` mid-hold, then a restart: the hold still held is continued (same id, start), the one that
  ended meanwhile is closed with the evidence;
- retention: a restarted agent with a short retention compacts the old records in place (void, seqs gapless) and a
  fresh history pulled from it still has each hold's start, peak and end;
- bad TIME and HOST[:GPU] words are typed usage errors (exit 2) that name the word.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.agents.observe import containers
from tests.agent_harness import AgentProc, kill_pids, run_state, simulated_agent, teardown_agent, wait_for
from tests.e2e.test_containers import Groups
from tests.e2e.test_containers import why_not as containers_why_not

pytestmark = pytest.mark.slow
PY = sys.executable
PROGS = Path(__file__).parent / "progs"
GROWER = str(PROGS / "sim_gpu_grower.py")
HOLDER = str(PROGS / "sim_gpu_holder.py")
GIB = 2**30
DOCKER_ID = "e5" * 32


def stage0(gpu: int, gib: float) -> list[str]:
    """``launch --env`` words that start the grower in its first stage (no exec of its own: its clock starts at once)."""
    return ["--env", f"GPUDECK_SIM_GPU_MEM={gpu}:{float(gib)}", "--env", "GPUDECK_TEST_GROWER_STAGE=0"]


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    yield from simulated_agent(gpudeck_home, monkeypatch, "2:H200:141")  # a level step of 14.1 GiB


def records(a: AgentProc, kind: str = "gpu_hold") -> list[dict]:
    """The ledger's records in the agent's journal (read-only), oldest first, each with its seq and ts."""
    db = sqlite3.connect(f"file:{a.state_dir / 'journal.db'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT seq, ts, data FROM events WHERE kind=? ORDER BY seq", (kind,)).fetchall()
    finally:
        db.close()
    return [{"seq": s, "ts": t, **json.loads(d)} for s, t, d in rows]


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).isoformat(timespec="milliseconds")


def ours(answer: dict, rid: str) -> list[dict]:
    """The holds of one run in a ``ledger --json`` answer."""
    return [h for h in answer["holds"] if h.get("run_id") == rid]


def ledger(a: AgentProc, *args: str) -> dict:
    return json.loads(a.cli("ledger", *args, "--json").stdout)


def test_a_runs_hold_starts_grows_ends_and_the_cli_answers_before_during_after(sim_agent: AgentProc) -> None:
    a = sim_agent
    before = time.time()
    time.sleep(1.1)
    for _attempt in range(3):  # the 2 GiB stage lasts 1.5 s; a tick that late on a loaded machine sees only 40 GiB
        rid = a.cli_json("launch", "--gpus", "0", "--force", *stage0(0, 2), "--", PY, GROWER, "--stages", "2,40", "--after", "1.5")["id"]
        try:  # an exec noticed only within 3 s of the start: on a loaded machine it may not be (then again)
            grown = wait_for(lambda: [r for r in records(a) if r.get("run") == rid and (r.get("bytes") or 0) >= 40 * GIB], timeout=20)
        except AssertionError:
            a.cli("stop", rid, "--grace", "1")
            continue
        # the run's shim has the --env declaration too (it holds 2 GiB all along): the grower is the one that grew
        mine = [r for r in records(a) if r.get("pid") == grown[0]["pid"]]
        if mine[0]["bytes"] == 2 * GIB:
            break
        a.cli("stop", rid, "--grace", "1")
    assert [r["change"] for r in mine] == ["start", "level"], mine
    start, level = mine
    assert start["attribution"] == "RUN" and start["gpu"] == 0 and start["uuid"].startswith("GPU-SIM-")
    assert start["pid"] == level["pid"] and start["hold"] == level["hold"] and level["peak"] == 40 * GIB
    during = time.time()
    time.sleep(1.1)
    a.cli("stop", rid, "--grace", "1")
    end = wait_for(lambda: [r for r in records(a) if r["hold"] == start["hold"] and r["change"] == "end"], timeout=60, what="the end")[0]
    assert end["peak"] == 40 * GIB and "no longer" in end["evidence"]
    time.sleep(1.1)
    after = time.time()
    n = len(records(a))
    time.sleep(2.5)  # idle samples of an unchanged GPU (one a second) write nothing
    assert len(records(a)) == n

    got = ledger(a, "local:0", "--at", iso(during))
    held = {h["pid"]: (h["run_id"], h["attribution"], h["at_bytes"]) for h in ours(got, rid)}
    assert held[start["pid"]] == (rid, "RUN", 40 * GIB)
    assert set(held) - {start["pid"]} and all(v == (rid, "RUN", 2 * GIB) for p, v in held.items() if p != start["pid"])  # the shim
    assert next(h for h in got["holds"] if h["pid"] == start["pid"])["ended"] == pytest.approx(end["ts"])
    # (other tests' simulated holders of no scope may hold meanwhile: only the run's holds are looked at)
    assert ours(ledger(a, "local:0", "--at", iso(before), "--no-sync"), rid) == []
    assert ours(ledger(a, "local:0", "--at", iso(after), "--no-sync"), rid) == []
    assert ours(ledger(a, "local:1", "--at", iso(during), "--no-sync"), rid) == []  # the other GPU
    # the moment of the 2 GiB stage: what it held then, not its peak
    early = ledger(a, "local:0", "--at", iso(start["started"] + 0.01), "--no-sync")  # (iso() keeps milliseconds)
    assert [h["at_bytes"] for h in early["holds"] if h["pid"] == start["pid"]] == [2 * GIB]

    fp = ledger(a, "local", "--run", rid, "--no-sync")
    assert fp["run"] == rid and [(f["gpu"], f["peak"]) for f in fp["footprint"]] == [(0, 40 * GIB)]
    assert start["pid"] in fp["footprint"][0]["pids"]
    # the union of the run's holds on GPU 0 (the grower's and the shim's): at least the grower's own span, at most from
    # the run's first hold's start to now (the shim's may start before the grower's and end after it; on a loaded
    # machine the start's record can be journaled a second after its sample)
    first = min(r["started"] for r in records(a) if r.get("run") == rid and r["gpu"] == 0)
    assert end["ts"] - start["started"] - 0.01 <= fp["footprint"][0]["held_s"] <= time.time() - first
    text = a.cli("ledger", "local", "--run", rid, "--no-sync").stdout
    print("\n" + text)  # the integrator's record of a real `gpudeck ledger --run` output
    assert f"run {rid} on local: 1 GPU(s) held over its life" in text and "40.0" in text and "#" in text
    text = a.cli("ledger", "local:0", "--since", "-5m", "--no-sync").stdout
    print(text)
    assert f"{rid} (rank" in text or rid in text
    text = a.cli("ledger", "local:0", "--at", iso(during), "--no-sync").stdout
    print(text)
    shown = a.cli("show", rid, "--no-sync").stdout  # the run's timeline lists its holds' records
    assert f"gpu_hold     GPU 0: pid {start['pid']} start 2.0 GiB RUN" in shown and f"pid {start['pid']} level 40.0 GiB" in shown
    assert f"pid {start['pid']}" in text and "RUN" in text


def test_an_agent_killed_mid_hold_continues_or_closes_each_hold_after_its_restart(
    gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "2:H200:141;unaccounted=1:3")
    a = AgentProc(gpudeck_home).start()
    env = {**a.env, "GPUDECK_SIM_GPU_MEM": "0:10"}
    stays = subprocess.Popen([PY, HOLDER], env=env, stdout=subprocess.DEVNULL)
    goes = subprocess.Popen([PY, HOLDER], env={**env, "GPUDECK_SIM_GPU_MEM": "1:20"}, stdout=subprocess.DEVNULL)
    b: AgentProc | None = None
    try:
        wait_for(lambda: {r.get("pid") for r in records(a)} >= {stays.pid, goes.pid}, timeout=60, what="both holds started")
        first = {r.get("pid"): r for r in records(a)}
        assert first[None]["attribution"] == "UNACCOUNTED" and first[None]["bytes"] == 3 * GIB
        a.kill9()  # mid-hold: no end is written
        goes.kill()
        goes.wait(10)
        b = AgentProc(gpudeck_home).start()
        last = max(x["seq"] for x in first.values())
        newer = wait_for(
            lambda: [r for r in records(b) if r["seq"] > last] if len([r for r in records(b) if r["seq"] > last]) >= 3 else None,
            timeout=60,
            what="3 records",
        )
        by_pid = {r.get("pid"): r for r in newer}
        assert by_pid[stays.pid]["change"] == "continued" and by_pid[stays.pid]["hold"] == first[stays.pid]["hold"]
        assert by_pid[stays.pid]["started"] == first[stays.pid]["started"]
        assert by_pid[None]["change"] == "continued"  # the unaccounted memory is still there
        gone = by_pid[goes.pid]
        assert (
            gone["change"] == "end"
            and gone["hold"] == first[goes.pid]["hold"]
            and gone["last_seen"] == pytest.approx(first[goes.pid]["ts"])
        )
        assert "agent restarted" in gone["evidence"]
        now = ledger(b, "local")
        assert sorted((str(h.get("pid")), h["attribution"]) for h in now["holds"] if h.get("pid") in (stays.pid, goes.pid, None)) == sorted(
            [(str(stays.pid), "FOREIGN"), ("None", "UNACCOUNTED")]
        )
        held = {h.get("pid"): h for h in now["holds"]}
        assert goes.pid not in held and held[stays.pid]["started"] == first[stays.pid]["started"]
        text = b.cli("ledger", "local", "--since", "-10m", "--no-sync").stdout
        print("\n" + text)
        assert "(after an agent restart)" in text
    finally:
        kill_pids([stays.pid, goes.pid])
        for p in (stays, goes):
            p.wait(10)
        teardown_agent(b or a)
        a.stop()


def test_retention_compacts_to_start_peak_and_end_and_a_fresh_history_still_has_them(
    gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "1:H200:141")
    a = AgentProc(gpudeck_home).start()
    pids: list[int] = []
    try:
        for _attempt in range(4):  # 2 -> 20 -> 40 GiB, 1.2 s in each: a late tick may miss a stage (then again)
            # a run: ticks sample every 0.5 s while it lives (its shim holds 2 GiB too: the grower is the one that grew)
            grow = [PY, GROWER, "--stages", "2,20,40", "--after", "1.2", "--seconds", "1.5"]
            rid = a.cli_json("launch", "--gpus", "0", "--force", *stage0(0, 2), "--", *grow)["id"]
            wait_for(lambda: run_state(a, rid) not in ("starting", "running"), timeout=60, what="the run's end")
            ends = wait_for(
                lambda: [r for r in records(a) if r.get("run") == rid and r["change"] == "end" and r["peak"] > 2 * GIB], timeout=60
            )
            mine = [r for r in records(a) if r["hold"] == ends[0]["hold"]]
            if [r["bytes"] // GIB for r in mine] == [2, 20, 40, 40]:
                break
        assert [(r["change"], r["bytes"] // GIB) for r in mine] == [("start", 2), ("level", 20), ("level", 40), ("end", 40)]
        a.stop()
        monkeypatch.setenv("GPUDECK_LEDGER_RETENTION_DAYS", "0.00001")  # 0.864 s: every record above is older
        time.sleep(1.0)
        a = AgentProc(gpudeck_home).start()  # compacts at its first sample
        voided = wait_for(lambda: [r for r in records(a, "void") if "compacted" in r["reason"]], timeout=30, what="compaction")
        assert [v["seq"] for v in voided] == [mine[1]["seq"]]  # the 20 GiB level: neither start, peak nor end
        kept = [r for r in records(a) if r["hold"] == mine[0]["hold"]]
        assert [(r["change"], r["bytes"] // GIB) for r in kept] == [("start", 2), ("level", 40), ("end", 40)]
        # a history pulled afresh from the compacted journal (no gap: the voided seq is there) has the hold whole
        (gpudeck_home / "history.db").unlink(missing_ok=True)
        got = ledger(a, "local:0", "--since", "-10m")
        row = next(h for h in got["holds"] if h["hold"] == mine[0]["hold"])
        assert row["peak"] == 40 * GIB and row["ended"] == pytest.approx(mine[-1]["ts"]) and row["started"] == mine[0]["started"]
        at_20 = ledger(a, "local:0", "--at", iso(mine[1]["ts"] + 0.5), "--no-sync")["holds"]
        assert [h["at_bytes"] for h in at_20 if h["hold"] == mine[0]["hold"]] == [
            2 * GIB
        ]  # the 20 GiB record is gone: the answer is the start's figure
    finally:
        kill_pids(pids)
        teardown_agent(a)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["local", "--at", "25:00"], "is not a time of day"),
        (["local", "--at", "yesterday"], "is not a time: give an ISO time"),
        (["local:x"], "the GPU after ':' must be an index"),
        (["local", "--at", "now", "--since", "-1h"], "not both"),
        (["local", "--since", "-1h", "--until", "-2h"], "swap them"),
    ],
)
def test_bad_words_are_usage_errors_that_name_the_word(args: list[str], says: str) -> None:
    cp = subprocess.run([PY, "-m", "gpudeck.console.cli.main", "ledger", *args], capture_output=True, text=True, env=dict(os.environ))
    assert cp.returncode == 2 and says in cp.stderr and cp.stdout == "", cp.stderr


@pytest.mark.skipif(containers_why_not() is not None, reason=str(containers_why_not()))
def test_a_holder_in_a_container_is_journaled_with_it_and_the_cli_names_it(
    gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A process placed in a real cgroup named as Docker names it (tests/e2e/test_containers.py's Groups) holds
    simulated memory: its hold's records carry the container, and `gpudeck ledger` shows its label."""
    root = tmp_path / "root"
    (root / f"var/lib/docker/containers/{DOCKER_ID}").mkdir(parents=True)
    (root / f"var/lib/docker/containers/{DOCKER_ID}/config.v2.json").write_text(json.dumps({"ID": DOCKER_ID, "Name": "/trainer"}))
    monkeypatch.setenv(containers.ROOT_ENV, str(root))
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "1:H200:141")
    a = AgentProc(gpudeck_home).start()
    groups = Groups()
    try:
        p = groups.start(dict(a.env, GPUDECK_SIM_GPU_MEM="0:3"), groups.make(f"system.slice/docker-{DOCKER_ID}.scope"))
        # the process holds (simulated) memory from its first instant, before the placer moves it into the group: the
        # start may carry no container; the record that learns it (the start, or an attribution record) carries it
        placed = wait_for(
            lambda: [r for r in records(a) if r.get("pid") == p.pid and r.get("container")], timeout=60, what="the hold's container"
        )[0]
        assert placed["container"] == {"runtime": "docker", "id": DOCKER_ID, "name": "trainer"}, placed
        assert placed["change"] in ("start", "attribution"), placed
        got = ledger(a, "local:0")
        assert [h["container"] for h in got["holds"] if h.get("pid") == p.pid] == ["docker:trainer"]
        text = a.cli("ledger", "local:0", "--no-sync").stdout
        print("\n" + text)
        assert "docker:trainer" in text
    finally:
        groups.close()
        teardown_agent(a)
