"""The CLI against hostile runs: escape sequences in a name, argv, env and output never reach the terminal raw,
secrets passed with --env are redacted in every view (--json too) unless --show-secrets, and a host that does not
answer makes the command exit 3, named on stderr and in --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.agent_harness import AgentProc, run_state, wait_for

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
    wait_for(lambda: run_state(agent, rid) == "succeeded", timeout=60, what="the run to end")

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


SLEEPER = "import os, sys, time; print(os.environ.get('HF_TOKEN'), flush=True); time.sleep(int(sys.argv[1]))"


def _env_of(run: dict) -> dict:
    return run["spec"]["env"]


def test_launch_relaunch_rollback_and_status_json_redact_env_secrets_unless_show_secrets(agent: AgentProc) -> None:
    """launch/relaunch/rollback --json share one printing path, status --json carries the live runs' specs: all redacted;
    --show-secrets shows them; the run itself gets the real value."""
    env = ["--env", "HF_TOKEN=hf_sekrit", "--env", "KEY_FILE=/keys/k", "--env", "PLAIN=ok"]
    first = agent.cli_json("launch", *env, "--", sys.executable, "-c", SLEEPER, "0")
    assert _env_of(first)["HF_TOKEN"] == "REDACTED" and _env_of(first)["KEY_FILE"] == "REDACTED" and _env_of(first)["PLAIN"] == "ok"
    assert "hf_sekrit" not in json.dumps(first)
    rid = first["id"]
    wait_for(lambda: run_state(agent, rid) == "succeeded", timeout=60, what="the run to end")
    assert "hf_sekrit" in agent.cli("tail", rid, "--raw").stdout  # the run got the real value

    shown = json.loads(agent.cli("launch", "--json", "--show-secrets", *env, "--", sys.executable, "-c", SLEEPER, "0").stdout)
    assert _env_of(shown)["HF_TOKEN"] == "hf_sekrit"

    again = json.loads(agent.cli("relaunch", rid, "--fresh", "--json").stdout)
    assert again["id"] != rid and _env_of(again)["HF_TOKEN"] == "REDACTED" and "hf_sekrit" not in json.dumps(again)
    back = json.loads(agent.cli("rollback", rid, "--to", rid, "--fresh", "--json").stdout)
    assert _env_of(back)["HF_TOKEN"] == "REDACTED" and "hf_sekrit" not in json.dumps(back)
    back = json.loads(agent.cli("rollback", rid, "--to", rid, "--fresh", "--json", "--show-secrets").stdout)
    assert _env_of(back)["HF_TOKEN"] == "hf_sekrit"

    live = agent.cli_json("launch", *env, "--", sys.executable, "-c", SLEEPER, "120")["id"]
    for args in (["status", "--json"], ["status", "--host", "local", "--json"], ["status"]):
        out = agent.cli(*args).stdout
        assert live in out and "hf_sekrit" not in out, args
    snap = json.loads(agent.cli("status", "--host", "local", "--json").stdout)
    assert _env_of(next(r for r in snap["runs"] if r["id"] == live))["HF_TOKEN"] == "REDACTED"
    assert "hf_sekrit" in agent.cli("status", "--host", "local", "--json", "--show-secrets").stdout


def _closed_write_end() -> int:
    """The write end of a pipe whose reader is already gone (what `| head` leaves once it has read enough)."""
    r, w = os.pipe()
    os.close(r)
    return w


def _closed_stdout(agent: AgentProc, *args: str) -> subprocess.CompletedProcess:
    """The CLI writing into a pipe whose reader is already gone."""
    w = _closed_write_end()
    try:
        return subprocess.run(
            [sys.executable, "-m", "gpudeck.console.cli.main", *args],
            env=agent.env,
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(w)


def test_output_into_a_closed_pipe_ends_quietly_with_141(agent: AgentProc) -> None:
    rid = agent.cli_json("launch", "--name", "piped", "--", sys.executable, "-c", "print('x\\n' * 5000)")["id"]
    wait_for(lambda: run_state(agent, rid) == "succeeded", timeout=60, what="the run to end")
    for args in (
        ["runs", "--json"],
        ["runs"],
        ["status"],
        ["history", "--json"],
        ["history"],
        ["show", rid],
        ["tail", rid, "-n", "-1"],
        ["hosts"],
        ["agent", "status"],
        ["launch", "--json", "--", sys.executable, "-c", "pass"],
    ):
        cp = _closed_stdout(agent, *args)
        assert cp.returncode == 141, (args, cp.returncode, cp.stderr)
        assert "Traceback" not in cp.stderr and "BrokenPipe" not in cp.stderr and "Exception ignored" not in cp.stderr, (args, cp.stderr)
    w = _closed_write_end()
    try:
        cp = subprocess.run(  # the entry point answers --version itself (it needs no console package)
            [sys.executable, "-c", "import sys; from gpudeck.console.entry import main; sys.exit(main(['--version']))"],
            env=agent.env,
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(w)
    assert cp.returncode == 141 and cp.stderr == "", cp.stderr
    # a real pipeline: `| head -n 1` gets its line, the shell sees no traceback
    cp = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m gpudeck.console.cli.main tail {rid} -n -1 | head -n 1"],
        env=agent.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.stdout == "x\n" and "Traceback" not in cp.stderr, cp


def test_a_request_id_covers_the_whole_launch_intent(agent: AgentProc) -> None:
    """A retry with the same key must repeat the whole launch: a different --env, --name, --cwd or claim is refused (exit 1,
    naming the field; an env value is never shown), and nothing new starts."""
    base = ["--request-id", "job-7", "--name", "keyed", "--env", "A=1", "--env", "HF_TOKEN=t1"]
    cmd = ["--", "sleep", "60"]
    first = agent.cli_json("launch", *base, *cmd)
    again = agent.cli_json("launch", *base, *cmd)
    assert again["id"] == first["id"] and again["duplicate"] is True
    # every field, one by one: tests/unit/test_ops_parity.py; here end to end, through the agent's record of the first run
    changes = {
        "env (HF_TOKEN)": ["--env", "HF_TOKEN=t2"],
        "env (B)": ["--env", "B=1"],
        "name (it was 'keyed', now 'other')": ["--name", "other"],
    }
    for field, extra in {**changes, "cwd": ["--cwd", "/tmp"], "claims": ["--claim-gpus", "2"]}.items():
        cp = agent.cli("launch", *base, *extra, *cmd, check=False)
        assert cp.returncode == 1 and cp.stdout == "", (extra, cp.stdout, cp.stderr)
        assert "request id: 'job-7' was already used for another launch" in cp.stderr and field in cp.stderr, (extra, cp.stderr)
        assert "t2" not in cp.stderr and "t1" not in cp.stderr  # names of env variables only, never values
    assert [r["id"] for r in agent.cli_json("runs")] == [first["id"]]  # nothing else was started


def test_history_negation_works_without_double_dash_and_each_argument_is_one_term(agent: AgentProc) -> None:
    ok = agent.cli_json("launch", "--name", "fine run", "--", sys.executable, "-c", "pass")["id"]
    bad = agent.cli_json("launch", "--name", "broken", "--", sys.executable, "-c", "raise SystemExit(3)")["id"]
    wait_for(
        lambda: {r["id"]: r["state"] for r in agent.cli_json("runs")} == {ok: "succeeded", bad: "failed"}, timeout=60, what="both to end"
    )

    def ids(*query: str) -> list[str]:
        return [r["id"] for r in json.loads(agent.cli("history", "--json", *query).stdout)]

    assert ids("-state:failed") == [ok]  # no `--` needed
    assert ids("-state:failed", "--no-sync") == [ok] and ids("--no-sync", "-name:fine run") == [bad]
    assert ids("-state:failed", "-state:succeeded") == []
    assert ids("--", "-state:succeeded") == [bad]  # after `--` as before
    assert ids("cause:~exit code 3") == [bad]  # one shell argument is one term, its spaces included
    assert sorted(ids("cause:~exit code")) == sorted([ok, bad])  # 'exit code 0' and 'exit code 3'
    assert ids("cause:~exit", "code") == []  # two arguments: two terms (the bare word `code` matches no run)
    assert ids("name:fine run") == [ok] and ids("fine run") == [ok]
    cp = agent.cli("history", "-bogus:x", check=False)
    assert cp.returncode == 2 and "unrecognized arguments: -bogus:x" in cp.stderr  # not a known key: argparse's error


def test_preflight_names_itself_and_a_bad_host_name_says_what_is_accepted(agent: AgentProc) -> None:
    from gpudeck.console.core.config import HOST_NAME_RULE

    cp = agent.cli("preflight", check=False)
    assert cp.returncode == 2 and "preflight needs a command" in cp.stderr and "gpudeck preflight -- " in cp.stderr, cp.stderr
    assert "launch" not in cp.stderr
    for args in (["launch", "--host", "bad host", "--", "true"], ["hosts", "add", "bad host"], ["status", "--host", "bad host"]):
        cp = agent.cli(*args, check=False)
        assert cp.returncode == 2 and "'bad host' is not a host name" in cp.stderr and HOST_NAME_RULE in cp.stderr, (args, cp.stderr)
    agent.cli("hosts", "add", "user@gpu-1.example", "[fe80::1]")  # what the rule says is accepted is accepted
    agent.cli("hosts", "remove", "user@gpu-1.example", "[fe80::1]")


def test_a_run_name_past_the_limit_is_refused_by_the_cli_and_by_the_agent(agent: AgentProc) -> None:
    """A 120 KB name made every table line 120,083 characters wide: the CLI refuses it before asking (exit 2, the limit
    named), and the agent refuses it too for a client that skips the CLI's check."""
    from gpudeck.agents.wire.errors import BadRequest
    from gpudeck.agents.wire.protocol import MAX_NAME, Launch, LaunchSpec

    long_name = "n" * 120_000
    cp = agent.cli("launch", "--name", long_name, "--", sys.executable, "-c", "pass", check=False)
    assert cp.returncode == 2, (cp.returncode, cp.stderr[:300])
    assert f"at most {MAX_NAME} characters" in cp.stderr and len(cp.stderr) < 500, cp.stderr[:300]
    assert agent.cli_json("runs") == []  # nothing recorded

    async def direct() -> str:
        c = await agent.client()
        try:
            await c.request(Launch(spec=LaunchSpec(argv=[sys.executable, "-c", "pass"], name="m" * (MAX_NAME + 1))))
        except BadRequest as exc:
            return exc.message
        finally:
            await c.close()
        return "accepted"

    import asyncio

    said = asyncio.run(direct())
    assert f"the limit is {MAX_NAME}" in said and "shorter --name" in said, said
    ok = agent.cli_json("launch", "--name", "m" * MAX_NAME, "--", sys.executable, "-c", "pass")
    assert ok["id"].startswith("r-")
