"""Containers seen from the host, end to end: real processes placed in real cgroups named as each runtime names
them (cgroup v2, and v1's name=systemd hierarchy where the host mounts one), holding SIMULATED GPU memory, read back
through a real agent: ``gpudeck status`` (the CONTAINER column, ``--json``), reclaim's listing and its
confirmation. Root on the test machine; every group made here is removed after its processes are killed by pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from gpudeck.agents.observe import containers
from gpudeck.agents.observe.procs import YOUNG_S, ProcTable
from gpudeck.agents.safety.containment import cgroup2_mount
from gpudeck.agents.wire.protocol import Container, GetSnapshot, GpuProcess
from gpudeck.console.present.formats import container_cell
from gpudeck.console.tui.screens.reclaim import ReclaimItem, reclaim_body
from tests.agent_harness import AgentProc, kill_pids, simulated_agent, wait_for

A = "a1" * 32
B = "b2" * 32
C = "c3" * 32
D = "d4" * 32
UID = "8c1f3c5e-6f1a-4f0e-9a57-0c3b2e0d1f42"
EVIL = "lxc.payload.ev\x1b[31mil $(x)"
PLACE = "import os, sys\nfor d in sys.argv[1:]:\n    open(d + '/cgroup.procs', 'w').write(str(os.getpid()))\nos.execvp('sleep', ['sleep', '300'])\n"


def _v1_systemd() -> str | None:
    """Where a cgroup v1 name=systemd hierarchy is mounted (hybrid hosts), or None."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                if right.startswith("cgroup ") and "name=systemd" in right.split()[-1].split(","):
                    return left.split()[4]
    except OSError:
        pass
    return None


def why_not() -> str | None:
    """Why this machine cannot run these tests (not root, no writable cgroup v2), or None."""
    if os.geteuid() != 0:
        return "needs root (the test makes cgroups and moves processes into them)"
    mount = cgroup2_mount()
    if mount is None:
        return "no cgroup v2 mounted here"
    probe = Path(mount) / f"gpudeck-test-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot make a cgroup under {mount}: {exc}"
    return None


pytestmark = pytest.mark.skipif(why_not() is not None, reason=str(why_not()))


class Groups:
    """cgroups made under one test folder per hierarchy, and the processes placed in them; all undone by ``close``."""

    def __init__(self) -> None:
        tag = f"gpudeck-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.v2 = Path(cgroup2_mount() or "/nonexistent") / tag
        v1 = _v1_systemd()
        self.v1 = Path(v1) / tag if v1 else None
        self.made: list[Path] = []
        self.procs: list[subprocess.Popen] = []

    def make(self, rel: str, v1: bool = False) -> Path:
        """The group ``rel`` under this test's folder of the v2 (or the v1 name=systemd) hierarchy, made as needed."""
        base = self.v1 if v1 else self.v2
        assert base is not None
        parts = [p for p in rel.split("/") if p]
        for d in [base, *(base.joinpath(*parts[: i + 1]) for i in range(len(parts)))]:
            if not d.exists():
                d.mkdir()
                self.made.append(d)
        return base.joinpath(*parts)

    def start(self, env: dict[str, str], *groups: Path) -> subprocess.Popen:
        """A sleep placed in ``groups`` (one per hierarchy) before it executes, as a runtime places its processes."""
        p = subprocess.Popen([sys.executable, "-c", PLACE, *map(str, groups)], env=env, stdout=subprocess.DEVNULL)
        self.procs.append(p)
        wait_for(lambda: _comm(p.pid) == "sleep", timeout=30, what=f"pid {p.pid} placed and executing sleep")
        return p

    def close(self) -> None:
        kill_pids([p.pid for p in self.procs])
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for d in sorted(self.made, key=lambda x: len(x.parts), reverse=True):
            for _ in range(50):  # a killed process leaves its group a moment after it is reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.fixture
def groups() -> Iterator[Groups]:
    g = Groups()
    yield g
    g.close()
    assert not g.v2.exists(), f"{g.v2} was left behind"


@pytest.fixture
def runtime_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The runtimes' own files, as Docker, Podman, Proxmox and the kubelet write them, in a tree the agent reads."""
    root = tmp_path / "root"
    (root / f"var/lib/docker/containers/{A}").mkdir(parents=True)
    (root / f"var/lib/docker/containers/{A}/config.v2.json").write_text(json.dumps({"ID": A, "Name": "/trainer", "State": {}}))
    (root / "var/lib/containers/storage/overlay-containers").mkdir(parents=True)
    (root / "var/lib/containers/storage/overlay-containers/containers.json").write_text(json.dumps([{"id": C, "names": ["podtrain"]}]))
    (root / "etc/pve/lxc").mkdir(parents=True)
    (root / "etc/pve/lxc/200.conf").write_text("arch: amd64\nhostname: gpu-box\n")
    (root / f"var/log/pods/ml_trainer-7d9f_{UID}").mkdir(parents=True)
    (root / "var/log/containers").mkdir(parents=True)
    (root / f"var/log/containers/trainer-7d9f_ml_worker-{D}.log").write_text("")
    monkeypatch.setenv(containers.ROOT_ENV, str(root))
    return root


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch, runtime_root: Path) -> Iterator[AgentProc]:
    yield from simulated_agent(gpudeck_home, monkeypatch, "2:H200:141")


def test_every_runtime_s_group_names_its_gpu_holder_in_status_json_reclaim_and_its_confirmation(
    sim_agent: AgentProc, groups: Groups
) -> None:
    a = sim_agent
    env = dict(a.env, GPUDECK_SIM_GPU_MEM="0:2")
    pod = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice"
    layouts = {
        "docker:trainer": [groups.make(f"system.slice/docker-{A}.scope")],
        f"docker:{B[:12]}": [groups.make(f"docker/{B}")],  # the cgroupfs driver; no config for it: the id shows
        "podman:podtrain": [groups.make(f"machine.slice/libpod-{C}.scope/container")],
        "lxc:web1": [groups.make("lxc.payload.web1")],
        "lxc:200(gpu-box)": [groups.make("lxc/200/ns/init.scope")],  # Proxmox: the VMID, its hostname from the conf
        "k8s:ml/trainer-7d9f/worker": [groups.make(f"{pod}/cri-containerd-{D}.scope")],
        "-": [groups.make("system.slice/sshd.service")],  # a host process: no container
        "lxc:ev\\x1b\\x5b31mil\\x20\\x24\\x28x\\x29": [groups.make(EVIL)],  # a hostile name, escaped
    }
    if groups.v1 is not None:  # a hybrid host: the v1 name=systemd hierarchy says it, the unified one does not
        layouts["docker:trainer(v1)"] = [groups.make(f"docker/{A}", v1=True)]
    started = {label: groups.start(env, *dirs) for label, dirs in layouts.items()}
    pids = {label: p.pid for label, p in started.items()}
    # kernels since 4.6 refuse a group name holding a newline (it would spoof a line of /proc/PID/cgroup)
    with pytest.raises(OSError):
        (groups.v2 / f"x\n0::/docker/{A}").mkdir()

    def placed() -> bool:
        snap = a.ask(GetSnapshot())
        seen = {p["pid"]: p for g in snap["gpus"] for p in g.get("processes", [])}
        return all(pid in seen and (label == "-" or seen[pid].get("container")) for label, pid in pids.items())

    wait_for(placed, timeout=60, what="every placed process as a GPU holder with its container")
    js = a.cli_json("status", "--host", "local")
    by_pid = {p["pid"]: p for g in js["gpus"] for p in g.get("processes", [])}
    for label, pid in pids.items():
        got = by_pid[pid]["container"]
        if label == "-":
            assert got is None, got
        else:
            assert got is not None, (label, by_pid[pid])
            assert Container(**got).label() == label.removesuffix("(v1)"), (label, got)
    k8s = by_pid[pids["k8s:ml/trainer-7d9f/worker"]]["container"]
    assert k8s == {
        "runtime": "kubernetes",
        "id": D,
        "name": "worker",
        "engine": "containerd",
        "pod_uid": UID,
        "pod": "trainer-7d9f",
        "namespace": "ml",
    }
    assert by_pid[pids["docker:trainer"]]["container"] == {"runtime": "docker", "id": A, "name": "trainer"}

    text = a.cli("status", "--host", "local").stdout
    print(text)
    header = next(line for line in text.splitlines() if line.startswith("PID"))
    assert header.split()[7] == "CONTAINER", header
    for label, pid in pids.items():
        row = next(line for line in text.splitlines() if line.split()[:1] == [str(pid)])
        assert row.split()[7] == label.removesuffix("(v1)"), row
    assert "\x1b" not in text

    listing = a.cli_json("reclaim", "local")
    leftovers = {lo["pid"]: lo for lo in listing["leftovers"]}
    lo = leftovers[pids["docker:trainer"]]
    assert lo["kind"] == "foreign" and lo["container"]["name"] == "trainer" and lo["note"].startswith("in container docker:trainer: ")
    assert "container" not in leftovers[pids["-"]]
    shown = a.cli("reclaim", "local").stdout
    assert "CONTAINER" in shown and "in container k8s:ml/trainer-7d9f/worker" in shown

    # the console's confirmation, built as the Host screen builds it from this very snapshot
    snap_p = msgspec.convert(by_pid[pids["podman:podtrain"]], GpuProcess)
    item = ReclaimItem(pid=snap_p.pid, who="FOREIGN", gpu_bytes={0: snap_p.used_bytes or 0}, container=container_cell(snap_p.container))
    assert f"pid {snap_p.pid}" in reclaim_body("local", [item], []).plain
    assert "in container podman:podtrain: stopped from the host, inside it" in reclaim_body("local", [item], []).plain

    done = a.cli_json("reclaim", f"local:{pids['docker:trainer']}", "--grace", "1")
    assert done[0]["stopped"][0]["pid"] == pids["docker:trainer"]
    assert started["docker:trainer"].wait(10) is not None  # it was ours: reaped here


def test_the_table_reads_a_process_s_cgroup_once_not_every_tick(
    groups: Groups, runtime_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = containers.ContainerReader(containers.ContainerNames(str(runtime_root)))
    monkeypatch.setattr(containers, "_shared", reader)
    p = groups.start(dict(os.environ), groups.make(f"system.slice/docker-{A}.scope"))
    table = ProcTable()
    young = lambda: (e := table.lookup(p.pid)) is not None and time.time() - e.create_time > YOUNG_S
    wait_for(young, timeout=10, what="the process past YOUNG_S (a young one is asked again)")
    table.refresh(full=True)
    entry = table.get(p.pid)
    assert entry is not None
    before = reader.reads
    for _ in range(50):  # fifty ticks, each asking for the container as the snapshot does
        table.refresh()
        found = table.get(p.pid)
        assert found is not None and found.read_container() == containers.Container(runtime="docker", id=A, name="trainer")
    assert reader.reads - before == 1  # the first tick read it; the forty-nine after it read nothing
    assert reader.names.file_reads == 1
