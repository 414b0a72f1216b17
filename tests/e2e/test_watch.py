"""`gpudeck watch` end to end: a real agent, the real CLI, a real watcher process and a real HTTP receiver on loopback.

The receiver is the rule's apprise target (``json://127.0.0.1:PORT/hook``). A run fails, an alert fires, a run
succeeds: exactly the matching messages arrive, once each. The receiver down for a while: the message arrives
once it is back. The watcher killed with -9 between an event and its delivery: delivered once after the restart.
The watcher stopped while a run fails: the event is sent after the restart, marked late.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.agent_harness import ROOT, AgentProc, teardown_agent, wait_for

pytestmark = pytest.mark.slow
PROGS = Path(__file__).resolve().parent / "progs"
PY = sys.executable


class Receiver:
    """A JSON webhook on 127.0.0.1: keeps every message it accepted; while ``down`` it answers 503."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.refused = 0
        self.down = False
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if rec.down:
                    rec.refused += 1
                    self.send_response(503)
                else:
                    rec.messages.append(json.loads(body))
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"json://127.0.0.1:{self.port}/hook"

    def about(self, text: str) -> list[dict]:
        """Messages whose body names ``text`` (a run id)."""
        return [m for m in self.messages if text in m.get("message", "")]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class WatchProc:
    """A real ``gpudeck watch`` process on the test's GPUDECK_HOME; stopped or killed by its pid."""

    def __init__(self, agent: AgentProc, log: Path) -> None:
        self.agent = agent
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, *args: str) -> WatchProc:
        seen = self.log.read_text().count("following") if self.log.exists() else 0  # the log is appended to across restarts
        self.fh = open(self.log, "a")
        self.proc = subprocess.Popen(
            [PY, "-m", "gpudeck.console.cli.main", "watch", *args],
            env=self.agent.env,
            stdin=subprocess.DEVNULL,
            stdout=self.fh,
            stderr=self.fh,
            start_new_session=True,
        )
        wait_for(lambda: self.log.read_text().count("following") > seen or self.proc.poll() is not None, 30, what="the watcher to start")
        assert self.proc.poll() is None, self.log.read_text()
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(20)
        self.fh.close()


def caught_up(home: Path) -> bool:
    """The watcher's cursor has reached the end of the history (every event synced so far has been read)."""
    hist = sqlite3.connect(home / "history.db")
    ob = sqlite3.connect(home / "watch.db")
    try:
        top = hist.execute("SELECT MAX(rowid) FROM events").fetchone()[0] or 0
        row = ob.execute("SELECT value FROM meta WHERE key='events_rowid'").fetchone()
        return row is not None and int(row[0]) >= top
    finally:
        hist.close()
        ob.close()


def outbox_rows(home: Path, run_id: str) -> list[tuple]:
    ob = sqlite3.connect(home / "watch.db")
    try:
        return ob.execute("SELECT state, attempts, late FROM outbox WHERE run_id=?", (run_id,)).fetchall()
    finally:
        ob.close()


def run_state(a: AgentProc, rid: str) -> str:
    return next(r for r in a.cli_json("runs") if r["id"] == rid)["state"]


def launch(a: AgentProc, name: str, *argv: str) -> str:
    return a.cli_json("launch", "--name", name, "--", *argv)["id"]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProc, Receiver, WatchProc]]:
    home = tmp_path_factory.mktemp("watch")
    old = {k: os.environ.get(k) for k in ("GPUDECK_HOME", "GPUDECK_SIMULATE_GPUS")}
    os.environ["GPUDECK_HOME"] = str(home)
    os.environ["GPUDECK_SIMULATE_GPUS"] = "4:H200:141"
    rec = Receiver()
    (home / "config.toml").write_text(
        f'[[notify]]\nto = ["{rec.url}"]\non = ["failed", "succeeded", "alert:rank_died"]\nmatch = "name:~w-"\n'
    )
    os.chmod(home / "config.toml", 0o600)
    a = AgentProc(home).start()
    w = WatchProc(a, home / "watch.log").start()
    try:
        yield a, rec, w
    finally:
        w.stop()
        teardown_agent(a)
        rec.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_matching_events_arrive_once_each(env: tuple[AgentProc, Receiver, WatchProc]) -> None:
    a, rec, w = env
    fail = launch(a, "w-fail", PY, "-c", "import sys; sys.exit(3)")
    ok = launch(a, "w-ok", PY, "-c", "pass")
    other = launch(a, "other-fail", PY, "-c", "import sys; sys.exit(3)")  # fails too, but `match` leaves it out
    crawl = launch(a, "w-crawl", PY, str(PROGS / "ranks.py"), str(ROOT), "3", "--sim-gib", "1", "--seconds", "120")
    runs = lambda: next(x for x in a.cli_json("status", "--host", "local")["runs"] if x["id"] == crawl)
    members = wait_for(
        lambda: len({m["rank"] for m in runs()["members"] if m.get("rank") is not None}) == 3 and runs()["members"], 30, what="3 ranks"
    )
    os.kill(next(m["pid"] for m in members if m.get("rank") == 1), signal.SIGKILL)
    wait_for(
        lambda: rec.about(fail) and rec.about(ok) and rec.about(crawl),
        60,
        what=f"three messages; got {rec.messages}; log {w.log.read_text()[-2000:]}",
    )
    a.cli("stop", crawl, "--grace", "1")  # stopped is not in `on`: no message
    wait_for(lambda: run_state(a, other) == "failed" and run_state(a, crawl) == "stopped", 30, what="the runs ended")
    wait_for(lambda: caught_up(a.home), 30, what="the watcher read the whole history")
    # the watcher restarted reads nothing twice
    w.stop()
    w.start()
    wait_for(lambda: caught_up(a.home), 30, what="the restarted watcher caught up")

    assert [m["title"] for m in rec.about(fail)] == [f"gpudeck: run {fail} (w-fail) failed on local"]
    assert rec.about(fail)[0]["type"] == "failure" and f"gpudeck show {fail} --host local" in rec.about(fail)[0]["message"]
    assert "exit code 3" in rec.about(fail)[0]["message"]
    assert len(rec.about(ok)) == 1 and rec.about(ok)[0]["type"] == "success" and "succeeded" in rec.about(ok)[0]["title"]
    alert = rec.about(crawl)
    assert (
        len(alert) == 1 and alert[0]["title"].startswith(f"gpudeck: rank_exited on run {crawl}") and "2 of 3 ranks" in alert[0]["message"]
    )
    assert rec.about(other) == []
    assert len(rec.messages) == 3, [m["title"] for m in rec.messages]
    assert all("[late]" not in m["title"] for m in rec.messages)
    st = json.loads(a.cli("watch", "--status", "--json").stdout)
    assert st["running_pid"] == w.proc.pid and st["targets"][0]["delivered"] == 3 and not st["targets"][0]["failing"]


def test_receiver_down_then_back_delivers_once(env: tuple[AgentProc, Receiver, WatchProc]) -> None:
    a, rec, w = env
    rec.down = True
    rid = launch(a, "w-down", PY, "-c", "import sys; sys.exit(4)")
    wait_for(lambda: rec.refused >= 3, 60, what="three refused attempts")
    st = a.cli("watch", "--status", check=False)
    assert st.returncode == 1 and "FAILING" in st.stdout and "127.0.0.1" in st.stdout, st.stdout
    assert [r[0] for r in outbox_rows(a.home, rid)] == ["pending"]
    rec.down = False
    wait_for(lambda: rec.about(rid), 60, what="the message after the receiver came back")
    wait_for(lambda: outbox_rows(a.home, rid)[0][0] == "delivered", 10, what="marked delivered")
    assert len(rec.about(rid)) == 1
    assert a.cli("watch", "--status", check=False).returncode == 0


def test_killed_between_event_and_delivery_delivers_once_after_restart(env: tuple[AgentProc, Receiver, WatchProc]) -> None:
    a, rec, w = env
    rec.down = True
    rid = launch(a, "w-kill", PY, "-c", "import sys; sys.exit(5)")
    wait_for(lambda: outbox_rows(a.home, rid), 30, what="the notification queued")
    w.stop(signal.SIGKILL)
    assert rec.about(rid) == [] and outbox_rows(a.home, rid)[0][0] == "pending"
    rec.down = False
    w.start()
    wait_for(lambda: rec.about(rid), 60, what="the message after the restart")
    wait_for(lambda: outbox_rows(a.home, rid)[0][0] == "delivered" and caught_up(a.home), 10, what="marked delivered")
    assert len(rec.about(rid)) == 1 and "[late]" not in rec.about(rid)[0]["title"]


def test_event_while_watcher_down_is_sent_late(env: tuple[AgentProc, Receiver, WatchProc]) -> None:
    a, rec, w = env
    w.stop()
    rid = launch(a, "w-late", PY, "-c", "import sys; sys.exit(6)")
    wait_for(lambda: run_state(a, rid) == "failed", 30, what="the run failed")
    w.start()
    wait_for(lambda: rec.about(rid), 60, what="the late message")
    wait_for(lambda: caught_up(a.home), 10, what="caught up")
    msg = rec.about(rid)
    assert len(msg) == 1 and msg[0]["title"].startswith("[late] ") and "while gpudeck watch was not running" in msg[0]["message"]


def test_check_sends_a_test_notification_to_every_target(env: tuple[AgentProc, Receiver, WatchProc]) -> None:
    a, rec, w = env
    before = len(rec.messages)
    cp = a.cli("watch", "--check")
    assert "1 [[notify]] rule(s), 1 target(s)" in cp.stdout and "ok" in cp.stdout and f"127.0.0.1:{rec.port}" in cp.stdout
    assert [m["title"] for m in rec.messages[before:]] == ["gpudeck: test notification"]
    rec.down = True
    try:
        cp = a.cli("watch", "--check", check=False)
        assert cp.returncode == 1 and "FAILED" in cp.stdout
    finally:
        rec.down = False
    conf = a.home / "config.toml"
    good = conf.read_text()
    try:
        conf.write_text(good.replace('"failed"', '"crashed"'))
        cp = a.cli("watch", "--check", check=False)
        assert cp.returncode == 2 and "unknown event 'crashed'" in cp.stderr
    finally:
        conf.write_text(good)
