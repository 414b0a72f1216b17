"""Provides asyncssh to the console, and the only place the console touches asyncssh's private names or its import
(console/tui/compat/README.md lists them).

- ``SSHClientConfig._handlers`` and ``SSHConfig._set_bool``: asyncssh's ssh config reader ignores ``CheckHostIP``;
  :class:`CheckHostIPConfig` adds it to the reader's table of options, parsed as asyncssh parses its own yes/no
  options. Waits for asyncssh to read the option itself (2.24.1, the version tested, does not).
- the logger class's ``_debug_level``: asyncssh formats a log line for every packet a channel receives before its
  logger checks whether packet logging is on; :func:`packet_logging_on` reads that level so the console's hook can
  skip the formatting. Waits for asyncssh to check the level first.
- how asyncssh is imported (issue 30: a `gpudeck status --host H` over SSH pays it on every call). Two of its
  import-time costs are skipped, and only where skipping changes nothing OpenSSH would do:
  - ``asyncssh.crypto.x509`` (X.509 certificates as SSH keys, RFC 6187, which OpenSSH does not implement; it imports
    ``cryptography.x509``, about 12 ms on a quiet 2-core machine) is blocked for the import, the way asyncssh's own
    ``try: from .x509 import ... except ImportError`` expects it to be missing: X.509 host keys and client
    certificates are then not offered, as with OpenSSH; every OpenSSH key, certificate and known_hosts entry works.
  - ``asyncssh.crypto.pq`` looks for liboqs (the sntrup761 key exchange) with ``ctypes.util.find_library('oqs')`` and
    ``('liboqs')`` at import, which execs ``ldconfig -p`` and then ``gcc`` for each name (about 20 ms). The look is
    answered "not found" without them only when the dynamic loader could not load a liboqs anyway
    (:func:`liboqs_loadable`: no ``oqs`` in ``/etc/ld.so.cache``, none in the loader's system folders, no
    ``LD_LIBRARY_PATH``/``LIBRARY_PATH``); anywhere else asyncssh looks as it always does. Not found is what the probe
    itself says on such a host (or an OSError at import, where gcc finds a library the loader cannot load).
  Waits for asyncssh to import these lazily.

tests/unit/test_textual_compat.py (the private names) and tests/unit/test_asyncssh_import.py (the import) fail when any
of them moves.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping

X509_MODULE = "asyncssh.crypto.x509"  # asyncssh's X.509 support, imported by asyncssh.crypto inside try/except ImportError
LIBOQS_NAMES = ("oqs", "liboqs")  # what asyncssh.crypto.pq asks ctypes.util.find_library for
LD_CACHE = "/etc/ld.so.cache"


def loader_dirs() -> list[str]:
    """glibc's system search path (``ld.so --help``), each folder once, with its ``glibc-hwcaps`` subfolders."""
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    base = ["/lib", "/usr/lib", "/lib64", "/usr/lib64"]
    if arch:
        base = [f"/lib/{arch}", f"/usr/lib/{arch}", *base]
    out: list[str] = []
    seen: set[str] = set()
    for d in base:
        real = os.path.realpath(d)
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        out.append(real)
        hw = os.path.join(real, "glibc-hwcaps")
        if os.path.isdir(hw):
            out += [os.path.join(hw, s) for s in sorted(os.listdir(hw))]
    return out


def liboqs_loadable(environ: Mapping[str, str] = os.environ, cache: str = LD_CACHE, dirs: Iterable[str] | None = None) -> bool:
    """Whether this process's dynamic loader might load a liboqs (then asyncssh's own look runs); False only when it
    surely cannot: not Linux's loader, a search path from the environment, an unreadable cache: True."""
    if not sys.platform.startswith("linux") or environ.get("LD_LIBRARY_PATH") or environ.get("LIBRARY_PATH"):
        return True
    try:
        with open(cache, "rb") as fh:
            if b"oqs" in fh.read():
                return True
    except OSError:
        return True
    for d in loader_dirs() if dirs is None else dirs:
        try:
            if any("oqs" in name for name in os.listdir(d)):
                return True
        except OSError:
            continue
    return False


def _not_liboqs(real: Callable[[str], str | None]) -> Callable[[str], str | None]:
    def find_library(name: str) -> str | None:
        return None if name in LIBOQS_NAMES else real(name)

    return find_library


def _import_asyncssh() -> None:
    """``import asyncssh`` without X.509 and, where no liboqs can load, without the liboqs look (the docstring above);
    nothing to do when something imported it already."""
    if "asyncssh" in sys.modules:
        return
    real_find = ctypes.util.find_library
    blocked = X509_MODULE not in sys.modules
    if blocked:
        sys.modules[X509_MODULE] = None  # type: ignore[assignment]  # the import system's "not there": ImportError
    if not liboqs_loadable():
        ctypes.util.find_library = _not_liboqs(real_find)  # type: ignore[assignment]  # for the import only: put back below
    try:
        import asyncssh  # noqa: F401  # the first import, under the conditions above
    finally:
        ctypes.util.find_library = real_find
        if blocked and sys.modules.get(X509_MODULE, 0) is None:
            del sys.modules[X509_MODULE]  # asyncssh has decided; a later explicit import finds the module again


_import_asyncssh()

import asyncssh as asyncssh  # noqa: E402  # imported above; transport.py takes it from here


class CheckHostIPConfig(asyncssh.config.SSHClientConfig):
    """asyncssh's ssh config reader, also reading ``CheckHostIP`` (yes/no)."""

    _handlers = {**asyncssh.config.SSHClientConfig._handlers, "checkhostip": ("CheckHostIP", asyncssh.config.SSHConfig._set_bool)}


def packet_logging_on() -> bool:
    """Whether asyncssh logs every packet (its debug level 3); True when the level cannot be read."""
    return getattr(type(asyncssh.logging.logger), "_debug_level", 3) >= 3
