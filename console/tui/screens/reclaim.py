"""Provides the reclaim flow shared by the Host and Leftovers screens: confirm what will be freed, run it, show the verified result."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from rich.text import Text
from textual.screen import Screen

from gpudeck.agents.wire.protocol import Gpu, StopResult
from gpudeck.console.core.fmt import gib
from gpudeck.console.core.sanitize import one_line
from gpudeck.console.tui.screens.base import deck
from gpudeck.console.tui.screens.dialogs import ConfirmDialog, ResultDialog, stop_result_text
from gpudeck.console.tui.widgets.progress import ProgressLine

GRACE_S = 10.0


@dataclass(frozen=True)
class ReclaimItem:
    """One process to reclaim: its pid, who it is, what it holds on which GPU."""

    pid: int
    who: str  # e.g. 'STALE r-1b2c3d4e rank 2'
    user: str = "-"
    command: str = ""
    gpu_bytes: dict[int, int] = field(default_factory=dict)
    live_run: str | None = None  # the live run it belongs to: reclaiming it breaks that run
    container: str = ""  # the container it runs in, seen from the host ('docker:trainer'); "" for none


def reclaim_body(host: str, items: list[ReclaimItem], gpus: list[Gpu], grace_s: float = GRACE_S) -> Text:
    """What the confirm dialog says: per GPU, which processes go and how much memory comes back."""
    by_gpu: dict[int, list[ReclaimItem]] = defaultdict(list)
    no_gpu: list[ReclaimItem] = []
    for it in items:
        if it.gpu_bytes:
            for g in it.gpu_bytes:
                by_gpu[g].append(it)
        else:
            no_gpu.append(it)
    gpu_by_index = {g.index: g for g in gpus}
    t = Text()
    t.append(f"Reclaim {len(items)} process(es) on {host}: ", style="bold")
    t.append(f"SIGTERM, {grace_s:.0f} s grace, then SIGKILL; then NVML verifies the memory came back.\n")
    total = 0
    for g in sorted(by_gpu):
        freed = sum(it.gpu_bytes.get(g, 0) for it in by_gpu[g])
        total += freed
        gpu = gpu_by_index.get(g)
        t.append(f"\nGPU {g}", style="bold")
        if gpu is not None:
            t.append(f"  {gib(gpu.memory_used)} of {gib(gpu.memory_total)} GiB used")
        t.append(f"  → frees {gib(freed)} GiB\n", style="bold green")
        for it in by_gpu[g]:
            t.append(
                f"  pid {it.pid:<8} {one_line(it.who, 28):<28} {one_line(it.user, 8):<8} {gib(it.gpu_bytes.get(g)):>6} GiB  {one_line(it.command, 26)}\n",
                style="bold red" if it.live_run else "",
            )
            _container_line(t, it)
    if no_gpu:
        t.append("\nholding no GPU memory\n", style="bold")
        for it in no_gpu:
            t.append(f"  pid {it.pid:<8} {one_line(it.who, 28):<28} {one_line(it.user, 8):<8} {one_line(it.command, 40)}\n")
            _container_line(t, it)
    t.append(f"\n{gib(total)} GiB should come back in all.\n", style="bold")
    live = sorted({it.live_run for it in items if it.live_run})
    for rid in live:
        pids = ", ".join(str(it.pid) for it in items if it.live_run == rid)
        t.append(
            f"⚠ pid {pids} belong(s) to live run {one_line(rid)}: reclaiming breaks that run. To end the run cleanly, stop it instead (s on its Run screen).\n",
            style="bold red",
        )
    return t


def _container_line(t: Text, it: ReclaimItem) -> None:
    """Under a process that runs in a container: which one (the signal goes into it from the host)."""
    if it.container:
        t.append(f"             in container {one_line(it.container, 60)}: stopped from the host, inside it\n", style="yellow")


async def reclaim_flow(
    screen: Screen, host: str, items: list[ReclaimItem], gpus: list[Gpu], progress: ProgressLine, grace_s: float = GRACE_S
) -> StopResult | None:
    """Confirm, reclaim exactly these pids with progress and elapsed time, then show the verified result."""
    if not items:
        screen.notify("mark processes first (space), then x", title="nothing to reclaim", severity="warning")
        return None
    include_live = any(it.live_run for it in items)
    label = "Reclaim, breaking the live run" if include_live else "Reclaim"
    ok = await screen.app.push_screen_wait(
        ConfirmDialog(f"Reclaim on {host}", reclaim_body(host, items, gpus, grace_s), confirm_label=label)
    )
    if not ok:
        return None
    pids = sorted({it.pid for it in items})
    progress.start(f"reclaiming {len(pids)} process(es) on {host}: SIGTERM sent", f"SIGKILL after {grace_s:.0f} s, then NVML verifies")
    # the reclaim `gpudeck reclaim HOST:PID ...` runs (ops.stop.reclaim): a host's error comes back as its message
    [(_host, res)] = await deck(screen).ops.reclaim({host: pids}, grace_s, include_live)
    if isinstance(res, str):
        progress.finish(f"reclaim failed: {res}", style="bold red")
        await screen.app.push_screen_wait(ResultDialog(f"Reclaim on {host} failed", Text(res, style="red")))
        return None
    progress.finish(
        f"reclaim on {host}: {res.state}, {gib(res.freed_bytes)} GiB freed in {res.seconds:.2f} s"
        + (f", {len(res.survivors)} SURVIVED" if res.survivors else ""),
        style="bold red" if res.survivors else "green",
    )
    await screen.app.push_screen_wait(ResultDialog(f"Reclaimed on {host}", stop_result_text(res)))
    return res
