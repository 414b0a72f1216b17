"""A launch reads its argv once (issue 21): the plan's one parse is what pre-flight, the estimate and the fingerprint use."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpudeck.agents.observe.gpus_sim import SimulatedGpuSampler
from gpudeck.agents.observe.procs import ProcTable
from gpudeck.agents.runs import launch
from gpudeck.agents.runs.supervisor import Supervisor
from gpudeck.agents.safety import estimate, preflight
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.protocol import LaunchSpec


async def test_a_trainer_launch_parses_its_argv_and_its_trainer_arguments_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"argv": 0, "trainer": 0}
    real_argv, real_trainer = estimate.parse_launch_argv, estimate.parse_trainer_args

    def count_argv(argv):  # type: ignore[no-untyped-def]
        calls["argv"] += 1
        return real_argv(argv)

    def count_trainer(trainer, args):  # type: ignore[no-untyped-def]
        calls["trainer"] += 1
        return real_trainer(trainer, args)

    for mod in (estimate, preflight, launch):  # every name the argv parser is reachable by
        monkeypatch.setattr(mod, "parse_launch_argv", count_argv)
    monkeypatch.setattr(estimate, "parse_trainer_args", count_trainer)
    procs = ProcTable(tmp_path / "runs")
    sup = Supervisor(Journal(tmp_path / "journal.db", "h"), tmp_path / "runs", "h", SimulatedGpuSampler("1", procs), procs)
    # a trainer run on a GPU this (simulated, one-GPU) host lacks: pre-flight fails, nothing is started
    spec = LaunchSpec(
        kind="fsdp",
        gpus=[5],
        argv=[sys.executable, "-m", "gpudeck.trainers.fsdp_lm", "--model-config", str(tmp_path / "nope.json"), "--fresh", "--out", "o"],
        cwd=str(tmp_path),
    )
    run, _ = await sup.launch(spec)
    assert run.state == "preflight_failed", run.cause
    assert calls == {"argv": 1, "trainer": 1}, calls
    sup.journal.close()
