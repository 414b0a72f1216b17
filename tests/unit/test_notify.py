"""The watcher's pure parts: [[notify]] rules, the on words of events, the outbox's exactly-once bookkeeping, messages."""

from __future__ import annotations

import re
import sqlite3
import stat
from pathlib import Path

import pytest

from gpudeck.console.core import config as cfg
from gpudeck.console.watch import outbox as ob
from gpudeck.console.watch.deliver import compose
from gpudeck.console.watch.rules import RuleError, compile_rules, on_word, targets_for
from tests.notify_urls import CLOSED, LOOPBACK, REMOTE, SECRET, URLS, leaks

URL = "json://127.0.0.1:9/hook"


def rule(on: list[str], match: str = "", to: list[str] | None = None) -> cfg.NotifyRule:
    return cfg.NotifyRule(to=tuple(to or [URL]), on=tuple(on), match=match)


def test_notify_tables_are_read_and_checked(tmp_path: Path) -> None:
    p = tmp_path / "config.toml"
    p.write_text('[[notify]]\nto = ["ntfy://n.example/x"]\non = ["failed", "alert:hang"]\nmatch = "host:gpu1"\n')
    conf = cfg.load(p)
    assert conf.notify == (cfg.NotifyRule(to=("ntfy://n.example/x",), on=("failed", "alert:hang"), match="host:gpu1"),)
    for bad, says in (
        ('[[notify]]\nto = "x"\non = ["failed"]\n', "`to` must be a non-empty list"),
        ('[[notify]]\nto = ["a://b"]\non = []\n', "`on` must be a non-empty list"),
        ('[[notify]]\nto = ["a://b"]\non = ["failed"]\nwhen = 1\n', "unknown keys ['when']"),
        ('[[notify]]\nto = ["a://b"]\non = ["failed"]\nmatch = 3\n', "`match` is a history filter"),
        ("notify = 3\n", "[[notify]] tables"),
    ):
        p.write_text(bad)
        with pytest.raises(cfg.ConfigError, match=__import__("re").escape(says)):
            cfg.load(p)


def test_rules_resolve_aliases_and_refuse_what_cannot_work() -> None:
    (r,) = compile_rules((rule(["failed", "alert:rank_died", "alert:hang"]),))
    assert r.on == {"failed", "alert:rank_exited", "alert:heartbeat_lost"}
    assert r.picks("alert:rank_exited") and not r.picks("alert:gpu_idle") and not r.picks("succeeded")
    assert compile_rules((rule(["alert"]),))[0].picks("alert:gpu_idle")
    with pytest.raises(RuleError, match="unknown event 'crashed'"):
        compile_rules((rule(["crashed"]),))
    with pytest.raises(RuleError, match="unknown alert 'alert:boom'"):
        compile_rules((rule(["alert:boom"]),))
    with pytest.raises(RuleError, match="unknown filter 'colour'"):
        compile_rules((rule(["failed"], match="colour:red"),))
    with pytest.raises(RuleError, match="is not a URL"):
        compile_rules((rule(["failed"], to=["not a url"]),))


def test_on_words_of_history_events() -> None:
    assert on_word("run_state", {"state": "failed"}) == "failed"
    assert on_word("run_state", {"state": "running"}) == "started"
    assert on_word("run_state", {"state": "stopping"}) is None
    assert on_word("alert", {"alert": {"kind": "rank_exited"}}) == "alert:rank_exited"
    assert on_word("alert", {"alert": {"kind": "made_up"}}) is None
    assert on_word("alert", {"alert": "text"}) is None
    assert on_word("telemetry", {"state": "failed"}) is None


def test_targets_for_evaluates_match_against_the_runs_row() -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE runs(host, id, name, kind, state, cause, cause_class, started, created)")
    conn.execute("INSERT INTO runs(host, id, name, kind, state) VALUES ('gpu1', 'r-1', 'fsdp-a', 'fsdp', 'failed')")
    conn.execute("INSERT INTO runs(host, id, name, kind, state) VALUES ('gpu2', 'r-2', 'other', 'command', 'failed')")
    rules = compile_rules((rule(["failed"], match="kind:fsdp host:~gpu"), rule(["failed"], to=[URL, "ntfy://n.example/all"])))
    assert targets_for(conn, rules, "failed", "gpu1", "r-1") == [(URL, 1), ("ntfy://n.example/all", 2)]  # one URL once, its first rule
    assert targets_for(conn, rules, "failed", "gpu2", "r-2") == [(URL, 2), ("ntfy://n.example/all", 2)]
    assert targets_for(conn, rules, "succeeded", "gpu1", "r-1") == []


def item(seq: int, target: str = URL) -> ob.Item:
    return ob.Item("gpu1", "ep", seq, target, 1, "failed", "r-1", "t", "b", "failure", False, 1000.0 + seq)


def test_outbox_is_private_and_counts_an_event_once_per_target(tmp_path: Path) -> None:
    box = ob.Outbox(tmp_path / "watch.db")
    assert stat.S_IMODE((tmp_path / "watch.db").stat().st_mode) == 0o600
    assert box.cursor() is None
    assert box.enqueue([item(1), item(2)], cursor=10) == 2
    assert box.enqueue([item(1), item(1, "ntfy://n.example/x")], cursor=12) == 1  # read again after a crash: nothing twice
    assert box.cursor() == 12
    due = box.due(now=2000.0)
    assert {(d.target, d.seq) for d in due} == {(URL, 1), ("ntfy://n.example/x", 1)}  # the oldest of each target
    box.delivered(due[0], now=2000.0)
    assert box.enqueue([due[0]], cursor=13) == 0  # delivered stays delivered
    box.close()
    again = ob.Outbox(tmp_path / "watch.db")
    assert again.cursor() == 13 and len(again.items("delivered")) == 1 and len(again.items("pending")) == 2


def test_a_failing_target_backs_off_then_expires(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ob.random, "uniform", lambda a, b: b)
    box = ob.Outbox(tmp_path / "watch.db", expire_s=100.0)
    box.enqueue([item(1), item(2)], cursor=2, now=1000.0)
    (first,) = box.due(now=1000.0)
    box.failed(first, "503", now=1000.0)
    assert box.due(now=1000.5) == [] and box.next_due() == 1000.0 + ob.BACKOFF_MIN_S
    box.failed(first, "503", now=1001.0)
    assert box.next_due() == 1001.0 + 2 * ob.BACKOFF_MIN_S  # doubling
    (st,) = box.status()
    assert st.failing and st.pending == 2 and st.consecutive == 2 and st.last_error == "503"
    assert box.expire(now=1200.0) == 2
    (st,) = box.status()
    assert st.expired == 2 and st.pending == 0 and box.due(now=5000.0) == []
    assert ob.backoff_s(50) == ob.BACKOFF_MAX_S


def test_messages_say_what_to_do_and_carry_no_control_characters() -> None:
    run = {"name": "evil\x1b[31mname", "kind": "fsdp", "state": "failed", "last_step": 120, "last_loss": 2.3456}
    m = compose("failed", "gpu1", "gpu1/ep/7", "r-1", 1000.0, {"state": "failed", "cause": "x" * 5000, "exit_code": 1}, run, late=False)
    assert "\x1b" not in m.title + m.body and "\\x1b" in m.title
    assert "gpudeck show r-1 --host gpu1" in m.body and "event gpu1/ep/7" in m.body and "step 120, loss 2.346" in m.body
    assert len(m.body) < 1500 and m.notify_type == "failure"
    late = compose(
        "alert:rank_exited", "gpu1", "k", "r-1", 0.0, {"alert": {"message": "rank 1 died", "severity": "critical"}}, {}, late=True
    )
    assert late.title.startswith("[late] gpudeck: rank_exited") and "rank 1 died" in late.body and late.notify_type == "failure"
    assert "while gpudeck watch was not running" in late.body


def test_metrics_address_is_loopback_unless_one_is_given() -> None:
    from gpudeck.console.watch.service import WatchError, parse_address

    assert parse_address("9464") == ("127.0.0.1", 9464)
    assert parse_address(":9500") == ("127.0.0.1", 9500)
    assert parse_address("10.0.0.5:9464") == ("10.0.0.5", 9464)
    assert parse_address("[::1]:9464") == ("::1", 9464)
    for bad in ("localhost:9464", "127.0.0.1:99999", "127.0.0.1:x", ""):
        with pytest.raises(WatchError, match="--metrics"):
            parse_address(bad)


def test_failing_summary_names_failing_targets_only(tmp_path: Path) -> None:
    path = tmp_path / "watch.db"
    assert ob.failing_summary(path) is None
    box = ob.Outbox(path)
    box.enqueue([item(1), item(1, "json://127.0.0.1:8/ok")], cursor=1, now=1000.0)
    for it in box.due(now=1000.0):
        if it.target == URL:
            box.failed(it, "503", now=1000.0)
        else:
            box.delivered(it, now=1000.0)
    line = ob.failing_summary(path)
    assert line is not None and "127.0.0.1:9" in line and "8/ok" not in line and "gpudeck watch --status" in line


def test_an_attempt_that_outlasts_the_wait_is_recorded_by_its_thread_and_not_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop stops waiting for a slow target; the send goes on and its answer is recorded: one message, not two."""
    import asyncio
    import threading
    import time

    from gpudeck.console.watch import deliver, service

    box = ob.Outbox(tmp_path / "watch.db")
    it = ob.Item("h", "e", 1, URL, 0, "failed", "r-1", "t", "b", "failure", False, time.time())
    box.enqueue([it], 1)
    sent: list[str] = []
    answer = threading.Event()

    def slow_send(url: str, msg: deliver.Message) -> str | None:
        sent.append(msg.title)
        answer.wait(10)  # the target takes longer than the loop waits, then accepts
        return None

    monkeypatch.setattr(deliver, "send", slow_send)
    monkeypatch.setattr(deliver, "SEND_TIMEOUT_S", 0.05)
    w = service.Watcher(service.WatchOptions(config=cfg.Config(hosts=(), path=tmp_path / "config.toml"), rules=[]))

    async def scenario() -> None:
        loop = asyncio.ensure_future(w._deliver_loop(box))
        await asyncio.sleep(2.0)  # past the wait (0.1 s) and past a failure's backoff (at most 1 s)
        assert box.items("pending"), "an attempt still in flight must not be recorded as anything yet"
        answer.set()
        deadline = time.time() + 10
        while not box.items("delivered") and time.time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(scenario())
    assert sent == ["t"]
    assert box.items() == [("h", "e", 1, URL, "delivered")]
    (st,) = box.status()
    assert (st.delivered, st.failures) == (1, 0)
    box.close()


# ---------------------------------------------------------------------------------------------- secrets of targets


def test_a_target_is_shown_in_apprise_s_privacy_form_with_no_secret_left() -> None:
    """apprise hides passwords and tokens it knows of; user names given alone, paths and headers it prints: hidden too."""
    from gpudeck.console.watch.targets import privacy_form

    forms = {u: privacy_form(u) for u in URLS}
    assert [f for f in forms.values() if leaks(f)] == []
    assert forms[LOOPBACK[2]] == "ntfy://user:****@127.0.0.1:9/…"  # a user with a password (apprise hid it) stays
    assert forms[REMOTE[1]].startswith("pover://u...i@")  # apprise's own masks stay: the target stays recognisable
    assert forms[f"json://{CLOSED}/hook?+Authorization=Bearer%20{SECRET}"] == "json://127.0.0.1:9/…"  # apprise prints headers
    assert forms[REMOTE[-1]] == "notaservice://…"  # apprise cannot read it: its scheme only, never raw
    assert privacy_form("no scheme at all " + SECRET) == "…"


def test_errors_about_a_target_have_its_secrets_scrubbed() -> None:
    from gpudeck.console.watch.targets import scrub

    url = f"json://{CLOSED}/hooks/{SECRET}/incoming?+Authorization=Bearer%20{SECRET}"
    err = f"HTTPConnectionPool(host='127.0.0.1', port=9): Max retries exceeded with url: /hooks/{SECRET}/incoming (Bearer {SECRET})"
    out = scrub(err, url)
    assert not leaks(out) and "Max retries exceeded" in out and "127.0.0.1" in out
    for u in URLS:
        assert not leaks(scrub(f"could not send to {u}: refused", u)), u


def test_a_to_entry_that_is_not_a_url_is_refused_without_quoting_it() -> None:
    with pytest.raises(RuleError, match="a `to` entry \\(18 characters\\) is not a URL") as exc:
        compile_rules((rule(["failed"], to=[f"token {SECRET}"]),))
    assert not leaks(str(exc.value))


def test_metrics_labels_are_keyed_ids_stable_per_outbox(tmp_path: Path) -> None:
    box = ob.Outbox(tmp_path / "watch.db")
    ids = {box.label(u) for u in URLS}
    assert len(ids) == len(URLS) and all(re.fullmatch(r"t-[0-9a-f]{8}", i) for i in ids)
    box.close()
    again = ob.Outbox(tmp_path / "watch.db")
    assert {again.label(u) for u in URLS} == ids  # the key lives in the outbox: an id survives restarts
    other = ob.Outbox(tmp_path / "other.db")
    assert {other.label(u) for u in URLS}.isdisjoint(ids)  # ... and is random per outbox: an id cannot be looked up


def test_the_fleet_header_names_failing_targets_without_secrets(tmp_path: Path) -> None:
    """The console's Fleet header is failing_summary's line: every URL form, three at a time (the line names three)."""
    for n in range(0, len(URLS), 3):
        path = tmp_path / f"watch{n}.db"
        box = ob.Outbox(path)
        batch = URLS[n : n + 3]
        box.enqueue([item(1, u) for u in batch], cursor=1, now=1000.0)
        for it in box.due(now=1000.0):
            box.failed(it, f"cannot reach {it.target}", now=1000.0)
        box.close()
        line = ob.failing_summary(path)
        assert line is not None and line.count("://") == len(batch) and not leaks(line), line


# ---------------------------------------------------------------------------------------------- rules SQLite cannot evaluate


def test_a_match_sqlite_would_refuse_is_refused_at_load_with_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """1000 names in one `match` made SQLite answer "Expression tree is too large" for every event: refused by --check."""
    from gpudeck.console.watch import cli
    from gpudeck.console.watch.rules import MAX_MATCH_CHARS, MAX_MATCH_COMPARISONS

    many = " ".join(f"-name:run-{i}" for i in range(1000))
    with pytest.raises(RuleError, match=f"at most {MAX_MATCH_CHARS}"):
        compile_rules((rule(["failed"], match=many),))
    alts = "name:" + ",".join(f"r{i}" for i in range(300))  # short, but 300 comparisons
    with pytest.raises(RuleError, match=f"makes 300 comparisons, at most {MAX_MATCH_COMPARISONS}"):
        compile_rules((rule(["failed"], match=alts),))
    assert compile_rules((rule(["failed"], match="name:" + ",".join(f"r{i}" for i in range(MAX_MATCH_COMPARISONS))),))

    monkeypatch.setenv("GPUDECK_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text(f'[[notify]]\nto = ["{URL}"]\non = ["failed"]\nmatch = "{alts}"\n')
    assert cli.check() == cli.EXIT_CONFIG
    assert f"at most {MAX_MATCH_COMPARISONS}" in capsys.readouterr().err


def test_a_rule_sqlite_cannot_evaluate_is_skipped_and_the_others_go_on() -> None:
    from gpudeck.console.watch.rules import unusable

    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE runs(host, id, name, kind, state, cause, cause_class, started, created)")
    conn.execute("INSERT INTO runs(host, id, name, kind, state) VALUES ('gpu1', 'r-1', 'a', 'fsdp', 'failed')")
    conn.setlimit(sqlite3.SQLITE_LIMIT_EXPR_DEPTH, 30)  # a SQLite built with a lower limit than the checks assume
    deep = "name:" + ",".join(f"x{i}" for i in range(40)) + ",a"
    rules = compile_rules((rule(["failed"], match=deep, to=["ntfy://n.example/deep"]), rule(["failed"], match="kind:fsdp")))
    assert set(unusable(conn, rules)) == {1}
    broken: dict[int, str] = {}
    assert targets_for(conn, rules, "failed", "gpu1", "r-1", broken) == [(URL, 2)]  # rule 2 still notifies
    assert set(broken) == {1} and "Expression tree is too large" in broken[1]
    assert targets_for(conn, rules, "failed", "gpu1", "r-1", broken) == [(URL, 2)]  # rule 1 not tried again
    conn.execute("DROP TABLE runs")  # the history itself unreadable: raised (the event is read again), no rule blamed
    with pytest.raises(sqlite3.OperationalError):
        targets_for(conn, rules, "failed", "gpu1", "r-1", {})


def test_status_json_says_no_watcher_runs_when_none_ever_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--status --json is always one JSON object (it printed nothing on stdout before a watcher had run); exit 3: none runs."""
    import json

    from gpudeck.console.watch import cli

    monkeypatch.setenv("GPUDECK_HOME", str(tmp_path))
    assert cli.status(as_json=True) == cli.EXIT_NOT_RUNNING
    out = json.loads(capsys.readouterr().out)
    assert out == {"running": False, "running_pid": None, "outbox": None, "targets": [], "notifications": []}
    assert cli.status(as_json=False) == cli.EXIT_NOT_RUNNING
    assert "watcher: not running; no outbox at" in capsys.readouterr().out
    box = ob.Outbox(tmp_path / "watch.db")
    box.enqueue([item(1, u) for u in URLS], cursor=1, now=1000.0)
    box.close()
    assert cli.status(as_json=True) == cli.EXIT_NOT_RUNNING  # nothing failing, but no watcher: 3
    out = json.loads(capsys.readouterr().out)
    assert out["running"] is False and len(out["targets"]) == len(URLS) and len(out["notifications"]) == len(URLS)
    assert {n["id"] for n in out["notifications"]} == {t["id"] for t in out["targets"]}  # one id names a target everywhere
    assert not leaks(json.dumps(out))


def test_a_busy_history_blames_no_rule() -> None:
    """The history locked while a rule is evaluated is the history's fault: raised (the event is read again), no rule skipped."""

    class Busy(sqlite3.Connection):
        def execute(self, sql: str, *args: object) -> sqlite3.Cursor:  # type: ignore[override]
            if "name =" in sql:  # the rule's filter
                err = sqlite3.OperationalError("database is locked")
                err.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]
                raise err
            return super().execute(sql, *args)

    conn = sqlite3.connect(":memory:", factory=Busy)
    conn.execute("CREATE TABLE runs(host, id, name, kind, state, cause, cause_class, started, created)")
    rules = compile_rules((rule(["failed"], match="name:a"),))
    broken: dict[int, str] = {}
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        targets_for(conn, rules, "failed", "gpu1", "r-1", broken)
    assert broken == {}
