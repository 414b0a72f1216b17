"""The one run-reference resolver, with real agents on two hosts over real sshd: never a silent pick.

Cases from issue 16: three live runs named ``dup`` on two hosts (``stop dup``
used to stop the one alone on its host, exit 0); ``tail r-`` with many matches
(it used to print one run's output); three matches on one host (``tail`` /
``stop`` / ``verify`` used to say "no run"); an exact id wins; a host that did
not answer is named (as a node of the run only when it is one), and a destructive command refuses a name then.
"""

from __future__ import annotations

from tests.sshd_harness import ConsoleSide

SLEEP = ["--", "sleep", "300"]


def launch(c: ConsoleSide, host: str, name: str) -> str:
    return c.cli("launch", "--host", host, "--name", name, *SLEEP).stdout.strip()


def state(c: ConsoleSide, host: str, rid: str) -> str:
    return next(r["state"] for r in c.cli_json("runs", "--host", host) if r["id"] == rid)  # one CLI call (an SSH round), not two


def test_a_name_of_three_runs_on_two_hosts_is_refused_with_the_candidates(two_hosts: ConsoleSide) -> None:
    c = two_hosts
    ids = [launch(c, "hosta", "dup"), launch(c, "hosta", "dup"), launch(c, "hostb", "dup")]
    for cmd in (["stop", "dup", "--grace", "1"], ["tail", "dup"], ["verify", "dup"]):
        cp = c.cli(*cmd, check=False)
        assert cp.returncode == 2, (cmd, cp.stdout, cp.stderr)
        assert "'dup' matches 3 runs" in cp.stderr
        for rid in ids:
            assert rid in cp.stderr  # every candidate, with its host, name, state and start
        assert cp.stderr.count(" dup ") == 3 and "hosta" in cp.stderr and "hostb" in cp.stderr and "running" in cp.stderr
    assert [state(c, h, r) for h, r in zip(("hosta", "hosta", "hostb"), ids)] == ["running"] * 3  # nothing was stopped
    # an exact id wins over everything else
    cp = c.cli("stop", ids[2], "--grace", "1", check=False)
    assert cp.returncode == 0, cp.stderr
    assert state(c, "hostb", ids[2]) == "stopped" and state(c, "hosta", ids[0]) == "running"


def test_three_matches_on_one_host_are_listed_not_missed(two_hosts: ConsoleSide) -> None:
    c = two_hosts
    ids = [launch(c, "hosta", "trio") for _ in range(3)]
    for cmd in (["tail", "trio"], ["stop", "trio"], ["verify", "trio"], ["tail", "trio", "--host", "hosta"]):
        cp = c.cli(*cmd, check=False)
        assert cp.returncode == 2, (cmd, cp.stderr)
        assert "no run" not in cp.stderr and "matches 3 runs" in cp.stderr
        assert all(rid in cp.stderr for rid in ids)


def test_a_prefix_of_many_runs_is_refused(two_hosts: ConsoleSide) -> None:
    c = two_hosts
    ids = [launch(c, h, f"p{i}") for i, h in enumerate(("hosta", "hostb", "hosta", "hostb"))]
    cp = c.cli("tail", "r-", check=False)
    assert cp.returncode == 2 and "'r-' matches 4 runs" in cp.stderr, cp.stderr
    assert all(rid in cp.stderr for rid in ids) and cp.stdout == ""
    # a unique name resolves across hosts
    assert c.cli("tail", "p1", check=False).returncode == 0


def test_a_host_that_did_not_answer_is_named_and_a_stop_by_name_refused(two_hosts: ConsoleSide) -> None:
    c = two_hosts
    rid = launch(c, "hosta", "solo")
    hostb = next(h for h in c.hosts if h.name == "hostb")
    hostb.stop_sshd()
    cp = c.cli("stop", "solo", "--grace", "1", check=False, timeout=180)
    assert cp.returncode == 2, cp.stderr
    assert "hostb did not answer" in cp.stderr and rid in cp.stderr  # the way forward: the full id or --host
    assert state(c, "hosta", rid) == "running"
    # a one-host run on a host that answered: hostb is not called a node of it, and the note says how it was resolved
    cp = c.cli("tail", "solo", check=False, timeout=180)
    assert cp.returncode == 0, cp.stderr
    assert "a node of this run" not in cp.stderr and "hostb did not answer; 'solo' was resolved on the hosts that did" in cp.stderr
    # --host given: the way forward is not "give --host"
    cp = c.cli("tail", "nosuch", "--host", "hostb", check=False, timeout=180)
    assert cp.returncode == 1 and "no run 'nosuch' on hostb; hostb did not answer: try again when it is back" in cp.stderr, cp.stderr
    assert "give --host" not in cp.stderr
    cp = c.cli("stop", rid, "--grace", "1", check=False, timeout=180)
    assert cp.returncode == 0, cp.stderr
    cp = c.cli("tail", "nosuch", check=False, timeout=180)
    assert cp.returncode != 0 and "hostb did not answer" in cp.stderr and "no run 'nosuch'" in cp.stderr


def test_a_request_id_reused_with_another_command_is_refused_not_answered_with_the_first_run(two_hosts: ConsoleSide) -> None:
    """--request-id names one launch: a retry gets its run back; another command under the same key is refused, nothing starts."""
    c = two_hosts
    first = c.cli("launch", "--host", "hosta", "--request-id", "job-1", "--name", "keyed", *SLEEP).stdout.strip()
    again = c.cli("launch", "--host", "hosta", "--request-id", "job-1", "--name", "keyed", *SLEEP).stdout.strip()
    assert again == first  # a retry of the same launch: the same run
    cp = c.cli("launch", "--host", "hosta", "--request-id", "job-1", "--name", "keyed", "--", "sleep", "301", check=False)
    assert cp.returncode != 0 and cp.stdout == "", (cp.stdout, cp.stderr)
    assert "request id: 'job-1' was already used for another launch (sleep 300)" in cp.stderr and "--request-id" in cp.stderr
    assert [r["id"] for r in c.cli_json("runs", "--host", "hosta")] == [first]  # nothing else was started
