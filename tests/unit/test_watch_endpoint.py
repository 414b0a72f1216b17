"""The watcher's metrics endpoint: scrapes are answered from a render made off the scrape path, in prometheus_client's formats."""

from __future__ import annotations

import gzip
import socket
import sqlite3
import time
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from gpudeck.agents.wire.protocol import Gpu, Snapshot
from gpudeck.console.watch.metrics import FleetCollector, MetricsEndpoint, WatchHealth

OPENMETRICS = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"


def fleet(n: int) -> SimpleNamespace:
    """A stand-in Fleet: what the collector reads (``links[name].status.state`` and ``.snapshot``)."""
    links = {}
    for h in range(n):
        snap = Snapshot(
            host=f"h{h}", ts=time.time(), epoch="e", gpus=[Gpu(index=i, memory_used=i << 30, memory_total=80 << 30) for i in range(2)]
        )
        links[f"h{h}"] = SimpleNamespace(status=SimpleNamespace(state="up", snapshot=snap))
    return SimpleNamespace(links=links)


def history() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.execute(
        "CREATE TABLE runs(host, id, kind, state, last_step, last_loss, tokens_per_s, mfu, alerts, world_size, ranks_seen, spec, ended)"
    )
    return conn


@pytest.fixture
def endpoint() -> Iterator[tuple[MetricsEndpoint, SimpleNamespace, str]]:
    f = fleet(2)
    ep = MetricsEndpoint(FleetCollector(f, history(), WatchHealth()), every_s=0.2)  # type: ignore[arg-type]
    port = ep.start("127.0.0.1", 0)
    try:
        yield ep, f, f"http://127.0.0.1:{port}/metrics"
    finally:
        ep.shutdown()


def get(url: str, accept: str = "", gz: bool = False) -> tuple[dict[str, str], str]:
    headers = {"Accept": accept} if accept else {}
    if gz:
        headers["Accept-Encoding"] = "gzip"
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:  # loopback: this test's own server
        raw = r.read()
        hdrs = dict(r.headers)
    return hdrs, (gzip.decompress(raw) if hdrs.get("Content-Encoding") == "gzip" else raw).decode()


def test_scrapes_are_served_from_the_render_and_parse(endpoint: tuple[MetricsEndpoint, SimpleNamespace, str]) -> None:
    ep, f, url = endpoint
    hdrs, text = get(url, OPENMETRICS, gz=True)  # as Prometheus asks
    assert hdrs["Content-Type"].startswith("application/openmetrics-text; version=1.0.0") and hdrs["Content-Encoding"] == "gzip"
    fams = {m.name: m for m in om_families(text)}
    assert len(fams["gpudeck_gpu_memory_used_bytes"].samples) == 4
    rendered = fams["gpudeck_watch_render_timestamp_seconds"].samples[0].value
    assert abs(time.time() - rendered) < 5
    # the plain text format, negotiated separately, parses with prometheus_client's own parser
    hdrs, text = get(url)
    assert hdrs["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "gpudeck_host_up" in {m.name for m in text_string_to_metric_families(text)}

    # a host added to the fleet shows at a later render, not at the scrape: the scrape serves the latest render
    f.links["h9"] = SimpleNamespace(status=SimpleNamespace(state="up", snapshot=None))
    deadline = time.time() + 10
    while time.time() < deadline:
        fams = {m.name: m for m in om_families(get(url, OPENMETRICS, gz=True)[1])}
        if any(s.labels["host"] == "h9" for s in fams["gpudeck_host_up"].samples):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the new host never reached the endpoint")
    assert fams["gpudeck_watch_render_timestamp_seconds"].samples[0].value > rendered
    assert fams["gpudeck_watch_render_cpu_seconds"].samples[0].value > 0


def test_a_scrape_does_not_render_and_renders_stop_without_scrapers(
    endpoint: tuple[MetricsEndpoint, SimpleNamespace, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ep, _f, url = endpoint
    get(url, OPENMETRICS, gz=True)
    calls: list[float] = []
    real = ep.render

    def counted(keys: object = None) -> None:
        calls.append(time.time())
        real(keys)  # type: ignore[arg-type]

    monkeypatch.setattr(ep, "render", counted)
    ep.every_s = 3600.0  # the thread's next render is far away (it is waiting on the previous period: at most 0.2 s more)
    time.sleep(0.5)
    calls.clear()
    for _ in range(5):
        get(url, OPENMETRICS, gz=True)
    assert calls == [], "a scrape of a format already rendered must not render"
    # a filtered scrape (name[]) is prometheus_client's own, built live, and holds only that family
    _h, text = get(url + "?name[]=gpudeck_host_up")
    assert {m.name for m in text_string_to_metric_families(text)} == {"gpudeck_host_up"}
    # formats nobody asked for lately are not rendered
    monkeypatch.setattr("gpudeck.console.watch.metrics.IDLE_AFTER_S", 0.0)
    renders = ep.renders
    real()
    assert ep.renders == renders


def test_formats_kept_are_bounded(endpoint: tuple[MetricsEndpoint, SimpleNamespace, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The Accept header names the version: a scraper cycling through versions gets answers, the render keeps a few."""
    ep, _f, url = endpoint
    monkeypatch.setattr("gpudeck.console.watch.metrics.MAX_FORMATS", 3)
    for minor in range(6):
        hdrs, text = get(url, f"application/openmetrics-text;version=1.0.{minor}")
        assert hdrs["Content-Type"].startswith(f"application/openmetrics-text; version=1.0.{minor}")
        assert "gpudeck_host_up" in {m.name for m in om_families(text)}
    assert len(ep._asked) == 3 and len(ep._cache) <= 3


def test_half_open_connections_take_no_thread_and_a_scrape_still_answers(
    endpoint: tuple[MetricsEndpoint, SimpleNamespace, str],
) -> None:
    """950 connections that never finish their request made prometheus_client's server run 957 threads: now one loop
    thread reads every request head, the open connections are bounded (the longest-waiting is closed) and a scraper is served."""
    import resource
    import threading
    from urllib.parse import urlsplit

    from gpudeck.console.watch import http_server

    ep, _f, url = endpoint
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = 950
    want = min(hard, 4 * n) if hard != resource.RLIM_INFINITY else 4 * n
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < n + http_server.MAX_CONNECTIONS + 64:
        n = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - http_server.MAX_CONNECTIONS - 64
    before = threading.active_count()
    port = urlsplit(url).port
    half: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the head
            half.append(s)
        time.sleep(0.5)
        assert threading.active_count() <= before + http_server.APP_THREADS, [t.name for t in threading.enumerate()]
        assert ep.server is not None and ep.server.open_connections() <= http_server.MAX_CONNECTIONS
        t0 = time.monotonic()
        hdrs, text = get(url, OPENMETRICS, gz=True)
        assert "gpudeck_host_up" in text and time.monotonic() - t0 < 5
        assert threading.active_count() <= before + http_server.APP_THREADS
        closed = sum(closed_by_server(s) for s in half[: n // 2])  # the oldest were closed to make room
        assert closed >= n // 2 - http_server.MAX_CONNECTIONS
    finally:
        for s in half:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def closed_by_server(s: socket.socket, wait_s: float = 0.01) -> bool:
    s.settimeout(wait_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_request_head_not_complete_in_time_is_closed(
    endpoint: tuple[MetricsEndpoint, SimpleNamespace, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from urllib.parse import urlsplit

    from gpudeck.console.watch import http_server

    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 0.3)
    _ep, _f, url = endpoint
    with socket.create_connection(("127.0.0.1", urlsplit(url).port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert closed_by_server(s, wait_s=5.0)
    with socket.create_connection(("127.0.0.1", urlsplit(url).port), timeout=5) as s:
        s.sendall(b"NOT HTTP\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
