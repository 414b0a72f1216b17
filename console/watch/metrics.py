"""Provides the watcher's Prometheus / OpenMetrics endpoint (prometheus_client), rendered off the scrape path.

The exposition is built (:class:`FleetCollector`) and formatted by prometheus_client's own encoders in a thread of
its own (:class:`MetricsEndpoint`) every :data:`RENDER_EVERY_S` while someone scrapes, and a scrape is answered with
the latest rendered bytes: at 256 hosts a render costs a few hundred ms of CPU (prometheus_client formats each
sample for about 10 us), which a scrape no longer waits for. The text says when it was rendered
(``gpudeck_watch_render_timestamp_seconds``): its age at a scrape is ``timestamp(x) - x`` in PromQL.

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
  (``target``: the target's id, ``t-`` and 8 hex digits of a keyed hash of its URL, as ``gpudeck watch --status`` names
  it: a label never carries the URL, whose secrets apprise's privacy form may not all hide), ``gpudeck_watch_render_timestamp_seconds`` (when this text
  was built), ``gpudeck_watch_render_seconds`` and ``_render_cpu_seconds`` (the previous render's wall and CPU time
  to build, format and compress).
"""

from __future__ import annotations

import gzip
import json
import re
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, StateSetMetricFamily
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

from gpudeck.agents.wire.protocol import LIVE_STATES, TERMINAL_STATES
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.watch.http_server import WsgiServer
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
RENDER_EVERY_S = 5.0  # the exposition is rebuilt this often while scraped (the watcher's snapshots come every 5 s)
IDLE_AFTER_S = 120.0  # a format nobody asked for in this long is no longer rendered (no scraper, no render CPU)
PROMETHEUS_ACCEPT = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
MAX_FORMATS = 8  # (content type, gzip) pairs rendered at once; a scraper asking for yet another is served live
GZIP_LEVEL = 6  # zlib's default: 1.4 MB of text (256 hosts) in ~14 ms to ~67 kB; level 9 took 4x the CPU for no gain


@dataclass
class WatchHealth:
    """The watcher's own counters, updated by the service."""

    events_read: int = 0
    started: float = field(default_factory=time.time)
    targets: list[TargetStatus] = field(default_factory=list)
    label: Callable[[str], str] = lambda _target: "t-?"  # the target's id (the outbox's keyed hash): never the URL


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
        self._lock = threading.Lock()  # the render thread and a live request (``name[]``) may collect at once: one at a time
        self.last_render_s = 0.0  # set by MetricsEndpoint after each render: build + format + compress
        self.last_render_cpu_s = 0.0

    def _runs(self, now: float) -> list[tuple]:
        live = ",".join("?" * len(LIVE_STATES))
        return self.conn.execute(
            f"SELECT {_RUN_COLS} FROM runs WHERE state IN ({live}) UNION ALL SELECT {_RUN_COLS} FROM runs WHERE ended >= ?"
            f" AND state NOT IN ({live}) LIMIT ?",
            (*LIVE_STATES, now - RUN_LINGER_S, *LIVE_STATES, MAX_RUNS),
        ).fetchall()

    def collect(self) -> Iterator[Metric]:
        """Every family, built now."""
        with self._lock:
            out = list(self._collect(time.time()))
        yield from out

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
        yield from self._health_families(now)

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

    def _health_families(self, now: float) -> Iterator[Metric]:
        h = self.health
        yield CounterMetricFamily("gpudeck_watch_events_read", "history events the watcher read", value=h.events_read)
        yield GaugeMetricFamily("gpudeck_watch_start_time_seconds", "when this watcher started (unix time)", value=h.started)
        yield GaugeMetricFamily(
            "gpudeck_watch_render_timestamp_seconds",
            "when this text was built (unix time): timestamp(x) - x is its age when scraped",
            value=now,
        )
        yield GaugeMetricFamily(
            "gpudeck_watch_render_seconds", "wall time the previous render took to build, format and compress", value=self.last_render_s
        )
        yield GaugeMetricFamily(
            "gpudeck_watch_render_cpu_seconds",
            "CPU time the previous render took to build, format and compress",
            value=self.last_render_cpu_s,
        )
        lab = ["target"]
        pending = GaugeMetricFamily("gpudeck_watch_notifications_pending", "notifications waiting for their target", labels=lab)
        delivered = CounterMetricFamily("gpudeck_watch_notifications_delivered", "notifications the target accepted", labels=lab)
        failures = CounterMetricFamily("gpudeck_watch_notifications_failures", "failed delivery attempts", labels=lab)
        expired = CounterMetricFamily("gpudeck_watch_notifications_expired", "notifications given up on", labels=lab)
        failing = GaugeMetricFamily("gpudeck_watch_target_failing", "1 when the target's recent attempts failed", labels=lab)
        for t in h.targets:
            lv = [h.label(t.target)]
            pending.add_metric(lv, float(t.pending))
            delivered.add_metric(lv, float(t.delivered))
            failures.add_metric(lv, float(t.failures))
            expired.add_metric(lv, float(t.expired))
            failing.add_metric(lv, 1.0 if t.failing else 0.0)
        yield from (pending, delivered, failures, expired, failing)


class _Families:
    """Families already built, collected again as they are (one build, formatted for every format asked)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class MetricsEndpoint:
    """Serves the collector's exposition as prometheus_client formats it, from bytes rendered in a thread of its own.

    A ``GET`` is answered with the latest render of the format it negotiates (prometheus_client's
    ``choose_encoder``, gzip when accepted), the same headers and bytes prometheus_client's WSGI app would send; the
    first ``GET`` of a format renders it at once (Prometheus's own format is rendered from the start). The thread renders every format asked within
    :data:`IDLE_AFTER_S` every ``every_s`` seconds (one build, formatted once per format). What the cache does not
    cover (``name[]`` filters, methods other than ``GET``) goes to prometheus_client's own app, built live. The HTTP
    server is console/watch/http_server.py: one thread and a bounded number of connections, however many are opened.
    """

    def __init__(self, collector: FleetCollector, every_s: float = RENDER_EVERY_S) -> None:
        self.collector = collector
        self.every_s = every_s
        # no describe(): the families depend on the fleet; "without names" lets a name[] filter reach the collector
        self.registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
        self.registry.register(collector)
        self._live = make_wsgi_app(self.registry)
        self._asked: dict[tuple[str, bool], tuple[Callable[[Any], bytes], float]] = {}  # (content type, gzip) -> (encoder, last asked)
        self._cache: dict[tuple[str, bool], bytes] = {}
        self._lock = threading.Lock()  # _asked and _cache
        self._render_lock = threading.Lock()  # one render at a time
        self._stop = threading.Event()
        self.renders = 0
        self.server: WsgiServer | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ rendering

    def render(self, keys: Iterable[tuple[str, bool]] | None = None) -> None:
        """Build the families once and format them for ``keys`` (default: every format asked recently)."""
        with self._render_lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            now = time.monotonic()
            with self._lock:
                if keys is None:
                    keys = [k for k, (_, asked) in self._asked.items() if now - asked < IDLE_AFTER_S]
                todo = [(k, self._asked[k][0]) for k in keys]
            if not todo:
                return
            fams = _Families(list(self.registry.collect()))
            out = {}
            for (ctype, gz), encoder in todo:
                body = encoder(fams)
                out[(ctype, gz)] = gzip.compress(body, compresslevel=GZIP_LEVEL) if gz else body
            with self._lock:
                self._cache.update(out)
            self.renders += 1
            self.collector.last_render_s = time.perf_counter() - t0
            self.collector.last_render_cpu_s = time.thread_time() - c0

    def _render_loop(self) -> None:
        while True:
            try:
                self.render()
            except Exception as exc:  # a render that fails leaves the previous one served; the next tries again
                print(f"gpudeck watch: metrics render failed ({type(exc).__name__}: {exc}); serving the previous one", file=sys.stderr)
            if self._stop.wait(self.every_s):
                return

    # ------------------------------------------------------------------ serving

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        """The WSGI app: cached bytes for a plain ``GET``, prometheus_client's own app for the rest."""
        if environ.get("REQUEST_METHOD") != "GET" or "name[]" in parse_qs(environ.get("QUERY_STRING", "")):
            return list(self._live(environ, start_response))
        if environ.get("PATH_INFO") == "/favicon.ico":
            return list(self._live(environ, start_response))
        encoder, ctype = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        gz = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", ""))
        key = (ctype, gz)
        now = time.monotonic()
        with self._lock:
            if key not in self._asked and len(self._asked) >= MAX_FORMATS:
                for k in [k for k, (_, asked) in self._asked.items() if now - asked >= IDLE_AFTER_S]:
                    del self._asked[k]
                    self._cache.pop(k, None)
            full = key not in self._asked and len(self._asked) >= MAX_FORMATS
            if not full:
                self._asked[key] = (encoder, now)
            body = self._cache.get(key)
        if full:  # the Accept header names the version: formats kept are bounded, one more is served live
            return list(self._live(environ, start_response))
        if body is None:  # the first scrape in this format: rendered now, then by the thread
            self.render([key])
            with self._lock:
                body = self._cache[key]
        headers = [("Content-Type", ctype)] + ([("Content-Encoding", "gzip")] if gz else [])
        start_response("200 OK", headers)
        return [body]

    def start(self, addr: str, port: int) -> int:
        """Serve on ``addr:port`` (0: any free port) and start rendering; the port served. OSError when it cannot bind."""
        self.server = WsgiServer(self.app)
        served = self.server.start(addr, port)
        # Prometheus's format (OpenMetrics 1.0, gzip) is rendered from the start, so that its first scrape does not wait
        # for a render either (it stops like any other format after IDLE_AFTER_S without a scrape)
        encoder, ctype = choose_encoder(PROMETHEUS_ACCEPT)
        with self._lock:
            self._asked[(ctype, True)] = (encoder, time.monotonic())
        self._threads = [threading.Thread(target=self._render_loop, name="metrics-render", daemon=True)]
        for t in self._threads:
            t.start()
        return served

    def shutdown(self) -> None:
        """Stop serving and rendering."""
        self._stop.set()
        if self.server is not None:
            self.server.shutdown()
