"""Provides the console's links to agents: the local Unix socket, or ``gpudeck agent dial`` over SSH.

SSH goes through asyncssh with the user's ``~/.ssh/config`` (HostName, User,
Port, IdentityFile, ProxyJump) and ``~/.ssh/known_hosts``. Host keys are
always checked: an unknown key and a changed key are refused with errors that
say what to do, and there is no option that turns the check off. Agent
forwarding stays off. Keepalives notice a dead link within about 30 s; the
fleet's snapshot watchdog usually notices sooner.

Only :mod:`gpudeck.console.fleet.fleet` uses this module; the CLI and the TUI go through the
Fleet.
"""

from __future__ import annotations

import asyncio
import atexit
import fnmatch
import getpass
import hashlib
import logging
import os
import re
import shlex
import shutil
import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpudeck.agents.wire.client import AgentClient
from gpudeck.agents.wire.errors import AgentError, AgentUnavailable
from gpudeck.console.fleet.compat import CheckHostIPConfig, asyncssh, packet_logging_on  # asyncssh: imported there, at less cost
from gpudeck.console.fleet.ssh_options import HostKeyError, SshError, SshOptions

__all__ = [
    "CONNECT_TIMEOUT_S",
    "SESSION_TIMEOUT_S",
    "HostKeyError",
    "SshError",
    "SshLink",
    "SshOptions",
    "connect_ssh",
    "encryption_preference",
    "host_settings",
    "open_agent_session",
]

CONNECT_TIMEOUT_S = 15.0
LOGIN_TIMEOUT_S = 30.0
# after the login, one round trip and a fork on the far side (it just forked for the login): 10 s is generous on a loaded
# host, and comes before the CLI's 15 s wait for a host and the keepalives' ~40 s, so the error says what hung
SESSION_TIMEOUT_S = 10.0
HELLO_TIMEOUT_S = 30.0  # the far side may have to start its agent first

log = logging.getLogger(__name__)


class _KnownHosts:
    """The known_hosts check OpenSSH makes: the entry for the name (or ``HostKeyAlias``) decides.

    asyncssh's own matcher also trusts a key recorded for the peer's IP address;
    OpenSSH never does (``CheckHostIP`` only adds a warning when the address's
    entry differs), so an address entry here never vouches for a name whose own
    entry is missing or holds another key. With ``HostKeyAlias`` the alias is
    looked up as it is, without the port, as OpenSSH does. Remembering whether a
    key *was* recorded lets the console tell a changed key (a possible attack)
    from a host never seen.
    """

    def __init__(self, paths: list[str], alias: str | None = None, check_host_ip: bool = False) -> None:
        self.paths = paths
        self.alias = alias
        self.check_host_ip = check_host_ip
        self.warning: str | None = None
        self.looked_up: tuple[str, str, int | None] | None = None
        self.recorded_keys = 0

    def __call__(self, host: str, addr: str, port: int | None):
        if self.alias:
            host, port = self.alias, None  # asyncssh passes the alias with the port; OpenSSH looks it up bare
        self.looked_up = (host, addr, port)
        keys, cas, revoked = self._lookup(host, port)  # no address: the IP's entry must not match the name
        self.recorded_keys = len(keys) + len(cas)
        if self.check_host_ip and addr and addr != host:
            # CheckHostIP yes: an address entry holding other keys is OpenSSH's "differs from the key for the IP
            # address" warning; it neither refuses nor vouches (ssh -o BatchMode=yes connects)
            ip_keys = self._lookup(addr, port)[0]
            if ip_keys and not any(k in ip_keys for k in keys):
                self.warning = f"the host key for {host} differs from the key recorded for the IP address {addr}"
                log.warning("%s", self.warning)
        return keys, cas, revoked

    def _lookup(self, host: str, port: int | None) -> tuple[list, list, list]:
        keys: list = []
        cas: list = []
        revoked: list = []
        for p in self.paths:
            try:
                kh = _read_known_hosts(p)
            except (OSError, ValueError):
                continue
            m = kh.match(host, "", port)
            keys.extend(m[0])
            cas.extend(m[1])
            revoked.extend(m[2])
        return keys, cas, revoked


# Start-up of a big fleet (issue 33, bench/RESULTS.md 28-scale). asyncssh reads the whole ssh config for every connection
# (twice: gpudeck's own settings and asyncssh's), and gpudeck read the whole known_hosts for every host-key check: with
# one `Host` block and one known_hosts line per host, a console start cost O(hosts^2): 80 + 80 + 16 ms a connection at
# 1,024 hosts, three minutes of CPU before every host was shown. Each file is now read once per version (path, inode,
# mtime, size): known_hosts parsed once, and each host's connection reads the config with the `Host` sections that
# cannot match its name left out (what asyncssh would skip anyway), written once per host to a private folder.
_FILE_CACHE: dict[tuple[str, int, int, int], object] = {}
_HOST_CONFIGS: dict[tuple[str, ...], list[str]] = {}
_WRITTEN: dict[str, tuple[str, ...]] = {}  # a per-host file -> its key in _HOST_CONFIGS
_FILTER_DIR: list[str] = []
_SECTION_START = re.compile(r"^\s*(host|match)(?:\s*=\s*|\s+)(.*)$", re.IGNORECASE)
_NO_FILTER = re.compile(r"^\s*canonicalizehostname\b", re.IGNORECASE | re.MULTILINE)
FILTER_MIN_BYTES = 16384  # a config smaller than this is read as it is: nothing to gain


def _file_key(path: str) -> tuple[str, int, int, int]:
    st = os.stat(path)
    return (path, st.st_ino, st.st_mtime_ns, st.st_size)


def _read_known_hosts(path: str) -> asyncssh.SSHKnownHosts:
    """A known_hosts file, parsed once per version of it (exact host names are then found by dictionary)."""
    key = _file_key(path)
    kh = _FILE_CACHE.get(key)
    if kh is None:
        kh = _FILE_CACHE[key] = asyncssh.read_known_hosts(path)
    assert isinstance(kh, asyncssh.SSHKnownHosts)
    return kh


@dataclass(frozen=True)
class _ConfigSections:
    """An ssh config file cut at its ``Host`` / ``Match`` lines, once per version of the file."""

    head: str  # before the first section: applies to every host
    sections: tuple[tuple[tuple[str, ...] | None, str], ...]  # (a Host line's patterns, or None for Match; the section's text)
    by_name: dict[str, tuple[int, ...]]  # the sections whose Host line names a host exactly (no wildcard), by that name
    always: tuple[int, ...]  # the others: Match sections, and Host lines with a wildcard or a negation (checked per host)
    filterable: bool  # big enough to gain, and no CanonicalizeHostname (the name would change after the filter)
    names_ciphers: bool  # a Ciphers or Include line (encryption_preference)


def _config_sections(path: str) -> _ConfigSections:
    key = _file_key(path)
    got = _FILE_CACHE.get(key)
    if isinstance(got, _ConfigSections):
        return got
    text = Path(path).read_text(errors="replace")
    head: list[str] = []
    sections: list[tuple[tuple[str, ...] | None, list[str]]] = []
    for line in text.splitlines(keepends=True):
        m = _SECTION_START.match(line)
        if m is not None:
            patterns: tuple[str, ...] | None = None
            if m.group(1).lower() == "host":
                try:
                    patterns = tuple(shlex.split(m.group(2)))
                except ValueError:
                    patterns = ("*",)  # asyncssh will say what is wrong with it: keep the section
            sections.append((patterns, [line]))
        elif sections:
            sections[-1][1].append(line)
        else:
            head.append(line)
    by_name: dict[str, list[int]] = {}
    always: list[int] = []
    for i, (pats, _lines) in enumerate(sections):
        if pats is not None and not any(c in p for p in pats for c in "*?[!"):
            for p in {p.lower() for p in pats}:
                by_name.setdefault(p, []).append(i)
        else:
            always.append(i)
    parsed = _ConfigSections(
        head="".join(head),
        sections=tuple((pats, "".join(lines)) for pats, lines in sections),
        by_name={k: tuple(v) for k, v in by_name.items()},
        always=tuple(always),
        filterable=len(text) >= FILTER_MIN_BYTES and _NO_FILTER.search(text) is None,
        names_ciphers=_CIPHERS_LINE.search(text) is not None,
    )
    _FILE_CACHE[key] = parsed
    return parsed


def _may_match(patterns: tuple[str, ...], name: str) -> bool:
    """Whether a ``Host`` line could apply to ``name``: a superset of OpenSSH's match (negations and case ignored)."""
    low = name.lower()
    for pat in patterns:
        pat = pat.lower().removeprefix("!")
        if "[" in pat or fnmatch.fnmatchcase(low, pat):
            return True
    return False


def _memory_dir() -> str | None:
    """A folder in memory for the per-host configs where there is one (a file made on a busy disk took 1.7 ms here)."""
    for d in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm"):
        if d and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
            return d
    return None  # the temporary folder


_PROXY_JUMP = re.compile(r"^\s*proxyjump(?:\s*=\s*|\s+)(\S+)", re.IGNORECASE | re.MULTILINE)


def _jump_hosts(text: str) -> set[str] | None:
    """The host names the ``ProxyJump`` lines of ``text`` go through (None: one the filter cannot read, a token)."""
    names: set[str] = set()
    for m in _PROXY_JUMP.finditer(text):
        for hop in m.group(1).split(","):
            hop = hop.removeprefix("ssh://").rsplit("@", 1)[-1]
            hop = hop[1:].split("]", 1)[0] if hop.startswith("[") else hop.split(":", 1)[0]
            if any(c in hop for c in "%$\"'"):
                return None
            if hop and hop.lower() != "none":
                names.add(hop)
    return names


def _sections_for(cut: _ConfigSections, name: str) -> list[int] | None:
    """The sections that can apply to ``name`` and to every host its ProxyJump goes through (asyncssh reads the same
    files for the jump host's connection), in file order; None when a jump host cannot be told."""
    want: set[str] = {name}
    seen: set[str] = set()
    keep: set[int] = set()
    while want - seen:
        host = (want - seen).pop()
        seen.add(host)
        for i in {*cut.by_name.get(host.lower(), ()), *cut.always}:
            pats = cut.sections[i][0]
            if pats is None or _may_match(pats, host):
                keep.add(i)
        jumps = _jump_hosts(cut.head + "".join(cut.sections[i][1] for i in keep))
        if jumps is None:
            return None
        want |= jumps
    return sorted(keep)


def host_config_paths(name: str, config_paths: Sequence[str]) -> list[str]:
    """The ssh config files for connecting to ``name``: each big file with the ``Host`` sections that cannot match
    ``name`` left out (asyncssh skips those lines anyway), so a connection reads its own part of a 1,000-host config
    rather than all of it. The sections of the hosts its ``ProxyJump`` goes through are kept too. ``Match`` sections,
    everything before the first section (an ``Include`` there too), and any file with ``CanonicalizeHostname`` (or a
    ProxyJump through a token) are kept as they are; the folder goes when the process exits."""
    out: list[str] = []
    for path in config_paths:
        try:
            cut = _config_sections(path)
            key = _file_key(path)
        except OSError:
            out.append(path)  # asyncssh says why it cannot be read
            continue
        if not cut.filterable:
            out.append(path)
            continue
        ck = (*map(str, key), name)
        done = _HOST_CONFIGS.get(ck)
        if done is None:
            keep = _sections_for(cut, name)
            if keep is None:  # a ProxyJump the filter cannot follow: the whole file
                out.append(path)
                continue
            kept = [cut.sections[i][1] for i in keep]
            if not _FILTER_DIR:
                _FILTER_DIR.append(tempfile.mkdtemp(prefix="gpudeck-ssh-", dir=_memory_dir()))  # 0700, this user's
                atexit.register(shutil.rmtree, _FILTER_DIR[0], True)
            digest = hashlib.sha256("\0".join(ck).encode()).hexdigest()[:24]
            dest = Path(_FILTER_DIR[0]) / f"{digest}.conf"
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(cut.head + "".join(kept))
            done = _HOST_CONFIGS[ck] = [str(dest)]
            _WRITTEN[str(dest)] = ck
        out.extend(done)
    return out


def release_host_config(paths: Sequence[str]) -> None:
    """Remove the per-host files :func:`host_config_paths` wrote, once asyncssh has read them (its connect, jump hosts
    included, is over): a killed console leaves an empty folder, not a file per host."""
    for p in paths:
        ck = _WRITTEN.pop(p, None)
        if ck is not None:
            _HOST_CONFIGS.pop(ck, None)
            try:
                os.unlink(p)
            except OSError:
                pass


@dataclass(frozen=True)
class HostSettings:
    """What the user's ssh config says of one host that gpudeck reads itself (asyncssh reads the rest)."""

    host_key_alias: str | None = None
    check_host_ip: bool = False  # OpenSSH's default: no
    connect_timeout_s: float | None = None  # ConnectTimeout (None: not set; 0 or less is taken as not set: gpudeck's own applies)


def host_settings(name: str, config_paths: Sequence[str]) -> HostSettings:
    """``HostKeyAlias``, ``CheckHostIP`` and ``ConnectTimeout`` as the user's ssh config sets them for ``name``."""
    if not config_paths:
        return HostSettings()
    try:
        cfg = CheckHostIPConfig.load(None, list(config_paths), False, False, False, "", "", name, None)
    except (OSError, asyncssh.Error, ValueError):
        return HostSettings()
    alias = cfg.get("HostKeyAlias")
    timeout = cfg.get("ConnectTimeout")
    return HostSettings(
        host_key_alias=str(alias) if alias else None,
        check_host_ip=bool(cfg.get("CheckHostIP", False)),
        connect_timeout_s=float(timeout) if isinstance(timeout, int | float) and timeout > 0 else None,
    )


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


class _AgentSession(asyncssh.SSHClientSession):
    """The agent bridge's channel: stdout bytes go straight into the AgentClient from asyncssh's receive path
    (no stream buffer and no task wake-up per message: with hundreds of hosts that is most of the console's CPU);
    the last 8 KiB of stderr are kept to explain a bridge that never answered."""

    def __init__(self) -> None:
        self.client: AgentClient | None = None
        self.chan: asyncssh.SSHClientChannel | None = None
        self.stderr: list[bytes] = []
        self.exit_status: int | None = None
        self.closed = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()

    def connection_made(self, chan: asyncssh.SSHClientChannel) -> None:
        self.chan = chan

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            self.stderr.append(data)
            while sum(len(c) for c in self.stderr) > 8192:
                self.stderr.pop(0)
        elif self.client is not None:
            self.client.feed(data)

    def eof_received(self) -> bool:
        if self.client is not None:
            self.client.feed_eof("the agent closed the connection")
        return False

    def exit_status_received(self, status: int) -> None:
        self.exit_status = status

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client is not None:
            self.client.feed_eof(f"connection lost: {exc}" if exc else "the agent closed the connection")
        self._can_write.set()
        self.closed.set()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    async def writable(self) -> None:
        """Wait until SSH flow control lets the channel take more."""
        await self._can_write.wait()


class _ChannelWriter:
    """What AgentClient writes through: the channel, with drain honouring SSH flow control."""

    def __init__(self, session: _AgentSession) -> None:
        self._s = session

    def write(self, data: bytes) -> None:
        assert self._s.chan is not None
        self._s.chan.write(data)

    async def drain(self) -> None:
        if self._s.closed.is_set():
            raise ConnectionResetError("the SSH channel is closed")
        await self._s.writable()

    def write_eof(self) -> None:
        assert self._s.chan is not None
        self._s.chan.write_eof()

    def close(self) -> None:
        if self._s.chan is not None:
            self._s.chan.close()


class SshLink:
    """One SSH connection running the agent bridge; ``client`` speaks the agent protocol over it."""

    def __init__(self, conn: asyncssh.SSHClientConnection, session: _AgentSession, client: AgentClient) -> None:
        self.conn = conn
        self.session = session
        self.client = client

    async def close(self) -> None:
        await self.client.close()
        self.conn.close()
        try:
            await asyncio.wait_for(self.conn.wait_closed(), 5.0)
        except (TimeoutError, Exception):
            pass


# AES-GCM first: hardware AES (AES-NI, ARMv8 crypto) and one AEAD call per packet in asyncssh, where
# chacha20-poly1305 sets up four cipher contexts per packet. Every algorithm asyncssh allows by default
# stays allowed (a server offering only chacha20 still works); only the preference order changes, and a
# `Ciphers` line in the user's ssh config (or an `Include`, which might hold one) wins over it.
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
_CIPHERS_LINE = re.compile(r"^\s*(ciphers|include)\b", re.IGNORECASE | re.MULTILINE)


def encryption_preference(config_paths: Sequence[str]) -> list[str] | None:
    """The cipher order to ask for, or None to leave it to the user's ssh config (it names Ciphers or Includes)."""
    for p in config_paths:
        try:
            if _config_sections(p).names_ciphers:
                return None
        except OSError:
            continue
    default = [a.decode() for a in asyncssh.encryption.get_default_encryption_algs()]
    first = [a for a in PREFERRED_CIPHERS if a in default]
    return first + [a for a in default if a not in first]


# asyncssh's AES-GCM code is used as it is. An earlier shim replaced its GCMCipher class process-wide to keep one
# AESGCM object per key; measured, that saved about 1 us per 200-byte packet (2.6 -> 1.6 us) and was slower for
# 32 KiB packets: at 256 hosts and a snapshot a second, 0.03% of one core. A library's crypto is not patched for that.


def _skip_idle_packet_log(chan: asyncssh.SSHClientChannel) -> None:
    """asyncssh formats a log line for every packet a channel receives before its logger checks whether packet
    logging is on (debug level 3); with a snapshot a second from hundreds of hosts that is a noticeable share of
    the console's CPU. The channel's hook only calls through when that level is set (or cannot be read)."""
    real = chan.log_received_packet

    def log_received_packet(pkttype: int, pktid: int | None, packet: object, note: str = "") -> None:
        if packet_logging_on():
            real(pkttype, pktid, packet, note)  # type: ignore[arg-type]

    chan.log_received_packet = log_received_packet  # type: ignore[method-assign]


async def connect_ssh(name: str, command: str, options: SshOptions, meanwhile: Callable[[], object] | None = None) -> SshLink:
    """Connect to ``name`` as ``~/.ssh/config`` describes it and start ``command`` (the agent bridge).

    ``meanwhile`` is called once the hello is on its way, while the far side starts ``command`` (its shell, Python and
    the bridge: the longest wait of a connect): work the caller needs anyway, done while it would otherwise wait (the
    CLI imports its printers there). It blocks the event loop, which has nothing else to do then (the agent's reply
    waits in the kernel); what it raises is logged and dropped, so the caller meets it again where it does the work."""
    config_paths = host_config_paths(name, options.config_paths())
    settings = host_settings(name, config_paths)
    kh = _KnownHosts(options.known_hosts_paths(), settings.host_key_alias, settings.check_host_ip)
    # the connect timeout as ssh takes it: the host's ConnectTimeout when the config sets one (gpudeck passing its own
    # would override it), else gpudeck's; a caller's explicit one first
    if options.connect_timeout_s is not None:
        timeout, timeout_from = options.connect_timeout_s, "the caller's limit"
    elif settings.connect_timeout_s is not None:
        timeout, timeout_from = settings.connect_timeout_s, f"ConnectTimeout for {name} in the ssh config"
    else:
        timeout, timeout_from = CONNECT_TIMEOUT_S, f"gpudeck's default: set ConnectTimeout for {name} in ~/.ssh/config to change it"
    kwargs: dict = dict(
        config=config_paths or None,
        known_hosts=kh,
        agent_forwarding=False,
        x11_forwarding=False,
        keepalive_interval=options.keepalive_s,
        keepalive_count_max=options.keepalive_count,
        connect_timeout=timeout,
        login_timeout=LOGIN_TIMEOUT_S,
    )
    algs = encryption_preference(options.config_paths())
    if algs is not None:
        kwargs["encryption_algs"] = algs
    if options.client_keys is not None:
        kwargs["client_keys"] = [str(p) for p in options.client_keys]
    try:
        try:
            conn = await asyncssh.connect(name, **kwargs)
        finally:
            release_host_config(config_paths)
    except asyncssh.HostKeyNotVerifiable as exc:
        raise _host_key_error(name, kh, exc) from None
    except asyncssh.PermissionDenied as exc:
        raise SshError(
            f"{name}: SSH authentication failed ({exc.reason}): check User and IdentityFile for {name} in ~/.ssh/config, or `ssh-add` the key"
        ) from None
    except asyncssh.ConnectionLost as exc:
        raise SshError(
            f"{name}: the SSH connection was lost during the handshake ({exc.reason}): is sshd there overloaded (MaxStartups) or the link dropping?"
        ) from None
    except asyncssh.DisconnectError as exc:
        raise SshError(f"{name}: SSH connection refused by the server ({exc.reason})") from None
    except TimeoutError:
        raise SshError(f"{name}: no SSH answer within {timeout:g} s ({timeout_from}): is the host up and reachable from here?") from None
    except ConnectionRefusedError as exc:
        raise SshError(
            f"{name}: nothing accepts SSH connections there ({exc.strerror or exc}): is sshd running, and are HostName and Port for {name} in ~/.ssh/config right?"
        ) from None
    except socket.gaierror as exc:
        raise SshError(f"{name}: cannot resolve its address ({exc.strerror or exc}): check HostName for {name} in ~/.ssh/config") from None
    except (OSError, asyncssh.Error) as exc:
        raise SshError(f"{name}: cannot connect over SSH: {exc}") from None
    _chan, session = await open_agent_session(conn, name, command, options.env)
    _skip_idle_packet_log(_chan)
    client = AgentClient(None, _ChannelWriter(session))
    session.client = client
    try:
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            hello = asyncio.ensure_future(client.say_hello(alias=name))
            if meanwhile is not None:
                await asyncio.sleep(0)  # the hello is written first (say_hello runs to its wait for the reply)
                try:
                    meanwhile()
                except Exception:
                    log.debug("%s: the work done while the far side starts failed", name, exc_info=True)
            await hello
    except (AgentError, TimeoutError) as exc:
        # the bridge never answered: say why, from its exit status and stderr
        try:
            await asyncio.wait_for(session.closed.wait(), 2.0)
        except (TimeoutError, Exception):
            pass
        await asyncio.sleep(0)
        stderr = b"".join(session.stderr).decode("utf-8", "replace").strip()
        await client.close()
        conn.close()
        if isinstance(exc, AgentError) and not isinstance(exc, AgentUnavailable):
            raise  # a typed refusal from the agent itself (version mismatch, permission)
        status = session.exit_status
        detail = stderr.splitlines()[-1] if stderr else (f"exit status {status}" if status is not None else "no answer")
        hint = (
            f'install gpudeck on {name}, or set its path in the config: [host.{name}] command = "/path/to/gpudeck agent dial"'
            if status == 127 or "not found" in stderr
            else f"see the agent log on {name} (`gpudeck agent status` there)"
        )
        raise SshError(f"{name}: `{command}` did not answer the gpudeck protocol ({detail}); {hint}") from None
    return SshLink(conn, session, client)


async def open_agent_session(
    conn: asyncssh.SSHClientConnection, name: str, command: str, env: dict[str, str], timeout_s: float = SESSION_TIMEOUT_S
) -> tuple[asyncssh.SSHClientChannel, _AgentSession]:
    """Open the channel that runs ``command`` (the agent bridge) on the logged-in ``conn``, within ``timeout_s``.

    The wait covers the channel open and the exec request's reply: a far side that took the login and then stops
    answering (a stopped or wedged sshd process) would otherwise hold the link in "connecting" until the keepalives
    give up, or for good without them. On any failure ``conn`` is closed and SshError says why."""
    try:
        async with asyncio.timeout(timeout_s):
            chan, session = await conn.create_session(_AgentSession, command, encoding=None, env=env or (), term_type=None)  # type: ignore[arg-type]  # asyncssh types env as a Mapping keyed by bytes | str (invariant key), so a dict[str, str] does not match
    except TimeoutError:
        conn.close()
        raise SshError(
            f"{name}: the SSH login worked, but the far side did not open a session within {timeout_s:g} s: check sshd on {name} "
            f"(overloaded? at its MaxSessions? a hung or stopped sshd-session process: `ps -o pid,stat,args -C sshd,sshd-session` there)"
        ) from None
    except (asyncssh.ChannelOpenError, asyncssh.Error, OSError) as exc:
        conn.close()
        raise SshError(f"{name}: connected, but cannot run `{command}` there: {exc}") from None
    except asyncio.CancelledError:  # the link is being closed while it waits: the connection goes with it
        conn.close()
        raise
    if not isinstance(session, _AgentSession):  # asyncssh types the session as its base class, not the factory's
        conn.close()
        raise TypeError(f"{name}: asyncssh returned a {type(session).__name__} session, not the _AgentSession it was asked for")
    return chan, session


def ssh_hostname(name: str, config_paths: Sequence[str]) -> str | None:
    """The HostName that ``~/.ssh/config`` gives ``name`` (None when the config names none)."""
    try:
        conf = asyncssh.config.SSHClientConfig.load(None, list(config_paths), False, False, False, getpass.getuser(), "", name, ())
    except (OSError, ValueError):
        return None
    value = conf.get("Hostname")
    return str(value) if value else None
