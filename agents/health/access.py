"""Provides the check the kernel would make for another user: could this uid, with these groups, open that file?

The agent may run as root, and a run's stacks can name any path (hostile input). Before the agent quotes a line of
a file named there, it opens the file the way the run's own user would have to: every folder on the way searched
(the execute bit of the class the user falls in: owner, one of its groups, or other), symbolic links on the way
followed as the kernel follows them (at most ``MAX_LINKS``; each link's target walked with the same checks), and
the file itself readable by that user. A final component that is a symbolic link is not followed at all, and a
file or folder carrying a POSIX ACL (which mode bits do not describe) is refused. Each folder is checked on the
descriptor it was opened as (``O_PATH``, no symbolic link followed), so a path swapped during the walk cannot send
the read elsewhere.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

MAX_LINKS = 40  # as the kernel's own limit on symbolic links in one lookup (ELOOP)
_SEARCH, _READ = 0o1, 0o4
_ACL = "system.posix_acl_access"


@dataclass(frozen=True)
class Reader:
    """Who opens the file: the filesystem uid and gid and the supplementary groups (-1: nobody in particular, so
    only the "other" bits count)."""

    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    def may(self, st: os.stat_result, want: int) -> bool:
        """Whether the mode bits of ``st`` give this reader ``want`` (``_READ`` or ``_SEARCH``), as the kernel decides:
        the owner's bits for the owner, else the group's for a member, else other's; root may do anything."""
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            return bool(st.st_mode & (want << 6))
        if st.st_gid == self.gid or st.st_gid in self.groups:
            return bool(st.st_mode & (want << 3))
        return bool(st.st_mode & want)


ANYONE = Reader(uid=-1, gid=-1)  # a reader in no owner's class and no group: only the "other" bits count


def reader_of(pid: int) -> Reader | None:
    """The filesystem identity of process ``pid`` (its ``Uid:``/``Gid:`` fs fields and ``Groups:`` in
    /proc/PID/status); None when it is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            text = fh.read(16384).decode("ascii", "replace")
    except OSError:
        return None
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            fields[key] = rest.split()
    try:
        uid, gid = int(fields["Uid"][3]), int(fields["Gid"][3])
        groups = frozenset(int(g) for g in fields.get("Groups", []))
    except (KeyError, IndexError, ValueError):
        return None
    return Reader(uid=uid, gid=gid, groups=groups)


def _has_acl(fd: int) -> bool:
    try:
        return _ACL in os.listxattr(f"/proc/self/fd/{fd}")
    except OSError:  # no xattr support on this filesystem: no ACL either
        return False


def _allowed(fd: int, reader: Reader, want: int) -> bool:
    st = os.fstat(fd)
    return reader.may(st, want) and (reader.uid == 0 or not _has_acl(fd))


def open_as(path: str, reader: Reader) -> int | None:
    """A read-only descriptor of the regular file at absolute ``path`` when ``reader`` could open it itself (see the
    module doc); None otherwise. The caller closes it."""
    if not path.startswith("/"):
        return None
    parts = path.split("/")[::-1]  # a stack: the next component last
    flags_dir = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    dfd = os.open("/", flags_dir)
    links = 0
    try:
        if not _allowed(dfd, reader, _SEARCH):
            return None
        while parts:
            name = parts.pop()
            if name in ("", "."):
                continue
            last = all(p in ("", ".") for p in parts)
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if last or links > MAX_LINKS:
                    return None
                target = os.readlink(name, dir_fd=dfd)
                if target.startswith("/"):
                    root = os.open("/", flags_dir)
                    os.close(dfd)
                    dfd = root
                    if not _allowed(dfd, reader, _SEARCH):
                        return None
                parts.extend(target.split("/")[::-1])
                continue
            if last:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                if stat.S_ISREG(os.fstat(fd).st_mode) and _allowed(fd, reader, _READ):
                    return fd
                os.close(fd)
                return None
            nfd = os.open(name, flags_dir, dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
            if not _allowed(dfd, reader, _SEARCH):
                return None
        return None  # the path names a folder
    except OSError:
        return None
    finally:
        os.close(dfd)
