"""The console's SSH tuning (AES-GCM first unless the user's ssh config says otherwise; no per-packet log work unless packet logging is on) and what a failed connection says."""

from __future__ import annotations

import socket
from pathlib import Path

import asyncssh
import pytest

from gpudeck.console.fleet.transport import (
    PREFERRED_CIPHERS,
    SshError,
    SshOptions,
    _skip_idle_packet_log,
    connect_ssh,
    encryption_preference,
)


def test_aes_gcm_first_and_every_default_still_allowed(tmp_path: Path) -> None:
    cfg = tmp_path / "config"
    cfg.write_text("Host gpu1\n    HostName 10.0.0.1\n    User me\n")
    algs = encryption_preference([str(cfg)])
    assert algs is not None and tuple(algs[:2]) == PREFERRED_CIPHERS
    assert sorted(algs) == sorted(a.decode() for a in asyncssh.encryption.get_default_encryption_algs())


def test_a_ciphers_line_or_an_include_leaves_the_choice_to_the_config(tmp_path: Path) -> None:
    for text in ("Host *\n  Ciphers chacha20-poly1305@openssh.com\n", "include ~/.ssh/more.conf\n"):
        cfg = tmp_path / "config"
        cfg.write_text(text)
        assert encryption_preference([str(cfg)]) is None
    assert encryption_preference([str(tmp_path / "missing")]) is not None


class _Chan:
    def __init__(self) -> None:
        self.logged: list[tuple] = []

    def log_received_packet(self, pkttype, pktid, packet, note=""):  # type: ignore[no-untyped-def]
        self.logged.append((pkttype, pktid, packet, note))


def test_received_packets_are_logged_only_at_asyncssh_debug_level_3() -> None:
    chan = _Chan()
    _skip_idle_packet_log(chan)  # type: ignore[arg-type]
    level = type(asyncssh.logging.logger)._debug_level
    try:
        asyncssh.set_debug_level(1)
        chan.log_received_packet(94, 7, b"data")
        assert chan.logged == []
        asyncssh.set_debug_level(3)
        chan.log_received_packet(94, 8, b"data", "note")
        assert chan.logged == [(94, 8, b"data", "note")]
    finally:
        asyncssh.set_debug_level(level)


def test_asyncssh_s_aes_gcm_is_not_patched() -> None:
    """Importing the console leaves asyncssh's crypto as asyncssh ships it (the keyed-GCM shim was dropped)."""
    assert asyncssh.encryption.GCMCipher is asyncssh.crypto.GCMCipher
    assert asyncssh.crypto.GCMCipher.__module__.startswith("asyncssh.")


async def test_a_name_that_does_not_resolve_or_a_port_nobody_listens_on_says_what_to_check(tmp_path: Path) -> None:
    with socket.socket() as s:  # a loopback port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "config"
    cfg.write_text(f"Host gone\n    HostName no-such-host.invalid\n\nHost down\n    HostName 127.0.0.1\n    Port {port}\n")
    opts = SshOptions(config=[cfg], known_hosts=[tmp_path / "known_hosts"], client_keys=[], connect_timeout_s=20)
    with pytest.raises(SshError) as gone:
        await connect_ssh("gone", "gpudeck agent dial", opts)
    assert (
        gone.value.message.startswith("gone: cannot resolve its address (")
        and "check HostName for gone in ~/.ssh/config" in gone.value.message
    )
    with pytest.raises(SshError) as down:
        await connect_ssh("down", "gpudeck agent dial", opts)
    assert down.value.message.startswith("down: nothing accepts SSH connections there (")
    assert "is sshd running, and are HostName and Port for down in ~/.ssh/config right?" in down.value.message


async def test_the_hosts_connect_timeout_in_the_ssh_config_is_the_one_used_and_named(tmp_path: Path) -> None:
    """ssh takes ConnectTimeout from the config; so does gpudeck (it passed its own 15 s, which overrode the user's).
    A loopback listener that never answers the SSH banner stands for a host that does not answer."""
    import time

    from gpudeck.console.fleet.transport import CONNECT_TIMEOUT_S, host_settings

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes the TCP handshake; nothing ever speaks SSH
        port = listener.getsockname()[1]
        cfg = tmp_path / "config"
        cfg.write_text(f"Host slow\n    HostName 127.0.0.1\n    Port {port}\n    ConnectTimeout 1\n\nHost plain\n    HostName 127.0.0.1\n")
        assert host_settings("slow", [str(cfg)]).connect_timeout_s == 1.0
        assert host_settings("plain", [str(cfg)]).connect_timeout_s is None  # gpudeck's default applies
        opts = SshOptions(config=[cfg], known_hosts=[tmp_path / "known_hosts"], client_keys=[])
        t0 = time.monotonic()
        with pytest.raises(SshError) as slow:
            await connect_ssh("slow", "gpudeck agent dial", opts)
        took = time.monotonic() - t0
    assert (
        slow.value.message
        == "slow: no SSH answer within 1 s (ConnectTimeout for slow in the ssh config): is the host up and reachable from here?"
    )
    assert took < CONNECT_TIMEOUT_S  # not gpudeck's 15 s (a hang limit, not a speed test: any time under it shows the config won)


def test_ssh_hostname_reads_the_hostname_the_ssh_config_gives_a_host(tmp_path: Path) -> None:
    """A multi-node launch's rendezvous address: the first host's HostName from the ssh config (asyncssh's reader,
    imported through fleet/compat like every other use of asyncssh)."""
    from gpudeck.console.fleet.transport import ssh_hostname

    conf = tmp_path / "config"
    conf.write_text("Host gpu1\n  HostName 10.0.0.7\n  User ops\n")
    assert ssh_hostname("gpu1", [str(conf)]) == "10.0.0.7"
    assert ssh_hostname("gpu2", [str(conf)]) is None
    assert ssh_hostname("gpu1", [str(tmp_path / "missing")]) is None
