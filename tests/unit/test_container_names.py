"""Containers seen from the host: every runtime's cgroup layout (v2, v1 with name=systemd, the Kubernetes drivers),
hostile group names, the names read from each runtime's own files (bounded, cached, never raising), and how the
CLI and the console show them (agents/observe/containers.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from gpudeck.agents.observe.containers import (
    CGROUP_READ_MAX,
    CONFIG_MAX,
    NAME_MAX,
    ContainerNames,
    ContainerReader,
    Place,
    parse_cgroup,
    shown,
)
from gpudeck.agents.wire.protocol import Container, Gpu, GpuProcess, Leftover, Snapshot, decode_reply, encode
from gpudeck.console.present.formats import format_leftovers, format_status
from gpudeck.console.tui.screens.reclaim import ReclaimItem, reclaim_body

A = "a" * 64
B = "0123456789abcdef" * 4
UID = "8c1f3c5e-6f1a-4f0e-9a57-0c3b2e0d1f42"
UID_ = UID.replace("-", "_")

V1 = (
    "12:pids:{p}\n11:memory:{p}\n10:devices:{p}\n9:cpu,cpuacct:{p}\n8:blkio:{p}\n7:freezer:{p}\n6:net_cls,net_prio:{p}\n"
    "5:perf_event:{p}\n4:hugetlb:{p}\n3:cpuset:{p}\n2:rdma:/\n1:name=systemd:{p}\n0::{u}\n"
)


def one(path: str) -> Place | None:
    """The place a v2-only file with this path names."""
    got = parse_cgroup(f"0::{path}\n".encode(), hierarchies=1)
    assert got.problem == "", got.problem
    return got.place


# ---------------------------------------------------------------------------------------------------- layouts


def test_docker_systemd_and_cgroupfs_drivers() -> None:
    assert one(f"/system.slice/docker-{A}.scope") == Place("docker", A)
    assert one(f"/docker/{A}") == Place("docker", A)
    assert one(f"/docker/{A}/init.scope") == Place("docker", A)


def test_podman_systemd_cgroupfs_and_rootless_and_its_monitor_is_not_the_container() -> None:
    assert one(f"/machine.slice/libpod-{A}.scope") == Place("podman", A)
    assert one(f"/machine.slice/libpod-{A}.scope/container") == Place("podman", A)  # podman 4 with --systemd
    assert one(f"/libpod_parent/libpod-{A}") == Place("podman", A)
    rootless = one(f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{A}.scope")
    assert rootless == Place("podman", A, owner_uid=1000)
    assert one(f"/machine.slice/libpod-conmon-{A}.scope") is None


def test_lxc_v1_lxc4_lxd_and_proxmox_paths_and_the_monitor_is_not_the_container() -> None:
    assert one("/lxc/web1") == Place("lxc", "web1")
    assert one("/lxc/200/ns/init.scope") == Place("lxc", "200")  # Proxmox
    assert one("/lxc.payload.web1/init.scope") == Place("lxc", "web1")  # LXC 4, LXD
    assert one("/lxc.payload/web1") == Place("lxc", "web1")
    assert one("/lxc.monitor.web1") is None
    assert one("/lxc.monitor/200") is None


@pytest.mark.parametrize(
    ("path", "engine"),
    [
        (f"/kubepods/burstable/pod{UID}/{A}", None),  # cgroupfs driver (v1 and v2)
        (f"/kubepods/pod{UID}/{A}", None),  # guaranteed QoS
        (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{A}.scope", "containerd"),
        (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{A}.scope", "cri-o"),
        (f"/kubepods.slice/kubepods-pod{UID_}.slice/docker-{A}.scope", "docker"),  # guaranteed QoS, dockershim
    ],
)
def test_kubernetes_every_driver_and_runtime(path: str, engine: str | None) -> None:
    assert one(path) == Place("kubernetes", A, engine=engine, pod_uid=UID)


def test_kubernetes_static_pod_uid_a_pod_level_process_and_the_conmon_scope() -> None:
    static = "6f1b0c7d8a3e4f5a6b7c8d9e0f1a2b3c"  # a static pod's uid is its config's hash
    assert one(f"/kubepods/burstable/pod{static}/{A}") == Place("kubernetes", A, pod_uid=static)
    assert one(f"/kubepods/burstable/pod{UID}") == Place("kubernetes", "", pod_uid=UID)
    pod = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
    assert one(f"{pod}/crio-conmon-{A}.scope") == Place("kubernetes", "", pod_uid=UID)  # the monitor: the pod, not a container
    assert one("/kubepods.slice/kubepods-burstable.slice") is None  # a QoS group names no pod


def test_no_container_for_host_processes() -> None:
    for path in (
        "/",
        "/init.scope",
        "/system.slice/sshd.service",
        "/user.slice/user-0.slice/session-3.scope",
        "/process_api/d57a15f66fa47131c057e627dac2a41f",
    ):
        assert one(path) is None, path


def test_cgroup_v1_reads_name_systemd_and_the_controllers_and_prefers_the_v2_line() -> None:
    text = V1.format(p=f"/docker/{A}", u="/")
    assert parse_cgroup(text.encode(), hierarchies=13).place == Place("docker", A)
    only_systemd = "4:memory:/\n1:name=systemd:/system.slice/docker-" + A + ".scope\n0::/\n"
    assert parse_cgroup(only_systemd.encode(), hierarchies=3).place == Place("docker", A)
    only_memory = f"4:memory:/kubepods/burstable/pod{UID}/{A}\n1:name=systemd:/\n"
    assert parse_cgroup(only_memory.encode(), hierarchies=2).place == Place("kubernetes", A, pod_uid=UID)
    both = f"1:name=systemd:/docker/{B}\n0::/system.slice/docker-{A}.scope\n"
    assert parse_cgroup(both.encode(), hierarchies=2).place == Place("docker", A)  # the unified line first


def test_the_outermost_container_of_a_nested_path_is_named() -> None:
    assert one(f"/docker/{A}/docker/{B}") == Place("docker", A)  # docker in docker: the host's runtime knows the outer one
    assert one(f"/lxc.payload.outer/system.slice/docker-{A}.scope") == Place("lxc", "outer")


# ---------------------------------------------------------------------------------------------------- hostile input


def test_a_group_name_holding_a_newline_is_not_believed() -> None:
    # kernels since 4.6 refuse such a name (tests/e2e/test_containers.py checks this one); older ones did not
    spoof = f"0::/user.slice/x\n0::/system.slice/docker-{A}.scope\n".encode()
    got = parse_cgroup(spoof, hierarchies=1)
    assert got.place is None and "newline" in got.problem
    v1 = ("1:name=systemd:/\n0::/evil\n3:memory:/docker/" + A + "\n").encode()
    assert parse_cgroup(v1, hierarchies=2).place is None


def test_malformed_lines_oversized_files_and_near_miss_ids_name_nothing() -> None:
    assert parse_cgroup(f"garbage\n0::/docker/{A}\n".encode()).problem.startswith("line 1")
    assert parse_cgroup(b"0::relative/docker/" + A.encode() + b"\n").place is None
    assert parse_cgroup(b"0::/" + b"x" * CGROUP_READ_MAX + b"\n").problem.startswith("longer")
    assert one("/docker/" + A[:63]) is None
    assert one("/docker/" + A.upper()) is None
    assert one("/system.slice/docker-" + A + "0.scope") is None
    assert one(f"/kubepods/burstable/pod{'z' * 36}/{A}") is None
    assert parse_cgroup(b"") == parse_cgroup(b"", hierarchies=1) == parse_cgroup(b"0::/\n")


def test_hostile_lxc_names_are_escaped_and_bounded() -> None:
    evil = one("/lxc.payload.\x1b[31mred $(rm -rf) \u202e")
    assert evil is not None and evil.id == "\\x1b\\x5b31mred\\x20\\x24\\x28rm\\x20-rf\\x29\\x20\\xe2\\x80\\xae"
    assert set(evil.id) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-\\")
    long = one("/lxc/" + "n" * 5000)
    assert long is not None and long.id == "n" * NAME_MAX + "..."
    raw = parse_cgroup(b"0::/lxc.payload.\xff\xfe\n", hierarchies=1).place  # not UTF-8: each byte escaped
    assert raw is not None and raw.id == "\\xff\\xfe"


def test_shown_keeps_only_the_safe_set() -> None:
    assert shown("trainer-01_a.b") == "trainer-01_a.b"
    assert shown("a/b c") == "a\\x2fb\\x20c"
    assert shown(b"x" * 100, limit=8) == "xxxxxxxx..."


# ---------------------------------------------------------------------------------------------------- names


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)  # type: ignore[operator]
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    write(
        root / f"var/lib/docker/containers/{A}/config.v2.json", json.dumps({"ID": A, "Name": "/trainer", "Config": {"Env": ["X=1"] * 50}})
    )
    write(
        root / "var/lib/containers/storage/overlay-containers/containers.json",
        json.dumps([{"id": B, "names": ["podtrain"], "image": "x"}, {"id": "short", "names": ["no"]}]),
    )
    write(root / "etc/pve/lxc/200.conf", "arch: amd64\nhostname: gpu-box\nmemory: 4096\n\n[snap1]\nhostname: old-name\n")
    (root / f"var/log/pods/ml_trainer-7d9f_{UID}").mkdir(parents=True)
    (root / "var/log/pods/kube-system_coredns-1_not-a-uid").mkdir(parents=True)
    write(root / f"var/log/containers/trainer-7d9f_ml_worker-{A}.log", "")
    write(
        root / "home/u1000/.local/share/containers/storage/overlay-containers/containers.json", json.dumps([{"id": A, "names": ["mine"]}])
    )
    return root


def names(tree: Path) -> ContainerNames:
    return ContainerNames(str(tree), home_of=lambda uid: f"/home/u{uid}")  # a home on the host: under the tree's root


def test_names_from_each_runtime_s_own_files(tree: Path) -> None:
    n = names(tree)
    assert n.container(Place("docker", A)) == Container(runtime="docker", id=A, name="trainer")
    assert n.container(Place("podman", B)).name == "podtrain"
    assert n.container(Place("podman", A, owner_uid=1000)).name == "mine"  # rootless: the user's own storage
    assert n.container(Place("lxc", "200")).name == "gpu-box"  # Proxmox's hostname, not the snapshot's
    assert n.container(Place("lxc", "web1")).name is None  # LXC/LXD: the path's name is the name
    k = n.container(Place("kubernetes", A, engine="containerd", pod_uid=UID))
    assert (k.namespace, k.pod, k.name, k.engine) == ("ml", "trainer-7d9f", "worker", "containerd")
    assert k.label() == "k8s:ml/trainer-7d9f/worker"


def test_a_user_s_group_is_never_named_from_root_s_registries(tree: Path) -> None:
    n = names(tree)
    assert n.container(Place("docker", A, owner_uid=1000)).name is None  # no rootless docker data in that home
    assert n.container(Place("lxc", "200", owner_uid=1000)).name is None
    k = n.container(Place("kubernetes", A, pod_uid=UID, owner_uid=1000))
    assert k.pod is None and k.label() == f"k8s:pod-{UID[:8]}/{A[:12]}@uid1000"


def test_names_are_cached_by_id_and_a_changed_registry_is_read_again(tree: Path) -> None:
    n = names(tree)
    for _ in range(5):
        n.container(Place("docker", A))
    assert n.file_reads == 1
    n.container(Place("podman", B))
    reads = n.file_reads
    assert n.container(Place("podman", "c" * 64)).name is None  # a miss within RELIST_S: the registry is not read again
    assert n.file_reads == reads


def test_hostile_runtime_files_give_name_unknown_never_an_exception(tree: Path) -> None:
    n = names(tree)
    ids = ["1" * 64, "2" * 64, "3" * 64, "4" * 64, "5" * 64]
    d = tree / "var/lib/docker/containers"
    write(d / ids[0] / "config.v2.json", b"\x00not json" * 10)
    write(d / ids[1] / "config.v2.json", json.dumps({"Name": 5}))
    write(d / ids[2] / "config.v2.json", json.dumps({"Name": "/x" + " " * CONFIG_MAX}))  # over the size cap: not read
    (d / ids[3]).mkdir()
    os.symlink(tree / f"var/lib/docker/containers/{A}/config.v2.json", d / ids[3] / "config.v2.json")  # a link: not followed
    (d / ids[4]).mkdir()
    os.mkfifo(d / ids[4] / "config.v2.json")  # a FIFO: never blocked on
    for i in ids:
        assert n.container(Place("docker", i)).name is None
    write(d / ("6" * 64) / "config.v2.json", json.dumps({"Name": "/\x1b]0;pwned\x07evil name"}))
    assert n.container(Place("docker", "6" * 64)).name == "\\x1b\\x5d0\\x3bpwned\\x07evil\\x20name"
    write(tree / "var/lib/containers/storage/overlay-containers/containers.json", "[" * 100000)
    assert ContainerNames(str(tree)).container(Place("podman", B)).name is None
    assert ContainerNames(str(tree / "nowhere")).container(Place("kubernetes", A, pod_uid=UID)).pod is None


def test_docker_s_data_root_is_read_from_its_daemon_json(tree: Path) -> None:
    write(tree / "etc/docker/daemon.json", json.dumps({"data-root": "/srv/docker"}))
    write(tree / f"srv/docker/containers/{B}/config.v2.json", json.dumps({"Name": "/elsewhere"}))
    assert names(tree).container(Place("docker", B)).name == "elsewhere"


def test_the_reader_reads_proc_pid_cgroup_and_checks_the_hierarchy_count(tmp_path: Path, tree: Path) -> None:
    proc = tmp_path / "proc"
    write(proc / "self/cgroup", "1:name=systemd:/\n0::/\n")
    write(proc / "41/cgroup", f"1:name=systemd:/docker/{A}\n0::/\n")
    write(proc / "42/cgroup", f"1:name=systemd:/\n0::/x\n0::/docker/{A}\n")  # one line too many
    r = ContainerReader(names(tree), proc=str(proc))
    c = r.of_pid(41)
    assert c is not None and c.label() == "docker:trainer"
    assert r.of_pid(42) is None and "newline" in r.refused[42]
    assert r.of_pid(43) is None  # gone
    assert r.reads == 2


# ---------------------------------------------------------------------------------------------------- views


def test_labels() -> None:
    assert Container(runtime="docker", id=A).label() == f"docker:{A[:12]}"
    assert Container(runtime="podman", id=A, name="t", owner_uid=1000).label() == "podman:t@uid1000"
    assert Container(runtime="lxc", id="200", name="gpu-box").label() == "lxc:200(gpu-box)"
    assert Container(runtime="lxc", id="web1").label() == "lxc:web1"
    assert Container(runtime="kubernetes", id="", pod_uid=UID).label() == f"k8s:pod-{UID[:8]}"


def test_the_field_is_optional_on_the_wire_both_ways() -> None:
    """N-1: an older agent's GpuProcess/Leftover (no field) decodes as None; an older console ignores the field."""
    old = b'{"type":"snapshot","host":"h","ts":1,"epoch":"e","gpus":[{"index":0,"memory_used":1,"processes":[{"pid":5,"gpu":0}]}]}\n'
    snap = decode_reply(old)
    assert isinstance(snap, Snapshot) and snap.gpus[0].processes[0].container is None
    p = GpuProcess(pid=5, gpu=0, container=Container(runtime="future-runtime", id="x", name="n"))
    wire = json.loads(encode(Snapshot(host="h", ts=1, epoch="e", gpus=[Gpu(index=0, memory_used=1, processes=[p])])))
    assert wire["gpus"][0]["processes"][0]["container"] == {"runtime": "future-runtime", "id": "x", "name": "n"}

    class OldGpuProcess(msgspec.Struct):  # what a console of the version before reads
        pid: int
        gpu: int

    assert msgspec.json.decode(json.dumps(wire["gpus"][0]["processes"][0]), type=OldGpuProcess) == OldGpuProcess(5, 0)


def test_status_has_a_container_column_and_reclaim_names_the_container() -> None:
    c = Container(runtime="docker", id=A, name="trainer")
    procs = [
        GpuProcess(pid=7, gpu=0, used_bytes=2**31, user="root", cmdline=["python", "t.py"], container=c),
        GpuProcess(pid=8, gpu=0, used_bytes=2**30, user="bob", cmdline=["sleep"]),
        GpuProcess(pid=9, gpu=0, user="eve", container=Container(runtime="lxc", id="\\x1b\\x5b31m")),
    ]
    text = format_status(Snapshot(host="h", ts=1, epoch="e", gpus=[Gpu(index=0, memory_used=3 * 2**30, processes=procs)]))
    header = next(line for line in text.splitlines() if line.startswith("PID"))
    assert "CONTAINER" in header.split()
    row7 = next(line for line in text.splitlines() if line.startswith("7 "))
    row8 = next(line for line in text.splitlines() if line.startswith("8 "))
    assert "docker:trainer" in row7 and row8.split()[7] == "-"
    assert "\x1b" not in text
    lo = Leftover(pid=7, kind="foreign", user="root", container=c, note="in container docker:trainer: not a gpudeck run")
    listing = format_leftovers("h", [lo])
    assert "CONTAINER" in listing and "docker:trainer" in listing
    body = reclaim_body("h", [ReclaimItem(pid=7, who="FOREIGN", gpu_bytes={0: 2**31}, container="docker:trainer")], [])
    assert "in container docker:trainer" in body.plain
    assert "in container" not in reclaim_body("h", [ReclaimItem(pid=8, who="FOREIGN", gpu_bytes={0: 1})], []).plain


def test_reclaim_and_launch_names_the_container_of_a_holder_it_would_stop() -> None:
    from gpudeck.agents.wire.protocol import PreflightCheck, PreflightResult
    from gpudeck.console.ops.holders import holder_plan
    from gpudeck.console.ops.launch import NodeOutcome

    held = [{"pid": p, "gpu": 0, "attribution": "FOREIGN", "user": "op", "used_bytes": 2**30, "cmdline": ["x"]} for p in (7, 8)]
    check = PreflightCheck(name="gpu_holders", ok=False, message="held", details={"holders": held})
    outcome = NodeOutcome("gpu1", preflight=PreflightResult(ok=False, host="gpu1", checks=[check]))
    procs = [GpuProcess(pid=7, gpu=0, container=Container(runtime="docker", id=A, name="trainer")), GpuProcess(pid=8, gpu=0)]
    snap = Snapshot(host="gpu1", ts=0.0, epoch="e", gpus=[Gpu(index=0, memory_used=2**31, processes=procs)])
    lines = holder_plan([outcome], {"gpu1": snap}, "op").lines()
    assert lines[0].endswith("`x`  in container docker:trainer") and "in container" not in lines[1]
