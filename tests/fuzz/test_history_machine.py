"""A state machine over the history replica: batches, replays, overlaps and interleavings of ingest calls never duplicate or lose an event.

Each (host, epoch) has a gapless event sequence, as an agent's journal has:
runs created, running, members, telemetry, alerts, ending. The machine ingests
random contiguous slices of them in random order across hosts and epochs —
including replays of what is already held and batches that overlap it — the
way reconnects and a second console process (``gpudeck history`` while the
TUI runs) do. A slice never starts past what the replica holds + 1: the Fleet
re-asks from its cursor on a gap, so that is the History's contract.

Invariants: every held seq exactly once with the agent's content; the cursor
equals the contiguous prefix held; each run row equals a reference fold of the
events held (state, cause, exit code, times, members, alerts, last step), so a
duplicate apply (members or alerts counted twice) or a lost one shows.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpudeck.agents.wire.protocol import TERMINAL_STATES, Event
from gpudeck.console.history.replica import History

HOSTS = ("gpu1", "gpu2", "gpu3")


def make_sequence(epoch_index: int, runs: int, rng_seed: int) -> list[Event]:
    """One agent journal's events: interleaved run lifecycles with gapless seqs from 1."""
    import random

    rng = random.Random(rng_seed)
    lifecycles: list[list[tuple[str, str | None, dict[str, Any]]]] = []
    for r in range(runs):
        rid = f"r-{epoch_index:04x}{r:04x}"  # unique per host across its epochs
        steps: list[tuple[str, str | None, dict[str, Any]]] = [
            (
                "run_created",
                rid,
                {"state": "starting", "spec": {"argv": ["python", "t.py"], "kind": "command", "name": f"n{r}"}, "name": f"n{r}"},
            ),
            ("run_state", rid, {"state": "running", "pid": 100 + r, "started": 1000.0 + r}),
        ]
        for k in range(rng.randint(0, 3)):
            steps.append(("members", rid, {"added": [{"pid": 200 + 10 * r + k, "rank": k}]}))
        for s in range(rng.randint(0, 4)):
            steps.append(
                ("telemetry", rid, {"record": {"type": "step", "rank": 0, "step": s, "loss": 1.0 / (s + 1), "ts": 1000.0 + s}, "offset": s})
            )
        if rng.random() < 0.5:
            steps.append(("alert", rid, {"alert": {"kind": "gpu_idle", "message": "idle", "ts": 1001.0}}))
        if rng.random() < 0.8:
            end = rng.choice([("succeeded", "exit code 0", 0), ("failed", "exit code 3", 3), ("stopped", "stopped by operator", None)])
            steps.append(("run_state", rid, {"state": end[0], "cause": end[1], "exit_code": end[2], "ended": 2000.0 + r}))
        lifecycles.append(steps)
    items: list[tuple[str, str | None, dict[str, Any]]] = [("agent_started", None, {"pid": 1})]
    while any(lifecycles):
        lc = rng.choice([x for x in lifecycles if x])
        items.append(lc.pop(0))
    return [Event(seq=i + 1, ts=1000.0 + i, kind=k, run_id=r, data=d) for i, (k, r, d) in enumerate(items)]


def reference_runs(events: list[Event]) -> dict[str, dict[str, Any]]:
    """The run rows a correct replica folds from these events (applied once each, in seq order)."""
    runs: dict[str, dict[str, Any]] = {}
    leaders: dict[str, set[int]] = {}  # the started process heads the members, once
    for ev in events:
        if not ev.run_id:
            continue
        d = ev.data
        if ev.kind == "run_created":
            runs.setdefault(
                ev.run_id,
                {
                    "state": d["state"],
                    "cause": None,
                    "exit_code": None,
                    "started": None,
                    "ended": None,
                    "members": 0,
                    "alerts": 0,
                    "last_step": None,
                    "created": ev.ts,
                },
            )
            continue
        row = runs.get(ev.run_id)
        if row is None:
            continue
        if ev.kind == "run_state":
            row["state"] = d["state"]
            for k in ("cause", "exit_code"):
                if k in d:
                    row[k] = d[k]
            if d["state"] == "running" and row["started"] is None:
                row["started"] = d.get("started", ev.ts)
            if d["state"] == "running" and d.get("pid") is not None and d["pid"] not in leaders.setdefault(ev.run_id, set()):
                leaders[ev.run_id].add(d["pid"])
                row["members"] += 1
            if d["state"] in TERMINAL_STATES:
                row["ended"] = d.get("ended", ev.ts)
        elif ev.kind == "members":
            row["members"] += len(d["added"])
        elif ev.kind == "alert":
            row["alerts"] += 1
        elif ev.kind == "telemetry" and d["record"]["type"] == "step":
            row["last_step"] = d["record"]["step"]
    return runs


class HistoryReplica(RuleBasedStateMachine):
    """Random ingest traffic against one History file."""

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gd-hm-"))
        self.history = History(self.dir / "history.db")
        self.journals: dict[tuple[str, str], list[Event]] = {}
        self.held: dict[tuple[str, str], int] = {}  # contiguous prefix ingested
        self.epochs: dict[str, list[str]] = {h: [] for h in HOSTS}
        self.seed = seed
        self.calls = 0

    def teardown(self) -> None:
        if hasattr(self, "history"):
            self.history.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(host=st.sampled_from(HOSTS), runs=st.integers(1, 6))
    def new_epoch(self, host: str, runs: int) -> None:
        """An agent journal appears (first contact, or the journal was recreated): the console takes its cursor."""
        epoch = f"{host}-e{len(self.epochs[host])}"
        self.epochs[host].append(epoch)
        self.journals[(host, epoch)] = make_sequence(len(self.epochs[host]), runs, self.seed + len(self.journals))
        self.held[(host, epoch)] = 0
        cur = self.history.cursor(host, epoch, "0.1.0", host)
        assert cur.new_epoch and cur.last_seq == 0

    @precondition(lambda self: bool(getattr(self, "journals", None)))
    @rule(data=st.data())
    def ingest(self, data: st.DataObject) -> None:
        """A batch from the cursor (or from before it: a replay overlapping what is held), of any length."""
        key = data.draw(st.sampled_from(sorted(self.journals)))
        seq = self.journals[key]
        held = self.held[key]
        start = data.draw(st.integers(1, min(held + 1, len(seq)))) if seq else 1
        end = data.draw(st.integers(start - 1, len(seq)))
        batch = seq[start - 1 : end]
        new = self.history.submit(key[0], key[1], batch).result(30)
        expect = max(0, end - held) if start <= held + 1 else 0
        assert new == expect, f"{key}: batch {start}..{end} with {held} held inserted {new}, expected {expect}"
        self.held[key] = max(held, end)
        self.calls += 1

    @precondition(lambda self: bool(getattr(self, "journals", None)))
    @rule(data=st.data())
    def concurrent_batches(self, data: st.DataObject) -> None:
        """Two writers queue overlapping batches for the same host at once (two console processes, or follow + a CLI sync)."""
        key = data.draw(st.sampled_from(sorted(self.journals)))
        seq = self.journals[key]
        held = self.held[key]
        a_end = data.draw(st.integers(held, len(seq)))
        b_end = data.draw(st.integers(held, len(seq)))
        f1 = self.history.submit(key[0], key[1], seq[held:a_end])
        f2 = self.history.submit(key[0], key[1], seq[held:b_end])
        n = f1.result(30) + f2.result(30)
        assert n == max(a_end, b_end) - held
        self.held[key] = max(held, a_end, b_end)

    @invariant()
    def exactly_once_and_equal_to_the_agent(self) -> None:
        if not hasattr(self, "history"):
            return
        for host, epoch in self.journals:
            held = self.held[(host, epoch)]
            assert self.history.seqs(host, epoch) == list(range(1, held + 1))
            assert self.history.cursor(host, epoch).last_seq == held
        assert self.history.event_count() == sum(self.held.values())

    @invariant()
    def runs_equal_the_reference_fold(self) -> None:
        if not hasattr(self, "history"):
            return
        for (host, epoch), seq in self.journals.items():
            want = reference_runs(seq[: self.held[(host, epoch)]])
            rows = self.history._exec(
                "SELECT id, state, cause, exit_code, started, ended, members, alert_count, last_step, created FROM runs WHERE host=? AND epoch=?",
                (host, epoch),
            )
            got = {
                r[0]: {
                    "state": r[1],
                    "cause": r[2],
                    "exit_code": r[3],
                    "started": r[4],
                    "ended": r[5],
                    "members": len(json.loads(r[6] or "[]")),
                    "alerts": r[7] or 0,
                    "last_step": r[8],
                    "created": r[9],
                }
                for r in rows
            }
            assert got == want, f"{host}/{epoch}: runs differ from the reference fold"


HistoryReplica.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestHistoryReplica = HistoryReplica.TestCase
