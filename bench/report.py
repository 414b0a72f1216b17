"""Benchmark: ``gpudeck report``'s work (gather from the history, render Markdown and JSON) for a long run, against
``gpudeck show``'s (find, events, metrics, format_show) on the same run of the same history file, in one process,
interleaved rounds.

The history is made by the real replica (``History.ingest``) from a run as an agent journals it: created, fingerprinted,
running, a manifest, ``--steps`` step records, ``--gpus`` GPU holds (start, ``--levels`` level changes, end), a claims
check, the end. The step records are the bulk: ``report`` reads only the other kinds of events and the steps from the
metrics table; ``show`` reads up to 10,000 events. Figures: the median of ``--rounds`` rounds of each, in ms, and the
ratio report / show.

Usage: python bench/report.py [--steps 100000] [--gpus 8] [--levels 20] [--rounds 9]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from gpudeck.agents.wire.protocol import Event
from gpudeck.console.history.replica import History
from gpudeck.console.ops.figures import run_figures
from gpudeck.console.ops.report import gather_report
from gpudeck.console.present.formats import format_show
from gpudeck.console.present.report import report_json, report_markdown

RID = "r-bench001"


def events(steps: int, gpus: int, levels: int) -> list[Event]:
    """One run's journal events, in seq order."""
    t0, seq = 1_700_000_000.0, 0
    out: list[Event] = []

    def ev(kind: str, ts: float, data: dict) -> None:
        nonlocal seq
        seq += 1
        out.append(Event(seq=seq, ts=ts, kind=kind, run_id=RID, data=data))

    spec = {"argv": ["python", "-m", "gpudeck.trainers.fsdp_lm"], "name": "llama-1b-8gpu", "kind": "fsdp", "gpus": list(range(gpus))}
    ev("run_created", t0, {"state": "starting", "spec": spec, "name": spec["name"]})
    ev("env_fingerprint", t0 + 1, {"env": {"python": "/venv/bin/python", "torch": "2.8.0", "freeze": [f"p{i}==1" for i in range(300)]}})
    ev("run_state", t0 + 2, {"state": "running", "pid": 100})
    ev("telemetry", t0 + 3, {"record": {"type": "manifest", "params_total": 1_100_000_000, "world_size": gpus}})
    for g in range(gpus):
        hold = {"hold": f"h{g}", "gpu": g, "pid": 200 + g, "run": RID, "rank": g, "attribution": "RUN", "started": t0 + 4}
        ev("gpu_hold", t0 + 4, {**hold, "change": "start", "bytes": 2**30, "peak": 2**30})
        for lv in range(levels):
            ev("gpu_hold", t0 + 5 + lv, {**hold, "change": "level", "bytes": (lv + 2) * 2**30, "peak": (lv + 2) * 2**30})
    for s in range(1, steps + 1):
        ev("telemetry", t0 + 10 + s, {"record": {"type": "step", "step": s, "loss": 10.0 / s, "tokens_per_s": 1000.0 + s % 7}})
    end = t0 + 20 + steps
    for g in range(gpus):
        hold = {"hold": f"h{g}", "gpu": g, "pid": 200 + g, "run": RID, "rank": g, "attribution": "RUN", "started": t0 + 4}
        ev("gpu_hold", end, {**hold, "change": "end", "bytes": 0, "peak": (levels + 1) * 2**30, "evidence": "gone"})
    ev("claims", end, {"rows": [{"what": "GPUs", "claimed": gpus, "observed": gpus, "ok": True, "source": "claims"}]})
    ev("run_state", end + 1, {"state": "succeeded", "cause": "exit code 0", "exit_code": 0, "ended": end + 1})
    return out


def do_report(h: History) -> int:
    rep = gather_report(h, RID)
    return len(report_markdown(rep)) + len(str(report_json(rep)))


def do_show(h: History) -> int:
    run = h.find(RID)
    evs = h.events(run.host, run.id)
    metrics = h.metrics(run.host, run.id)
    return len(format_show(run, evs, run_figures(run, metrics)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--levels", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gd-bench-report-") as d:
        h = History(Path(d) / "history.db")
        try:
            evs = events(a.steps, a.gpus, a.levels)
            t = time.perf_counter()
            for i in range(0, len(evs), 5000):
                asyncio.run(h.ingest("gpu1", "ep-1", evs[i : i + 5000]))
            print(f"report history: {len(evs):,} events of one run ingested in {time.perf_counter() - t:.1f} s")
            times: dict[str, list[float]] = {"report": [], "show": []}
            for _ in range(a.rounds):
                for name, fn in (("report", do_report), ("show", do_show)):
                    t = time.perf_counter()
                    fn(h)
                    times[name].append((time.perf_counter() - t) * 1000)
        finally:
            h.close()
    r, s = statistics.median(times["report"]), statistics.median(times["show"])
    print(
        f"report gather + Markdown + JSON, {a.steps:,} steps, {a.gpus} GPUs x {a.levels + 2} hold records: {r:.1f} ms "
        f"(median of {a.rounds}); show of the same run: {s:.1f} ms; report/show {r / s:.2f}x"
    )


if __name__ == "__main__":
    main()
