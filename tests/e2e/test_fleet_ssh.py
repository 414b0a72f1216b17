"""The fleet over real SSH: real sshd per host, locked-down keys, real agents, the real CLI and history."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpudeck.console.core import config as cfg
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.fleet.transport import HostKeyError, connect_ssh
from gpudeck.console.history.replica import History
from tests.agent_harness import stop_runs, wait_for
from tests.agent_harness import until as wait_until
from tests.sshd_harness import ConsoleSide, SshHost, keygen

pytestmark = pytest.mark.slow
PY = sys.executable


@pytest.fixture
def console_side():
    c = ConsoleSide()
    yield c
    for h in c.hosts:
        stop_runs(h.agent)
    c.cleanup()


@pytest.fixture
def two_hosts(console_side: ConsoleSide):
    for name in ("hosta", "hostb"):
        console_side.add(SshHost(name, console_side.pub).start())
    console_side.cli("hosts", "add", "hosta", "hostb")
    return console_side


def _fleet(c: ConsoleSide, history: History | None = None, interval_s: float = 0.5, names: tuple[str, ...] = ("hosta", "hostb")) -> Fleet:
    conf = cfg.Config(hosts=tuple(cfg.HostSettings(n) for n in ("local", *names)), path=c.gpudeck_home / "config.toml")
    return Fleet(config=conf, ssh=c.ssh_options(), history=history, interval_s=interval_s, state_dir=c.gpudeck_home / "agent")


def test_launch_tail_stop_on_a_remote_host_and_find_it_in_history(two_hosts: ConsoleSide) -> None:
    c = two_hosts
    check = c.cli_json("hosts", "--check")
    assert {h["name"]: h["state"] for h in check["hosts"]} == {"local": "up", "hosta": "up", "hostb": "up"}

    rid = c.cli(
        "launch", "--host", "hostb", "--name", "greeter", "--", PY, "-c", "print('hello from b', flush=True); import time; time.sleep(120)"
    ).stdout.strip()
    assert rid.startswith("r-")
    # the run lives on hostb's agent, not on hosta's or the local one
    assert any(r["id"] == rid for r in two_hosts.hosts[1].agent.cli_json("runs"))
    assert not any(r["id"] == rid for r in two_hosts.hosts[0].agent.cli_json("runs"))

    out = wait_for(
        lambda: (t := c.cli("tail", rid, "-n", "5").stdout) and "hello from b" in t and t, timeout=30, what="the run's output over SSH"
    )
    assert "hello from b" in out
    runs = c.cli_json("runs")
    assert next(r for r in runs if r["id"] == rid)["host"] == "hostb"
    status = c.cli_json("status")
    assert {h["host"]: h["state"] for h in status["hosts"]} == {"local": "up", "hosta": "up", "hostb": "up"}

    res = c.cli_json("stop", rid, "--grace", "5")  # no --host: the fleet finds the run on hostb
    assert res["host"] == "hostb" and res["state"] == "stopped"
    assert not res.get("survivors")

    rows = c.cli_json("history", "host:hostb")
    row = next(r for r in rows if r["id"] == rid)
    assert row["state"] == "stopped" and row["cause"].startswith("stopped by operator") and row["cause_class"] == "operator"
    assert row["name"] == "greeter" and row["argv"][0] == PY
    assert [r["id"] for r in c.cli_json("history", "cause:operator", "name:~greet")] == [rid]
    assert c.cli_json("history", "host:hosta") == []
    shown = c.cli_json("show", rid)
    kinds = [e["kind"] for e in shown["events"]]
    assert kinds[0] == "run_created" and "run_state" in kinds
    assert sum(1 for e in shown["events"] if e["kind"] == "run_state" and e["data"]["state"] == "stopped") == 1
    human = c.cli("show", rid).stdout
    assert "stopped by operator" in human and "timeline:" in human

    # syncing again adds nothing: the replica is idempotent
    db = c.gpudeck_home / "history.db"
    n1 = (
        subprocess.run(["sqlite3", str(db), "select count(*) from events"], capture_output=True, text=True).stdout
        if shutil.which("sqlite3")
        else None
    )
    c.cli("history")
    h = History(db)
    try:
        counts = {host: h.event_count(host) for host in ("hosta", "hostb")}
        for host in ("hosta", "hostb"):
            epoch = next(x.epoch for x in h.hosts() if x.name == host)
            seqs = h.seqs(host, epoch)
            assert seqs == list(range(1, len(seqs) + 1)), f"{host}: gap or duplicate in {seqs}"
        assert counts["hostb"] > 0
    finally:
        h.close()
    if n1 is not None:
        n2 = subprocess.run(["sqlite3", str(db), "select count(*) from events"], capture_output=True, text=True).stdout
        assert n1 == n2


@pytest.mark.timeout(240)
async def test_a_run_that_ends_while_the_console_is_cut_off_is_recorded_exactly_once(two_hosts: ConsoleSide) -> None:
    c = two_hosts
    hosta, hostb = c.hosts
    history = History(c.gpudeck_home / "history.db")
    fleet = _fleet(c, history)
    fleet.start()
    try:

        def about() -> str:
            return f"hostb: {fleet.links['hostb'].status}"

        until = functools.partial(wait_until, about=about)

        await until(lambda: all(fleet.links[h].status.state == "up" for h in ("hosta", "hostb")), 30, "both hosts up")
        reply = await fleet.launch("hostb", _spec(["-c", "import time; time.sleep(4); raise SystemExit(3)"]))
        rid = reply.run.id
        await until(lambda: _state(history, "hostb", rid) == "running", 20, "the run in history as running")

        hostb.stop_sshd()  # the console loses hostb: sessions and listener gone
        await until(lambda: fleet.links["hostb"].status.state == "unreachable", 30, "hostb unreachable")
        assert fleet.links["hostb"].status.error
        # the other host keeps updating while hostb is down
        seen = fleet.links["hosta"].status.last_seen or 0
        await until(lambda: (fleet.links["hosta"].status.last_seen or 0) > seen + 1, 10, "hosta still streaming")
        # and the CLI shows every host by the fleet's name, the one that is down with why
        cp = await asyncio.to_thread(c.cli, "status", check=False)
        assert cp.returncode == 3, cp  # a host it needed did not answer
        me = socket.gethostname().split(".")[0]  # the machine's name, as the agents report it
        assert f"host hosta ({me})" in cp.stdout and f"host local ({me})" in cp.stdout, cp.stdout
        assert "host hostb  UNREACHABLE: nothing accepts SSH connections there (" in cp.stdout, cp.stdout
        assert "is sshd running, and are HostName and Port for hostb in ~/.ssh/config right?" in cp.stdout, cp.stdout
        # the run ends on hostb while nobody watches
        await asyncio.to_thread(
            wait_for,
            lambda: next((r for r in hostb.agent.cli_json("runs") if r["id"] == rid and r["state"] == "failed"), None),
            30,
            0.2,
            "the run to end on hostb",
        )
        assert _state(history, "hostb", rid) == "running"  # the console could not know yet

        hostb.start_sshd()  # same port, same keys: the link comes back by itself
        await until(lambda: fleet.links["hostb"].status.state == "up", 60, "hostb back up")
        await until(lambda: _state(history, "hostb", rid) == "failed", 30, "the run's end in history")
        row = history.find(rid)
        assert row.exit_code == 3 and row.cause is not None and row.cause.startswith("exit code 3") and row.cause_class == "exit_code"
        events = history.events("hostb", rid)
        ends = [e for e in events if e.kind == "run_state" and e.data["state"] == "failed"]
        assert len(ends) == 1, events
        epoch = fleet.links["hostb"].status.epoch
        seqs = history.seqs("hostb", epoch)
        assert seqs == list(range(1, len(seqs) + 1)), f"gap or duplicate: {seqs}"
        agent_last = json.loads(hostb.agent.cli("agent", "status", "--json").stdout)["epoch"] == epoch
        assert agent_last
        assert fleet.links["hostb"].status.connects >= 2
    finally:
        await fleet.close()
        history.close()


def _spec(args: list[str]):  # type: ignore[no-untyped-def]
    from gpudeck.agents.wire.protocol import LaunchSpec

    return LaunchSpec(argv=[PY, *args], name="away")


def _state(history: History, host: str, rid: str) -> str | None:
    try:
        return history.find(rid, host).state
    except Exception:
        return None


async def test_unknown_and_changed_host_keys_are_refused_before_anything_is_sent(console_side: ConsoleSide) -> None:
    c = console_side
    stranger = SshHost("hostc", c.pub, start_agent=False).start()
    c.add(stranger, trust=False)
    cp = c.cli("status", "--host", "hostc", check=False)
    assert cp.returncode == 3  # not reached (safely): EXIT_UNREACHABLE
    assert "is not known" in cp.stderr and "ssh hostc" in cp.stderr, cp.stderr

    # a key recorded for that address that is not the host's: a changed key
    other = keygen(c.dir / "impostor")
    with open(c.known_hosts, "a") as fh:
        fh.write(f"[{stranger.address}]:{stranger.port} {other}\n")
    cp = c.cli("status", "--host", "hostc", check=False)
    assert cp.returncode == 3  # not reached (safely): EXIT_UNREACHABLE
    assert "CHANGED" in cp.stderr and "possible attack" in cp.stderr and "ssh-keygen -R" in cp.stderr, cp.stderr
    with pytest.raises(HostKeyError):
        await connect_ssh("hostc", "gpudeck agent dial", c.ssh_options())
    # the key check happens before authentication: no session ever started there
    assert "Starting session" not in stranger.log.read_text()


def test_a_host_given_with_host_that_is_not_configured_still_works(console_side: ConsoleSide) -> None:
    c = console_side
    h = SshHost("hostd", c.pub).start()
    c.add(h)
    snap = c.cli_json("status", "--host", "hostd")
    assert snap["epoch"] and "gpus" in snap or "gpu_error" in snap
    cp = c.cli("status", "--host", "nosuchhost", check=False)
    assert cp.returncode == 3 and "nosuchhost" in cp.stderr


async def test_a_recreated_agent_journal_is_a_new_epoch_and_old_runs_stay(two_hosts: ConsoleSide) -> None:
    c = two_hosts
    hostb = c.hosts[1]
    rid = c.cli("launch", "--host", "hostb", "--", PY, "-c", "pass").stdout.strip()
    wait_for(lambda: any(r["id"] == rid and r["state"] == "succeeded" for r in hostb.agent.cli_json("runs")), 20, what="run ends")
    assert [r["id"] for r in c.cli_json("history", "host:hostb")] == [rid]
    hostb.agent.stop()
    for f in hostb.agent.state_dir.glob("journal.db*"):
        f.rename(f.with_name("old-" + f.name))
    hostb.agent.start()
    rid2 = c.cli("launch", "--host", "hostb", "--", PY, "-c", "pass").stdout.strip()
    wait_for(lambda: any(r["id"] == rid2 and r["state"] == "succeeded" for r in hostb.agent.cli_json("runs")), 20, what="second run ends")
    cp = c.cli("history", "host:hostb", "--json")
    assert {r["id"] for r in json.loads(cp.stdout)} == {rid, rid2}
    h = History(c.gpudeck_home / "history.db")
    try:
        epochs = h.epochs("hostb")
        assert len(epochs) == 2 and epochs[1].replaces == epochs[0].epoch
    finally:
        h.close()


def test_the_locked_down_key_runs_the_agent_bridge_and_nothing_else(console_side: ConsoleSide, tmp_path: Path) -> None:
    c = console_side
    h = SshHost("hoste", c.pub).start()
    c.add(h)
    marker = tmp_path / "ran"
    cp = subprocess.run(
        ["ssh", "-F", str(c.ssh_config), "-o", f"UserKnownHostsFile={c.known_hosts}", "-o", "BatchMode=yes", "hoste", f"touch {marker}"],
        input="",
        capture_output=True,
        text=True,
        timeout=30,
        env=c.env,
    )
    assert not marker.exists(), "a shell command ran through the restricted key"
    # what ran instead is the bridge: its first line is the agent's answer to garbage, a typed error
    cp = subprocess.run(
        ["ssh", "-F", str(c.ssh_config), "-o", f"UserKnownHostsFile={c.known_hosts}", "-o", "BatchMode=yes", "hoste", "anything"],
        input="not json\n",
        capture_output=True,
        text=True,
        timeout=30,
        env=c.env,
    )
    assert json.loads(cp.stdout.splitlines()[0])["code"] == "bad_json", cp.stdout + cp.stderr
    assert os.path.exists(h.home / "agent" / "journal.db")


def _journal_seqs(host: SshHost) -> tuple[str, list[int]]:
    """The agent's own journal, read from its file: (epoch, every seq)."""
    import sqlite3

    db = sqlite3.connect(host.agent.state_dir / "journal.db", timeout=10)
    try:
        epoch = db.execute("SELECT value FROM meta WHERE key='epoch'").fetchone()[0]
        return epoch, [s for (s,) in db.execute("SELECT seq FROM events ORDER BY seq")]
    finally:
        db.close()


@pytest.mark.timeout(180)
async def test_a_restarted_agent_is_reconnected_while_the_history_is_locked_and_nothing_is_lost(console_side: ConsoleSide) -> None:
    """issue 33: at 1,024 hosts the link of a host that restarts its agent every minute did not come back. When the link
    dropped, recording its state in history.db met a writer that held the file past the busy timeout ("database is
    locked"), and the exception ended the link's reconnect loop for good. The rule: a host that comes back is
    reconnected within its backoff cap, and its sync resumes from the cursor with nothing lost or doubled."""
    import sqlite3

    from gpudeck.console.fleet.fleet import BACKOFF_MAX_S

    c = console_side
    host = SshHost("hostr", c.pub).start()
    c.add(host)
    history = History(c.gpudeck_home / "history.db")
    fleet = _fleet(c, history, names=("hostr",))
    link = fleet.links["hostr"]
    fleet.start()
    locker: sqlite3.Connection | None = None
    try:

        def about() -> str:
            return f"hostr: {link.status}"

        until = functools.partial(wait_until, about=about)

        def caught_up() -> bool:
            epoch, seqs = _journal_seqs(host)
            return bool(seqs) and history.seqs("hostr", epoch) == seqs

        await until(lambda: link.status.state == "up", 30, "hostr up")
        await until(caught_up, 30, "the journal in the history")
        first_connects = link.status.connects
        held_before = len(_journal_seqs(host)[1])

        # another writer holds history.db (as the console's own writer does while it commits a night's backlog) past
        # the history's busy timeout, and the agent restarts meanwhile
        locker = sqlite3.connect(c.gpudeck_home / "history.db", isolation_level=None, timeout=1)
        locker.execute("BEGIN IMMEDIATE")
        await asyncio.to_thread(host.agent.stop)
        await asyncio.to_thread(host.agent.start)
        await until(lambda: link.status.state != "up", 30, "the link to notice the restart")
        await asyncio.sleep(12)  # past the history's 10 s busy timeout: the note of the state change has failed
        locker.execute("ROLLBACK")
        locker.close()
        locker = None

        await until(lambda: link.status.state == "up" and link.status.connects > first_connects, BACKOFF_MAX_S + 30, "hostr back up")
        await until(caught_up, 30, "the sync to resume from the cursor")
        epoch, seqs = _journal_seqs(host)
        held = history.seqs("hostr", epoch)
        assert held == seqs == list(range(1, len(seqs) + 1)), f"lost or doubled: history {held}, journal {seqs}"
        assert len(seqs) > held_before  # the restarted agent journaled its start, and the resumed sync pulled it
    finally:
        if locker is not None:
            locker.close()
        await fleet.close()
        history.close()


class _WatchedHistory(History):
    """The real history, with each batch handed to its writer noted (host, first seq, last seq); the writer waits for
    ``gate`` before the first batch."""

    def __init__(self, path: Path) -> None:
        import threading

        super().__init__(path)
        self.submitted: list[tuple[str, int, int]] = []
        self.gate = threading.Event()

    def submit(self, host, epoch, events):  # type: ignore[no-untyped-def]
        if host == "hostp" and not any(h == "hostp" for h, _a, _b in self.submitted):
            threading = __import__("threading")
            holding = threading.Event()
            threading.Thread(target=self._run_job, args=(lambda conn: holding.set() or self.gate.wait(120),), daemon=True).start()
            assert holding.wait(30), "the writer did not take the holding job"
        self.submitted.append((host, events[0].seq, events[-1].seq))
        return super().submit(host, epoch, events)


@pytest.mark.timeout(240)
async def test_a_backlog_of_several_batches_lands_once_and_the_policies_hear_each_event_once_when_the_link_drops_mid_write(
    console_side: ConsoleSide,
) -> None:
    """A host behind by several batches is pulled while the history writes the batch before (console/fleet/fleet.py
    sync_events). The link dropping while a batch is being written must lose nothing and tell nothing twice: the batch
    lands, the policies hear of it once, and the pull after the reconnect starts after it."""
    from gpudeck.agents.storage.journal import Journal
    from gpudeck.agents.wire import paths
    from gpudeck.console.fleet.fleet import EVENT_BATCH

    c = console_side
    host = SshHost("hostp", c.pub)
    paths.ensure_private_dir(host.agent.state_dir)
    journal = Journal(paths.journal_path(host.agent.state_dir), "hostp")
    n = 2 * EVENT_BATCH + 321
    rec = {"rank": 0, "type": "step", "loss": 2.5}
    journal.append_many([("telemetry", "r-backlog", {"record": {**rec, "ts": 1e9 + i, "step": i}, "offset": i}) for i in range(n)])
    journal.close()
    host.start()
    c.add(host)
    history = _WatchedHistory(c.gpudeck_home / "history.db")
    fleet = _fleet(c, history, names=("hostp",))
    link = fleet.links["hostp"]
    heard: list[int] = []

    class Policy:
        def on_events(self, name: str, events: list) -> None:  # type: ignore[type-arg]
            if name == "hostp":
                heard.extend(e.seq for e in events)

        def on_link_state(self, st: object) -> None:
            pass

    fleet.add_watcher(Policy())
    gate = history.gate  # the writer held before the first batch: it waits in the queue while the link pulls the next
    fleet.start()
    try:

        def about() -> str:
            return f"hostp: {link.status}; submitted {history.submitted}"

        until = functools.partial(wait_until, about=about)

        await until(lambda: any(h == "hostp" for h, _a, _b in history.submitted), 60, "the first batch handed to the writer")
        first = [b for b in history.submitted if b[0] == "hostp"][0]
        assert first == ("hostp", 1, EVENT_BATCH), history.submitted
        await asyncio.sleep(1.0)  # the next batch's pull meanwhile; nothing is told before it is written
        assert heard == [] and link.status.synced_seq == 0
        # the agent killed (and started again) while the batch waits for the writer: the link drops and connects
        # again, then the batch is written
        connects = link.status.connects
        await asyncio.to_thread(host.agent.kill9)
        await asyncio.to_thread(host.agent.start)
        await until(lambda: link.status.state != "up" or link.status.connects > connects, 60, "the link to drop")
        assert heard == []
        gate.set()
        await until(lambda: heard[:1] == [1], 30, "the batch written after the link dropped to be told")
        epoch, seqs = _journal_seqs(host)
        await until(lambda: history.seqs("hostp", epoch) == seqs, 90, "the whole journal in the history")
        await until(lambda: heard[-1:] == seqs[-1:], 30, "the policies to hear the last event")
        assert heard == seqs, "each event told to the policies once, in order"
        ours = [(a, b) for h, a, b in history.submitted if h == "hostp"]
        assert ours[0] == (1, EVENT_BATCH) and ours[1][0] == EVENT_BATCH + 1, ours  # after the reconnect: from the cursor
    finally:
        gate.set()
        await fleet.close()
        history.close()
        stop_runs(host.agent)
