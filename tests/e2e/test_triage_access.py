"""Triage quotes a source line only where the rank's own user could open the file: every folder on the way, not the
file's mode alone. A real other uid (nobody, 65534) and real folders made by root; the kernel itself (``cat`` run as
nobody) is the judge the agent's answer is compared with."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.agents.health.access import ANYONE, reader_of
from gpudeck.agents.health.triage import source_line

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make folders another uid cannot enter")


@pytest.fixture
def tree() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="gpudeck-access-", dir="/tmp"))  # /tmp: a path nobody can walk to
    os.chmod(base, 0o755)

    def folder(name: str, mode: int, gid: int = 0) -> Path:
        d = base / name
        d.mkdir()
        os.chown(d, 0, gid)
        os.chmod(d, mode)
        return d

    def source(d: Path, mode: int = 0o644, uid: int = 0, gid: int = 0, text: str = "") -> None:
        f = d / "src.py"
        f.write_text(text or f"line of {d.name}\n")
        os.chown(f, uid, gid)
        os.chmod(f, mode)

    source(folder("closed", 0o700))  # the case from the issue: a 0644 file in root's 0700 folder
    source(folder("search_only", 0o711))
    source(folder("group_nogroup", 0o750, gid=NOBODY))  # nobody's group may search it
    source(folder("group_root", 0o750, gid=0))
    source(folder("open_owner_denied", 0o755), mode=0o044, uid=NOBODY)  # the owner's bits rule the owner
    source(folder("open_group_file", 0o755), mode=0o640, gid=NOBODY)
    inner = folder("closed_outer", 0o700)
    (inner / "deeper").mkdir(mode=0o755)
    source(inner / "deeper")
    acl = folder("acl_denies_nobody", 0o755)  # the mode bits say nobody may search it; its ACL says otherwise
    source(acl)
    _deny_by_acl(acl, NOBODY)
    (base / "via_closed").symlink_to(base / "closed")  # a link on the way: its target is walked too
    (base / "via_open").symlink_to("search_only")
    try:
        yield base
    finally:
        shutil.rmtree(base)


def _deny_by_acl(path: Path, uid: int) -> None:
    """A POSIX access ACL on ``path``: owner rwx, ``uid`` nothing, group and others r-x (setfacl's binary form)."""
    entries = [(0x01, 7, 0xFFFFFFFF), (0x02, 0, uid), (0x04, 5, 0xFFFFFFFF), (0x10, 5, 0xFFFFFFFF), (0x20, 5, 0xFFFFFFFF)]
    os.setxattr(path, "system.posix_acl_access", struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))


def _kernel_says(path: Path) -> bool:
    return subprocess.run(["cat", str(path)], user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, cwd="/").returncode == 0


def test_a_line_is_quoted_only_where_nobody_itself_could_open_the_file(tree: Path) -> None:
    rank = subprocess.Popen(["sleep", "60"], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/")
    try:
        who = reader_of(rank.pid)
        assert who is not None and who.uid == NOBODY and who.gid == NOBODY
        expect = {
            "closed": False,
            "search_only": True,
            "group_nogroup": True,
            "group_root": False,
            "open_owner_denied": False,
            "open_group_file": True,
            "closed_outer/deeper": False,
            "acl_denies_nobody": False,  # refused for carrying an ACL at all (mode bits do not describe it)
            "via_closed": False,
            "via_open": True,
        }
        for rel, allowed in expect.items():
            path = tree / rel / "src.py"
            assert _kernel_says(path) is allowed, f"the kernel's own answer for {rel} is not what this test assumes"
            quoted = source_line(str(path), 1, who)
            assert (quoted is not None) is allowed, f"{rel}: quoted {quoted!r}, nobody can{'' if allowed else 'not'} open it"
            if allowed:
                assert quoted is not None and quoted.startswith("line of ")
        # root (the agent itself) reads every one of them: the refusals above are nobody's, not the agent's
        assert all(source_line(str(tree / rel / "src.py"), 1, reader_of(os.getpid()) or ANYONE) for rel in expect)
    finally:
        rank.kill()
        rank.wait()
