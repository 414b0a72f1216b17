"""Provides real OpenSSH hosts for the tests: ``sshd`` on a loopback port, its own keys, its own agent.

Each :class:`SshHost` is one "host" of the fleet: Debian's ``/usr/sbin/sshd``
started with ``-f /dev/null`` and everything on the command line, a generated
host key, and an ``authorized_keys`` line that locks the console's key to
``restrict,command="<venv>/bin/gpudeck agent dial"`` — so every test that goes
through it also proves a locked-down key is enough. ``SetEnv GPUDECK_HOME``
gives each host its own agent state. :class:`ConsoleSide` is the operator's
machine: a HOME with ``~/.ssh/config``, ``known_hosts`` and the client key,
and its own GPUDECK_HOME for the history and config.

Processes are stopped by pid at teardown.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.agent_harness import AgentProc, wait_exited

SSHD = "/usr/sbin/sshd"
GPUDECK = str(Path(sys.executable).with_name("gpudeck"))


def require_sshd() -> str:
    """The sshd binary; fails with how to install it (the Makefile's test target installs it)."""
    if not os.access(SSHD, os.X_OK):
        raise RuntimeError(f"{SSHD} is missing: `apt-get install -y openssh-server` (make test does this when it can)")
    # privilege separation needs this directory when sshd runs as root
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    return SSHD


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, comment: str = "gpudeck-test") -> str:
    """An ed25519 key pair at ``path``; returns the public key line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)
    return (path.with_suffix(".pub") if path.suffix else Path(str(path) + ".pub")).read_text().strip()


def short_tmp(prefix: str) -> Path:
    """A short temp dir (Unix socket paths must stay under 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class SshHost:
    """sshd + agent for one fleet host, on 127.0.0.1 (or an address inside a network namespace)."""

    def __init__(
        self,
        name: str,
        client_pub: str,
        *,
        address: str = "127.0.0.1",
        netns: str | None = None,
        port: int | None = None,
        start_agent: bool = True,
    ) -> None:
        require_sshd()
        self.name = name
        self.address = address
        self.netns = netns
        self.dir = short_tmp(f"gd-{name}-")
        self.home = self.dir / "home"  # the host's GPUDECK_HOME (its agent's state)
        self.home.mkdir()
        self.port = port or free_port()
        self.host_key = self.dir / "host_ed25519"
        self.host_pub = keygen(self.host_key, f"{name}-host")
        self.authorized = self.dir / "authorized_keys"
        self.authorized.write_text(f'restrict,command="{GPUDECK} agent dial" {client_pub}\n')
        os.chmod(self.authorized, 0o600)
        self.log = self.dir / "sshd.log"
        self.proc: subprocess.Popen | None = None
        self.agent = AgentProc(self.home)
        self._start_agent = start_agent

    def sshd_argv(self) -> list[str]:
        argv = [
            SSHD,
            "-D",
            "-e",
            "-f",
            "/dev/null",
            "-o",
            f"ListenAddress={self.address}",
            "-o",
            f"Port={self.port}",
            "-o",
            f"HostKey={self.host_key}",
            "-o",
            f"AuthorizedKeysFile={self.authorized}",
            "-o",
            "StrictModes=no",
            "-o",
            "PasswordAuthentication=no",
            "-o",
            "KbdInteractiveAuthentication=no",
            "-o",
            "PubkeyAuthentication=yes",
            "-o",
            "UsePAM=no",
            "-o",
            "PermitRootLogin=prohibit-password",
            "-o",
            f"PidFile={self.dir / 'sshd.pid'}",
            "-o",
            f"SetEnv=GPUDECK_HOME={self.home}",
            "-o",
            "LogLevel=VERBOSE",
            "-o",
            "MaxStartups=100:30:200",
        ]
        if self.netns:
            return ["ip", "netns", "exec", self.netns, *argv]
        return argv

    def start(self) -> SshHost:
        if self._start_agent and (self.agent.proc is None or self.agent.proc.poll() is not None):
            self.agent.start()
        self.start_sshd()
        return self

    def start_sshd(self) -> None:
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(self.sshd_argv(), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
        logf.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self._listening():
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd did not listen on {self.address}:{self.port}: {self.log.read_text()[-2000:]}")

    def _listening(self) -> bool:
        if self.netns:
            out = subprocess.run(["ip", "netns", "exec", self.netns, "ss", "-ltnH"], capture_output=True, text=True).stdout
            return f"{self.address}:{self.port}" in out
        try:
            with socket.create_connection((self.address, self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def stop_sshd(self) -> None:
        """Stop the sshd listener and every session it serves (connection children setsid, so by pid)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        alive = wait_exited(procs, 5)  # the sessions' processes are init's once the listener is gone
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.proc.wait(10)

    def drop_sessions(self) -> int:
        """Kill the per-connection sshd processes (the console's links drop); the listener stays. Returns how many."""
        import psutil

        if self.proc is None:
            return 0
        n = 0
        for p in psutil.Process(self.proc.pid).children(recursive=False):
            try:
                p.kill()
                n += 1
            except psutil.Error:
                pass
        return n

    def stop(self) -> None:
        self.stop_sshd()
        self.agent.stop()
        self.agent.stop_autostarted()

    def known_hosts_line(self) -> str:
        target = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        return f"{target} {self.host_pub}"

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class ConsoleSide:
    """The operator's machine: HOME with ~/.ssh (config, known_hosts, key) and a GPUDECK_HOME."""

    def __init__(self) -> None:
        self.dir = short_tmp("gd-console-")
        self.home = self.dir / "user"  # HOME
        self.ssh_dir = self.home / ".ssh"
        self.ssh_dir.mkdir(parents=True)
        os.chmod(self.ssh_dir, 0o700)
        self.key = self.ssh_dir / "id_ed25519"
        self.pub = keygen(self.key, "console")
        self.gpudeck_home = self.dir / "gpudeck"
        self.gpudeck_home.mkdir()
        self.hosts: list[SshHost] = []
        self.local = AgentProc(self.gpudeck_home)

    @property
    def ssh_config(self) -> Path:
        return self.ssh_dir / "config"

    @property
    def known_hosts(self) -> Path:
        return self.ssh_dir / "known_hosts"

    def add(self, host: SshHost, trust: bool = True) -> None:
        """Describe a host in ~/.ssh/config (and trust its key unless told not to)."""
        self.hosts.append(host)
        with open(self.ssh_config, "a") as fh:
            fh.write(
                f"Host {host.name}\n    HostName {host.address}\n    Port {host.port}\n    User {os.environ.get('USER') or 'root'}\n    IdentityFile {self.key}\n    IdentitiesOnly yes\n\n"
            )
        if trust:
            with open(self.known_hosts, "a") as fh:
                fh.write(host.known_hosts_line() + "\n")

    def ssh_options(self):  # type: ignore[no-untyped-def]
        from gpudeck.console.fleet.transport import SshOptions

        return SshOptions(config=[self.ssh_config], known_hosts=[self.known_hosts], keepalive_s=2.0, keepalive_count=3)

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["HOME"] = str(self.home)
        env["GPUDECK_HOME"] = str(self.gpudeck_home)
        env.pop("SSH_AUTH_SOCK", None)
        return env

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """The real ``gpudeck`` CLI as the operator runs it (their HOME, their ~/.ssh)."""
        cp = subprocess.run(
            [sys.executable, "-m", "gpudeck.console.cli.main", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and cp.returncode != 0:
            logs = "\n".join(
                f"--- {h.name} sshd log:\n{h.log.read_text()[-1500:] if h.log.exists() else ''}\n--- {h.name} agent log:\n{h.agent.log()[-1500:]}"
                for h in self.hosts
            )
            raise AssertionError(f"gpudeck {' '.join(args)} exited {cp.returncode}\nstdout: {cp.stdout}\nstderr: {cp.stderr}\n{logs}")
        return cp

    def cli_json(self, *args: str):  # type: ignore[no-untyped-def]
        import json

        return json.loads(self.cli(args[0], "--json", *args[1:]).stdout)

    def cleanup(self) -> None:
        self.local.stop_autostarted()
        for h in self.hosts:
            h.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)
