"""What one SSH command pays before the agent answers (issue 30): the far side's `gpudeck agent dial` imports the
bridge alone, and console/fleet/compat.py imports asyncssh without X.509 and, where no liboqs can load, without its
liboqs look. Each import check runs in a fresh process, as a user's command does."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from gpudeck.console.fleet import compat
from tests.agent_harness import AgentProc

GPUDECK = str(Path(sys.executable).with_name("gpudeck"))


def _fresh(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_agent_dial_answers_and_imports_no_asyncio_parser_or_wire_protocol(agent: AgentProc) -> None:
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    hello = b'{"type":"hello","request_id":"h1","client":"gpudeck","host_alias":"t"}\n'
    cp = subprocess.run([GPUDECK, "agent", "dial"], input=hello, capture_output=True, timeout=60, env=env)
    assert b'"type":"hello_reply"' in cp.stdout, cp.stderr[-2000:]
    modules = {line.rsplit("|", 1)[1].strip() for line in cp.stderr.decode().splitlines() if line.startswith("import time:")}
    assert "gpudeck.agents.wire.dial" in modules  # the report is there
    assert not {"asyncio", "argparse", "msgspec", "gpudeck.agents.__main__", "gpudeck.agents.wire.client"} & modules


def test_agent_dial_with_options_or_help_still_goes_through_the_agents_parser() -> None:
    cp = subprocess.run([GPUDECK, "agent", "dial", "--help"], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0 and cp.stdout.startswith("usage: gpudeck agent dial [-h] [--state-dir DIR]"), cp.stdout


def test_asyncssh_comes_without_x509_and_still_reads_openssh_keys(tmp_path: Path) -> None:
    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    code = (
        "import sys\n"
        "from gpudeck.console.fleet import transport\n"
        "import asyncssh\n"
        "assert 'cryptography.x509' not in sys.modules, 'cryptography.x509 was imported'\n"
        f"assert sys.modules.get({compat.X509_MODULE!r}, 0) is not None, 'the block was left in sys.modules'\n"
        f"k = asyncssh.read_private_key({str(key)!r})\n"
        f"assert k.export_public_key().decode().split()[1] == open({str(key) + '.pub'!r}).read().split()[1]\n"
        "print(k.get_algorithm())\n"
    )
    cp = _fresh(code)
    assert cp.returncode == 0 and cp.stdout.strip() == "ssh-ed25519", cp.stderr[-2000:]


def test_asyncssh_still_looks_for_liboqs_through_find_library_by_these_names() -> None:
    spec = importlib.util.find_spec("asyncssh.crypto.pq")
    assert spec is not None and spec.origin
    src = Path(spec.origin).read_text()
    assert "ctypes.util.find_library(lib)" in src and f"for lib in {compat.LIBOQS_NAMES!r}" in src, (
        "asyncssh.crypto.pq looks for liboqs another way now: console/fleet/compat.py's skip of the look no longer applies"
    )


def _looked_for(env: dict[str, str]) -> tuple[set[str], bool]:
    code = (
        "import ctypes.util\n"
        "seen = []\n"
        "real = ctypes.util.find_library\n"
        "def spy(name):\n"
        "    seen.append(name)\n"
        "    return real(name)\n"
        "ctypes.util.find_library = spy\n"
        "from gpudeck.console.fleet import compat\n"
        "print(','.join(seen)); print(ctypes.util.find_library is spy)\n"
    )
    cp = _fresh(code, env)
    assert cp.returncode == 0, cp.stderr[-2000:]
    names, restored = cp.stdout.split()
    return set(names.split(",")), restored == "True"


def test_the_liboqs_look_runs_wherever_a_liboqs_might_load() -> None:
    seen, restored = _looked_for({**os.environ, "LD_LIBRARY_PATH": "/nonexistent"})
    assert set(compat.LIBOQS_NAMES) <= seen and restored
    if not compat.liboqs_loadable():  # this machine: no liboqs anywhere the loader looks: the look is answered at once
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LIBRARY_PATH")}
        seen, restored = _looked_for(env)
        assert not set(compat.LIBOQS_NAMES) & seen and restored
        assert "nettle" in seen  # asyncssh's other looks (UMAC's libnettle) run as they always did


def test_liboqs_loadable_says_no_only_where_the_loader_cannot_find_one(tmp_path: Path) -> None:
    cache = tmp_path / "ld.so.cache"
    cache.write_bytes(b"glibc-ld.so.cache1.1\0libc.so.6\0/usr/lib/x86_64-linux-gnu/libc.so.6\0")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libc.so.6").touch()
    clean: dict[str, str] = {}
    assert compat.liboqs_loadable(clean, str(cache), [str(lib)]) is (not sys.platform.startswith("linux"))
    assert compat.liboqs_loadable({"LD_LIBRARY_PATH": "/opt/oqs/lib"}, str(cache), [str(lib)])
    assert compat.liboqs_loadable({"LIBRARY_PATH": "/opt/oqs/lib"}, str(cache), [str(lib)])
    assert compat.liboqs_loadable(clean, str(tmp_path / "no-cache"), [str(lib)])  # unreadable cache: look
    (lib / "liboqs.so.5").touch()  # in a system folder, not in the cache (ldconfig not run since)
    assert compat.liboqs_loadable(clean, str(cache), [str(lib)])
    (lib / "liboqs.so.5").unlink()
    cache.write_bytes(cache.read_bytes() + b"liboqs.so.5\0/usr/local/lib/liboqs.so.5\0")
    assert compat.liboqs_loadable(clean, str(cache), [str(lib)])
