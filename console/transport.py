"""Provides the console's links to agents: the local Unix socket, or ``gpudeck agent dial`` over SSH.

SSH goes through asyncssh with the user's ``~/.ssh/config`` (HostName, User,
Port, IdentityFile, ProxyJump) and ``~/.ssh/known_hosts``. Host keys are
always checked: an unknown key and a changed key are refused with errors that
say what to do, and there is no option that turns the check off. Agent
forwarding stays off. Keepalives notice a dead link within about 30 s; the
fleet's snapshot watchdog usually notices sooner.

Only :mod:`console.fleet` uses this module; the CLI and the TUI go through the
Fleet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh

from agents.client import AgentClient
from agents.errors import AgentError, AgentUnavailable

KEEPALIVE_S = 10.0
KEEPALIVE_COUNT = 3
CONNECT_TIMEOUT_S = 15.0
LOGIN_TIMEOUT_S = 30.0
HELLO_TIMEOUT_S = 30.0  # the far side may have to start its agent first


class HostKeyError(AgentError):
    """The host's SSH key is unknown or changed; nothing was sent to it."""

    code = "host_key"


class SshError(AgentError):
    """The SSH connection could not be made or was refused."""

    code = "ssh"


@dataclass(frozen=True)
class SshOptions:
    """Where the SSH client settings come from (the user's files unless a test says otherwise)."""

    config: Sequence[Path] | None = None  # None: ~/.ssh/config (if it exists)
    known_hosts: Sequence[Path] | None = None  # None: ~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts
    client_keys: Sequence[Path] | None = None  # None: IdentityFile from the config, else ~/.ssh/id_*
    keepalive_s: float = KEEPALIVE_S
    keepalive_count: int = KEEPALIVE_COUNT
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    env: dict[str, str] = field(default_factory=dict)

    def config_paths(self) -> list[str]:
        if self.config is not None:
            return [str(p) for p in self.config]
        p = Path("~/.ssh/config").expanduser()
        return [str(p)] if p.exists() else []

    def known_hosts_paths(self) -> list[str]:
        if self.known_hosts is not None:
            return [str(p) for p in self.known_hosts]
        return [str(p) for p in (Path("~/.ssh/known_hosts").expanduser(), Path("/etc/ssh/ssh_known_hosts")) if p.exists()]


class _KnownHosts:
    """A known_hosts matcher that remembers whether the host had any key on record.

    asyncssh only says "not trusted"; knowing that a key *was* recorded lets the
    console tell a changed key (a possible attack) from a host never seen.
    """

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.looked_up: tuple[str, str, int | None] | None = None
        self.recorded_keys = 0

    def __call__(self, host: str, addr: str, port: int | None):  # type: ignore[no-untyped-def]
        self.looked_up = (host, addr, port)
        keys: list = []
        cas: list = []
        revoked: list = []
        for p in self.paths:
            try:
                kh = asyncssh.read_known_hosts(p)
            except (OSError, ValueError):
                continue
            m = kh.match(host, addr, port)
            keys.extend(m[0])
            cas.extend(m[1])
            revoked.extend(m[2])
        self.recorded_keys = len(keys) + len(cas)
        return keys, cas, revoked


def _host_key_error(name: str, kh: _KnownHosts, exc: Exception) -> HostKeyError:
    target = kh.looked_up[0] if kh.looked_up else name
    port = kh.looked_up[2] if kh.looked_up else None
    where = f"[{target}]:{port}" if port not in (None, 22) else target
    files = ", ".join(kh.paths) or "~/.ssh/known_hosts (missing)"
    if kh.recorded_keys:
        return HostKeyError(
            f"{name}: the SSH host key of {where} has CHANGED since it was recorded in {files} — this is a possible attack "
            f"(someone may be intercepting the connection), or the host was reinstalled. Nothing was sent. If you know the "
            f"host was rebuilt, remove the old key with `ssh-keygen -R '{where}'` and run `ssh {name}` once to check and accept the new one."
        )
    return HostKeyError(
        f"{name}: the SSH host key of {where} is not known (not in {files}); nothing was sent. "
        f"Run `ssh {name}` once, check the fingerprint, and accept it; then gpudeck will connect. ({exc})"
    )


class SshLink:
    """One SSH connection running the agent bridge; ``client`` speaks the agent protocol over it."""

    def __init__(self, conn: asyncssh.SSHClientConnection, proc: asyncssh.SSHClientProcess, client: AgentClient) -> None:
        self.conn = conn
        self.proc = proc
        self.client = client

    async def close(self) -> None:
        await self.client.close()
        self.conn.close()
        try:
            await asyncio.wait_for(self.conn.wait_closed(), 5.0)
        except (asyncio.TimeoutError, Exception):
            pass


async def _stderr_tail(proc: asyncssh.SSHClientProcess, into: list[bytes]) -> None:
    try:
        while True:
            chunk = await proc.stderr.read(4096)
            if not chunk:
                return
            into.append(chunk)
            while sum(len(c) for c in into) > 8192:
                into.pop(0)
    except (asyncssh.Error, OSError, asyncio.CancelledError):
        return


async def connect_ssh(name: str, command: str, options: SshOptions) -> SshLink:
    """Connect to ``name`` as ``~/.ssh/config`` describes it and start ``command`` (the agent bridge)."""
    kh = _KnownHosts(options.known_hosts_paths())
    kwargs: dict = dict(
        config=options.config_paths() or None,
        known_hosts=kh,
        agent_forwarding=False,
        x11_forwarding=False,
        keepalive_interval=options.keepalive_s,
        keepalive_count_max=options.keepalive_count,
        connect_timeout=options.connect_timeout_s,
        login_timeout=LOGIN_TIMEOUT_S,
    )
    if options.client_keys is not None:
        kwargs["client_keys"] = [str(p) for p in options.client_keys]
    try:
        conn = await asyncssh.connect(name, **kwargs)
    except asyncssh.HostKeyNotVerifiable as exc:
        raise _host_key_error(name, kh, exc) from None
    except asyncssh.PermissionDenied as exc:
        raise SshError(f"{name}: SSH authentication failed ({exc.reason}): check User and IdentityFile for {name} in ~/.ssh/config, or `ssh-add` the key") from None
    except asyncssh.ConnectionLost as exc:
        raise SshError(f"{name}: the SSH connection was lost during the handshake ({exc.reason}): is sshd there overloaded (MaxStartups) or the link dropping?") from None
    except asyncssh.DisconnectError as exc:
        raise SshError(f"{name}: SSH connection refused by the server ({exc.reason})") from None
    except asyncio.TimeoutError:
        raise SshError(f"{name}: no SSH answer within {options.connect_timeout_s:.0f} s: is the host up and reachable from here?") from None
    except (OSError, asyncssh.Error) as exc:
        raise SshError(f"{name}: cannot connect over SSH: {exc}") from None
    try:
        proc = await conn.create_process(command, encoding=None, env=options.env or (), term_type=None)
    except (asyncssh.ChannelOpenError, asyncssh.Error, OSError) as exc:
        conn.close()
        raise SshError(f"{name}: connected, but cannot run `{command}` there: {exc}") from None
    errors: list[bytes] = []
    err_task = asyncio.ensure_future(_stderr_tail(proc, errors))
    client = AgentClient(proc.stdout, proc.stdin)
    client.keep(err_task)
    try:
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            await client.say_hello(alias=name)
    except (AgentError, TimeoutError) as exc:
        # the bridge never answered: say why, from its exit status and stderr
        try:
            await asyncio.wait_for(proc.wait_closed(), 2.0)
        except (asyncio.TimeoutError, Exception):
            pass
        await asyncio.sleep(0)
        stderr = b"".join(errors).decode("utf-8", "replace").strip()
        await client.close()
        conn.close()
        if isinstance(exc, AgentError) and not isinstance(exc, AgentUnavailable):
            raise  # a typed refusal from the agent itself (version mismatch, permission)
        status = proc.exit_status
        detail = stderr.splitlines()[-1] if stderr else (f"exit status {status}" if status is not None else "no answer")
        hint = (
            f"install gpudeck on {name}, or set its path in the config: [host.{name}] command = \"/path/to/gpudeck agent dial\""
            if status == 127 or "not found" in stderr
            else f"see the agent log on {name} (`gpudeck agent status` there)"
        )
        raise SshError(f"{name}: `{command}` did not answer the gpudeck protocol ({detail}); {hint}") from None
    return SshLink(conn, proc, client)

