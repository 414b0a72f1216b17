"""The run report over a real history file (events as agents journal them, folded by the real replica): rank processes
that contradict a manifest's world size, a claim with no agent verdict, the environment diff against the parent run
with a secret in both specs, leftovers (a STALE ledger hold, a reclaim), and the Markdown escaping of hostile values."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import Event
from gpudeck.console.history.replica import History
from gpudeck.console.ops.report import SCHEMA, gather_report
from gpudeck.console.present.report import md, report_json, report_markdown

GIB = 2**30
SECRET = "hf_do_not_print_me"


def _env(torch: str, nccl_value: str) -> dict:
    return {
        "python": "/venv/bin/python",
        "python_version": "3.11.7",
        "torch": torch,
        "torch_cuda": "12.8",
        "driver": "570.1",
        "dist_env": {"NCCL_DEBUG": "WARN", "NCCL_IB_KEY": nccl_value},
        "packages": {"torch": torch},
        "freeze": [f"torch=={torch}"],
        "freeze_hash": torch * 4,
    }


def _hold(rid: str, seq: int, ts: float, change: str, attribution: str, held: int, started: float, **extra: object) -> Event:
    """One ledger record of the run's rank 0 (pid 101) on GPU 3, as agents/observe/ledger.py journals it."""
    data = {"change": change, "hold": f"{rid}-h", "gpu": 3, "pid": 101, "run": rid, "rank": 0, "attribution": attribution}
    return Event(seq=seq, ts=ts, kind="gpu_hold", run_id=rid, data={**data, "bytes": held, "peak": 5 * GIB, "started": started, **extra})


def _run_events(rid: str, t0: float, *, parent: str | None, torch: str, name: str, world: int, ranks: int) -> list[Event]:
    spec: dict = {"argv": ["python", "train.py"], "name": name, "env": {"HF_TOKEN": SECRET}, "claims": {"world_size": 4, "gpus": 2}}
    if parent:
        spec["parent"] = parent
    members = [{"pid": 101 + r, "rank": r, "cmdline": ["python"]} for r in range(ranks)]
    end = {"state": "failed", "cause": "exit code 1; Python exception: boom", "exit_code": 1, "ended": t0 + 20, "evidence": "exit_record"}
    kinds_data: list[tuple[str, dict]] = [
        ("run_created", {"state": "starting", "spec": spec, "name": name}),
        ("env_fingerprint", {"env": _env(torch, "raw-value")}),
        ("run_state", {"state": "running", "pid": 100}),
        ("members", {"added": members}),
        ("telemetry", {"record": {"type": "manifest", "ts": t0 + 4, "params_total": 771_000_000, "world_size": world}}),
        ("telemetry", {"record": {"type": "step", "step": 1, "loss": 9.0, "tokens_per_s": 10.0}}),
        ("telemetry", {"record": {"type": "step", "step": 2, "loss": 4.0, "tokens_per_s": 30.0}}),
    ]
    evs = [Event(seq=i + 1, ts=t0 + i, kind=k, run_id=rid, data=d) for i, (k, d) in enumerate(kinds_data)]
    return [
        *evs,
        _hold(rid, 8, t0 + 7, "start", "RUN", 5 * GIB, t0 + 7),
        Event(seq=9, ts=t0 + 20, kind="run_state", run_id=rid, data={**end, "lingering": [101]}),
        _hold(rid, 10, t0 + 21, "attribution", "STALE", 5 * GIB, t0 + 7),
        Event(seq=11, ts=t0 + 30, kind="reclaimed", run_id=rid, data={"state": "stopped", "pids": [101], "message": "reclaimed 1 process"}),
        _hold(rid, 12, t0 + 31, "end", "STALE", 0, t0 + 7, evidence="pid 101 no longer holds memory"),
    ]


@pytest.fixture
def history(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = History(tmp_path / "history.db")
    asyncio.run(h.ingest("gpu1", "ep-a", _run_events("r-parent01", 1000.0, parent=None, torch="2.7.1", name="good", world=4, ranks=4)))
    asyncio.run(
        h.ingest("gpu1", "ep-b", _run_events("r-child002", 2000.0, parent="r-parent01", torch="2.8.0", name="bad|<i>", world=4, ranks=1))
    )
    yield h
    h.close()


def test_ranks_seen_contradict_a_manifest_that_agrees_with_the_claim(history: History) -> None:
    rep = gather_report(history, "r-child002", now=3000.0)
    world = next(c for c in rep.claims if c.what == "world size")
    assert (world.claimed, world.evidence, world.verdict) == (4, 4, "CONTRADICTED") and "1 rank process" in world.detail
    gpus = next(c for c in rep.claims if c.what == "GPUs")
    assert (gpus.claimed, gpus.evidence, gpus.verdict, gpus.detail) == (2, 1, "CONTRADICTED", "GPU 3")
    params = next(c for c in rep.claims if c.what == "params")
    assert (params.claimed, params.evidence, params.verdict) == (None, 771_000_000, "NOT CLAIMED")
    parent = gather_report(history, "r-parent01", now=3000.0)
    assert next(c for c in parent.claims if c.what == "world size").verdict == "CONSISTENT"


def test_the_parent_diff_the_leftovers_and_no_secret(history: History) -> None:
    rep = gather_report(history, "r-child002", now=3000.0)
    text = report_markdown(rep)
    doc = report_json(rep)
    assert doc["schema"] == SCHEMA and doc["environment"]["parent"] == "r-parent01"
    assert any(d["key"] == "torch" and d["parent"] == "2.7.1" and d["run"] == "2.8.0" and d["core"] for d in doc["environment"]["diff"])
    assert "| torch | 2.7.1 | 2.8.0 | yes |" in text
    dumped = json.dumps(doc, default=str)
    for out in (text, dumped):
        assert SECRET not in out and "raw-value" not in out  # the --env secret redacted, the NCCL_*KEY value digested
    assert "(value hidden)" in text
    lo = doc["leftovers"]
    assert lo["lingering"] == [101] and [h["pid"] for h in lo["stale_holds"]] == [101] and lo["reclaims"][0]["pids"] == [101]
    assert "- Reclaimed at" in text and "after the run ended (STALE)" in text and "Alive at the run's end: pid 101" in text
    assert rep.ending.verdict.startswith("FAILED: exit code 1") and rep.curve.loss_min == 4.0 and rep.curve.tokens_per_s_median == 20.0
    assert "bad\\|&lt;i&gt;" in text and "<i>" not in text


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("a|b", "a\\|b"),
        ("<script>x</script>", "&lt;script&gt;x&lt;/script&gt;"),
        ("line1\nline2\r\tz", "line1\\\\x0aline2\\\\x0d\\\\x09z"),
        ("\x1b[31mred\u202e", "\\\\x1b\\[31mred\\\\u202e"),
        (
            "[link](http://x) ![i](y) `code` *em* _em_ run_state ~~s~~",
            "\\[link\\](http://x) !\\[i\\](y) \\`code\\` \\*em\\* \\_em\\_ run_state \\~\\~s\\~\\~",
        ),
        ("", "-"),
        (None, "-"),
    ],
)
def test_md_makes_a_hostile_value_one_inert_line(raw: object, shown: str) -> None:
    assert md(raw) == shown


def test_md_bounds_a_long_value() -> None:
    out = md("x" * 10_000, 50)
    assert len(out) <= 50 and out.endswith("…") and not re.search(r"\s", out)


def _claims_run(h: History, rid: str, rows: list[dict] | None) -> None:
    spec = {"argv": ["python", "t.py"], "claims": {"params": 1_000_000_000, "tokens_per_s": 5000.0, "dataset_samples": 100}}
    evs = [
        Event(seq=1, ts=10.0, kind="run_created", run_id=rid, data={"state": "starting", "spec": spec}),
        Event(seq=2, ts=11.0, kind="run_state", run_id=rid, data={"state": "running", "pid": 5}),
        Event(seq=3, ts=12.0, kind="telemetry", run_id=rid, data={"record": {"type": "manifest", "params_total": 1_050_000_000}}),
        Event(seq=4, ts=13.0, kind="telemetry", run_id=rid, data={"record": {"type": "step", "step": 1, "tokens_per_s": 20.0}}),
    ]
    if rows is not None:
        evs.append(Event(seq=5, ts=14.0, kind="claims", run_id=rid, data={"rows": rows}))
    evs.append(Event(seq=6, ts=15.0, kind="run_state", run_id=rid, data={"state": "succeeded", "cause": "exit code 0", "exit_code": 0}))
    asyncio.run(h.ingest("h", f"ep-{rid}", evs))


def test_the_agents_verdict_decides_within_its_tolerance_and_without_one_a_claim_is_unchecked(tmp_path: Path) -> None:
    h = History(tmp_path / "history.db")
    try:
        rows = [
            {"what": "params", "claimed": 1_000_000_000, "observed": 1_050_000_000, "ok": True, "source": "claims"},
            {"what": "tokens/s", "claimed": 5000.0, "observed": 21.0, "ok": False, "source": "claims"},
            {"what": "world size", "claimed": 1, "observed": 1, "ok": True, "source": "manifest"},  # no claim: the manifest's own
        ]
        _claims_run(h, "r-checked1", rows)
        _claims_run(h, "r-nocheck1", None)
        got = {c.what: c for c in gather_report(h, "r-checked1", now=100.0).claims}
        assert got["params"].verdict == "CONSISTENT" and got["params"].claim_source == "launch --claim-*"
        assert (got["tokens/s"].evidence, got["tokens/s"].verdict) == (20.0, "CONTRADICTED") and "21 tok/s" in got["tokens/s"].detail
        assert got["dataset samples"].verdict == "NO EVIDENCE"  # claimed, and no manifest figure to check it against
        assert got["world size"].verdict == "NOT CLAIMED"
        got = {c.what: c for c in gather_report(h, "r-nocheck1", now=100.0).claims}
        assert got["params"].verdict == "UNCHECKED" and got["tokens/s"].verdict == "UNCHECKED"
        assert gather_report(h, "r-nocheck1", now=100.0).ending.verdict == "SUCCEEDED: exit code 0"  # a manifest and a step: work
    finally:
        h.close()


def test_rank_deaths_hangs_and_a_stored_triage_are_reported_with_their_source(tmp_path: Path) -> None:
    h = History(tmp_path / "history.db")
    try:
        rid = "r-hung0001"
        triage = {
            "run_id": rid,
            "ts": 30.0,
            "reason": "hang alert",
            "culprit": "rank 1 sleeps in time.sleep|<x>",
            "ranks": [{"pid": 7, "rank": 1}],
        }
        evs = [
            Event(seq=1, ts=10.0, kind="run_created", run_id=rid, data={"state": "starting", "spec": {"argv": ["python"]}}),
            Event(seq=2, ts=11.0, kind="run_state", run_id=rid, data={"state": "running", "pid": 5}),
            Event(
                seq=3,
                ts=20.0,
                kind="alert",
                run_id=rid,
                data={"alert": {"kind": "rank_exited", "message": "rank 2 exited", "ts": 20.0, "rank": 2, "pid": 8}},
            ),
            Event(
                seq=4,
                ts=29.0,
                kind="alert",
                run_id=rid,
                data={"alert": {"kind": "hang", "message": "no step for 300 s", "ts": 29.0, "severity": "critical"}},
            ),
            Event(seq=5, ts=30.0, kind="triage", run_id=rid, data={"triage": triage}),
            Event(seq=6, ts=40.0, kind="run_state", run_id=rid, data={"state": "stopped", "cause": "stopped by operator"}),
        ]
        asyncio.run(h.ingest("h", "ep", evs))
        rep = gather_report(h, rid, now=50.0)
        assert [a.kind for a in rep.rank_deaths] == ["rank_exited"] and [a.kind for a in rep.hangs] == ["hang"]
        assert [t.culprit for t in rep.triages] == ["rank 1 sleeps in time.sleep|<x>"]
        text = report_markdown(rep)
        assert "Rank deaths: 1; hangs and stragglers: 1. Source: alert events." in text
        assert "likely culprit rank 1 sleeps in time.sleep\\|&lt;x&gt;" in text and "Source: triage events" in text
        assert rep.ending.verdict == "STOPPED: stopped by operator"
        doc = report_json(rep)
        assert doc["incidents"]["rank_deaths"] == 1 and doc["incidents"]["triages"][0]["ranks"] == 1
    finally:
        h.close()


def test_the_json_keys_are_the_schema_s(history: History) -> None:
    doc = report_json(gather_report(history, "r-child002", now=3000.0))
    assert set(doc["gpus"]) == {"asked", "footprint", "holds", "note", "source"}
    assert set(doc["environment"]) == {"fingerprint", "source", "parent", "parent_note", "diff"}
    assert set(doc["incidents"]) == {"alerts", "rank_deaths", "hangs", "triages"}
    assert set(doc["leftovers"]) == {"lingering", "stale_holds", "stop", "reclaims"}
    assert set(doc["run"]) == {
        "host",
        "id",
        "name",
        "kind",
        "state",
        "argv",
        "gpus",
        "start",
        "operator",
        "parent",
        "created",
        "started",
        "ended",
        "spec",
    }
    assert set(doc["ending"]) >= {
        "verdict",
        "state",
        "cause",
        "exit_code",
        "signal",
        "decided_on",
        "output_bytes",
        "output_tail",
        "output_source",
        "notes",
    }
    assert set(doc["curve"]) >= {"steps", "loss_first", "loss_last", "loss_min", "tokens_per_s_median", "source"}
    assert json.loads(json.dumps(doc, default=str))["schema"] == SCHEMA


def test_a_live_run_is_reported_as_not_ended(tmp_path: Path) -> None:
    h = History(tmp_path / "history.db")
    try:
        evs = [
            Event(seq=1, ts=10.0, kind="run_created", run_id="r-live0001", data={"state": "starting", "spec": {"argv": ["sleep", "9"]}}),
            Event(seq=2, ts=11.0, kind="run_state", run_id="r-live0001", data={"state": "running", "pid": 5}),
        ]
        asyncio.run(h.ingest("h", "ep", evs))
        rep = gather_report(h, "r-live0001", now=20.0)
        assert rep.ending.verdict == "NOT ENDED: the run is running (this report is of a run in progress)"
        assert "> **Outcome**: NOT ENDED: the run is running" in report_markdown(rep)
    finally:
        h.close()
