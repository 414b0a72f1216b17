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


def _options(paths: list[str], name: str) -> dict:
    cfg = asyncssh.config.SSHClientConfig.load(None, paths, False, False, False, "me", (), name, ())
    return {k: cfg.get(k) for k in ("Hostname", "Port", "User", "IdentityFile", "ProxyJump", "ConnectTimeout", "Compression")}


def test_a_big_config_is_read_per_host_with_the_same_outcome_as_the_whole_file(tmp_path: Path) -> None:
    """issue 33: a connection reads only the sections that can apply to its host (a 1,024-host config was read whole
    for every connection); what asyncssh makes of it is the same as from the whole file."""
    from gpudeck.console.fleet.transport import FILTER_MIN_BYTES, host_config_paths, release_host_config

    blocks = ["Compression yes\n", "Host gpu-7 !gpu-70\n    ConnectTimeout 7\n", "Host gpu-9\n    ProxyJump me@jump-a:2222,jump-b\n"]
    blocks += ["Host jump-a\n    HostName 192.0.2.1\n    ProxyJump jump-c\n", "Host jump-b jump-c\n    User hop\n    Port 2022\n"]
    blocks += [f"Host gpu-{i} alias-{i}\n    HostName 10.0.{i // 256}.{i % 256}\n    Port {2200 + i}\n" for i in range(600)]
    blocks += ["Host gpu-1?\n    User wild\n", 'Host "quoted name"\n    Port 9\n', "Host *\n    IdentityFile ~/.ssh/fleet\n"]
    cfg = tmp_path / "config"
    cfg.write_text("\n".join(blocks))
    assert cfg.stat().st_size >= FILTER_MIN_BYTES
    for name in ("gpu-0", "gpu-7", "gpu-70", "gpu-13", "alias-599", "quoted name", "GPU-5", "unknown", "gpu-9"):
        part = host_config_paths(name, [str(cfg)])
        assert part != [str(cfg)] and Path(part[0]).stat().st_size < 1000
        assert _options(part, name) == _options([str(cfg)], name), name
    # asyncssh reads the same files for each jump host's connection: theirs are in gpu-9's part (jump-c through jump-a)
    part = host_config_paths("gpu-9", [str(cfg)])
    for hop in ("jump-a", "jump-b", "jump-c"):
        assert _options(part, hop) == _options([str(cfg)], hop), hop
    cfg.write_text(cfg.read_text() + "Host gpu-600\n    ProxyJump %h-bastion\n")
    assert host_config_paths("gpu-600", [str(cfg)]) == [str(cfg)]  # a token in a jump: the whole file
    assert host_config_paths("gpu-0", [str(cfg)]) == host_config_paths("gpu-0", [str(cfg)])  # written once
    release_host_config(part := host_config_paths("gpu-0", [str(cfg)]))  # read by asyncssh's connect: removed
    assert not Path(part[0]).exists()
    again = host_config_paths("gpu-0", [str(cfg)])  # a reconnect writes it again
    assert Path(again[0]).exists() and _options(again, "gpu-0") == _options([str(cfg)], "gpu-0")


def test_a_small_config_or_one_that_canonicalizes_is_read_whole(tmp_path: Path) -> None:
    from gpudeck.console.fleet.transport import host_config_paths

    small = tmp_path / "small"
    small.write_text("Host gpu-1\n    Port 2201\n")
    assert host_config_paths("gpu-1", [str(small)]) == [str(small)]
    canon = tmp_path / "canon"
    canon.write_text("CanonicalizeHostname yes\n" + "".join(f"Host gpu-{i}\n    Port {2200 + i}\n" for i in range(2000)))
    assert host_config_paths("gpu-1", [str(canon)]) == [str(canon)]
    assert host_config_paths("gpu-1", [str(tmp_path / "missing")]) == [str(tmp_path / "missing")]


def test_ssh_hostname_reads_the_hostname_the_ssh_config_gives_a_host(tmp_path: Path) -> None:
    """A multi-node launch's rendezvous address: the first host's HostName from the ssh config (asyncssh's reader,
    imported through fleet/compat like every other use of asyncssh)."""
    from gpudeck.console.fleet.transport import ssh_hostname

    conf = tmp_path / "config"
    conf.write_text("Host gpu1\n  HostName 10.0.0.7\n  User ops\n")
    assert ssh_hostname("gpu1", [str(conf)]) == "10.0.0.7"
    assert ssh_hostname("gpu2", [str(conf)]) is None
    assert ssh_hostname("gpu1", [str(tmp_path / "missing")]) is None
