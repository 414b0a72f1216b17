"""Hostile input and access, end to end over real SSH: shell metacharacters stay literal, no TCP port, no forwarding, parameterised history.

What tests/e2e/test_agent_socket.py and test_fleet_ssh.py already prove (socket
modes, another uid refused, hostile frames, unknown and changed host keys, a
shell command through the locked-down key) is not repeated; this file covers
the rest of issue 7's "Hostile input and access".

The host's agent runs with ``HOME`` pointing at a sandbox and ``PATH`` starting
with stub ``rm`` and ``reboot`` programs that only leave a marker: if any layer
ever handed an argument to a shell, the stubs would run (and say so) instead
of the real commands, and the sandbox's canary file would be gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpudeck.console.fleet.transport import connect_ssh
from tests.agent_harness import AgentProc, stop_runs, wait_exited, wait_for
from tests.netns_harness import tcp_sockets
from tests.sshd_harness import GPUDECK, ConsoleSide, SshHost, short_tmp

pytestmark = pytest.mark.slow
PY = sys.executable
PRINT_ARGV = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'env': os.environ.get('GD_X')}), flush=True)"


class SandboxedAgent(AgentProc):
    """The host's agent with HOME in a sandbox and stub rm/reboot first on PATH (harmless if anything ever used a shell)."""

    def __init__(self, home: Path, sandbox: Path) -> None:
        super().__init__(home)
        self.sandbox = sandbox

    @property
    def env(self) -> dict[str, str]:
        env = super().env
        env["HOME"] = str(self.sandbox)
        env["PATH"] = f"{self.sandbox / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env


def _sandbox() -> Path:
    sb = short_tmp("gd-sandbox-")
    (sb / "bin").mkdir()
    for name in ("rm", "reboot", "shutdown", "curl"):
        stub = sb / "bin" / name
        stub.write_text(f'#!/bin/sh\necho "$0 $*" >> {sb}/STUB-RAN\nexit 0\n')
        stub.chmod(0o755)
    (sb / "canary").write_text("still here\n")
    return sb


class DebugSshHost(SshHost):
    """An SshHost whose sshd logs at DEBUG1 (channel requests such as agent forwarding show in its log)."""

    def sshd_argv(self) -> list[str]:
        # sftp is configured, so the test can show the forced command overrides a subsystem request too
        argv = ["LogLevel=DEBUG1" if a == "LogLevel=VERBOSE" else a for a in super().sshd_argv()]
        return [*argv, "-o", "Subsystem=sftp internal-sftp"]


def ssh_argv(c: ConsoleSide, host: str, *extra: str) -> list[str]:
    """OpenSSH's client as the operator would run it, with the console's config and known_hosts."""
    return ["ssh", "-F", str(c.ssh_config), "-o", f"UserKnownHostsFile={c.known_hosts}", "-o", "BatchMode=yes", *extra, host]


def dial_processes(h: SshHost, besides: set[int] | None = None) -> list[psutil.Process]:
    """The `gpudeck agent dial` bridges this host's sshd runs now, other than the pids in ``besides``."""
    assert h.proc is not None
    out = []
    for p in psutil.Process(h.proc.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
            if (
                "dial" in cmd
                and any(x.endswith("gpudeck") or x == "gpudeck.console.cli.main" for x in cmd)
                and p.pid not in (besides or set())
            ):
                out.append(p)
        except psutil.Error:
            continue
    return out


def dial_pids(h: SshHost) -> set[int]:
    return {p.pid for p in dial_processes(h)}


def _end_session(ctl: subprocess.Popen, h: SshHost, before: set[int]) -> None:
    """Close an ssh client and wait until its bridge on the host is gone too.

    A bridge still starting up when its session dies is re-parented away from sshd, so stopping sshd would miss
    it, and it would start a fresh agent for a host that is being torn down; it is waited for (or killed) by pid.
    """
    bridges = dial_processes(h, before)
    ctl.kill()
    ctl.wait(10)
    alive = wait_exited(bridges, 10)  # a re-parented bridge is init's: psutil's wait would also wait out init's reaping
    for p in alive:
        p.kill()


def assert_no_tcp(*pids: int) -> None:
    for pid in pids:
        found = tcp_sockets(pid)
        assert found == [], f"pid {pid} ({' '.join(psutil.Process(pid).cmdline()[:4])}) holds TCP sockets: {found}"


def _safe_env(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def _agent_states(h: SshHost) -> dict[str, str]:
    """Run states straight from the host agent's journal file (cheaper than a CLI call per poll)."""
    import sqlite3

    db = sqlite3.connect(h.agent.state_dir / "journal.db", timeout=10)
    try:
        return dict(db.execute("SELECT id, state FROM runs").fetchall())
    finally:
        db.close()


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[ConsoleSide, SshHost, Path]]:
    c = ConsoleSide()
    sandbox = _sandbox()
    h = DebugSshHost("sec", c.pub, start_agent=False)
    h.agent = SandboxedAgent(h.home, sandbox)
    h._start_agent = True
    c.add(h)
    try:
        h.start()
        c.cli("hosts", "add", "sec")
        yield c, h, sandbox
    finally:
        stop_runs(h.agent)
        c.cleanup()
        shutil.rmtree(sandbox, ignore_errors=True)


def test_the_tcp_check_sees_a_real_listener() -> None:
    """The no-TCP assertions below can fail: a socket this process opens is found, by inode, in /proc/<pid>/net/tcp."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        found = tcp_sockets(os.getpid())
        assert any(t.state == "LISTEN" and t.local == f"127.0.0.1:{s.getsockname()[1]}" for t in found), found
    finally:
        s.close()


def test_shell_metacharacters_in_arguments_env_and_name_are_passed_literally_over_ssh(fleet, tmp_path: Path) -> None:
    c, h, sandbox = fleet
    markers = [tmp_path / f"m{i}" for i in range(8)]
    payloads = [
        '"; rm -rf ~; "',
        "$(reboot)",
        "`reboot`",
        f"; touch {markers[0]}",
        f"$(touch {markers[1]})",
        f"| touch {markers[2]}",
        f"&& touch {markers[3]} &&",
        f"`touch {markers[4]}`",
        "'",
        '"',
        "\\",
        "*",
        "~",
        "$HOME",
        "${PATH}",
        "",
        "  two  spaces  ",
        "-c",
        "--",
        "a\nb",
        "tab\there",
        "ünïcødé ✓",
        "%s%n%x",
        '{"type":"launch","spec":{"argv":["reboot"]}}',
    ]
    env_value = f"$(touch {markers[5]}); rm -rf ~"
    name = f"x\"; touch {markers[6]}; echo \"$(touch {markers[7]})' OR '1'='1"
    out = c.cli("launch", "--host", "sec", "--name", name, "--env", f"GD_X={env_value}", "--json", "--", PY, "-c", PRINT_ARGV, *payloads)
    rid = json.loads(out.stdout)["id"]
    try:
        wait_for(lambda: _agent_states(h).get(rid) not in (None, "starting", "running"), timeout=120, interval=0.2, what="the run to end")
    except AssertionError as exc:
        rd = h.agent.state_dir / "runs" / rid
        files = {f.name: f.read_text()[-500:] for f in rd.iterdir()} if rd.exists() else {}
        procs = [(p.pid, p.status(), p.cmdline()[:3]) for p in psutil.process_iter() if _safe_env(p).get("GPUDECK_RUN_ID") == rid]
        raise AssertionError(
            f"{exc}: state {_agent_states(h).get(rid)}, files {files}, processes {procs}, agent log {h.agent.log()[-1500:]}"
        ) from None
    row = next(r for r in c.cli_json("runs", "--host", "sec") if r["id"] == rid)
    assert row["state"] == "succeeded", row
    printed = json.loads(c.cli("tail", rid, "--host", "sec", "-n", "-1").stdout.strip().splitlines()[-1])
    assert printed["argv"] == payloads, "an argument was changed on the way"
    assert printed["env"] == env_value
    assert row["name"] == name and row["spec"]["argv"] == [PY, "-c", PRINT_ARGV, *payloads]
    assert [m for m in markers if m.exists()] == [], "a shell ran a command hidden in an argument"
    assert not (sandbox / "STUB-RAN").exists(), f"a shell ran: {(sandbox / 'STUB-RAN').read_text()}"
    assert (sandbox / "canary").exists(), "`rm -rf ~` ran in the agent's HOME"
    # the same name, exactly, through the history's filter language (it reaches SQL only as a parameter)
    hits = c.cli_json("history", f"name:{name}")  # one shell argument is one term, as given
    assert [r["id"] for r in hits] == [rid], [(r["id"], r["host"], r["name"]) for r in hits]
    assert c.cli_json("show", rid)["name"] == name
    print(
        f"\n{len(payloads)} hostile arguments, a hostile --env value and name went over SSH and came back byte for byte; "
        f"no marker file, no stub ran, the canary in HOME survived"
    )


def test_history_filters_are_parameterised_through_the_cli(fleet) -> None:
    c, h, _ = fleet
    from gpudeck.agents.wire.protocol import LaunchSpec
    from gpudeck.console.core import config as cfg
    from gpudeck.console.fleet.fleet import Fleet

    names = ["x'; DROP TABLE runs; --", "' OR '1'='1", "100%", "1000x", "a_b", "axb", 'q"uote']

    async def launch_all() -> dict[str, str]:
        conf = cfg.Config(hosts=(cfg.HostSettings("sec"),), path=c.gpudeck_home / "config.toml")
        f = Fleet(config=conf, ssh=c.ssh_options(), watch=False)
        try:
            return {n: (await f.launch("sec", LaunchSpec(argv=["true"], name=n, cwd="/"))).run.id for n in names}
        finally:
            await f.close()

    ids = asyncio.run(launch_all())
    wait_for(lambda: all(_agent_states(h).get(i) == "succeeded" for i in ids.values()), timeout=120, interval=0.2, what="the runs to end")

    def found(query: str, sync: bool = False) -> list[tuple[str, str]]:
        return [(r["id"], r["name"]) for r in c.cli_json("history", *([] if sync else ["--no-sync"]), query)]

    everything = found("limit:10000", sync=True)  # one sync pulls the runs in; the queries below read the history as it is
    assert set(ids.values()) <= {i for i, _ in everything}
    for n in ("x'; DROP TABLE runs; --", "' OR '1'='1", 'q"uote'):
        assert found(f"name:{n}") == [(ids[n], n)], n
    # LIKE wildcards in a value are literal: as wildcards they would also match the decoys 1000x and axb
    assert found("name:~100%") == [(ids["100%"], "100%")]
    assert found("name:~a_b") == [(ids["a_b"], "a_b")]
    for q in ('host:"sec\' OR 1=1 --"', "state:~\"' OR ''='\"", '"\' OR 1=1 --"'):
        assert found(q) == [], q
    # a state that is not one is refused before any SQL (exit 2, the states listed)
    refused = c.cli("history", "--no-sync", "state:\"' OR ''='\"", check=False)
    assert refused.returncode == 2 and "not a state" in refused.stderr
    # the tables are all still there and nothing was rewritten
    assert found("limit:10000") == everything
    db = c.gpudeck_home / "history.db"
    tables = subprocess.run(
        ["sqlite3", str(db), "select name from sqlite_master where type='table' order by name"], capture_output=True, text=True
    ).stdout.split()
    assert {"events", "runs", "hosts", "epochs"} <= set(tables), tables


def test_the_agent_opens_no_tcp_port_while_serving_ssh_launches_and_streams(fleet) -> None:
    c, h, _ = fleet

    async def busy() -> None:
        link = await connect_ssh("sec", "gpudeck agent dial", c.ssh_options())
        try:
            from gpudeck.agents.wire.protocol import GetEvents, Launch, LaunchSpec, WatchSnapshots

            await link.client.request(Launch(spec=LaunchSpec(argv=["sleep", "1"], name="tcp-probe")), timeout=60)
            snaps = link.client.stream(WatchSnapshots(interval_s=0.1))
            events = link.client.stream(GetEvents(after_seq=0, follow=True))
            await snaps.__anext__()
            await events.__anext__()
            dials = dial_processes(h)
            assert dials, "no dial bridge found under sshd"
            assert_no_tcp(h.agent.pid, *(p.pid for p in dials))
            await snaps.aclose()
            await events.aclose()
        finally:
            await link.close()

    assert_no_tcp(h.agent.pid)
    asyncio.run(busy())
    assert_no_tcp(h.agent.pid)
    listening = [t for t in tcp_sockets(h.agent.pid) if t.state == "LISTEN"]
    assert listening == []


def test_an_agent_started_by_the_forced_command_is_private_and_opens_no_tcp_port() -> None:
    c = ConsoleSide()
    h = SshHost("cold", c.pub, start_agent=False)  # no agent yet: `gpudeck agent dial` starts it
    c.add(h)
    try:
        h.start()
        snap = c.cli_json("status", "--host", "cold")
        sd = h.home / "agent"
        sock = sd / "sock" / "agent.sock"
        assert stat.S_IMODE(sd.stat().st_mode) == 0o700
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        pid = int((sd / "agent.lock").read_text())
        assert snap["epoch"]
        assert_no_tcp(pid)
    finally:
        c.cleanup()


def _ssh_agent(tmp: Path, key: Path) -> tuple[subprocess.Popen, str]:
    sock = str(tmp / "agent.sock")
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", sock], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: os.path.exists(sock), what="ssh-agent's socket")
    subprocess.run(["ssh-add", str(key)], env={**os.environ, "SSH_AUTH_SOCK": sock}, check=True, capture_output=True)
    return proc, sock


def test_the_console_never_forwards_the_users_ssh_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a key that would allow forwarding: the console asks for none; OpenSSH's `ssh -A` (the control) gets one."""
    c = ConsoleSide()
    h = DebugSshHost("fwd", c.pub)
    # command= but not restrict: this server would forward an agent if the client asked
    h.authorized.write_text(f'command="{GPUDECK} agent dial" {c.pub}\n')
    c.add(h)
    tmp = short_tmp("gd-sshagent-")
    agent_proc, agent_sock = _ssh_agent(tmp, c.key)
    try:
        h.start()
        monkeypatch.setenv("SSH_AUTH_SOCK", agent_sock)  # the operator has an ssh-agent running

        async def console_env() -> dict[str, str]:
            t0 = dial_pids(h)
            link = await connect_ssh("fwd", "gpudeck agent dial", c.ssh_options())
            try:
                dials = wait_for(lambda: dial_processes(h, t0), what="the console's dial bridge")
                return dials[0].environ()
            finally:
                await link.close()
                wait_exited(dial_processes(h, t0), 10)

        env = asyncio.run(console_env())
        assert "SSH_AUTH_SOCK" not in env, "the console forwarded the operator's ssh-agent"
        log = h.log.read_text()
        assert "auth-agent-req" not in log, "the console asked the server for agent forwarding"

        # the control: OpenSSH with -A does get an agent socket through this key, and sshd logs the request
        t0 = dial_pids(h)
        ctl = subprocess.Popen(
            ssh_argv(c, "fwd", "-A"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**c.env, "SSH_AUTH_SOCK": agent_sock},
        )
        try:
            dials = wait_for(lambda: dial_processes(h, t0), what="the control's dial bridge")
            assert "SSH_AUTH_SOCK" in dials[0].environ(), "the control did not get a forwarded agent: this check could not fail"
            assert "auth-agent-req" in h.log.read_text()
        finally:
            _end_session(ctl, h, t0)
        print("\nagent forwarding: console connection has no SSH_AUTH_SOCK and sent no auth-agent-req; `ssh -A` (control) got one")
    finally:
        agent_proc.kill()
        agent_proc.wait(10)
        c.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def _echo_server() -> tuple[socket.socket, int, list[bytes]]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    got: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            data = conn.recv(100)
            got.append(data)
            conn.sendall(data)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1], got


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_restricted_key_gives_no_pty_no_forwarding_no_subsystem_and_no_client_env(fleet, tmp_path: Path) -> None:
    c, h, sandbox = fleet
    srv, port, got = _echo_server()
    try:
        # no PTY
        cp = subprocess.run(ssh_argv(c, "sec", "-tt"), input="", capture_output=True, text=True, timeout=30, env=c.env)
        assert "PTY allocation request failed" in cp.stderr, cp.stderr

        # no local forwarding: the tunnel's far end refuses, nothing reaches the service
        lport = _free_port()
        fwd = subprocess.Popen(
            ssh_argv(c, "sec", "-N", "-L", f"127.0.0.1:{lport}:127.0.0.1:{port}"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=c.env,
        )
        try:

            def try_tunnel() -> bytes | None:
                try:
                    with socket.create_connection(("127.0.0.1", lport), timeout=2) as s:
                        s.sendall(b"through the tunnel")
                        s.settimeout(3)
                        try:
                            return s.recv(100) or b"closed"
                        except OSError:
                            return b"closed"
                except OSError:
                    return None

            answer = wait_for(try_tunnel, timeout=15, what="the ssh client's local listener")
            assert answer == b"closed" and got == [], f"the tunnel carried data: {answer!r} {got}"
        finally:
            fwd.kill()
            _, err = fwd.communicate(timeout=10)
        assert "prohibited" in err or "open failed" in err, err

        # no remote forwarding
        rport = _free_port()
        cp = subprocess.run(
            ssh_argv(c, "sec", "-N", "-o", "ExitOnForwardFailure=yes", "-R", f"127.0.0.1:{rport}:127.0.0.1:{port}"),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            env=c.env,
        )
        assert cp.returncode != 0 and "forwarding failed" in cp.stderr, cp.stderr
        assert got == []

        # a subsystem (sftp) is not served: the forced command runs instead, and it only speaks the agent protocol
        cp = subprocess.run([*ssh_argv(c, "sec", "-s"), "sftp"], input="garbage\n", capture_output=True, text=True, timeout=30, env=c.env)
        assert json.loads(cp.stdout.splitlines()[0])["code"] == "bad_json", cp.stdout + cp.stderr

        # a command after the host, even a whole shell line, is not run: the bridge runs and answers in protocol
        marker = tmp_path / "shell-ran"
        cp = subprocess.run(
            [*ssh_argv(c, "sec"), "sh", "-c", f"'touch {marker}'"],
            input='{"type":"ping","request_id":"p"}\n',
            capture_output=True,
            text=True,
            timeout=30,
            env=c.env,
        )
        assert not marker.exists()
        assert json.loads(cp.stdout.splitlines()[0])["type"] == "pong", cp.stdout + cp.stderr

        # the client cannot set the bridge's environment (no AcceptEnv, no PermitUserEnvironment)
        evil = tmp_path / "evil-home"
        t0 = dial_pids(h)
        ctl = subprocess.Popen(
            ssh_argv(c, "sec", "-o", f"SetEnv=GPUDECK_HOME={evil} LD_PRELOAD=/tmp/evil.so"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=c.env,
        )
        try:
            dials = wait_for(lambda: dial_processes(h, t0), what="the bridge")
            env = dials[0].environ()
            assert env.get("GPUDECK_HOME") == str(h.home) and "LD_PRELOAD" not in env, env
        finally:
            _end_session(ctl, h, t0)
        assert not evil.exists()
        # and through this key no agent was forwarded either
        t0 = dial_pids(h)
        ctl = subprocess.Popen(
            ssh_argv(c, "sec", "-A"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**c.env, "SSH_AUTH_SOCK": "/nonexistent"},
        )
        try:
            dials = wait_for(lambda: dial_processes(h, t0), what="the bridge")
            assert "SSH_AUTH_SOCK" not in dials[0].environ()
        finally:
            _end_session(ctl, h, t0)
        print(
            "\nrestricted key: PTY refused, -L and -R refused (nothing reached the service), sftp subsystem not served, "
            "a shell line not run, client SetEnv ignored, no agent forwarded"
        )
    finally:
        srv.close()
    assert_no_tcp(h.agent.pid)
