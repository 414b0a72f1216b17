"""Host keys as OpenSSH checks them: for each known_hosts and config case, the console decides what ``ssh -o BatchMode=yes`` decides.

One real sshd on a loopback port. ``localhost`` resolves to 127.0.0.1 here, so
a host reached by that name has two possible entries: ``[localhost]:PORT``
(the name's) and ``[127.0.0.1]:PORT`` (the address's). Every case is run
through both clients with the same config and the same known_hosts file (a
copy each, since ``ssh`` may append to it) and their answers must agree.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.console.fleet.transport import HostKeyError, SshOptions, connect_ssh
from tests.sshd_harness import ConsoleSide, SshHost, keygen

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def box() -> Iterator[tuple[ConsoleSide, SshHost, str]]:
    if socket.gethostbyname("localhost") != "127.0.0.1":
        pytest.skip("localhost does not resolve to 127.0.0.1 on this machine")
    c = ConsoleSide()
    h = SshHost("keys", c.pub)
    c.hosts.append(h)
    other = keygen(c.dir / "impostor", "impostor").split(None, 2)
    try:
        h.start()
        yield c, h, f"{other[0]} {other[1]}"
    finally:
        c.cleanup()


def _case(c: ConsoleSide, h: SshHost, tag: str, options: str, entries: list[str]) -> tuple[Path, Path]:
    cfg = c.dir / f"config-{tag}"
    cfg.write_text(f"Host {tag}\n    Port {h.port}\n    User root\n    IdentityFile {c.key}\n    IdentitiesOnly yes\n{options}")
    kh = c.dir / f"known_hosts-{tag}"
    kh.write_text("".join(e + "\n" for e in entries))
    return cfg, kh


def _openssh_accepts(c: ConsoleSide, cfg: Path, kh: Path, tag: str) -> tuple[bool, str]:
    copy = kh.with_name(kh.name + ".ssh")
    shutil.copy(kh, copy)
    cp = subprocess.run(
        ["ssh", "-F", str(cfg), "-o", f"UserKnownHostsFile={copy}", "-o", "GlobalKnownHostsFile=/dev/null", "-o", "BatchMode=yes", tag],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env=c.env,
    )
    refused = "Host key verification failed" in cp.stderr or "REMOTE HOST IDENTIFICATION HAS CHANGED" in cp.stderr
    return not refused, cp.stderr


def _console_accepts(cfg: Path, kh: Path, tag: str, key: Path) -> tuple[bool, str]:
    async def go() -> tuple[bool, str]:
        try:
            link = await connect_ssh(tag, "gpudeck agent dial", SshOptions(config=[cfg], known_hosts=[kh], client_keys=[key]))
        except HostKeyError as exc:
            return False, exc.message
        await link.close()
        return True, ""

    return asyncio.run(go())


def _key(h: SshHost) -> str:
    return " ".join(h.host_pub.split()[:2])


CASES = [
    # (tag, extra config, known_hosts entries: NAME/IP/ALIAS + RIGHT/WRONG, expected)
    ("ip-right", "    HostName 127.0.0.1\n", [("IP", "RIGHT")], True),
    ("name-missing-ip-right", "    HostName localhost\n", [("IP", "RIGHT")], False),
    ("name-wrong-ip-right", "    HostName localhost\n", [("NAME", "WRONG"), ("IP", "RIGHT")], False),
    ("name-right-ip-wrong", "    HostName localhost\n", [("NAME", "RIGHT"), ("IP", "WRONG")], True),
    (
        "name-right-ip-wrong-checkhostip",
        "    HostName localhost\n    CheckHostIP yes\n",
        [("NAME", "RIGHT"), ("IP", "WRONG")],
        True,
    ),  # a warning
    ("name-right-ip-right-checkhostip", "    HostName localhost\n    CheckHostIP yes\n", [("NAME", "RIGHT"), ("IP", "RIGHT")], True),
    ("name-right-ip-missing-checkhostip", "    HostName localhost\n    CheckHostIP yes\n", [("NAME", "RIGHT")], True),
    ("alias-right", "    HostName 127.0.0.1\n    HostKeyAlias mybox\n", [("ALIAS", "RIGHT")], True),
    ("alias-missing-ip-right", "    HostName 127.0.0.1\n    HostKeyAlias mybox\n", [("IP", "RIGHT")], False),
    ("alias-wrong-ip-right", "    HostName 127.0.0.1\n    HostKeyAlias mybox\n", [("ALIAS", "WRONG"), ("IP", "RIGHT")], False),
]


@pytest.mark.parametrize("tag,options,entries,expected", CASES, ids=[c[0] for c in CASES])
def test_the_console_trusts_a_host_key_exactly_when_openssh_does(
    box, tag: str, options: str, entries: list[tuple[str, str]], expected: bool
) -> None:
    c, h, wrong = box
    where = {"NAME": f"[localhost]:{h.port}", "IP": f"[127.0.0.1]:{h.port}", "ALIAS": "mybox"}
    lines = [f"{where[w]} {_key(h) if k == 'RIGHT' else wrong}" for w, k in entries]
    cfg, kh = _case(c, h, tag, options, lines)
    ssh_ok, ssh_err = _openssh_accepts(c, cfg, kh, tag)
    ours_ok, ours_err = _console_accepts(cfg, kh, tag, c.key)
    assert ssh_ok == expected, f"OpenSSH itself answered otherwise than this case expects (the case is wrong): {ssh_err}"
    assert ours_ok == ssh_ok, (
        f"ssh {'accepted' if ssh_ok else 'refused'} ({ssh_err.strip()[-300:]}); the console {'accepted' if ours_ok else 'refused'} ({ours_err})"
    )
