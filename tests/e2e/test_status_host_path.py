"""``gpudeck status --host H`` runs on its own path (console/cli/status_cmd.py: without the command module's imports,
the printers imported while the far side starts; issue 30), over a real sshd with a real agent: the same text and
--json as the all-hosts ``status`` prints for that host, and exit 3 with the same error for a host that does not answer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent_harness import stop_runs
from tests.sshd_harness import ConsoleSide, SshHost, free_port

pytestmark = pytest.mark.slow
GPUDECK = str(Path(sys.executable).with_name("gpudeck"))
SAMPLED = re.compile(r"\(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d, sampled in [0-9.]+ ms\)")  # the header's time: one per snapshot
VOLATILE = ("ts", "request_id", "sample_ms")  # what differs between two snapshots of an idle host


@pytest.fixture
def one_host():  # type: ignore[no-untyped-def]
    """hosta: a real sshd with its own agent (SIMULATED GPUs, so status has rows), the one host in the config (besides
    `local`, always there: the all-hosts status starts an agent there, stopped at teardown)."""
    c = ConsoleSide()
    try:
        os.environ["GPUDECK_SIMULATE_GPUS"] = "2"
        c.add(SshHost("hosta", c.pub).start())
        c.gpudeck_home.joinpath("config.toml").write_text('hosts = ["hosta"]\n')
        yield c
    finally:
        os.environ.pop("GPUDECK_SIMULATE_GPUS", None)
        for h in c.hosts:
            stop_runs(h.agent)
        c.cleanup()


def _gpudeck(c: ConsoleSide, *args: str, profile: bool = False) -> subprocess.CompletedProcess[str]:
    """The installed script, as the operator runs it (with PYTHONPROFILEIMPORTTIME when ``profile``)."""
    env = {**c.env, "PYTHONPROFILEIMPORTTIME": "1"} if profile else c.env
    return subprocess.run([GPUDECK, *args], env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _steady(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in VOLATILE}


def test_status_host_prints_what_the_all_hosts_status_prints(one_host: ConsoleSide) -> None:
    lean = _gpudeck(one_host, "status", "--host", "hosta")
    every = _gpudeck(one_host, "status")  # the command module's path (cli/main.py's cmd_status), every configured host
    assert lean.returncode == 0 and every.returncode == 0, (lean.stderr, every.stderr)
    assert lean.stdout.startswith("host hosta ") and "SIMULATED H100-80GB" in lean.stdout, lean.stdout
    assert "\nhost hosta " in every.stdout  # after `local`'s part (always a host of the fleet)
    assert SAMPLED.sub("(T)", lean.stdout) == SAMPLED.sub("(T)", every.stdout[every.stdout.index("\nhost hosta ") + 1 :])
    assert lean.stderr == every.stderr == ""

    one = json.loads(_gpudeck(one_host, "status", "--host", "hosta", "--json").stdout)
    both = json.loads(_gpudeck(one_host, "status", "--json").stdout)
    assert both["unreachable"] == [] and [h["host"] for h in both["hosts"]] == ["local", "hosta"]
    assert _steady(one) == _steady(both["hosts"][1]["snapshot"])
    assert one["type"] == "snapshot" and len(one["gpus"]) == 2

    # a filter that matches nothing: said on stderr, exit 1 for --run, as before
    miss = _gpudeck(one_host, "status", "--host", "hosta", "--run", "no-such-run")
    assert miss.returncode == 1 and "no-such-run" in miss.stderr, miss.stderr


def test_status_host_imports_the_printers_after_the_ssh_library_and_not_the_command_module(one_host: ConsoleSide) -> None:
    cp = _gpudeck(one_host, "status", "--host", "hosta", profile=True)
    assert cp.returncode == 0, cp.stderr[-2000:]
    done = [line.rsplit("|", 1)[1].strip() for line in cp.stderr.splitlines() if line.startswith("import time:")]
    assert "gpudeck.console.cli.main" not in done  # every other command's imports stay out
    # import-time lines come as each import ends: the printers end after asyncssh, i.e. they were imported during the connect
    assert done.index("gpudeck.console.present.formats") > done.index("asyncssh")


def test_status_host_of_a_host_that_does_not_answer_exits_3_saying_why(one_host: ConsoleSide) -> None:
    down = SshHost("hostdown", one_host.pub, port=free_port(), start_agent=False)  # described and trusted, no sshd
    one_host.add(down)
    text = _gpudeck(one_host, "status", "--host", "hostdown")
    assert text.returncode == 3 and text.stdout == ""
    assert text.stderr.startswith("gpudeck: host hostdown is unreachable: ") and "nothing accepts SSH connections" in text.stderr
    js = _gpudeck(one_host, "status", "--host", "hostdown", "--json")
    assert js.returncode == 3
    doc = json.loads(js.stdout)
    assert [u["host"] for u in doc["unreachable"]] == ["hostdown"] and "nothing accepts SSH connections" in doc["unreachable"][0]["error"]
    assert js.stderr == text.stderr  # the same one line on stderr
    # the all-hosts path says the same of it (the command module's path)
    one_host.gpudeck_home.joinpath("config.toml").write_text('hosts = ["hostdown"]\n')
    every = _gpudeck(one_host, "status")
    assert every.returncode == 3 and "hostdown" in every.stdout and "nothing accepts SSH connections" in every.stderr
