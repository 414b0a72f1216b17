"""`gpudeck watch --metrics`: the endpoint parsed with prometheus_client's own parser, and scraped by a real Prometheus.

A real agent (simulated GPUs, labelled so) runs a two-rank run; the watcher serves metrics on a loopback port.
The text is parsed with ``prometheus_client.parser``; then Debian's ``prometheus`` (installed by ``make
test-deps``; the test is skipped, saying so, when it is missing) scrapes the watcher every second for a few
seconds, and PromQL over its HTTP API returns the run's and the GPUs' series.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agent_harness import ROOT, AgentProc, teardown_agent, wait_for
from tests.watch_harness import metrics_watcher

pytestmark = pytest.mark.slow
PROGS = Path(__file__).resolve().parent / "progs"
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # loopback only: the URLs are built here
        return r.read().decode()


@pytest.fixture
def watched(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[AgentProc, str, str]]:
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "4:H200:141")
    a = AgentProc(gpudeck_home).start()
    try:
        with metrics_watcher(a, gpudeck_home / "watch.log") as (_w, url):
            rid = a.cli_json(
                "launch", "--name", "m-run", "--", PY, str(PROGS / "ranks.py"), str(ROOT), "2", "--sim-gib", "1", "--seconds", "60"
            )["id"]
            yield a, url, rid
    finally:
        teardown_agent(a)


def families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(get(url))}


def test_metrics_parse_and_a_real_prometheus_scrapes_them(watched: tuple[AgentProc, str, str], tmp_path: Path) -> None:
    a, url, rid = watched

    def run_step() -> float | None:
        fam = families(url).get("gpudeck_run_step")
        return next((s.value for s in fam.samples if s.labels.get("run_id") == rid and s.value > 0), None) if fam else None

    wait_for(run_step, 30, what="the run's step in the metrics")
    fams = families(url)
    used = fams["gpudeck_gpu_memory_used_bytes"].samples
    assert sorted(s.labels["gpu"] for s in used if s.labels["host"] == "local") == ["0", "1", "2", "3"]
    assert {s.labels["host"] for s in fams["gpudeck_host_up"].samples if s.value == 1} == {"local"}
    assert next(s.value for s in fams["gpudeck_host_simulated"].samples if s.labels["host"] == "local") == 1
    state = {s.labels["gpudeck_run_state"]: s.value for s in fams["gpudeck_run_state"].samples if s.labels["run_id"] == rid}
    assert state["running"] == 1 and state["failed"] == 0
    assert next(s.value for s in fams["gpudeck_run_ranks_expected"].samples if s.labels["run_id"] == rid) == 2
    # every label is bounded: no pid, no name, no free text
    labels = {k for f in fams.values() for s in f.samples for k in s.labels}
    assert labels <= {"host", "gpu", "attribution", "run_id", "kind", "gpudeck_run_state", "gpudeck_host_link_state", "target"}, labels
    assert "m-run" not in get(url)
    # the Grafana dashboard in the repository asks only for families the endpoint serves
    dash = (ROOT / "docs" / "grafana" / "gpudeck.json").read_text()
    wanted = {n.removesuffix("_total") for n in re.findall(r"gpudeck_[a-z_]+", dash)}
    assert wanted <= set(fams), wanted - set(fams)

    prom = shutil.which("prometheus")
    if prom is None:
        pytest.skip("Debian's prometheus is not installed (make test-deps installs it): the PromQL half of this test did not run")
    target = urllib.parse.urlparse(url).netloc
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: gpudeck\n    static_configs:\n      - targets: ['{target}']\n"
    )
    p = subprocess.Popen(
        [
            prom,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "w"),
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api/v1/query?query="

    def query(q: str) -> list[dict]:
        try:
            out = json.loads(get(api + urllib.parse.quote(q)))
        except OSError:
            return []
        return out["data"]["result"] if out.get("status") == "success" else []

    try:
        wait_for(
            lambda: query(f'gpudeck_run_step{{run_id="{rid}"}} > 0'),
            60,
            interval=0.5,
            what=f"Prometheus to scrape the run; log {(tmp_path / 'prometheus.log').read_text()[-1500:]}",
        )
        assert len(query('gpudeck_gpu_memory_used_bytes{host="local"}')) == 4
        assert query(f'gpudeck_run_state{{run_id="{rid}", gpudeck_run_state="running"}} == 1')
        assert query('up{job="gpudeck"} == 1')
        wait_for(
            lambda: float(query(f'count_over_time(gpudeck_run_step{{run_id="{rid}"}}[1m])')[0]["value"][1]) >= 3,
            30,
            interval=0.5,
            what="three scrapes",
        )
        # the text is rendered off the scrape path: its age when scraped is visible, and bounded by the render period
        age = float(query("timestamp(gpudeck_watch_render_timestamp_seconds) - gpudeck_watch_render_timestamp_seconds")[0]["value"][1])
        assert 0 <= age < 15, age
        scrape = float(query('scrape_duration_seconds{job="gpudeck"}')[0]["value"][1])
        print(f"watch_metrics: Prometheus scraped the watcher in {scrape * 1000:.1f} ms; the text was {age:.1f} s old")
    finally:
        os.kill(p.pid, signal.SIGTERM)
        p.wait(20)
