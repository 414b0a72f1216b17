"""Provides a loopback fleet for the benchmarks: N real agent processes behind one asyncssh SSH server process.

What is real and what is not, so nobody reads more into a figure than it holds:

- **Agents are real**: each host is its own ``python -m gpudeck.agents serve`` process
  with its own ``GPUDECK_HOME`` (journal, socket, run folders), started in
  batches so the machine is not swamped, each waited for on its socket.
- **GPUs are SIMULATED**: every agent runs with
  ``GPUDECK_SIMULATE_GPUS`` (default ``8:H200``, see agents/observe/gpus_sim.py);
  every GPU it reports is labelled ``SIMULATED`` and ``Snapshot.simulated``
  is true. No NVML is involved.
- **The SSH server side is asyncssh in-process, NOT OpenSSH**: one separate
  "SSH farm" process (``python bench/fleet_hosts.py farm SPEC``) runs
  ``asyncssh.listen`` once per host on 127.0.0.1 (ports chosen by the OS),
  with one generated ed25519 host key and the console's generated client key
  authorised. There is no sshd fork, no login shell and no ``gpudeck``
  process per session: for an exec of ``gpudeck agent dial`` the farm
  bridges the channel to that host's agent socket in-process (bytes both
  ways unchanged, as agents/wire/dial.py does); for an exec of
  ``gpudeck status --json`` (the exec-per-tick peer) it connects to that
  host's agent, sends Hello + GetSnapshot, writes the snapshot as one JSON
  line and exits 0 — so the peer's *host-side* exec cost is not in the farm
  and is measured separately by bench/fleet.py. The client side (the
  console) is the real one: asyncssh with a generated ssh config
  (``Host hNNN`` / HostName / Port / User / IdentityFile / IdentitiesOnly)
  and known_hosts, through :class:`gpudeck.console.fleet.transport.SshOptions`.

:class:`FleetHosts` starts and stops all of it (by pid); :class:`FleetSpec`
is the part a console process in another process needs (``fleet.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil

AGENT_START_TIMEOUT_S = 120.0  # per batch, on a loaded 2-core machine
FARM_START_TIMEOUT_S = 120.0
DIAL_COMMAND = "gpudeck agent dial"
STATUS_COMMAND = "gpudeck status --json"


_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """Runs in each child before exec: SIGTERM when the process that started it dies, so a killed bench leaves no agents behind."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_worker(argv: list[str], stderr_path: Path) -> subprocess.Popen:
    """A bench worker process (dies with us; stderr to a file) whose stdout is JSON lines."""
    with open(stderr_path, "wb") as errlog:
        return subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=errlog,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))},
            preexec_fn=die_with_parent,
        )


def worker_messages(proc: subprocess.Popen) -> Iterator[dict[str, Any]]:
    """The JSON objects a worker prints, one per line (other lines are skipped)."""
    assert proc.stdout is not None
    for raw in proc.stdout:
        try:
            msg = json.loads(raw)
        except ValueError:
            continue
        if isinstance(msg, dict):
            yield msg


def stop_on_signals() -> None:
    """Make SIGTERM and SIGINT raise in the main thread (SIGINT is ignored in background jobs), so ``close()`` runs."""

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGINT, _raise)


PIN_ENV = {"console": "BENCH_CONSOLE_CPUS", "standin": "BENCH_STANDIN_CPUS"}


def parse_cpus(text: str, check: bool = True) -> set[int]:
    """``0-1,4`` -> {0, 1, 4}: a CPU list as taskset takes it (ValueError on anything else, and, with ``check``, on
    a CPU this process may not run on)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (write it as taskset does, e.g. 0-1 or 0,2-5)")
        if hi and int(hi) < int(lo):
            raise ValueError(f"not a CPU list: {text!r} ({part.strip()} runs backwards)")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    usable = os.sched_getaffinity(0)
    if check and not cpus <= usable:
        raise ValueError(f"CPUs {sorted(cpus - usable)} are not usable here (this process may run on {sorted(usable)})")
    return cpus


def pin_options(ap: argparse.ArgumentParser, console: str, standin: str) -> None:
    """Check the benches' --console-cpus / --standin-cpus (an argparse error otherwise), hand them to :func:`pin` through
    the environment, and pin this driver to the stand-in's CPUs (it measures; it stays off the console's)."""
    for role, text in (("console", console), ("standin", standin)):
        if text:
            try:
                parse_cpus(text)
            except ValueError as exc:
                ap.error(f"--{role}-cpus: {exc}")
            os.environ[PIN_ENV[role]] = text
    pin(os.getpid(), "standin")


def pin(pid: int, role: str) -> str:
    """Pin ``pid``, every thread of it and every descendant to the CPUs the environment names for ``role``
    (``console`` or ``standin``: BENCH_CONSOLE_CPUS / BENCH_STANDIN_CPUS, set by the benches' --console-cpus and
    --standin-cpus); nothing when it names none. Returns a phrase for the bench's header line."""
    text = os.environ.get(PIN_ENV[role], "")
    if not text:
        return f"{role} not pinned"
    cpus = parse_cpus(text, check=False)  # checked when the option was read, before this driver was pinned
    procs = [psutil.Process(pid)]
    try:
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        pass
    for proc in procs:
        try:
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                os.sched_setaffinity(int(tid), cpus)
        except (OSError, psutil.Error):
            continue  # a thread or process that ended meanwhile
    got = os.sched_getaffinity(pid)
    if got != cpus:  # the header line must not claim a pinning that did not take
        raise RuntimeError(f"pinning the {role} (pid {pid}) to CPUs {text} did not take: it may run on {sorted(got)}")
    return f"{role} on CPUs {text}"


class FleetStartError(RuntimeError):
    """The loopback fleet could not be brought up; the message says which part failed and where its log is."""


@dataclass(frozen=True)
class FleetSpec:
    """What a console process needs to reach the loopback fleet: host names, homes, ssh files."""

    base_dir: Path
    names: tuple[str, ...]
    homes: tuple[Path, ...]  # each host's GPUDECK_HOME (the agent's state is home/agent)
    ports: tuple[int, ...]
    ssh_config: Path
    known_hosts: Path
    client_key: Path
    gpus: str

    @property
    def path(self) -> Path:
        """Where the spec is saved (``fleet.json`` in the base dir)."""
        return self.base_dir / "fleet.json"

    def state_dir(self, i: int) -> Path:
        """Host ``i``'s agent state folder."""
        return self.homes[i] / "agent"

    def socket(self, i: int) -> Path:
        """Host ``i``'s agent socket."""
        return self.state_dir(i) / "sock" / "agent.sock"

    def ssh_options(self, keepalive_s: float = 10.0):  # type: ignore[no-untyped-def]
        """The console's SSH settings for this fleet (its ssh config and known_hosts, nothing of ~/.ssh)."""
        from gpudeck.console.fleet.transport import SshOptions

        return SshOptions(config=[self.ssh_config], known_hosts=[self.known_hosts], keepalive_s=keepalive_s)

    def config(self):  # type: ignore[no-untyped-def]
        """A console Config with one HostSettings per host (no ``local``: only the loopback hosts are followed)."""
        from gpudeck.console.core import config as cfg

        return cfg.Config(hosts=tuple(cfg.HostSettings(name=n) for n in self.names), path=self.base_dir / "config.toml")

    def save(self) -> Path:
        """Write ``fleet.json``."""
        data = {
            "base_dir": str(self.base_dir),
            "names": list(self.names),
            "homes": [str(h) for h in self.homes],
            "ports": list(self.ports),
            "ssh_config": str(self.ssh_config),
            "known_hosts": str(self.known_hosts),
            "client_key": str(self.client_key),
            "gpus": self.gpus,
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)
        return self.path

    @classmethod
    def load(cls, path: Path) -> FleetSpec:
        """Read a saved ``fleet.json``."""
        d = json.loads(Path(path).read_text())
        return cls(
            base_dir=Path(d["base_dir"]),
            names=tuple(d["names"]),
            homes=tuple(Path(h) for h in d["homes"]),
            ports=tuple(int(p) for p in d["ports"]),
            ssh_config=Path(d["ssh_config"]),
            known_hosts=Path(d["known_hosts"]),
            client_key=Path(d["client_key"]),
            gpus=d["gpus"],
        )


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (their own, not their children's); gone ones count 0."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def runqueue_wait_s(pids: list[int] | None = None) -> float:
    """Seconds the main threads of these processes (default: this one) spent runnable but waiting for a CPU (schedstat).

    The main thread is the one that runs the event loop; a process starved by the
    machine's load shows it here while its own CPU stays flat.
    """
    total = 0
    for pid in pids if pids is not None else [os.getpid()]:
        try:
            with open(f"/proc/{pid}/schedstat") as fh:
                total += int(fh.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def rss_parts() -> dict[str, int]:
    """This process's resident memory split as the kernel counts it: anonymous, file-backed, shared memory (bytes)."""
    parts = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in parts:
                    parts[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return parts


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of these processes together."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total


@dataclass
class LoopbackKeys:
    """The keys of a loopback SSH server process and of the console that logs in to it (``base_dir/ssh``, 0700)."""

    dir: Path
    host_key: Any  # asyncssh.SSHKey: its public half goes into known_hosts
    client_key_path: Path


def make_keys(base_dir: Path, comment: str) -> LoopbackKeys:
    """A generated ed25519 host key (``comment``) and console key, the console's key authorised."""
    import asyncssh

    keys = base_dir / "ssh"
    keys.mkdir(exist_ok=True)
    os.chmod(keys, 0o700)
    host_key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    host_key.write_private_key(str(keys / "host_ed25519"))
    client_key = asyncssh.generate_private_key("ssh-ed25519", comment="gpudeck-bench-console")
    client_key_path = keys / "client_ed25519"
    client_key.write_private_key(str(client_key_path))
    os.chmod(client_key_path, 0o600)
    (keys / "authorized_keys").write_text(client_key.export_public_key().decode())
    return LoopbackKeys(keys, host_key, client_key_path)


def start_server(python: str, script: Path, mode: str, spec: dict, base_dir: Path, name: str) -> subprocess.Popen:
    """``python script mode SPEC`` (the SSH farm or the stand-in) in its own session, dying with us, ``spec`` written
    to ``base_dir/NAME.json`` and its output to ``base_dir/NAME.log``; without our GPUDECK_* settings."""
    spec_path = base_dir / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    log = open(base_dir / f"{name}.log", "wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUDECK_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    try:
        return subprocess.Popen(
            [python, str(script), mode, str(spec_path)],
            env=env,
            cwd=str(base_dir),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    finally:
        log.close()


def client_spec(
    base_dir: Path, keys: LoopbackKeys, names: list[str], homes: list[Path], ports: list[int], gpus: str, ciphers: str | None
) -> FleetSpec:
    """The console's side of a loopback fleet: an ssh config (``Host NAME`` per port) and known_hosts, saved as a
    :class:`FleetSpec`."""
    host_pub = keys.host_key.export_public_key().decode().strip()
    user = getpass.getuser()
    ssh_config = keys.dir / "config"
    with open(ssh_config, "w") as fh:
        for nm, port in zip(names, ports):
            fh.write(
                f"Host {nm}\n    HostName 127.0.0.1\n    Port {port}\n    User {user}\n    IdentityFile {keys.client_key_path}\n    IdentitiesOnly yes\n"
            )
            if ciphers:
                fh.write(f"    Ciphers {ciphers}\n")
            fh.write("\n")
    known = keys.dir / "known_hosts"
    known.write_text("".join(f"[127.0.0.1]:{port} {host_pub}\n" for port in ports))
    spec = FleetSpec(
        base_dir=base_dir,
        names=tuple(names),
        homes=tuple(homes),
        ports=tuple(ports),
        ssh_config=ssh_config,
        known_hosts=known,
        client_key=keys.client_key_path,
        gpus=gpus,
    )
    spec.save()
    return spec


class FleetHosts:
    """N real agents (SIMULATED GPUs) behind one asyncssh in-process SSH server (not OpenSSH), on loopback.

    ``FleetHosts(n)`` brings everything up or raises :class:`FleetStartError`
    (having stopped what it started); ``close()`` stops the agents, the farm
    and any run process the agents left behind, each by pid.
    """

    def __init__(
        self,
        n: int,
        gpus: str = "8:H200",
        base_dir: Path | None = None,
        *,
        batch: int = 16,
        python: str = sys.executable,
        progress: Callable[[str], None] | None = None,
        keep: bool = False,
        ciphers: str | None = None,
    ) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one host")
        self.n = n
        self.gpus = gpus
        self.ciphers = ciphers  # an ssh config `Ciphers` line for every host (None: the client's default preference)
        self.python = python
        self.batch = max(1, batch)
        self._progress = progress or (lambda _msg: None)
        self._own_dir = base_dir is None
        self.keep = keep
        self.base_dir = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="gdf-", dir="/tmp"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.names: list[str] = [f"h{i:03d}" for i in range(n)]
        self.homes: list[Path] = [self.base_dir / nm for nm in self.names]
        self.agents: list[subprocess.Popen] = []
        self.farm: subprocess.Popen | None = None
        self.spec: FleetSpec | None = None
        self.start_seconds = 0.0
        t0 = time.monotonic()
        try:
            self._start_agents()
            self._start_farm()
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0

    # ------------------------------------------------------------------ public

    @property
    def agent_pids(self) -> list[int]:
        """The agents' pids, in host order."""
        return [p.pid for p in self.agents]

    @property
    def farm_pid(self) -> int:
        """The SSH farm's pid."""
        assert self.farm is not None
        return self.farm.pid

    def ssh_options(self, keepalive_s: float = 10.0):  # type: ignore[no-untyped-def]
        """The console's SshOptions for this fleet."""
        assert self.spec is not None
        return self.spec.ssh_options(keepalive_s)

    def config(self):  # type: ignore[no-untyped-def]
        """A console Config listing every host."""
        assert self.spec is not None
        return self.spec.config()

    def agent_env(self, i: int) -> dict[str, str]:
        """The environment agent ``i`` runs with (also what a CLI on "host i" needs: its GPUDECK_HOME)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUDECK_")}
        env["GPUDECK_HOME"] = str(self.homes[i])
        env["GPUDECK_SIMULATE_GPUS"] = self.gpus
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        return env

    def close(self) -> None:
        """Stop the farm, the agents and leftover run processes (by pid); remove the folder unless ``keep``."""
        procs = ([self.farm] if self.farm is not None else []) + self.agents
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except OSError:
                    pass
        deadline = time.monotonic() + 20
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._stop_leftover_runs()
        self.agents = []
        self.farm = None
        if self._own_dir and not self.keep:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> FleetHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ start-up

    def _start_agents(self) -> None:
        for lo in range(0, self.n, self.batch):
            idx = list(range(lo, min(self.n, lo + self.batch)))
            for i in idx:
                home = self.homes[i]
                home.mkdir(parents=True, exist_ok=True)
                errlog = open(home / "agent.stderr", "wb")
                try:
                    self.agents.append(
                        subprocess.Popen(
                            [self.python, "-m", "gpudeck.agents", "serve", "--state-dir", str(home / "agent")],
                            env=self.agent_env(i),
                            cwd=str(home),
                            stdin=subprocess.DEVNULL,
                            stdout=errlog,
                            stderr=errlog,
                            start_new_session=True,
                            preexec_fn=die_with_parent,
                        )
                    )
                finally:
                    errlog.close()
            deadline = time.monotonic() + AGENT_START_TIMEOUT_S
            for i in idx:
                self._wait_agent(i, deadline)
            self._progress(f"agents up: {idx[-1] + 1}/{self.n}")

    def _wait_agent(self, i: int, deadline: float) -> None:
        sock_path = self.homes[i] / "agent" / "sock" / "agent.sock"
        proc = self.agents[i]
        while True:
            if proc.poll() is not None:
                raise FleetStartError(
                    f"agent {self.names[i]} (pid {proc.pid}) exited with {proc.returncode} at start: {self._tail(self.homes[i] / 'agent.stderr')} {self._tail(self.homes[i] / 'agent' / 'agent.log')}"
                )
            if sock_path.exists():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(str(sock_path))
                    return
                except OSError:
                    pass
                finally:
                    s.close()
            if time.monotonic() > deadline:
                raise FleetStartError(
                    f"agent {self.names[i]} (pid {proc.pid}) did not open {sock_path} within {AGENT_START_TIMEOUT_S:.0f} s of its batch's start "
                    f"(machine load {os.getloadavg()[0]:.1f}); its log: {self._tail(self.homes[i] / 'agent' / 'agent.log')}"
                )
            time.sleep(0.05)

    def _start_farm(self) -> None:
        keys = make_keys(self.base_dir, "gpudeck-bench-farm")
        farm_spec = {
            "hosts": [{"name": nm, "socket": str(h / "agent" / "sock" / "agent.sock")} for nm, h in zip(self.names, self.homes)],
            "host_key": str(keys.dir / "host_ed25519"),
            "authorized_keys": str(keys.dir / "authorized_keys"),
            "ready": str(self.base_dir / "farm.ready.json"),
        }
        self.farm = start_server(self.python, Path(__file__).resolve(), "farm", farm_spec, self.base_dir, "farm")
        ready = Path(farm_spec["ready"])
        deadline = time.monotonic() + FARM_START_TIMEOUT_S
        while not ready.exists():
            if self.farm.poll() is not None:
                raise FleetStartError(f"the SSH farm exited with {self.farm.returncode}: {self._tail(self.base_dir / 'farm.log')}")
            if time.monotonic() > deadline:
                raise FleetStartError(
                    f"the SSH farm did not listen on {self.n} ports within {FARM_START_TIMEOUT_S:.0f} s: {self._tail(self.base_dir / 'farm.log')}"
                )
            time.sleep(0.05)
        ports = json.loads(ready.read_text())["ports"]
        self.spec = client_spec(self.base_dir, keys, list(self.names), list(self.homes), ports, self.gpus, self.ciphers)
        self._progress(f"SSH farm (asyncssh in-process, pid {self.farm.pid}) listening on {len(ports)} ports")

    def _stop_leftover_runs(self) -> None:
        """Run processes the agents started (they outlive their agent by design) and that are still alive."""
        base = str(self.base_dir)
        found: list[psutil.Process] = []
        for p in psutil.process_iter(["pid"]):
            try:
                env = p.environ()
            except psutil.Error:
                continue
            if env.get("GPUDECK_RUN_ID") and env.get("GPUDECK_HOME", "").startswith(base):
                found.append(p)
        for p in found:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(found, timeout=5)

    @staticmethod
    def _tail(path: Path, n: int = 1500) -> str:
        try:
            return path.read_text(errors="replace")[-n:].strip() or "(empty)"
        except OSError:
            return f"({path} missing)"


# ---------------------------------------------------------------------------- the SSH farm process


class _Farm:
    """The asyncssh in-process server side: one listener per host; dial bridges, status answers one snapshot."""

    def __init__(self, sockets: list[Path]) -> None:
        self.sockets = sockets
        self.sessions = 0
        self.status_execs = 0

    async def session(self, i: int, process) -> None:  # type: ignore[no-untyped-def]
        import asyncssh

        cmd = (process.command or "").strip()
        try:
            if cmd.endswith(DIAL_COMMAND):
                await self._dial(process, self.sockets[i])
            elif cmd.endswith(STATUS_COMMAND):
                await self._status(process, self.sockets[i])
            else:
                process.stderr.write(
                    f"{cmd or '(shell)'}: command not found (bench SSH farm: only `{DIAL_COMMAND}` and `{STATUS_COMMAND}`)\n".encode()
                )
                process.exit(127)
        except (asyncssh.Error, OSError, BrokenPipeError, ConnectionError):
            try:
                process.exit(1)
            except Exception:
                pass

    async def _dial(self, process, sock: Path) -> None:  # type: ignore[no-untyped-def]
        import asyncssh

        self.sessions += 1
        try:
            reader, writer = await asyncio.open_unix_connection(str(sock), limit=1 << 20)
        except OSError as exc:
            process.stderr.write(f"gpudeck agent dial: no agent answers on {sock}: {exc}\n".encode())
            process.exit(1)
            return

        async def up() -> None:
            try:
                while True:
                    data = await process.stdin.read(1 << 16)
                    if not data:
                        break
                    writer.write(data)
                    await writer.drain()
            except (asyncssh.Error, OSError, ConnectionError):
                pass
            finally:
                try:
                    writer.write_eof()  # as dial does: the agent answers what is in flight, then closes
                except (OSError, RuntimeError):
                    pass

        up_task = asyncio.ensure_future(up())
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                process.stdout.write(data)
                await process.stdout.drain()
        except (asyncssh.Error, OSError, ConnectionError):
            pass
        finally:
            up_task.cancel()
            writer.close()
            try:
                process.exit(0)
            except Exception:
                pass

    async def _status(self, process, sock: Path) -> None:  # type: ignore[no-untyped-def]
        import msgspec

        from gpudeck.agents.wire.client import AgentClient
        from gpudeck.agents.wire.errors import AgentError
        from gpudeck.agents.wire.protocol import GetSnapshot

        self.status_execs += 1
        try:
            client = await AgentClient.connect_unix(sock, autostart=False)
        except AgentError as exc:
            process.stderr.write(f"gpudeck status: {exc.message}\n".encode())
            process.exit(1)
            return
        try:
            snap = await client.request(GetSnapshot(), timeout=30)
        finally:
            await client.close()
        # the same document `gpudeck status --json` prints (msgspec's encoder: no spaces after separators)
        process.stdout.write(msgspec.json.encode(snap) + b"\n")
        process.exit(0)


def _no_ignore_padding(asyncssh) -> None:  # type: ignore[no-untyped-def]
    """Make the farm's asyncssh send like OpenSSH's sshd: asyncssh inserts an empty SSH_MSG_IGNORE before every
    packet it sends once encryption is on (a CBC-era countermeasure); sshd does not. Left in, every message to the
    console would be two packets, a cost of this bench's server that real GPU hosts (OpenSSH) do not impose.
    Both designs (gpudeck and exec-per-tick) talk to the same farm."""
    from asyncssh.connection import SSHConnection
    from asyncssh.constants import MSG_IGNORE
    from asyncssh.packet import String

    orig = SSHConnection.send_packet
    empty = String(b"")

    def send_packet(self, pkttype, *args, handler=None):  # type: ignore[no-untyped-def]
        if pkttype == MSG_IGNORE and args == (empty,):
            return None
        return orig(self, pkttype, *args, handler=handler)

    SSHConnection.send_packet = send_packet  # type: ignore[method-assign]


async def _farm_main(spec_path: Path) -> None:
    import functools

    import asyncssh

    _no_ignore_padding(asyncssh)
    spec = json.loads(Path(spec_path).read_text())
    farm = _Farm([Path(h["socket"]) for h in spec["hosts"]])
    host_key = asyncssh.read_private_key(spec["host_key"])
    authorized = asyncssh.read_authorized_keys(spec["authorized_keys"])
    acceptors = []
    for i in range(len(spec["hosts"])):
        acc = await asyncssh.listen(
            host="127.0.0.1",
            port=0,
            server_host_keys=[host_key],
            authorized_client_keys=authorized,
            process_factory=functools.partial(farm.session, i),
            encoding=None,
            allow_scp=False,
            agent_forwarding=False,
            x11_forwarding=False,
            login_timeout=120,
        )
        acceptors.append(acc)
    ready = Path(spec["ready"])
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "ports": [a.get_port() for a in acceptors]}))
    os.replace(tmp, ready)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for a in acceptors:
        a.close()


# ---------------------------------------------------------------------------- smoke check


async def smoke(spec: FleetSpec, seconds: float, label: str = "fleet_hosts") -> None:
    """Follow every host of ``spec`` with a real Fleet for ``seconds`` and print what each showed (a quick check)."""
    from gpudeck.console.fleet.fleet import Fleet
    from gpudeck.console.history.replica import History

    hist = History(spec.base_dir / "smoke-history.db")
    fleet = Fleet(config=spec.config(), ssh=spec.ssh_options(), interval_s=1.0, history=hist)
    fleet.start()
    t0 = time.monotonic()
    states: list[str] = []
    try:
        while time.monotonic() - t0 < 60:
            states = [ln.status.state for ln in fleet.links.values()]
            if all(s == "up" for s in states):
                break
            await asyncio.sleep(0.2)
        print(f"{label} smoke: {sum(s == 'up' for s in states)}/{len(states)} hosts up after {time.monotonic() - t0:.1f} s", flush=True)
        await asyncio.sleep(seconds)
        for name, ln in fleet.links.items():
            snap = ln.status.snapshot
            print(
                f"{label} smoke {name}: {ln.status.state} host={snap.host if snap else None} {len(snap.gpus) if snap else 0} GPUs "
                f"({snap.gpus[0].name if snap and snap.gpus else ''}) simulated={snap.simulated if snap else None} "
                f"runs={len(snap.runs) if snap else 0} synced_seq={ln.status.synced_seq} err={ln.status.error}",
                flush=True,
            )
        print(f"{label} smoke: history holds {hist.event_count()} events", flush=True)
    finally:
        await fleet.close()
        hist.close()


def main(argv: list[str] | None = None) -> int:
    """``farm SPEC`` runs the SSH farm (FleetHosts starts it); ``smoke --hosts N`` brings a fleet up and follows it briefly."""
    ap = argparse.ArgumentParser(description="loopback fleet for the benchmarks (SIMULATED GPUs, asyncssh in-process SSH server)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("farm")
    f.add_argument("spec", type=Path)
    s = sub.add_parser("smoke")
    s.add_argument("--hosts", type=int, default=4)
    s.add_argument("--gpus", default="8:H200")
    s.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    if args.cmd == "farm":
        asyncio.run(_farm_main(args.spec))
        return 0
    stop_on_signals()
    t0 = time.monotonic()
    with FleetHosts(args.hosts, args.gpus, progress=lambda m: print(f"fleet_hosts {m}", file=sys.stderr, flush=True)) as fh:
        print(f"fleet_hosts smoke: {args.hosts} agents + farm up in {time.monotonic() - t0:.1f} s (base {fh.base_dir})", flush=True)
        assert fh.spec is not None
        asyncio.run(smoke(fh.spec, args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
