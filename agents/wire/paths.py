"""Provides where the agent keeps its state (the journal, run folders and the socket), and opens it safely.

Everything gpudeck creates under its state is private whatever the umask:
folders 0700, files 0600 (:func:`ensure_private_dir`, :func:`private_file`).
A state path is never reached through a symbolic link nor through a folder
another user owns: each component from the state's root (``GPUDECK_HOME`` or
the platform's state folder) down is checked with ``lstat``, and files are
opened with ``O_NOFOLLOW``; a path that fails is refused with
:class:`UnsafePath`, whose message says what to fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import platformdirs

from gpudeck.agents.wire.errors import PermissionDenied


class UnsafePath(PermissionDenied):
    """A state path is a symbolic link, or another user owns it or a folder on the way to it."""


def state_dir() -> Path:
    """The agent's state folder: ``$GPUDECK_HOME/agent`` when set, else the user state dir."""
    home = os.environ.get("GPUDECK_HOME")
    if home:
        return Path(home).expanduser().resolve() / "agent"
    return Path(platformdirs.user_state_dir("gpudeck")) / "agent"


def socket_path(base: Path | None = None) -> Path:
    """The agent's Unix socket, inside a 0700 folder."""
    return (base or state_dir()) / "sock" / "agent.sock"


def journal_path(base: Path | None = None) -> Path:
    """The agent's SQLite journal."""
    return (base or state_dir()) / "journal.db"


def runs_dir(base: Path | None = None) -> Path:
    """Where each run's folder (spec.json, output.log, telemetry.jsonl, exit.json) lives."""
    return (base or state_dir()) / "runs"


def envs_dir(base: Path | None = None) -> Path:
    """Where ``--rebuild-env`` recreates recorded python environments."""
    return (base or state_dir()) / "envs"


def log_path(base: Path | None = None) -> Path:
    """The agent's own log file."""
    return (base or state_dir()) / "agent.log"


def _root_of(path: Path) -> Path:
    """The folder from which ``path``'s components are checked: GPUDECK_HOME (resolved once, as state_dir() does) or
    the platform's state folder when ``path`` is inside it, else ``path``'s own parent (a --state-dir elsewhere)."""
    home = os.environ.get("GPUDECK_HOME")
    roots = [Path(home).expanduser().resolve()] if home else []
    roots.append(Path(platformdirs.user_state_dir("gpudeck")).resolve())
    full = Path(os.path.abspath(path))
    for root in roots:
        if full.is_relative_to(root):
            return root
    return full.parent


def check_path(path: Path, root: Path | None = None) -> None:
    """Refuse ``path`` if it or an existing folder between ``root`` and it is a symbolic link or another user's.

    Folders on the way may belong to this user or to root; ``path`` itself must be this user's.
    """
    me = os.geteuid()
    full = Path(os.path.abspath(path))
    base = Path(os.path.abspath(root)) if root is not None else _root_of(full)
    parts = full.relative_to(base).parts if full.is_relative_to(base) else ()
    chain = [base] + [base.joinpath(*parts[: i + 1]) for i in range(len(parts))]
    for p in chain:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return  # what does not exist yet is created by this user
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePath(
                f"{p} is a symbolic link; gpudeck does not follow links in its state: replace it with a real "
                f"{'file' if p == full else 'folder'} (`rm {p}`), or point GPUDECK_HOME at the real place"
            )
        if st.st_uid != me and (p == full or st.st_uid != 0):
            raise UnsafePath(
                f"{p} belongs to uid {st.st_uid}, not to you (uid {me}): another user could read or replace gpudeck's "
                f"state there; use a GPUDECK_HOME of your own, or `chown {me} {p}` if it is yours"
            )
        if p != full and stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            raise UnsafePath(
                f"{p} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): anyone could swap what is inside; `chmod o-w {p}`"
            )


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) as 0700 folders whatever the umask, after checking that no component is a link
    or another user's; an existing folder is made 0700."""
    check_path(path)
    missing: list[Path] = []
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    check_path(path)  # nothing was swapped in meanwhile
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def private_file(path: Path) -> Path:
    """Make sure ``path`` exists as this user's regular 0600 file, reached without links (created empty if missing).

    SQLite gives its -wal and -shm files the database file's mode, so a database created through here stays private.
    """
    check_path(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path} is not a regular file: remove it and gpudeck creates it again")
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): use a GPUDECK_HOME of your own")
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path
