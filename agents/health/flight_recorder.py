"""Provides the agent's side of torch's Flight Recorder: ask a trainer's ranks for a dump, read it, summarise it across ranks.

gpudeck's trainers (``trainers/common/diagnostics.py``) run a thread that watches
``RUN_DIR/flight_recorder/request``; :func:`request` writes a fresh nonce
there, and every rank answers with ``RUN_DIR/flight_recorder/rank<R>.<PID>.json``:
its newest Flight Recorder entries (collective sequence number, op, retired or
not), JSON. No signal and no ptrace: the rank's own thread writes it.

Every file there is written by the run, so it is hostile input: the folder and
the files are opened without following links (relative to the folder's fd),
a dump larger than ``MAX_DUMP_BYTES`` is refused, and it is decoded by msgspec
into :class:`FrDump`, whose fields are closed (``forbid_unknown_fields``), so
the structure is at most four levels deep and every list and string is bounded.
The agent never unpickles.

:func:`summarise` says where each rank is in the collectives of its process
group: "rank 2 last completed gloo:all_reduce seq 57; ranks 0, 1 and 3 are in
seq 58 (gloo:all_gather): rank 2 is behind".
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from collections.abc import Sequence
from typing import Annotated

import msgspec

MAX_DUMP_BYTES = 1 << 20  # one rank's dump (the trainers write 256 trimmed entries: ~45 KiB)
MAX_ENTRIES = 4096
WAIT_S = 3.0  # after the stacks are in: how much longer a missing dump is waited for
FOLDER = "flight_recorder"  # trainers/contract.py: flight_recorder_request_file / flight_recorder_dump_file
REQUEST = "request"

Name = Annotated[str, msgspec.Meta(max_length=200)]


class FrEntry(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One Flight Recorder entry, as the trainers trim it."""

    collective_seq_id: int = 0
    p2p_seq_id: int = 0
    pg_id: int = 0
    process_group: Annotated[list[Name], msgspec.Meta(max_length=4)] = []
    profiling_name: Name = ""
    state: Name = ""
    retired: bool = False
    is_p2p: bool = False


class FrDump(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One rank's answer to a request."""

    nonce: Name
    rank: int
    pid: int
    version: Name = ""
    error: Annotated[str, msgspec.Meta(max_length=400)] = ""
    entries: Annotated[list[FrEntry], msgspec.Meta(max_length=MAX_ENTRIES)] = []


_DECODER = msgspec.json.Decoder(FrDump)


def _folder_fd(run_dir: str) -> int | None:
    try:
        return os.open(os.path.join(run_dir, FOLDER), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


def request(run_dir: str) -> str | None:
    """Ask every rank of the run for a dump: a fresh nonce in the request file; None when the folder is not there."""
    fd = _folder_fd(run_dir)
    if fd is None:
        return None
    nonce = secrets.token_hex(8)
    try:
        f = os.open(REQUEST, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            if not stat.S_ISREG(os.fstat(f).st_mode):
                return None
            os.write(f, nonce.encode())
        finally:
            os.close(f)
    except OSError:
        return None
    finally:
        os.close(fd)
    return nonce


def read_dump(run_dir: str, rank: int, pid: int, nonce: str) -> FrDump | str | None:
    """Rank ``rank``'s answer to ``nonce``: the dump, a string saying why it is refused, or None (not there yet)."""
    fd = _folder_fd(run_dir)
    if fd is None:
        return None
    try:
        f = os.open(f"rank{rank}.{pid}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError as exc:
        return "its dump is a symbolic link (not followed)" if exc.errno == errno.ELOOP else None
    finally:
        os.close(fd)
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode):
            return "its dump is not a regular file"
        if st.st_size > MAX_DUMP_BYTES:
            return f"its dump is {st.st_size} bytes, over the {MAX_DUMP_BYTES} read"
        data = os.read(f, MAX_DUMP_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(f)
    try:
        dump = _DECODER.decode(data)
    except msgspec.DecodeError as exc:  # written beside and renamed in: never a torn write, so a malformed dump
        return f"its dump does not decode ({exc})"[:300]
    if dump.nonce != nonce or dump.rank != rank or dump.pid != pid:
        return None
    return dump


def collect(run_dir: str, ranks: Sequence[tuple[int, int]], nonce: str, wait_s: float = WAIT_S) -> dict[int, FrDump | str]:
    """Every (rank, pid)'s answer, waiting up to ``wait_s`` for those not in yet; a rank without one is left out.

    A refused file (a link, too large, malformed) is looked at again until the deadline, since the rank may still
    write its answer over it; at the deadline the reason stands for that rank."""
    got: dict[int, FrDump] = {}
    refused: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while True:
        for rank, pid in ranks:
            if rank not in got:
                d = read_dump(run_dir, rank, pid, nonce)
                if isinstance(d, FrDump):
                    got[rank] = d
                    refused.pop(rank, None)
                elif d is not None:
                    refused[rank] = d
        if len(got) == len(ranks) or time.monotonic() >= deadline:
            return {**refused, **got}
        time.sleep(0.1)


def _names(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def summarise(dumps: dict[int, FrDump | str], expected: Sequence[int]) -> str:
    """One line: where each rank is in its collectives, and which rank is behind."""
    refused = {r: d for r, d in dumps.items() if isinstance(d, str)}
    got = {r: d for r, d in dumps.items() if isinstance(d, FrDump)}
    failed = {r: d.error for r, d in got.items() if d.error}
    tail = []
    missing = sorted(set(expected) - set(dumps))
    if missing:
        tail.append(f"no dump from {_names(missing)} within {WAIT_S:.0f} s")
    tail += [f"rank {r}: {why}" for r, why in sorted(refused.items())]
    tail += [f"rank {r}: {why}" for r, why in sorted(failed.items())]
    usable = {r: d for r, d in got.items() if not d.error}
    if not usable:
        return "Flight Recorder: " + ("; ".join(tail) or "no rank answered")

    # the process group with the most collectives recorded: the one every rank steps through
    def key(e: FrEntry) -> tuple[int, str]:  # a group's id and its backend: the CPU and NCCL recorders number apart
        return e.pg_id, e.profiling_name.split(":", 1)[0]

    counts: dict[tuple[int, str], int] = {}
    for d in usable.values():
        for e in d.entries:
            if not e.is_p2p:
                counts[key(e)] = counts.get(key(e), 0) + 1
    if not counts:
        return "Flight Recorder: no collective recorded yet" + (f" ({'; '.join(tail)})" if tail else "")
    pg = max(counts, key=lambda k: counts[k])
    # per rank: its last completed collective, and the first it entered that has not completed
    done: dict[int, FrEntry | None] = {}
    inflight: dict[int, FrEntry | None] = {}
    for r, d in usable.items():
        mine = [e for e in d.entries if key(e) == pg and not e.is_p2p]
        fin = [e for e in mine if e.retired]
        last = max(fin, key=lambda e: e.collective_seq_id) if fin else None
        after = [e for e in mine if not e.retired and (last is None or e.collective_seq_id > last.collective_seq_id)]
        done[r] = last
        inflight[r] = min(after, key=lambda e: e.collective_seq_id) if after else None

    def entered(r: int) -> int:
        e = inflight[r] or done[r]
        return e.collective_seq_id if e is not None else 0

    pgname = next((e.process_group[1] for d in usable.values() for e in d.entries if key(e) == pg and len(e.process_group) > 1), str(pg[0]))
    low = min(entered(r) for r in usable)
    behind = sorted(r for r in usable if entered(r) == low)
    ahead: dict[int, list[int]] = {}
    for r in sorted(usable):
        if entered(r) != low:
            ahead.setdefault(entered(r), []).append(r)
    op = {r: getattr(inflight[r] or done[r], "profiling_name", "?") for r in usable}
    if not ahead:
        state = "in flight" if inflight[behind[0]] else "completed"
        where = f"seq {low} ({op[behind[0]]}, {state})" if low else "no collective"
        verb = "is at" if len(behind) == 1 else "are all at"
        line = f"Flight Recorder ({pgname}): {_names(behind)} {verb} {where}: no rank is behind in the collectives"
    else:
        first = behind[0]
        d0 = done[first]
        lead = (
            f"{_names(behind)} last completed {d0.profiling_name} seq {d0.collective_seq_id}"
            if d0
            else f"{_names(behind)} completed no collective"
        )
        if inflight[first] is not None:
            lead += f" and {'is' if len(behind) == 1 else 'are'} in seq {low} ({op[first]})"
        rest = "; ".join(f"{_names(rs)} {'is' if len(rs) == 1 else 'are'} in seq {s} ({op[rs[0]]})" for s, rs in sorted(ahead.items()))
        line = f"Flight Recorder ({pgname}): {lead}; {rest}: {_names(behind)} {'is' if len(behind) == 1 else 'are'} behind"
    return line + (f" ({'; '.join(tail)})" if tail else "")
