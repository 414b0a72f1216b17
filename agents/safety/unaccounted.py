"""Provides unaccounted GPU memory as a holder: memory no visible process explains, for pre-flight, reclaim and status.

A GPU's used memory minus what the processes NVML lists hold is memory that no
process visible to this agent explains: processes of another PID namespace (a
container without ``--pid=host``, another pod: NVML lists only this
namespace's), or a context the driver keeps. It is a holder like any other
(ARCHITECTURE.md, "A run"): pre-flight counts it on every GPU a launch uses,
reclaim lists it, status shows it. It cannot be signalled from here, so reclaim
never offers to stop it; the note says where to look instead.

The threshold is :data:`UNACCOUNTED_HOLDER_BYTES` (1 GiB) per GPU. Below it the
difference is bookkeeping, not a holder: per-context overhead the driver does
not charge to any process, and with NVML's v1 memory call the driver's own
reserve (a few hundred MiB on an idle GPU). A CUDA context alone holds about
0.5 GiB, so a holder that allocated anything at all is above it. When any
listed process's memory is not reported (``used_bytes`` None: MIG, some
containers) the difference may be that process's, so it is shown and not
counted as a holder.
"""

from __future__ import annotations

from gpudeck.agents.wire.protocol import Gpu, NamespaceInfo, UnaccountedMemory

GIB = 2**30
UNACCOUNTED_HOLDER_BYTES = GIB  # per GPU; see the module docstring for why 1 GiB


def note_for(gpu: int, used_bytes: int, ns: NamespaceInfo | None, simulated: bool = False, unreported: int = 0) -> str:
    """Where memory no visible process explains may be held, and what to do; the same words in every view (they follow
    'GPU G: X GiB')."""
    what = "held by no process visible to this agent"
    if simulated:
        what += " (SIMULATED: declared by GPUDECK_SIMULATE_GPUS)"
    if unreported:
        return (
            f"{what}; {unreported} listed process(es) on it have memory the driver does not report, so it may be theirs: "
            "not counted as a holder"
        )
    where = "memory held outside this agent's PID namespace or by the driver"
    if ns is not None and ns.pid_namespace == "isolated":
        markers = f" ({', '.join(ns.container_markers)})" if ns.container_markers else ""
        where += f" (this agent runs in its own PID namespace{markers}, where NVML lists only that namespace's processes)"
    else:
        where += " (another container's processes, or a context the driver keeps)"
    return (
        f"{what}: {where}; it cannot be signalled from here — run gpudeck on the host (or where the holder runs) to name "
        f"and reclaim it, or once GPU {gpu} is idle reset it (`nvidia-smi -r -i {gpu}`)"
    )


def unaccounted(gpus: list[Gpu], ns: NamespaceInfo | None, simulated: bool = False) -> list[UnaccountedMemory]:
    """One entry per GPU with memory no visible process explains; ``holder`` where it counts as one (threshold, all reported)."""
    out: list[UnaccountedMemory] = []
    for g in gpus:
        held = g.unaccounted_bytes or 0
        if held <= 0:
            continue
        unreported = sum(1 for p in g.processes if p.used_bytes is None)
        out.append(
            UnaccountedMemory(
                gpu=g.index,
                used_bytes=held,
                holder=held >= UNACCOUNTED_HOLDER_BYTES and not unreported,
                note=note_for(g.index, held, ns, simulated, unreported),
            )
        )
    return out


def holders(gpus: list[Gpu], ns: NamespaceInfo | None, simulated: bool = False) -> list[UnaccountedMemory]:
    """Only the entries that count as holders."""
    return [u for u in unaccounted(gpus, ns, simulated) if u.holder]
