"""Provides the watcher's Prometheus / OpenMetrics endpoint (prometheus_client), built at each scrape from what it follows.

Families (every label bounded: hosts come from the config, GPUs are indices, runs are run ids of live runs and
of runs that ended less than :data:`RUN_LINGER_S` ago, kinds and states are fixed sets; never a pid, a name, a
cause or any other text from a host):

- per GPU ``{host, gpu}``: ``gpudeck_gpu_memory_used_bytes``, ``_memory_total_bytes``, ``_utilization_percent``,
  ``_power_watts``, ``_temperature_celsius``, ``_unaccounted_bytes``, and ``gpudeck_gpu_held_bytes{attribution}``
  (memory held by processes of live runs (RUN), of ended runs (STALE), of no run (FOREIGN), or by pids the OS
  cannot see (NO_SUCH_PROCESS); only attributions that hold something: an absent series means 0);
- per run ``{host, run_id}``: ``gpudeck_run_info{kind}``, ``gpudeck_run_state{gpudeck_run_state}`` (a state set),
  ``_step``, ``_loss``, ``_tokens_per_second``, ``_mfu_ratio``, ``_alerts{kind}`` (alerts not cleared),
  ``_ranks_expected``, ``_ranks_alive``;
- per host ``{host}``: ``gpudeck_host_up``, ``gpudeck_host_link_state{gpudeck_host_link_state}``,
  ``gpudeck_host_snapshot_age_seconds``, ``gpudeck_host_simulated``;
- the watcher: ``gpudeck_watch_events_read_total``, ``gpudeck_watch_notifications_pending{target}``,
  ``_delivered_total{target}``, ``_failures_total{target}``, ``_expired_total{target}``, ``gpudeck_watch_target_failing{target}``
  (``target``: the apprise URL with its secrets hidden), ``gpudeck_watch_scrape_seconds`` and ``_scrape_cpu_seconds`` (the previous scrape's
  wall and CPU time to build and format).
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, StateSetMetricFamily
from prometheus_client.registry import Collector

from gpudeck.agents.protocol import LIVE_STATES, TERMINAL_STATES
from gpudeck.console.fleet import Fleet
from gpudeck.console.watch.outbox import TargetStatus
from gpudeck.console.watch.rules import ALERT_KINDS

RUN_LINGER_S = 600.0  # an ended run's series stay this long after it ended, then leave the endpoint
MAX_RUNS = 2000  # runs exported at most (newest first): a bound on series whatever the history holds
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_KINDS = ("fsdp", "dflash", "command")
_RUN_STATES = ("pending", "starting", "running", "stopping", *sorted(TERMINAL_STATES))
_LINK_STATES = ("connecting", "up", "unreachable", "version_mismatch", "host_key")
_ATTRIBUTIONS = ("RUN", "STALE", "FOREIGN", "NO_SUCH_PROCESS")
_RUN_COLS = "host, id, kind, state, last_step, last_loss, tokens_per_s, mfu, alerts, world_size, ranks_seen, spec"


@dataclass
class WatchHealth:
    """The watcher's own counters, updated by the service."""

    events_read: int = 0
    started: float = field(default_factory=time.time)
    targets: list[TargetStatus] = field(default_factory=list)
    redact: Callable[[str], str] = str


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _expected_ranks(spec_json: str | None, world_size: int | None) -> int | None:
    if world_size:
        return int(world_size)
    try:
        spec = json.loads(spec_json or "{}")
        n = spec.get("expected_ranks")
        return int(n) if n else None
    except (ValueError, TypeError, AttributeError):
        return None


class FleetCollector(Collector):
    """Builds every family from the Fleet's latest snapshots, the history's runs and the watcher's health at each scrape."""

    def __init__(self, fleet: Fleet, history_conn: sqlite3.Connection, health: WatchHealth) -> None:
        self.fleet = fleet
        self.conn = history_conn
        self.health = health
        self._lock = threading.Lock()  # the server answers scrapes on threads; one collection at a time
        self.last_scrape_s = 0.0
        self.last_scrape_cpu_s = 0.0

    def _runs(self, now: float) -> list[tuple]:
        live = ",".join("?" * len(LIVE_STATES))
        return self.conn.execute(
            f"SELECT {_RUN_COLS} FROM runs WHERE state IN ({live}) UNION ALL SELECT {_RUN_COLS} FROM runs WHERE ended >= ?"
            f" AND state NOT IN ({live}) LIMIT ?",
            (*LIVE_STATES, now - RUN_LINGER_S, *LIVE_STATES, MAX_RUNS),
        ).fetchall()

    def collect(self) -> Iterator[Metric]:
        """Every family, built now."""
        t0, c0 = time.perf_counter(), time.thread_time()
        with self._lock:
            out = list(self._collect(time.time()))
        yield from out
        # reached once the exposition has formatted every family above: this scrape's cost, shown by the next one
        self.last_scrape_s = time.perf_counter() - t0
        self.last_scrape_cpu_s = time.thread_time() - c0

    def _collect(self, now: float) -> Iterator[Metric]:
        g = {
            "mem_used": GaugeMetricFamily("gpudeck_gpu_memory_used_bytes", "GPU memory in use", labels=["host", "gpu"]),
            "mem_total": GaugeMetricFamily("gpudeck_gpu_memory_total_bytes", "GPU memory in all", labels=["host", "gpu"]),
            "util": GaugeMetricFamily("gpudeck_gpu_utilization_percent", "GPU utilisation (NVML, percent)", labels=["host", "gpu"]),
            "power": GaugeMetricFamily("gpudeck_gpu_power_watts", "GPU power draw", labels=["host", "gpu"]),
            "temp": GaugeMetricFamily("gpudeck_gpu_temperature_celsius", "GPU temperature", labels=["host", "gpu"]),
            "unacc": GaugeMetricFamily(
                "gpudeck_gpu_unaccounted_bytes", "used memory no visible process accounts for", labels=["host", "gpu"]
            ),
            "held": GaugeMetricFamily(
                "gpudeck_gpu_held_bytes", "GPU memory held by processes, by attribution", labels=["host", "gpu", "attribution"]
            ),
        }
        up = GaugeMetricFamily("gpudeck_host_up", "1 when the host's agent link is up", labels=["host"])
        link = StateSetMetricFamily("gpudeck_host_link_state", "the host's agent link state", labels=["host"])
        age = GaugeMetricFamily("gpudeck_host_snapshot_age_seconds", "seconds since the host's latest snapshot was taken", labels=["host"])
        sim = GaugeMetricFamily("gpudeck_host_simulated", "1 when the host's GPUs are simulated (GPUDECK_SIMULATE_GPUS)", labels=["host"])
        alive_ranks: dict[tuple[str, str], int] = {}
        for name, hl in self.fleet.links.items():
            st = hl.status
            up.add_metric([name], 1.0 if st.state == "up" else 0.0)
            link.add_metric([name], {s: s == st.state for s in _LINK_STATES})
            snap = st.snapshot
            if snap is None:
                continue
            age.add_metric([name], max(0.0, now - snap.ts))
            sim.add_metric([name], 1.0 if snap.simulated else 0.0)
            if st.state != "up":
                continue  # a down host's GPUs are not known now: no stale values
            for gpu in snap.gpus:
                lab = [name, str(gpu.index)]
                g["mem_used"].add_metric(lab, float(gpu.memory_used))
                if gpu.memory_total:
                    g["mem_total"].add_metric(lab, float(gpu.memory_total))
                for key, v in (
                    ("util", gpu.util_gpu),
                    ("power", gpu.power_w),
                    ("temp", gpu.temperature_c),
                    ("unacc", gpu.unaccounted_bytes),
                ):
                    if v is not None:
                        g[key].add_metric(lab, float(v))
                if gpu.processes:  # only what is held: an absent series is 0 (a third of the endpoint's series otherwise)
                    held: dict[str, float] = {}
                    for p in gpu.processes:
                        if p.used_bytes is not None and p.attribution in _ATTRIBUTIONS:
                            held[p.attribution] = held.get(p.attribution, 0.0) + p.used_bytes
                    for attr, v in held.items():
                        g["held"].add_metric([*lab, attr], v)
            for r in snap.runs:
                ranks = {m.rank for m in r.members if m.rank is not None}
                alive_ranks[(name, r.id)] = len(ranks)
        yield from g.values()
        yield from (up, link, age, sim)
        yield from self._run_families(now, alive_ranks)
        yield from self._health_families()

    def _run_families(self, now: float, alive_ranks: dict[tuple[str, str], int]) -> Iterator[Metric]:
        lab = ["host", "run_id"]
        info = GaugeMetricFamily("gpudeck_run_info", "a run followed (value 1)", labels=[*lab, "kind"])
        state = StateSetMetricFamily("gpudeck_run_state", "the run's state", labels=lab)
        step = GaugeMetricFamily("gpudeck_run_step", "the run's last reported step", labels=lab)
        loss = GaugeMetricFamily("gpudeck_run_loss", "the run's last reported loss", labels=lab)
        tps = GaugeMetricFamily("gpudeck_run_tokens_per_second", "the run's last reported throughput", labels=lab)
        mfu = GaugeMetricFamily("gpudeck_run_mfu_ratio", "the run's last reported model FLOPs utilisation (0-1)", labels=lab)
        alerts = GaugeMetricFamily("gpudeck_run_alerts", "the run's alerts not cleared, by kind", labels=[*lab, "kind"])
        expected = GaugeMetricFamily("gpudeck_run_ranks_expected", "ranks the run should have", labels=lab)
        alive = GaugeMetricFamily("gpudeck_run_ranks_alive", "ranks of the run seen alive now (live runs)", labels=lab)
        hosts = set(self.fleet.links)
        for host, rid, kind, st, last_step, last_loss, tokens, m, alerts_json, world, _ranks_seen, spec in self._runs(now):
            if host not in hosts or not isinstance(rid, str) or not _RUN_ID.match(rid):
                continue  # a run of a host no longer in the config, or an id no label should carry
            lv = [host, rid]
            info.add_metric([*lv, kind if kind in _KINDS else "other"], 1.0)
            state.add_metric(lv, {s: s == st for s in _RUN_STATES})
            for fam, v in ((step, last_step), (loss, last_loss), (tps, tokens), (mfu, m)):
                if (x := _num(v)) is not None:
                    fam.add_metric(lv, x)
            counts = dict.fromkeys(ALERT_KINDS, 0)
            try:
                for a in json.loads(alerts_json or "[]"):
                    if isinstance(a, dict) and a.get("kind") in counts and not a.get("cleared"):
                        counts[a["kind"]] += 1
            except ValueError:
                pass
            for k, n in counts.items():
                alerts.add_metric([*lv, k], float(n))
            if (e := _expected_ranks(spec, int(world) if isinstance(world, int) else None)) is not None:
                expected.add_metric(lv, float(e))
            if st in LIVE_STATES:
                alive.add_metric(lv, float(alive_ranks.get((host, rid), 0)))
        yield from (info, state, step, loss, tps, mfu, alerts, expected, alive)

    def _health_families(self) -> Iterator[Metric]:
        h = self.health
        yield CounterMetricFamily("gpudeck_watch_events_read", "history events the watcher read", value=h.events_read)
        yield GaugeMetricFamily("gpudeck_watch_start_time_seconds", "when this watcher started (unix time)", value=h.started)
        yield GaugeMetricFamily(
            "gpudeck_watch_scrape_seconds",
            "wall time the previous scrape took to build and format (compression not included)",
            value=self.last_scrape_s,
        )
        yield GaugeMetricFamily(
            "gpudeck_watch_scrape_cpu_seconds", "CPU time the previous scrape took to build and format", value=self.last_scrape_cpu_s
        )
        lab = ["target"]
        pending = GaugeMetricFamily("gpudeck_watch_notifications_pending", "notifications waiting for their target", labels=lab)
        delivered = CounterMetricFamily("gpudeck_watch_notifications_delivered", "notifications the target accepted", labels=lab)
        failures = CounterMetricFamily("gpudeck_watch_notifications_failures", "failed delivery attempts", labels=lab)
        expired = CounterMetricFamily("gpudeck_watch_notifications_expired", "notifications given up on", labels=lab)
        failing = GaugeMetricFamily("gpudeck_watch_target_failing", "1 when the target's recent attempts failed", labels=lab)
        for t in h.targets:
            lv = [h.redact(t.target)]
            pending.add_metric(lv, float(t.pending))
            delivered.add_metric(lv, float(t.delivered))
            failures.add_metric(lv, float(t.failures))
            expired.add_metric(lv, float(t.expired))
            failing.add_metric(lv, 1.0 if t.failing else 0.0)
        yield from (pending, delivered, failures, expired, failing)
