"""The CLI against hostile runs: escape sequences in a name, argv, env and output never reach the terminal raw,
secrets passed with --env are redacted in every view (--json too) unless --show-secrets, and a host that does not
answer makes the command exit 3, named on stderr and in --json."""

from __future__ import annotations

import json
import sys

from tests.agent_harness import AgentProc, wait_for

EVIL = "\x1b]0;pwned\x07\x1b[2J\x1b]52;c;ZXZpbA==\x07\x9b31m\u202e"
PRINT = "import os, sys; print(sys.argv[1] + os.environ['HF_TOKEN'], flush=True)"


def _no_controls(text: str) -> None:
    bad = [c for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F or c == "\u202e"]
    assert not bad, f"raw control characters reached the terminal: {bad!r} in {text[:300]!r}"


def test_hostile_name_argv_and_output_are_escaped_and_secrets_redacted(agent: AgentProc) -> None:
    name = f"evil{EVIL}[bold red]x[/]"
    rid = agent.cli_json(
        "launch", "--name", name, "--env", "HF_TOKEN=hf_sekrit", "--env", f"PLAIN=ok{EVIL}", "--", sys.executable, "-c", PRINT, f"out{EVIL}"
    )["id"]
    wait_for(lambda: next(r for r in agent.cli_json("runs") if r["id"] == rid)["state"] == "succeeded", timeout=60, what="the run to end")

    for args in (["runs"], ["history"], ["show", rid], ["tail", rid], ["diff", rid, rid], ["status"]):
        cp = agent.cli(*args)
        _no_controls(cp.stdout)
        _no_controls(cp.stderr)
        assert "hf_sekrit" not in cp.stdout or args[0] == "tail", (args, cp.stdout)  # tail shows what the run printed
    assert "\\x1b]0;pwned\\x07" in agent.cli("runs").stdout  # shown, as visible escapes
    assert "out\\x1b]0;pwned" in agent.cli("tail", rid).stdout
    assert f"out{EVIL}hf_sekrit" in agent.cli("tail", rid, "--raw").stdout  # --raw: byte for byte

    # --json is data: the name exactly as given, the secret redacted unless asked for
    row = next(r for r in agent.cli_json("runs") if r["id"] == rid)
    assert row["name"] == name
    assert row["spec"]["env"]["HF_TOKEN"] == "REDACTED" and row["spec"]["env"]["PLAIN"] == f"ok{EVIL}"
    for args in (["history"], ["show", rid]):
        out = agent.cli(*args, "--json").stdout
        assert "hf_sekrit" not in out and "REDACTED" in out, args
    assert (
        next(r for r in json.loads(agent.cli("runs", "--json", "--show-secrets").stdout) if r["id"] == rid)["spec"]["env"]["HF_TOKEN"]
        == "hf_sekrit"
    )
    assert "hf_sekrit" in agent.cli("show", rid, "--json", "--show-secrets").stdout


def test_a_host_that_does_not_answer_exits_3_and_is_named(agent: AgentProc) -> None:
    agent.cli("hosts", "add", "ghost.invalid")
    rid = agent.cli_json("launch", "--", sys.executable, "-c", "pass")["id"]
    wait_for(
        lambda: next(r for r in agent.cli_json("runs", "--host", "local") if r["id"] == rid)["state"] == "succeeded",
        timeout=60,
        what="the run to end",
    )
    cp = agent.cli("runs", "--json", check=False)
    assert cp.returncode == 3, cp
    out = json.loads(cp.stdout)
    assert [u["host"] for u in out["unreachable"]] == ["ghost.invalid"] and out["unreachable"][0]["error"]
    assert rid in [r["id"] for r in out["runs"]]  # the partial answer is there beside it
    assert "ghost.invalid" in cp.stderr
    cp = agent.cli("runs", check=False)
    assert cp.returncode == 3 and "ghost.invalid" in cp.stderr and rid in cp.stdout
    cp = agent.cli("status", "--json", check=False)
    assert cp.returncode == 3 and [u["host"] for u in json.loads(cp.stdout)["unreachable"]] == ["ghost.invalid"]
    cp = agent.cli("history", "--json", check=False)
    assert cp.returncode == 3 and [u["host"] for u in json.loads(cp.stdout)["unreachable"]] == ["ghost.invalid"], cp
    agent.cli("hosts", "remove", "ghost.invalid")
    cp = agent.cli("runs", "--json")
    assert isinstance(json.loads(cp.stdout), list)  # every host answered: the plain list, exit 0
