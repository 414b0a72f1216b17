"""A launch racing the supervision tick: the run must stay supervised (found by the fleet soak: lost -> running, untracked)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gpudeck.agents.observe.gpus_sim import SimulatedGpuSampler
from gpudeck.agents.observe.procs import ProcTable
from gpudeck.agents.runs.supervisor import Supervisor
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.protocol import LaunchSpec


async def test_a_slow_spawn_racing_the_tick_still_ends_as_the_run_really_ended(tmp_path: Path) -> None:
    procs = ProcTable(tmp_path / "runs")
    sup = Supervisor(Journal(tmp_path / "journal.db", "h"), tmp_path / "runs", "h", SimulatedGpuSampler("1", procs), procs)
    real_spawn = sup.spawn_shim

    def slow_spawn(run, env):  # type: ignore[no-untyped-def]
        time.sleep(1.0)  # the thread is slow to report the pid (a loaded machine)
        return real_spawn(run, env)

    sup.spawn_shim = slow_spawn  # type: ignore[method-assign]

    async def ticks() -> None:
        while True:
            sup.refresh()
            await asyncio.sleep(0.02)

    ticker = asyncio.ensure_future(ticks())
    try:
        run, _ = await sup.launch(LaunchSpec(argv=["sleep", "0.5"], cwd=str(tmp_path)))
        assert run.id in {r.id for r in sup.live_runs()}, "the run is supervised right after its launch"
        deadline = time.monotonic() + 20
        while sup.run_state(run.id) not in ("succeeded", "failed", "lost", "ended") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        ticker.cancel()
    final = sup.journal.get_run(run.id)
    assert final is not None and final.state == "succeeded", final
    states = [e.data.get("state") for e in sup.journal.events_after(0) if e.run_id == run.id and e.kind == "run_state"]
    assert states == ["running", "succeeded"], states
