"""No notification target's secret leaves `gpudeck watch`: not its metrics, `--status`, `--status --json` or its log.

A real watcher process (with the real local agent) has one rule with 26 targets in the forms people write
(tests/notify_urls.py: passwords, tokens as user names, in paths, in query arguments and headers, service keys).
The loopback ones point at a closed port: the watcher tries them, fails and logs it. The others were recorded as
failing with errors that quote their URL (as a network library's would): nothing is sent to any real service.
Then the metrics are scraped over HTTP, `--status` and `--status --json` run, and the log read: none shows the
secret, in any spelling. The console's Fleet header is tested in tests/functional/test_console.py.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.console.watch import outbox as ob
from tests.agent_harness import AgentProc, teardown_agent, wait_for
from tests.notify_urls import LOOPBACK, REMOTE, URLS, leaks
from tests.watch_harness import metrics_watcher

pytestmark = pytest.mark.slow
PY = sys.executable


def seed_outbox(home: Path) -> None:
    """A pending notification for every loopback target; every other target failing with an error quoting its URL."""
    box = ob.Outbox(home / "watch.db")
    now = __import__("time").time()
    items = [ob.Item("local", "e", i, u, 1, "failed", "r-00000001", "t", "b", "failure", False, now) for i, u in enumerate(URLS)]
    box.enqueue(items, cursor=0, now=now)
    for it in items:
        if it.target in REMOTE:
            box.expire_item(it, f"HTTPSConnectionPool: Max retries exceeded with url {it.target} (recorded before the fix)", now=now)
    box.close()


@pytest.fixture
def watcher(gpudeck_home: Path) -> Iterator[tuple[AgentProc, str, Path, subprocess.Popen]]:
    (gpudeck_home / "config.toml").write_text(f'[[notify]]\nto = {json.dumps(URLS)}\non = ["failed"]\n')
    os.chmod(gpudeck_home / "config.toml", 0o600)
    a = AgentProc(gpudeck_home).start()
    seed_outbox(gpudeck_home)
    try:
        with metrics_watcher(a, gpudeck_home / "watch.log") as (w, url):
            yield a, url, gpudeck_home / "watch.log", w
    finally:
        teardown_agent(a)


def attempted(home: Path) -> set[str]:
    conn = sqlite3.connect(home / "watch.db")
    try:
        return {t for (t,) in conn.execute("SELECT target FROM targets WHERE failures > 0 OR expired > 0")}
    finally:
        conn.close()


def test_no_target_secret_in_metrics_status_or_log(watcher: tuple[AgentProc, str, Path, subprocess.Popen]) -> None:
    a, url, log, w = watcher
    wait_for(lambda: attempted(a.home) >= set(URLS), 60, what=f"an attempt at every target; log {log.read_text()[-2000:]}")

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:  # loopback: the watcher's own endpoint
            return r.read().decode()

    text = wait_for(lambda: (t := scrape()).count("gpudeck_watch_target_failing{") == len(URLS) and t, 30, what="every target's series")
    assert not leaks(text)
    labels = set(re.findall(r'gpudeck_watch_target_failing\{target="([^"]*)"\}', text))
    assert len(labels) == len(URLS) and all(re.fullmatch(r"t-[0-9a-f]{8}", x) for x in labels), labels

    st = a.cli("watch", "--status", check=False)
    assert st.returncode == 1 and st.stdout.count("FAILING") == len(URLS), st.stdout
    assert not leaks(st.stdout + st.stderr), st.stdout
    js = a.cli("watch", "--status", "--json", check=False)
    out = json.loads(js.stdout)
    assert out["running"] and out["running_pid"] == w.pid and js.returncode == 1
    assert {t["id"] for t in out["targets"]} == labels  # the ids --status gives are the metrics' labels
    assert not leaks(js.stdout + js.stderr)

    logged = log.read_text()
    assert logged.count("failed (") >= len(LOOPBACK) - 1  # mailto to a bare address apprise cannot use: dropped, said once
    assert not leaks(logged), logged
