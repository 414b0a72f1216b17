"""Provides what ``gpudeck reclaim HOST`` offers to stop: the leftovers of ended runs and GPU memory no run owns.

A leftover is one of (failures 1-3 of ARCHITECTURE.md):

- ``orphan``: a process of a run that has ended, found as a stop of that run
  finds its members (:func:`gpudeck.agents.safety.membership.run_members`):
  in its cgroup whatever its environment says; else carrying its tag (a
  re-parented torchrun worker, a DataLoader or compile worker) or descending
  from it without the tag (it cleared its environment); with the GPU memory it
  holds, its CPU and RSS;
- ``foreign``: a process holding GPU memory that belongs to no gpudeck run;
- ``zombie`` / ``disk_sleep``: a GPU holder in that state (signals do not
  reach it; the note says what can);
- ``no_such_process``: a pid NVML reports on a GPU that the OS does not show;
- ``live``: a member of a live run (listed and stopped only when asked to).
"""

from __future__ import annotations

from collections.abc import Callable

from gpudeck.agents.observe.procs import CT_TOLERANCE, ProcTable, proc_info, read_stat
from gpudeck.agents.wire.protocol import TERMINAL_STATES, Gpu, Leftover, Member, RunInfo

_NOTES = {
    "orphan": "left by run {run} ({cause}){how}; `gpudeck reclaim {host}:{pid}` stops it",
    "foreign": "not a gpudeck run: started by {user} outside gpudeck; stop it only if you know whose it is (`gpudeck reclaim {host}:{pid}`)",
    "zombie": "has exited; its GPU memory is released when its parent (pid {ppid}) reaps it: stop or restart pid {ppid} — signals to the zombie do nothing",
    "disk_sleep": "in disk sleep (D): waiting on I/O that does not return (storage or driver); SIGKILL takes effect only when the I/O ends — check `dmesg` and the file system it uses; it is not retried in a loop",
    "no_such_process": "NVML reports it but the OS shows no such pid: another container or PID namespace, or a context the driver still holds; it cannot be signalled from here — check the other containers' nvidia-smi, or reset the GPU once it is idle",
    "live": "a member of live run {run}: `gpudeck stop {run}` stops the whole run; reclaim stops it alone only with --include-live",
}


_HOW = {
    "cgroup": " (in its cgroup)",
    "ancestry": " (without the run's tag: it cleared its environment, and descends from the run or stays in its session)",
}


def _ended(state: str | None) -> bool:
    return state in TERMINAL_STATES or state == "ended"


def _kind_for_status(status: str | None, default: str) -> str:
    if status == "zombie":
        return "zombie"
    if status == "disk-sleep":
        return "disk_sleep"
    return default


def find_leftovers(
    host: str,
    procs: ProcTable,
    gpus: list[Gpu],
    run_state: Callable[[str], str | None],
    get_run: Callable[[str], RunInfo | None],
    *,
    include_live: bool = False,
    members: dict[int, tuple[str, Member]] | None = None,
) -> list[Leftover]:
    """Every leftover on this host; ``gpus`` are attributed (GpuProcess.attribution).

    ``members``: pid -> (run id, member) for the live processes of ended runs (and of live runs when
    ``include_live``), as a stop of each run finds them (``agents/runs/reclaim.py``'s ``run_processes``).
    """
    members = members or {}
    out: dict[int, Leftover] = {}
    runs: dict[str, RunInfo | None] = {}

    def run_of(rid: str | None) -> RunInfo | None:
        if rid is None:
            return None
        if rid not in runs:
            runs[rid] = get_run(rid)
        return runs[rid]

    def add(pid: int, kind: str, run_id: str | None, rank: int | None) -> Leftover:
        lo = out.get(pid)
        if lo is not None:
            return lo
        placed = members.get(pid)
        if run_id is None and placed is not None:  # a GPU holder without the tag that a stop of its run would stop
            run_id = placed[0]
            kind = "orphan" if _ended(run_state(run_id)) else "live"
        found_by = (placed[1].found_by or placed[1].role) if placed is not None and placed[0] == run_id else ("tag" if run_id else "")
        info = proc_info(pid, run_id=run_id, rank=rank) if kind != "no_such_process" else None
        run = run_of(run_id)
        if info is not None:
            kind = _kind_for_status(info.status, kind)
        entry = procs.lookup(pid) if info is not None else None
        same = entry is not None and info is not None and abs(entry.create_time - (info.create_time or 0.0)) <= CT_TOLERANCE
        container = entry.read_container() if entry is not None and same else None
        lo = Leftover(
            pid=pid,
            create_time=info.create_time if info else None,
            kind=kind,  # type: ignore[arg-type]
            run_id=run_id,
            run_state=run.state if run else (run_state(run_id) if run_id else None),
            run_ended=run.ended if run else None,
            run_cause=run.cause if run else None,
            rank=rank,
            user=info.user if info else None,
            status=info.status if info else "no such process",
            ppid=info.ppid if info else None,
            cmdline=(list(info.cmdline[:24]) if info else []),
            rss=info.rss if info else None,
            found_by=found_by,
            container=container,
        )
        lo.note = _NOTES[lo.kind].format(
            host=host,
            pid=pid,
            run=run_id or "-",
            cause=(lo.run_cause or lo.run_state or "ended"),
            user=lo.user or "another user",
            ppid=lo.ppid or "?",
            how=_HOW.get(found_by, ""),
        )
        if container is not None:  # reclaim from the host stops a process inside it: say which container
            lo.note = f"in container {container.label()}: {lo.note}"
        out[pid] = lo
        return lo

    for g in gpus:
        for p in g.processes:
            if p.attribution == "NO_SUCH_PROCESS":
                lo = add(p.pid, "no_such_process", None, None)
            elif p.attribution == "FOREIGN":
                lo = add(p.pid, "foreign", None, None)
            elif p.attribution == "STALE":
                lo = add(p.pid, "orphan", p.run_id, p.rank)
            elif include_live or p.status in ("zombie", "disk-sleep"):
                lo = add(p.pid, "live", p.run_id, p.rank)
            else:
                continue
            lo.gpu_bytes[g.index] = lo.gpu_bytes.get(g.index, 0) + (p.used_bytes or 0)
    # every process a stop of its run would stop (its group, its tag, its ancestry), with or without a GPU
    for pid, (rid, m) in members.items():
        if pid in out:
            continue
        ended = _ended(run_state(rid))
        if not ended and not include_live:
            continue
        add(pid, "orphan" if ended else "live", rid, m.rank)
    # tagged processes of ended runs hold CPU and RAM even without a GPU (runs older than those looked at above too)
    for e in procs.tagged():
        if e.pid in out or e.run_id is None:
            continue
        ended = _ended(run_state(e.run_id))
        if not ended and not include_live:
            continue
        st = read_stat(e.pid)
        if st is None or st.status == "zombie" and ended:
            continue  # gone, or an already-dead worker whose parent will reap it (holds nothing)
        add(e.pid, "orphan" if ended else "live", e.run_id, e.rank)
    return sorted(out.values(), key=lambda lo: (lo.kind == "live", -sum(lo.gpu_bytes.values()), lo.pid))
