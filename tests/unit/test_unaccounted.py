"""Memory no visible process explains is a holder: the PID namespace probe, the simulated GPUs that hold such memory,
pre-flight (refused, or --force recorded), the reclaim listing and the status view; and a reclaim's verification that
names what it verified (agents/observe/namespace.py, agents/safety/unaccounted.py, agents/observe/gpus_sim.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gpudeck.agents.observe import namespace
from gpudeck.agents.observe.gpus_sim import SimulatedGpuSampler, SimulatedGpuSpecError, parse_sim_spec
from gpudeck.agents.observe.procs import ProcTable
from gpudeck.agents.safety.preflight import run_preflight
from gpudeck.agents.safety.unaccounted import UNACCOUNTED_HOLDER_BYTES, holders, unaccounted
from gpudeck.agents.wire.protocol import (
    Gpu,
    GpuProcess,
    LaunchSpec,
    LeftoverList,
    NamespaceInfo,
    PreflightCheck,
    PreflightResult,
    Snapshot,
    decode_reply,
    encode,
)
from gpudeck.console.present.formats import format_leftovers, format_status

GIB = 2**30
HOST = "gpu1"
ISOLATED = NamespaceInfo(pid_namespace="isolated", container_markers=["/.dockerenv"], label="own PID namespace")
ON_HOST = NamespaceInfo(pid_namespace="host", label="host PID namespace")


def gpu(index: int, used_gib: float = 0.0, unaccounted_gib: float = 0.0, procs: list[GpuProcess] | None = None) -> Gpu:
    return Gpu(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA H200",
        memory_used=int((used_gib + unaccounted_gib) * GIB),
        memory_total=141 * GIB,
        unaccounted_bytes=int(unaccounted_gib * GIB),
        processes=procs or [],
    )


def preflight(spec: LaunchSpec, gpus: list[Gpu], ns: NamespaceInfo = ISOLATED) -> PreflightResult:
    return run_preflight(
        spec,
        host=HOST,
        gpus=gpus,
        gpu_error=None,
        ended={},
        estimate=None,
        python_check=None,
        port_free=lambda port: True,
        disk_free=lambda path: 10**15,
        now=1.8e9,
        namespace=ns,
    )


def holders_check(result: PreflightResult) -> PreflightCheck:
    return next(c for c in result.checks if c.name == "gpu_holders")


# ----------------------------------------------------------------------------- the PID namespace probe


def fake_root(tmp_path: Path, inode: int | None, nspid: str = "4242", files: dict[str, bytes] | None = None) -> Path:
    (tmp_path / "proc" / "self" / "ns").mkdir(parents=True)
    (tmp_path / "proc" / "1").mkdir(parents=True)
    if inode is not None:
        os.symlink(f"pid:[{inode}]", tmp_path / "proc" / "self" / "ns" / "pid")
    (tmp_path / "proc" / "self" / "status").write_bytes(f"Name:\tpython\nNSpid:\t{nspid}\n".encode())
    for rel, data in (files or {}).items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return tmp_path


def test_the_host_pid_namespace_is_told_by_its_fixed_inode(tmp_path: Path) -> None:
    info = namespace.detect(fake_root(tmp_path, namespace.INITIAL_PID_NS_INODE))
    assert info.pid_namespace == "host" and info.container_markers == ()
    assert info.label == "host PID namespace" and "(the host's)" in info.evidence[0]


def test_another_pid_namespace_even_where_proc_was_mounted_for_it(tmp_path: Path) -> None:
    # unshare --pid --fork --mount-proc: NSpid has one entry and pid 1 is the namespace's own, yet the inode differs
    info = namespace.detect(fake_root(tmp_path, 4026532175, nspid="3"))
    assert info.pid_namespace == "isolated"
    assert "NVML lists only this namespace's processes" in info.label


def test_nspid_with_two_levels_says_isolated_where_ns_is_unreadable(tmp_path: Path) -> None:
    info = namespace.detect(fake_root(tmp_path, None, nspid="71\t3"))
    assert info.pid_namespace == "isolated" and any("NSpid lists 2 levels" in e for e in info.evidence)


def test_container_markers_are_reported_and_the_namespace_decides(tmp_path: Path) -> None:
    files = {
        ".dockerenv": b"",
        "run/.containerenv": b"",
        "proc/1/environ": b"PATH=/bin\0container=podman\0HOME=/",
        "proc/1/cgroup": b"0::/kubepods/besteffort/pod1234/abc\n",
    }
    info = namespace.detect(fake_root(tmp_path, namespace.INITIAL_PID_NS_INODE, files=files))
    assert info.pid_namespace == "host"  # a marker alone is not a PID namespace (an image built by Docker, run in a VM)
    assert info.container_markers == (
        "/.dockerenv",
        "/run/.containerenv",
        "container=podman in pid 1's environment",
        "/proc/1/cgroup names kubepods",
    )
    assert "every GPU process is visible" in info.label


def test_nothing_readable_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    info = namespace.detect(tmp_path)
    assert info.pid_namespace == "unknown" and info.label.startswith("PID namespace unknown")


def test_this_machine_and_a_real_unshare(tmp_path: Path) -> None:
    here = namespace.detect("/")
    assert here.pid_namespace in ("host", "isolated") and here.label
    if os.geteuid() != 0 or not Path("/usr/bin/unshare").exists():
        pytest.skip("unshare --pid needs root and util-linux's unshare")
    code = "from gpudeck.agents.observe import namespace; print(namespace.detect('/').pid_namespace)"
    cp = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    if cp.returncode != 0:
        pytest.skip(f"unshare --pid refused here: {cp.stderr.strip()[:200]}")
    assert cp.stdout.strip() == "isolated"


# ----------------------------------------------------------------------------- the threshold


def test_the_threshold_and_unreported_memory() -> None:
    small = gpu(0, unaccounted_gib=0.4)
    big = gpu(1, unaccounted_gib=7.6)
    murky = gpu(2, unaccounted_gib=7.6, procs=[GpuProcess(pid=5, gpu=2, used_bytes=None)])
    got = {u.gpu: u for u in unaccounted([small, big, murky, gpu(3)], ISOLATED)}
    assert sorted(got) == [0, 1, 2]  # GPU 3 has none
    assert not got[0].holder and got[1].holder and not got[2].holder
    assert "may be theirs" in got[2].note
    assert "outside this agent's PID namespace" in got[1].note and "run gpudeck on the host" in got[1].note
    assert "/.dockerenv" in got[1].note and "nvidia-smi -r -i 1" in got[1].note
    assert [u.gpu for u in holders([small, big, murky], ON_HOST)] == [1]
    assert UNACCOUNTED_HOLDER_BYTES == GIB


# ----------------------------------------------------------------------------- the simulated GPUs


def test_the_simulated_spec_takes_unaccounted_memory() -> None:
    spec = parse_sim_spec("2:H200:141;unaccounted=0:7.5,1:2,0:0.5")
    assert spec.unaccounted == ((0, 8 * GIB), (1, 2 * GIB))
    assert parse_sim_spec(spec.text) == spec
    assert parse_sim_spec("4").unaccounted == ()
    for bad, why in [
        ("2;unaccounted=2:1", "the GPUs are 0-1"),
        ("2:H200:141;unaccounted=0:200", "at most the GPU's 141 GiB"),
        ("2;unaccounted=0:nan", "more than 0"),
        ("2;hidden=0:1", "only unaccounted="),
        ("2;unaccounted=0", "is not GPU:GiB"),
        ("2;unaccounted=", "only unaccounted="),
    ]:
        with pytest.raises(SimulatedGpuSpecError, match=why):
            parse_sim_spec(bad)


def test_the_simulated_gpus_report_it_as_held_by_no_process() -> None:
    sampler = SimulatedGpuSampler("2:H200:141;unaccounted=0:7.6", ProcTable())
    g0, g1 = sampler.sample()
    assert g0.memory_used == int(7.6 * GIB) and g0.unaccounted_bytes == int(7.6 * GIB) and g0.processes == ()
    assert g1.memory_used == 0 and g1.unaccounted_bytes == 0
    assert sampler.memory_used()[0] == int(7.6 * GIB)
    assert "held by no process" in sampler.description and g0.name.startswith("SIMULATED")


# ----------------------------------------------------------------------------- pre-flight


def test_unaccounted_memory_on_a_requested_gpu_refuses_a_plain_command() -> None:
    gpus = [gpu(0, unaccounted_gib=7.6), gpu(1)]
    res = preflight(LaunchSpec(argv=["sleep", "30"], gpus=[0]), gpus)
    c = holders_check(res)
    assert not res.ok and not c.ok and not c.overridden
    assert "GPU 0: 7.6 GiB held by no process visible to this agent" in c.message
    assert "outside this agent's PID namespace" in c.message and "--force" in c.message
    assert c.details["unaccounted"] == [{"gpu": 0, "used_bytes": int(7.6 * GIB)}] and c.details["holders"] == []
    # another GPU: nothing to say; no --gpus: the run sees every GPU, so GPU 0 counts
    assert holders_check(preflight(LaunchSpec(argv=["sleep", "30"], gpus=[1]), gpus)).ok
    assert not holders_check(preflight(LaunchSpec(argv=["sleep", "30"]), gpus)).ok


def test_force_goes_past_unaccounted_memory_and_is_recorded() -> None:
    res = preflight(LaunchSpec(argv=["sleep", "30"], gpus=[0], force=True), [gpu(0, unaccounted_gib=7.6)])
    c = holders_check(res)
    assert res.ok and res.forced and c.overridden and c.details["forced"] is True
    assert c.message.startswith("overridden with --force (recorded)") and c.details["unaccounted"][0]["gpu"] == 0


def test_with_foreign_holders_both_are_named_and_below_the_threshold_it_is_only_mentioned() -> None:
    foreign = GpuProcess(pid=77, gpu=0, used_bytes=3 * GIB, attribution="FOREIGN", user="bob", cmdline=["python"])
    c = holders_check(preflight(LaunchSpec(argv=["x"], gpus=[0]), [gpu(0, used_gib=3, unaccounted_gib=5, procs=[foreign])], ON_HOST))
    assert "1 process not of a live run holds memory and memory no visible process explains is held on GPU 0" in c.message
    assert "pid 77" in c.message and c.details["holders"][0]["pid"] == 77
    ok = holders_check(preflight(LaunchSpec(argv=["x"], gpus=[0]), [gpu(0, unaccounted_gib=0.4)]))
    assert ok.ok and "0.4 GiB held by no visible process (under the 1.0 GiB threshold)" in ok.message


# ----------------------------------------------------------------------------- reclaim listing and status, on the wire


def test_the_reclaim_listing_names_it_and_never_says_no_leftovers() -> None:
    items = unaccounted([gpu(0, unaccounted_gib=7.6)], ISOLATED)
    reply = decode_reply(encode(LeftoverList(leftovers=[], unaccounted=items)))
    assert isinstance(reply, LeftoverList) and reply.unaccounted == items
    text = format_leftovers(HOST, reply.leftovers, reply.unaccounted)
    assert "no leftovers" not in text and "no leftover process" in text
    assert "GPU 0: 7.6 GiB UNACCOUNTED, held by no process visible to this agent" in text
    assert "outside this agent's PID namespace" in text
    assert "no leftovers" in format_leftovers(HOST, [], [])


def test_status_shows_the_holder_and_the_namespace() -> None:
    g = gpu(0, unaccounted_gib=7.6)
    snap = Snapshot(host=HOST, ts=1.8e9, epoch="e", gpus=[g], namespace=ISOLATED, unaccounted=unaccounted([g], ISOLATED))
    text = format_status(decode_reply(encode(snap)))  # type: ignore[arg-type]
    assert "PID NAMESPACE: own PID namespace" in text
    assert "GPU 0: 7.6 GiB UNACCOUNTED" in text and "7.6" in text.splitlines()[3]


def test_an_older_peer_decodes_the_new_fields_away() -> None:
    """Fields were added with defaults only: a reply without them decodes, and one with them decodes where a struct
    lacks them (msgspec drops unknown fields)."""
    old = b'{"type":"leftover_list","request_id":"1","leftovers":[],"gpus":[]}\n'
    reply = decode_reply(old)
    assert isinstance(reply, LeftoverList) and reply.unaccounted == []

    class OldLeftoverList(msgspec.Struct, tag="leftover_list", tag_field="type", kw_only=True):
        request_id: str = ""
        leftovers: list[dict] = []
        gpus: list[dict] = []
        gpu_error: str | None = None

    new = encode(LeftoverList(request_id="2", unaccounted=unaccounted([gpu(0, unaccounted_gib=7.6)], ISOLATED)))
    assert msgspec.json.decode(new, type=OldLeftoverList).request_id == "2"
