"""Hang and straggler rules over fake time, the telemetry they read, and the triage's stack parsing and culprit line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpudeck.agents.health import flight_recorder as fr
from gpudeck.agents.health.rules import HANG_AFTER_S, STRAGGLER_WINDOW, Observation, RunHealth, hang_threshold
from gpudeck.agents.health.triage import Target, collect, culprit, parse_faulthandler, parse_py_spy
from gpudeck.agents.observe.telemetry import TelemetryTail
from gpudeck.agents.wire.protocol import LaunchSpec, RankEvidence, RankTelemetry, RunInfo, RunTelemetry

T0 = 1_700_000_000.0


def make_run(**spec: object) -> RunInfo:
    return RunInfo(
        id="r-hang0001",
        host="h1",
        state="running",
        started=T0,
        spec=LaunchSpec(argv=["torchrun", "train.py"], **spec),  # type: ignore[arg-type]
        telemetry=RunTelemetry(world_size=4, ranks={str(r): RankTelemetry(rank=r, pid=100 + r) for r in range(4)}),
    )


def obs(run: RunInfo, now: float) -> Observation:
    return Observation(now=now, run=run, live_ranks={r: 100 + r for r in range(4)}, gpu_uuids={5: "GPU-five"}, gpu_util={5: 90})


# ----------------------------------------------------------------------------- hang


def test_hang_threshold_is_5_median_steps_or_the_floor() -> None:
    run = make_run()
    assert run.telemetry is not None
    assert hang_threshold(run) == HANG_AFTER_S == 120.0
    run.telemetry.step_period_s = 40.0
    assert hang_threshold(run) == 200.0
    assert hang_threshold(make_run(hang_after_s=3.0)) == 3.0


def test_hang_raised_at_the_threshold_and_cleared_by_the_next_step() -> None:
    run = make_run(hang_after_s=10.0)
    tel = run.telemetry
    assert tel is not None
    h = RunHealth(run.id)
    assert h.update(obs(run, T0)) == []  # no step yet: still starting up, never a hang
    tel.step, tel.last_step_ts, tel.step_period_s = 7, T0 + 1, 0.5
    assert h.update(obs(run, T0 + 10.9)) == []
    got = h.update(obs(run, T0 + 11.2))
    assert [a.kind for a in got] == ["hang"] and got[0].severity == "critical"
    a = got[0]
    assert a.message.startswith("no step for 10 s (hang threshold 10 s: max(5 x median step 0.50 s, 10 s)) after step 7 with 4 ranks alive")
    assert "gathering every rank's stacks now" in a.message and a.data["on_hang"] == "triage" and h.hung is a
    assert h.update(obs(run, T0 + 20)) == []  # raised once
    tel.step, tel.last_step_ts = 8, T0 + 21
    h.update(obs(run, T0 + 21.5))
    assert h.hung is None and [c.kind for c in h.cleared_since_last()] == ["hang"]


def test_no_hang_while_stopping_or_when_alert_only_says_how_to_triage() -> None:
    run = make_run(hang_after_s=5.0, on_hang="alert")
    assert run.telemetry is not None
    run.telemetry.step, run.telemetry.last_step_ts = 3, T0
    h = RunHealth(run.id)
    stopping = Observation(now=T0 + 60, run=run, live_ranks={0: 100}, stopping=True)
    assert h.update(stopping) == []
    got = h.update(obs(run, T0 + 60))
    assert "`gpudeck triage r-hang0001` gathers every rank's stacks" in got[0].message


# ----------------------------------------------------------------------------- stragglers


def test_straggler_named_with_host_and_gpu_and_cleared_on_recovery() -> None:
    run = make_run()
    tel = run.telemetry
    assert tel is not None
    for r in range(4):
        tel.ranks[str(r)].host = f"node{r // 2}"
    tel.ranks["2"].gpu_uuid = "GPU-five"
    h = RunHealth(run.id)
    for r in range(4):
        tel.ranks[str(r)].compute_recent = [0.10] * (STRAGGLER_WINDOW - 1)
    assert h.update(obs(run, T0)) == []  # a window not full yet
    for r in range(4):
        tel.ranks[str(r)].compute_recent = [0.10] * STRAGGLER_WINDOW
    tel.ranks["2"].compute_recent = [0.128] * STRAGGLER_WINDOW  # 1.28x: under the line
    assert h.update(obs(run, T0 + 1)) == []
    tel.ranks["2"].compute_recent = [0.10] * 3 + [0.14] * (STRAGGLER_WINDOW - 3)
    got = h.update(obs(run, T0 + 2))
    assert [(a.kind, a.rank, a.gpu) for a in got] == [("straggler", 2, 5)]
    assert got[0].message.startswith("rank 2 on node1 (GPU 5) is a straggler: it computes 140 ms a step, 1.40x the 100 ms median")
    assert got[0].data["host"] == "node1" and got[0].pid == 102
    tel.ranks["2"].compute_recent = [0.10] * STRAGGLER_WINDOW
    h.update(obs(run, T0 + 3))
    assert h.active == [] and [(c.kind, c.rank) for c in h.cleared_since_last()] == [("straggler", 2)]


def test_telemetry_fold_keeps_step_period_last_step_time_and_compute_split(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.jsonl"
    lines = [{"ts": T0, "rank": 0, "type": "manifest", "pid": 100, "host": "n1", "stack_signal": "SIGUSR2"}]
    for step in range(1, 6):
        for rank in (0, 1):
            lines.append(
                {"ts": T0 + step * 2.0 + rank * 0.01, "rank": rank, "type": "step", "step": step, "compute_s": 0.5 + rank, "wait_s": 0.1}
            )
    lines.append({"ts": T0 + 11, "rank": 1, "type": "step", "step": 6, "compute_s": -1})  # a negative time is no sample
    lines.append({"ts": T0 + 12, "rank": 1, "type": "step", "step": 7, "wait_s": "x"})  # a mistyped one: the line is refused
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tail = TelemetryTail(path)
    tail.poll()
    s = tail.summary
    assert s.last_step_ts == T0 + 11 and s.step_period_s == 2.0
    assert s.ranks["0"].host == "n1" and s.ranks["0"].stack_signal == "SIGUSR2"
    assert s.ranks["1"].compute_recent == [1.5] * 5 and s.ranks["1"].wait_recent == [0.1] * 5 and s.bad_lines == 1


# ----------------------------------------------------------------------------- stacks and the culprit

FAULTHANDLER = """Thread 0x00007f1c2b7fe6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/x/gpudeck/trainers/telemetry.py", line 88 in beat

Current thread 0x00007f1c3a1f4740 (most recent call first):
  File "/x/gpudeck/trainers/diagnostics.py", line 150 in maybe_sleep_for_test
  File "/x/gpudeck/trainers/fsdp_lm.py", line 927 in main
"""

PY_SPY = """Process 4242: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    wait (torch/distributed/distributed_c10d.py:2811)
    all_reduce (torch/distributed/distributed_c10d.py:2790)
    reduce_mean_and_stop (gpudeck/trainers/runtime.py:430)
    main (gpudeck/trainers/fsdp_lm.py:960)
Thread 4250 (idle): "gpudeck-heartbeat"
    wait (threading.py:331)
"""


def test_stacks_parse_with_the_main_thread_last() -> None:
    fh = parse_faulthandler(FAULTHANDLER)
    assert [len(f) for _, f in fh] == [2, 2] and fh[-1][1][0].func == "maybe_sleep_for_test" and fh[-1][1][0].line == 150
    spy = parse_py_spy(PY_SPY, 4242)
    assert spy[-1][0] == "MainThread" and [f.func for f in spy[-1][1]][:2] == ["wait", "all_reduce"]


def test_culprit_names_the_rank_outside_the_collective() -> None:
    def ev(rank: int, where: str, coll: bool, state: str = "sleeping") -> RankEvidence:
        return RankEvidence(rank=rank, pid=100 + rank, host="h1", state=state, where=where, in_collective=coll, method="faulthandler")

    evs = [ev(r, "in all_gather_into_tensor: `work.wait()` at x.py:1 (wait)", True) for r in (0, 1, 3)]
    evs.insert(2, ev(2, "`time.sleep(seconds)` at diagnostics.py:150 (maybe_sleep_for_test)", False))
    assert culprit(evs) == (
        "rank 2 on h1 is stuck in `time.sleep(seconds)` at diagnostics.py:150 (maybe_sleep_for_test); "
        "every other rank waits in all_gather_into_tensor"
    )
    evs[2] = ev(2, "", False, state="stopped")
    evs[2].in_collective = None
    assert culprit(evs).startswith("rank 2 on h1 is stopped (state T")
    assert culprit([ev(r, "in all_reduce: x", True) for r in range(2)]).startswith(
        "every rank here (rank 0 and rank 1) waits in all_reduce: "
    )


def test_collect_without_a_manifest_uses_py_spy_and_never_signals(tmp_path: Path) -> None:
    code = "import time\ndef stuck():\n    time.sleep(60)\nprint('ready', flush=True)\nstuck()\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        import psutil

        ct = psutil.Process(p.pid).create_time()
        t0 = time.monotonic()
        (ev,) = collect([Target(rank=None, pid=p.pid, create_time=ct, host="h1")], str(tmp_path), [])
        assert time.monotonic() - t0 < 30
        assert p.poll() is None  # still running: nothing was signalled
        assert ev.state == "sleeping" and ev.cpu_percent is not None and ev.cpu_percent < 50
        assert "not a gpudeck trainer" in ev.method_why
        if ev.method == "py-spy":
            assert "stuck" in ev.stacks and ev.in_collective is False and "`time.sleep(60)` at <string>" not in ev.where
        else:  # no ptrace here: said, with what to do
            assert ev.method == "none" and "py-spy" in ev.method_why
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()


def test_collective_clock_times_waits_on_cpu_and_reports_nothing_on_cuda() -> None:
    import pytest

    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from gpudeck.trainers.common.diagnostics import CollectiveClock

    assert CollectiveClock(on_cuda=True).split(1.0, (0.0, 0)) == {}
    os.environ["GPUDECK_COMPUTE_TIMING"] = "0"
    try:
        from gpudeck.trainers.common.diagnostics import NoClock, step_clock

        assert isinstance(step_clock(False), NoClock)
    finally:
        del os.environ["GPUDECK_COMPUTE_TIMING"]
    clock = CollectiveClock(on_cuda=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        start = clock.mark()
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
        got = clock.split(0.5, start)
    finally:
        dist.destroy_process_group()
    assert got["waits"] == 3 and 0 <= got["wait_s"] < 0.5 and got["compute_s"] == round(0.5 - got["wait_s"], 5)


def _fr_dump(rank: int, pid: int, nonce: str, done: int, inflight: int | None) -> dict:
    entries = [
        {"collective_seq_id": i, "pg_id": 0, "process_group": ["0", "default_pg"], "profiling_name": "gloo:all_reduce", "retired": True}
        for i in range(1, done + 1)
    ]
    if inflight is not None:
        entries.append(
            {
                "collective_seq_id": inflight,
                "pg_id": 0,
                "process_group": ["0", "default_pg"],
                "profiling_name": "gloo:all_gather",
                "retired": False,
            }
        )
    return {"nonce": nonce, "rank": rank, "pid": pid, "entries": entries}


def test_flight_recorder_request_read_and_summary_name_the_rank_behind(tmp_path: Path) -> None:
    folder = tmp_path / "flight_recorder"
    folder.mkdir()
    nonce = fr.request(str(tmp_path))
    assert nonce is not None and (folder / "request").read_text() == nonce
    for rank in (0, 1, 3):
        (folder / f"rank{rank}.{100 + rank}.json").write_text(json.dumps(_fr_dump(rank, 100 + rank, nonce, 57, 58)))
    (folder / "rank2.102.json").write_text(json.dumps(_fr_dump(2, 102, nonce, 57, None)))
    dumps = fr.collect(str(tmp_path), [(r, 100 + r) for r in range(4)], nonce, wait_s=0.5)
    line = fr.summarise(dumps, range(4))
    assert line == (
        "Flight Recorder (default_pg): rank 2 last completed gloo:all_reduce seq 57; "
        "ranks 0, 1 and 3 are in seq 58 (gloo:all_gather): rank 2 is behind"
    ), line
    # hostile files: a stale nonce, an unknown field, a link, an oversized file: none is taken; each refused one says why
    (folder / "rank0.100.json").write_text(json.dumps(_fr_dump(0, 100, "old", 57, 58)))
    (folder / "rank1.101.json").write_text(json.dumps({**_fr_dump(1, 101, nonce, 1, None), "extra": [[[[1]]]]}))
    (folder / "rank2.102.json").unlink()
    (folder / "rank2.102.json").symlink_to(folder / "rank3.103.json")
    (folder / "rank3.103.json").write_bytes(b" " * (fr.MAX_DUMP_BYTES + 1))
    dumps = fr.collect(str(tmp_path), [(r, 100 + r) for r in range(4)], nonce, wait_s=0.2)
    assert sorted(dumps) == [1, 2, 3] and "over the" in str(dumps[3]), dumps
    assert "does not decode" in str(dumps[1]) and "symbolic link" in str(dumps[2]), dumps
    line = fr.summarise(dumps, range(4))
    assert line.startswith("Flight Recorder: no dump from rank 0 within"), line
    assert "rank 1: its dump does not decode" in line and "rank 2: its dump is a symbolic link" in line, line
    # a request folder that is a link is not written through
    (tmp_path / "elsewhere").mkdir()
    folder.rename(tmp_path / "old_fr")
    folder.symlink_to(tmp_path / "elsewhere")
    assert fr.request(str(tmp_path)) is None and not (tmp_path / "elsewhere" / "request").exists()


class _HostEvent:
    """A stand-in for torch.cuda.Event on CPU: the host's clock at record(), for the bracket arithmetic."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _HostEvent) -> float:
        return 1000.0 * (end.t - self.t)


def test_cuda_compute_clock_subtracts_fsdp_stalls_and_reports_a_step_late(monkeypatch) -> None:
    """CudaComputeClock's plumbing on CPU: FSDP2's wait points are bracketed (a real 1-rank fully_shard step),
    a stall's time is wait_s, not compute_s, and step N's record carries step N-1's figures."""
    import pytest

    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gpudeck.trainers.common.diagnostics import CudaComputeClock

    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setenv("GPUDECK_COMPUTE_TIMING", "every:1")  # every step timed here (the default is one in four)
    clock = CudaComputeClock()
    assert clock.patched == [
        "FSDPParamGroup.wait_for_unshard",
        "FSDPParamGroup.post_backward",
        "FSDPState._root_post_backward_final_callback",
    ]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        got = []
        for step in (1, 2, 3):
            clock.mark()
            model(torch.ones(2, 8)).sum().backward()
            with clock.stall():
                time.sleep(0.05)  # a collective wait the trainer brackets itself
            time.sleep(0.02)  # compute outside any bracket
            got.append(clock.split(0.0, None, step))
    finally:
        dist.destroy_process_group()
    assert got[0] == {}  # the first step's figures come with the second record
    for rec, timed in zip(got[1:], (1, 2), strict=True):
        assert rec["timed_step"] == timed and rec["stalls"] >= 5, rec  # 3 unshard waits (forward) + backward's + the trainer's
        assert 0.05 <= rec["wait_s"] < 0.5 and 0.02 <= rec["compute_s"] < 0.5, rec


def test_cuda_compute_clock_times_one_step_in_four_and_reports_it_with_the_next(monkeypatch) -> None:
    import pytest

    torch = pytest.importorskip("torch")
    from gpudeck.trainers.common.diagnostics import CudaComputeClock

    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.delenv("GPUDECK_COMPUTE_TIMING", raising=False)
    clock = CudaComputeClock()
    assert clock.every == 4
    got = {}
    for step in range(1, 11):
        clock.mark()
        with clock.stall():
            time.sleep(0.002)
        got[step] = clock.split(0.0, None, step)
    assert {s: r["timed_step"] for s, r in got.items() if r} == {2: 1, 6: 5, 10: 9}


def test_py_spy_error_is_its_error_line_and_first_cause_without_the_backtrace() -> None:
    from gpudeck.agents.health.triage import py_spy_error

    stderr = (
        "Error: Failed to get process executable name. Check that the process is running.\n\nCaused by:\n"
        "    0: Permission denied (os error 13)\n    1: Permission denied (os error 13)\n\nStack backtrace:\n"
        "   0: <E as anyhow::context::ext::StdError>::ext_context\n  10: main\n"
    )
    assert py_spy_error(stderr, 1) == (
        "Error: Failed to get process executable name. Check that the process is running. (Permission denied (os error 13))"
    )
    assert py_spy_error("", 3) == "exit code 3"


def test_source_line_reads_only_what_the_runs_user_could_and_follows_no_link(tmp_path) -> None:
    """A run's stack can name any path; the agent (maybe root) quotes a line only from a file that user may read."""
    import os

    from gpudeck.agents.health.access import ANYONE, Reader
    from gpudeck.agents.health.triage import source_line

    secret = tmp_path / "secret"
    secret.write_text("root-only line\n")
    os.chmod(secret, 0o600)
    public = tmp_path / "public.py"
    public.write_text("x = 1\ntime.sleep(seconds)\n")
    os.chmod(public, 0o644)
    link = tmp_path / "link.py"
    link.symlink_to(public)
    os.chmod(tmp_path, 0o755)
    me = Reader(os.getuid(), os.getgid(), frozenset(os.getgroups()))
    other = Reader(os.getuid() + 12345, os.getgid() + 12345)
    assert source_line(str(public), 2, me) == "time.sleep(seconds)"
    assert source_line(str(secret), 1, me) == "root-only line"  # the run's own file
    assert source_line(str(secret), 1, other) is None  # another user's private file
    assert source_line(str(secret), 1, ANYONE) is None
    assert source_line(str(link), 2, me) is None  # a link is not followed
    assert source_line("/dev/zero", 1, me) is None  # not a regular file
    assert source_line("relative/path.py", 1, me) is None
