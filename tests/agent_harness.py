"""Provides test helpers that run a real agent process and the real CLI against it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import psutil

from gpudeck.agents.wire.client import AgentClient
from gpudeck.agents.wire.protocol import GetRun, ListRuns, Stop

ROOT = Path(__file__).resolve().parent.parent


class AgentProc:
    """A real ``python -m gpudeck.agents serve`` process on a private GPUDECK_HOME; stopped by pid."""

    def __init__(self, home: Path, prefix: tuple[str, ...] = ()) -> None:
        self.home = home
        self.state_dir = home / "agent"
        self.proc: subprocess.Popen | None = None
        self.prefix = prefix  # a command the agent runs under (e.g. setpriv dropping a capability)

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["GPUDECK_HOME"] = str(self.home)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def start(self) -> AgentProc:
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "gpudeck.agents", "serve", "--state-dir", str(self.state_dir)],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        sock = self.state_dir / "sock" / "agent.sock"
        deadline = time.monotonic() + 120  # a hang limit: an agent's start-up on a 4x oversubscribed machine takes seconds
        while time.monotonic() < deadline:
            if sock.exists() and self._answers():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}; log: {self.log()}")
            time.sleep(0.05)
        raise RuntimeError(f"agent did not come up; log: {self.log()}")

    def _answers(self) -> bool:
        import socket

        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(self.state_dir / "sock" / "agent.sock"))
            return True
        except OSError:
            return False
        finally:
            s.close()

    def log(self) -> str:
        try:
            return (self.state_dir / "agent.log").read_text()[-3000:]
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def stop_autostarted(self) -> None:
        """Stop an agent that a CLI call started on this test's state dir after ours went away (by its pid)."""
        try:
            pid = int((self.state_dir / "agent.lock").read_text().strip() or 0)
        except (OSError, ValueError):
            return
        if not pid or (self.proc is not None and pid == self.proc.pid):
            return
        try:
            p = psutil.Process(pid)
            if "--state-dir" in p.cmdline() and str(self.state_dir) in p.cmdline():
                p.terminate()
                wait_exited([p], 10)
        except (psutil.Error, OSError):
            pass

    def cli(self, *args: str, check: bool = True, timeout: float = 60, stdin: str | None = None) -> subprocess.CompletedProcess:
        """Run the real ``gpudeck`` CLI against this agent."""
        cp = subprocess.run(
            [sys.executable, "-m", "gpudeck.console.cli.main", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=stdin,
        )
        if check and cp.returncode != 0:
            raise AssertionError(
                f"gpudeck {' '.join(args)} exited {cp.returncode}\nstdout: {cp.stdout}\nstderr: {cp.stderr}\nagent log: {self.log()}"
            )
        return cp

    def cli_json(self, *args: str) -> Any:
        # --json goes right after the subcommand: after "--" it would be part of the run's argv
        return json.loads(self.cli(args[0], "--json", *args[1:]).stdout)

    async def client(self) -> AgentClient:
        return await AgentClient.connect_unix(state_dir=self.state_dir, autostart=False)

    def ask(self, msg: Any, timeout: float = 60) -> Any:
        """One request straight to the agent's socket, the reply as plain data (polling through the CLI costs a
        Python start each time, which on a loaded machine is seconds)."""

        async def go() -> Any:
            c = await self.client()
            try:
                return msgspec.to_builtins(await c.request(msg, timeout=timeout))
            finally:
                await c.close()

        return asyncio.run(go())


def run_state(a: AgentProc, rid: str) -> str | None:
    """A run's state as its agent holds it, asked over the agent's socket: for a wait's polls, each of which through the
    CLI (`runs --json`) was a Python start (0.2 s of CPU, taken from the run being waited for on 2 cores)."""
    run = a.ask(GetRun(run_id=rid)).get("run")
    return run["state"] if run else None


def wait_exited(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every one of ``procs`` has exited (gone, or a zombie: exited, only its parent's wait is missing); returns
    those still running after ``timeout``. For processes that are not our children: their parent is init once theirs
    is gone, and psutil's wait()/wait_procs() also wait out init's reaping, which on this machine comes up to ~1.5 s
    after the exit (an autostarted agent's stop took 1.1-1.9 s, its exit 5 ms after the signal)."""
    deadline = time.monotonic() + timeout
    left = list(procs)
    while True:
        still = []
        for p in left:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    still.append(p)
            except psutil.NoSuchProcess:
                pass
        left = still
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def simulated_agent(home: Path, monkeypatch: Any, spec: str) -> Iterator[AgentProc]:
    """A real agent on SIMULATED GPUs (``GPUDECK_SIMULATE_GPUS=spec``, set through the test's ``monkeypatch``) for a
    fixture to ``yield from``: torn down, its runs stopped, after the test."""
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", spec)
    a = AgentProc(home).start()
    yield a
    teardown_agent(a)


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def stop_runs(a: AgentProc) -> None:
    """Stop every run a test left on this agent (through the agent, then by tag); never raises.

    The list and the stops go straight to the agent's socket: through the CLI each was a Python start (0.2 s of CPU,
    more on a busy machine) in the teardown of hundreds of tests. Where the agent does not answer there (gone, or
    called from a running event loop), the CLI's way as before: it starts an agent, which adopts what is left."""
    try:
        runs = None
        if not _in_event_loop():
            try:
                runs = a.ask(ListRuns(limit=100000))["runs"]
            except Exception:
                pass
        via_socket = runs is not None
        if runs is None:
            runs = a.cli_json("runs")
        live = [r["id"] for r in runs if r["state"] in ("starting", "running", "stopping")]

        def stop(rid: str) -> None:
            if via_socket:
                try:
                    a.ask(Stop(run_id=rid, grace_s=1.0))
                except Exception:
                    pass  # ended meanwhile, or the agent went away: what is left is killed by its tag below
            else:
                a.cli("stop", rid, "--grace", "1", check=False)

        with ThreadPoolExecutor(max_workers=max(1, min(8, len(live)))) as pool:  # the stops wait on their graces together
            list(pool.map(stop, live))
        kill_tagged(*(r["id"] for r in runs))
    except Exception:
        pass


def teardown_agent(a: AgentProc) -> None:
    """Stop every run a test left, then the agent itself."""
    stop_runs(a)
    a.stop()
    a.stop_autostarted()


def kill_pids(pids: list[int]) -> None:
    """Teardown safety net: SIGKILL exactly these pids (processes the test started); a gone one is fine."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_tagged(*run_ids: str) -> None:
    """Teardown safety net: SIGKILL processes carrying one of these runs' tags (by pid, never by name)."""
    tags = set(run_ids)
    if not tags:
        return
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("GPUDECK_RUN_ID") in tags:
                p.kill()
        except (psutil.Error, OSError):
            pass


def wait_for(pred, timeout: float = 10.0, interval: float = 0.05, what: str = "condition") -> Any:  # type: ignore[no-untyped-def]
    """Poll ``pred`` until it returns a truthy value; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def until(pred, timeout: float, what: str, about=None, interval: float = 0.1) -> Any:  # type: ignore[no-untyped-def]
    """``wait_for`` for a test on an event loop: poll ``pred`` without blocking the loop; on timeout, fail with ``what``
    and ``about()`` (the state worth reading: a link's status, say)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s: {what}" + (f" ({about()})" if about is not None else ""))
        await asyncio.sleep(interval)


def journal_add_member(state_dir: Path, run_id: str, member: dict) -> list[dict]:
    """Write one more member into a run's row of a stopped agent's journal (a PID-reuse stand-in); returns the members before."""
    import sqlite3

    db = sqlite3.connect(state_dir / "journal.db")
    try:
        members = json.loads(db.execute("SELECT members FROM runs WHERE id=?", (run_id,)).fetchone()[0])
        db.execute("UPDATE runs SET members=? WHERE id=?", (json.dumps([*members, member]), run_id))
        db.commit()
    finally:
        db.close()
    return members
