"""A real ``gpudeck watch --metrics`` process for the watcher's end-to-end tests: started on a free loopback port, stopped by its pid."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.agent_harness import AgentProc, wait_for


@contextmanager
def metrics_watcher(a: AgentProc, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """The watcher on ``a``'s GPUDECK_HOME serving metrics on 127.0.0.1 (any free port), its output in ``log``: (process, URL)."""
    fh = open(log, "w")
    w = subprocess.Popen(
        [sys.executable, "-m", "gpudeck.console.cli.main", "watch", "--metrics", "127.0.0.1:0"],
        env=a.env,
        stdin=subprocess.DEVNULL,
        stdout=fh,
        stderr=fh,
        start_new_session=True,
    )
    try:
        m = wait_for(
            lambda: re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", log.read_text()) or w.poll() is not None,
            30,
            what="the endpoint",
        )
        assert w.poll() is None, log.read_text()
        yield w, m.group(1)
    finally:
        if w.poll() is None:
            os.kill(w.pid, signal.SIGTERM)
            w.wait(20)
        fh.close()
