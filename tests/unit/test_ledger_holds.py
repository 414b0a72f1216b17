"""The GPU ledger's rules on a real journal (agents/observe/ledger.py): records only on change, levels by step with no
wobble, attribution changes, restart (continued or ended with evidence), compaction keeps start, peak and end, settings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpudeck.agents.observe.ledger import GIB, Ledger, LedgerSettingError, enabled_from_env, level_step, retention_from_env
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.protocol import Container, Gpu, GpuProcess

TOTAL = 80 * GIB  # step 8 GiB


def gpu(*procs: tuple[int, float], index: int = 0, unaccounted: int = 0, attribution: str = "FOREIGN", run: str | None = None) -> Gpu:
    ps = [
        GpuProcess(pid=pid, gpu=index, used_bytes=int(gib * GIB), create_time=1000.0 + pid, attribution=attribution, run_id=run)  # type: ignore[arg-type]
        for pid, gib in procs
    ]
    return Gpu(index=index, uuid=f"GPU-SIM-{index}", memory_used=0, memory_total=TOTAL, processes=ps, unaccounted_bytes=unaccounted or None)


def records(j: Journal) -> list[dict]:
    j.flush()
    return [e.data for e in j.events_of_kind("gpu_hold")]


@pytest.fixture
def journal(tmp_path: Path):  # type: ignore[no-untyped-def]
    j = Journal(tmp_path / "journal.db", "h")
    yield j
    j.close()


def test_start_level_end_and_nothing_for_an_unchanged_sample(journal: Journal) -> None:
    led = Ledger(journal)
    assert [r[2]["change"] for r in led.observe([gpu((10, 2.0))], {}, now=100.0)] == ["start"]
    for t in range(5):  # unchanged, and wobbling by less than a step: no record
        assert led.observe([gpu((10, 2.0 + (t % 2) * 7.5))], {}, now=101.0 + t) == []
    assert [r[2]["change"] for r in led.observe([gpu((10, 10.5))], {}, now=110.0)] == ["level"]
    assert led.observe([gpu((10, 12.0))], {}, now=111.0) == []  # 1.5 GiB from the last record: under the 8 GiB step
    assert [r[2]["change"] for r in led.observe([gpu()], {}, now=120.0)] == ["end"]
    got = records(journal)
    assert [d["change"] for d in got] == ["start", "level", "end"]
    assert len({d["hold"] for d in got}) == 1 and all(d["started"] == 100.0 for d in got)
    assert got[-1]["peak"] == int(12.0 * GIB) and got[1]["bytes"] == int(10.5 * GIB)
    assert got[0]["pid"] == 10 and got[0]["uuid"] == "GPU-SIM-0" and got[0]["attribution"] == "FOREIGN"


def test_level_step_is_a_gib_or_a_tenth_of_the_gpu() -> None:
    assert level_step(80 * GIB) == 8 * GIB and level_step(4 * GIB) == GIB and level_step(0) == GIB


def test_unaccounted_memory_is_a_holder_and_attribution_changes_are_recorded(journal: Journal) -> None:
    led = Ledger(journal)
    led.observe([gpu((10, 4.0), attribution="RUN", run="r-1")], {0: 3 * GIB}, now=1.0)
    got = led.observe([gpu((10, 4.0), attribution="STALE", run="r-1")], {0: 3 * GIB}, now=2.0)
    assert [(k, rid, d["change"], d["attribution"]) for k, rid, d in got] == [("gpu_hold", "r-1", "attribution", "STALE")]
    led.observe([gpu((10, 4.0), attribution="STALE", run="r-1")], {}, now=3.0)
    got = records(journal)
    un = [d for d in got if d["attribution"] == "UNACCOUNTED"]
    assert [d["change"] for d in un] == ["start", "end"] and "pid" not in un[0] and un[0]["bytes"] == 3 * GIB


def test_restart_continues_a_hold_still_held_and_ends_one_gone_with_evidence(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal.db", "h")
    led = Ledger(j)
    led.observe([gpu((10, 2.0), (11, 5.0))], {}, now=100.0)
    first = {d["pid"]: d["hold"] for d in records(j)}
    written = j.events_of_kind("gpu_hold")[-1].ts
    j.close()  # the agent is gone (no end written)
    j = Journal(tmp_path / "journal.db", "h")
    try:
        led = Ledger(j)
        got = led.observe([gpu((10, 2.0))], {}, now=200.0)
        by_pid = {d["pid"]: d for _k, _r, d in got}
        assert by_pid[10]["change"] == "continued" and by_pid[10]["hold"] == first[10] and by_pid[10]["started"] == 100.0
        assert by_pid[11]["change"] == "end" and by_pid[11]["hold"] == first[11] and by_pid[11]["last_seen"] == written
        assert "restarted" in by_pid[11]["evidence"]
        assert led.observe([gpu((10, 2.0))], {}, now=201.0) == []
    finally:
        j.close()


def test_compaction_keeps_start_peak_and_end_and_leaves_no_gap(journal: Journal) -> None:
    led = Ledger(journal, retention_s=50.0)
    for t, gib in enumerate([1, 10, 20, 40, 30, 20, 10]):
        led.observe([gpu((10, gib))], {}, now=float(t))
    led.observe([gpu()], {}, now=10.0)
    journal.flush()
    before = [e.seq for e in journal.events_after(0)]
    assert [d["change"] for d in records(journal)] == ["start", "level", "level", "level", "level", "level", "level", "end"]
    assert led.compact(now=time.time()) == 0  # nothing older than the retention yet (records carry the journal's time)
    assert led.compact(now=time.time() + 100.0) == 5
    journal.flush()
    kept = records(journal)
    assert [(d["change"], d["bytes"] // GIB) for d in kept] == [("start", 1), ("level", 40), ("end", 10)]
    assert [e.seq for e in journal.events_after(0)] == before  # voided in place: seqs stay gapless
    assert sum(1 for e in journal.events_after(0) if e.kind == "void") == 5


def test_settings_are_read_with_typed_errors() -> None:
    assert enabled_from_env({}) and not enabled_from_env({"GPUDECK_LEDGER": "off"})
    with pytest.raises(LedgerSettingError, match="GPUDECK_LEDGER='maybe'"):
        enabled_from_env({"GPUDECK_LEDGER": "maybe"})
    assert retention_from_env({"GPUDECK_LEDGER_RETENTION_DAYS": "0.5"}) == 43200
    for bad in ("-1", "x", "nan", "1e9"):
        with pytest.raises(LedgerSettingError, match="GPUDECK_LEDGER_RETENTION_DAYS"):
            retention_from_env({"GPUDECK_LEDGER_RETENTION_DAYS": bad})


def test_an_off_ledger_records_nothing(journal: Journal) -> None:
    led = Ledger(journal, enabled=False)
    assert led.observe([gpu((10, 2.0))], {}, now=1.0) == [] and records(journal) == []


def test_an_idle_sample_that_looks_the_same_is_not_attributed_again_until_a_tick_with_runs(journal: Journal) -> None:
    led = Ledger(journal)
    raw = [gpu((10, 2.0))]
    assert not led.unchanged(raw)  # the first look is attributed
    led.observe(raw, {}, idle=True)
    assert led.unchanged([gpu((10, 2.0))])
    assert not led.unchanged([gpu((10, 3.0))], remember=False)  # a look at another's sample: not remembered
    assert not led.unchanged([gpu((10, 3.0))])  # bytes moved: attributed (no record yet: under a step)
    assert not led.unchanged([gpu((10, 3.0), (11, 1.0))])  # another holder
    led.observe([gpu((10, 3.0), (11, 1.0))], {}, idle=False)  # a tick with a live run
    assert not led.unchanged([gpu((10, 3.0), (11, 1.0))])  # after it, the next idle look is attributed in full


def test_a_holders_container_is_recorded_from_its_attribution(journal: Journal) -> None:
    led = Ledger(journal)
    box = Container(runtime="docker", id="0123abcd" * 8, name="trainer")
    p = GpuProcess(pid=10, gpu=0, used_bytes=2 * GIB, create_time=1010.0, container=box)
    g = Gpu(index=0, uuid="GPU-SIM-0", memory_used=0, memory_total=TOTAL, processes=[p])
    (item,) = led.observe([g], {}, now=1.0)
    assert item[2]["container"] == {"runtime": "docker", "id": "0123abcd" * 8, "name": "trainer"}
    (plain,) = led.observe([g, gpu((11, 2.0), index=1)], {}, now=2.0)  # no container: the field is left out
    assert "container" not in plain[2]


def test_a_container_learned_after_the_start_is_journaled_once_as_an_attribution_record(journal: Journal) -> None:
    """A process that held memory before its runtime placed it (its first samples show no container) gets one
    attribution record carrying the container when it is learned; later samples that show the same write nothing."""
    led = Ledger(journal)
    box = Container(runtime="docker", id="0123abcd" * 8, name="trainer")
    bare = GpuProcess(pid=10, gpu=0, used_bytes=2 * GIB, create_time=1010.0)
    placed = GpuProcess(pid=10, gpu=0, used_bytes=2 * GIB, create_time=1010.0, container=box)

    def g(p: GpuProcess) -> Gpu:
        return Gpu(index=0, uuid="GPU-SIM-0", memory_used=0, memory_total=TOTAL, processes=[p])

    (start,) = led.observe([g(bare)], {}, now=1.0)
    assert start[2]["change"] == "start" and "container" not in start[2]
    (learned,) = led.observe([g(placed)], {}, now=2.0)
    assert learned[2]["change"] == "attribution" and learned[2]["hold"] == start[2]["hold"]
    assert learned[2]["container"] == {"runtime": "docker", "id": "0123abcd" * 8, "name": "trainer"}
    assert led.observe([g(placed)], {}, now=3.0) == []
    assert led.observe([g(bare)], {}, now=4.0) == []  # a sample that lost it does not unlearn it
    (end,) = led.observe([], {}, now=5.0)
    assert end[2]["container"]["name"] == "trainer"
