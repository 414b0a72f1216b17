"""One run across hosts (issue 8): two "hosts" as network namespaces, each with sshd + agent, joined by a LAN.

The console (this test process and the CLI it runs) stays in the root namespace
and reaches each host over SSH on its own link; the hosts reach each other over
a LAN: a bridge in a switch namespace, with a veth into each host. The
rendezvous address and the gloo interface come from each host's config entry
(``rdzv_host``, ``gloo_socket_ifname``), as on real multi-node hosts. The
output folder is shared (one file system), like the shared storage multi-node
checkpoints need.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from gpudeck.agents.wire.protocol import GetRun
from tests.agent_harness import ROOT, wait_for
from tests.sshd_harness import ConsoleSide
from tests.trainer_harness import FSDP_SMALL

pytest.importorskip("torch")
netns = pytest.importorskip("tests.netns_harness")
pytestmark = pytest.mark.slow
PY = sys.executable
LAN = "10.77.{}.{}"


class Lan:
    """A switch namespace with a bridge; each host namespace gets a veth into it and an address on 10.77.N.0/24."""

    def __init__(self) -> None:
        self.name = f"gdsw-{os.getpid()}"
        self.subnet = (os.getpid() % 200) + 20
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self._ip(["link", "add", "br0", "type", "bridge"])
        self._ip(["link", "set", "br0", "up"])
        self.members: list[tuple[str, str, str]] = []

    def _ip(self, args: list[str], ns: str | None = None) -> None:
        subprocess.run(["ip", "netns", "exec", ns or self.name, "ip", *args], check=True, capture_output=True)

    def join(self, ns: str) -> tuple[str, str]:
        """Connect a host namespace; returns (its LAN address, its LAN interface name)."""
        i = len(self.members) + 1
        ifname, peer = f"lan{i}", f"sw{os.getpid() % 10000}p{i}"
        subprocess.run(["ip", "link", "add", peer, "type", "veth", "peer", "name", ifname], check=True)
        subprocess.run(["ip", "link", "set", ifname, "netns", ns], check=True)
        subprocess.run(["ip", "link", "set", peer, "netns", self.name], check=True)
        self._ip(["link", "set", peer, "master", "br0"])
        self._ip(["link", "set", peer, "up"])
        addr = LAN.format(self.subnet, i)
        self._ip(["addr", "add", f"{addr}/24", "dev", ifname], ns)
        self._ip(["link", "set", ifname, "up"], ns)
        self.members.append((ns, ifname, addr))
        return addr, ifname

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


@pytest.fixture
def cluster(tmp_path: Path):
    try:
        netns.require_netns()
    except netns.NetnsUnavailable as exc:
        pytest.skip(str(exc))
    console = ConsoleSide()
    lan = Lan()
    with netns.netns_pool() as pool:
        try:
            conf = ['hosts = ["nodea", "nodeb"]', ""]
            for name in ("nodea", "nodeb"):
                ns = pool.create()
                addr, ifname = lan.join(ns.name)
                host = netns.NsSshHost(name, console.pub, ns)
                host.start()
                console.add(host)
                conf += [
                    f"[host.{name}]",
                    f'rdzv_host = "{addr}"',
                    f'gloo_socket_ifname = "{ifname}"',
                    'env = { OMP_NUM_THREADS = "1" }',
                    "",
                ]
            (console.gpudeck_home / "config.toml").write_text("\n".join(conf))
            yield console
        finally:
            live = [(h, r["id"]) for h in console.hosts for r in _agent_runs(h) if r["state"] in ("starting", "running", "stopping")]
            with ThreadPoolExecutor(max_workers=max(1, len(live))) as stops:  # the nodes' stops wait out their graces together
                list(stops.map(lambda hr: hr[0].agent.cli("stop", hr[1], "--grace", "2", check=False), live))
            console.cleanup()
            lan.remove()


def _agent_runs(h) -> list[dict]:  # type: ignore[no-untyped-def]
    try:
        return h.agent.cli_json("runs")
    except Exception:
        return []


TRAIN = [
    *FSDP_SMALL,
    "--checkpoint-every",
    "3",
    "--log-every",
    "1",
    "--no-export",
]


@pytest.mark.timeout(900)  # a hang limit: two nodes of real training on a loaded 2-core machine take minutes
def test_a_two_node_run_trains_stops_resumes_and_is_one_record(cluster: ConsoleSide, tmp_path: Path) -> None:
    c = cluster
    out = tmp_path / "shared-out"
    cp = c.cli(
        "launch",
        "--hosts",
        "nodea,nodeb",
        "--kind",
        "fsdp",
        "--nproc-per-node",
        "2",
        "--python",
        PY,
        "--cwd",
        str(ROOT),
        "--name",
        "two-node",
        "--fresh",
        "--json",
        "--",
        *TRAIN,
        "--max-steps",
        "10000",
        "--out",
        str(out),
        timeout=180,
    )
    launched = json.loads(cp.stdout)
    rid = launched["id"]
    print(f"\nlaunched {rid} on {launched['hosts']}, rendezvous {launched['rdzv_endpoint']}")
    assert [n["spec"]["node_rank"] for n in launched["nodes"]] == [0, 1]
    argv0 = launched["nodes"][0]["spec"]["argv"]
    assert "--rdzv-endpoint" in argv0 and argv0[argv0.index("--rdzv-id") + 1] == rid and argv0[argv0.index("--nnodes") + 1] == "2"
    assert launched["nodes"][1]["spec"]["env"]["GLOO_SOCKET_IFNAME"] == "lan2"

    # both nodes train together: 4 ranks, one run; checkpoints land in the shared folder
    def trained() -> bool:
        return any(p.name.startswith("step_") for p in (out / "checkpoints").glob("step_*")) if (out / "checkpoints").exists() else False

    try:
        wait_for(trained, timeout=240, interval=0.25, what="a checkpoint from the 2-node run")
    except AssertionError:
        raise AssertionError(c.cli("tail", rid, "-n", "80", check=False).stdout[-6000:] + json.dumps(c.cli_json("runs"))[:3000]) from None
    runs = c.cli_json("runs")
    row = next(r for r in runs if r["id"] == rid)
    assert row["host"] == "nodea+nodeb" and row["state"] == "running" and len(row["nodes"]) == 2, row
    tail = c.cli("tail", rid, "-n", "50").stdout
    assert "[nodea]" in tail and "[nodeb]" in tail, tail[-2000:]

    res = json.loads(c.cli("stop", rid, "--grace", "60", "--json", timeout=180).stdout)
    assert {n["host"] for n in res["nodes"]} == {"nodea", "nodeb"} and all(n["state"] == "stopped" for n in res["nodes"]), res
    human_hist = c.cli("history", "name:two-node").stdout
    assert "nodea+nodeb" in human_hist
    hist = c.cli_json("history", "name:two-node")
    assert len(hist) == 1 and hist[0]["state"] == "stopped" and hist[0]["hosts"] == ["nodea", "nodeb"]
    steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if (p / "gpudeck_checkpoint.json").exists())
    assert steps, "the stop should leave a complete checkpoint"

    cp = c.cli(
        "launch",
        "--hosts",
        "nodea,nodeb",
        "--kind",
        "fsdp",
        "--nproc-per-node",
        "2",
        "--python",
        PY,
        "--cwd",
        str(ROOT),
        "--name",
        "two-node-resumed",
        "--resume",
        str(steps[-1]),
        "--json",
        "--",
        *TRAIN,
        "--max-steps",
        str(steps[-1] + 3),
        "--out",
        str(out),
        timeout=180,
    )
    rid2 = json.loads(cp.stdout)["id"]
    wait_for(lambda: _nodes_ended(c, rid2), timeout=300, interval=0.25, what="the resumed run to finish")
    final = next(x for x in c.cli_json("runs") if x["id"] == rid2)
    assert final["state"] == "succeeded", c.cli("tail", rid2, "-n", "40").stdout
    # every host's history is complete: gapless, no duplicates
    from gpudeck.console.history.replica import History

    h = History(c.gpudeck_home / "history.db")
    try:
        for host in h.hosts():
            if host.name in ("nodea", "nodeb"):
                seqs = h.seqs(host.name, host.epoch or "")
                assert seqs == list(range(1, len(seqs) + 1))
    finally:
        h.close()


def test_killing_one_nodes_ranks_raises_the_alert_and_names_the_node_in_the_cause(cluster: ConsoleSide, tmp_path: Path) -> None:
    c = cluster
    out = tmp_path / "kill-out"
    rid = _launch_long_two_node_run(c, out)
    nodeb = c.hosts[1]

    def ranks_b() -> list[int]:
        return [
            p.pid
            for p in psutil.process_iter()
            if _tag(p.pid) == rid
            and "gpudeck.trainers.fsdp_lm" in " ".join(_cmd(p))
            and p.pid in nodeb.ns.pids()
            and "torch.distributed.run" not in " ".join(_cmd(p))
        ]

    pids = wait_for(lambda: len(ranks_b()) == 1 and ranks_b(), timeout=240, interval=0.5, what="nodeb's rank")
    wait_for(lambda: (out / "checkpoints").exists(), timeout=240, interval=0.25, what="training started")
    os.kill(pids[0], signal.SIGKILL)
    t_kill = time.time()
    wait_for(lambda: _nodes_ended(c, rid), timeout=300, interval=0.25, what="the run to end")
    row = next(x for x in c.cli_json("runs") if x["id"] == rid)
    assert row["state"] in ("failed", "stopped", "lost"), row
    print(f"\nafter killing a rank on nodeb: {row['state']}: {row['cause']}")
    assert "nodeb" in row["cause"] or "nodea" in row["cause"]
    show = c.cli_json("show", rid, "--host", "nodeb")
    # the rank's death came first, so its alert is journaled before the node's end, whether the health tick saw the
    # rank gone first or torchrun ended the node first (the end then raises it: agents/runs/ending.py)
    ends = [e for e in show["events"] if e["kind"] == "run_state" and e["data"]["state"] in ("failed", "stopped", "lost")]
    alerts = [e for e in show["events"] if e["kind"] == "alert" and e["data"]["alert"]["kind"] == "rank_exited"]
    assert alerts and ends and alerts[0]["seq"] < ends[0]["seq"], [(e["kind"], e["data"].get("state")) for e in show["events"]]
    print(f"rank_exited alert {alerts[0]['ts'] - t_kill:.1f} s after the kill")


def _nodes_ended(c: ConsoleSide, rid: str) -> bool:
    """Every node's agent holds the run as ended. Asked over each agent's socket: a console `runs` is an SSH round
    to every host and a Python start, seconds of CPU taken from the ranks on 2 cores; the console's own answer is
    checked once they have ended."""
    for h in c.hosts:
        run = h.agent.ask(GetRun(run_id=rid)).get("run")
        if not run or run["state"] in ("starting", "running", "stopping"):
            return False
    return True


def _launch_long_two_node_run(c: ConsoleSide, out: Path) -> str:
    """A two-node fsdp run (one rank per node) long enough to be cut or killed; returns its id."""
    cp = c.cli(
        "launch",
        "--hosts",
        "nodea,nodeb",
        "--kind",
        "fsdp",
        "--nproc-per-node",
        "1",
        "--python",
        PY,
        "--cwd",
        str(ROOT),
        "--fresh",
        "--json",
        "--",
        *TRAIN,
        "--max-steps",
        "10000",
        "--out",
        str(out),
        timeout=180,
    )
    return str(json.loads(cp.stdout)["id"])


def _tag(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"GPUDECK_RUN_ID="):
            return kv.split(b"=", 1)[1].decode()
    return None


def _cmd(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_a_node_cut_off_during_the_run_is_reported_then_stopped_when_it_is_back(cluster: ConsoleSide, tmp_path: Path) -> None:
    c = cluster
    out = tmp_path / "cut-out"
    rid = _launch_long_two_node_run(c, out)
    wait_for(lambda: (out / "checkpoints").exists(), timeout=240, interval=0.25, what="training started")
    c.cli("history")  # the history holds both nodes as running
    nodeb = c.hosts[1]
    # the operator's ssh config gives nodeb a ConnectTimeout, as ssh would take it (gpudeck's own is 15 s): each of
    # the three CLI calls below waits that long for nodeb before answering without it
    with open(c.ssh_config, "a") as fh:
        fh.write(f"Host {nodeb.name}\n    ConnectTimeout 6\n\n")
    nodeb.ns.cut("drop")  # the console's link to nodeb goes silent; the hosts' LAN stays up, so training goes on
    t0 = time.monotonic()
    try:
        cp = c.cli("runs", "--json", check=False)
        assert cp.returncode == 3 and "nodeb" in cp.stderr, cp  # a host did not answer: the partial answer, and who is missing
        partial = json.loads(cp.stdout)
        assert [u["host"] for u in partial["unreachable"]] == ["nodeb"], partial["unreachable"]
        row = next(r for r in partial["runs"] if r["id"] == rid)
        print(f"\nwith nodeb cut off ({time.monotonic() - t0:.0f} s to answer): {row['host']} {row['state']}: {row['cause']}")
        assert row["host"] == "nodea" or "nodeb" not in row["host"] or row["cause"]
        cp = c.cli("stop", rid, "--grace", "30", check=False, timeout=240)
        print(cp.stdout)
        assert cp.returncode == 1 and "[nodeb] UNREACHABLE" in cp.stdout and "[nodea]" in cp.stdout
        cp = c.cli("history", "--json", f"id:{rid}", check=False)
        assert cp.returncode == 3, cp
        hist = json.loads(cp.stdout)["runs"]
        print(f"history while nodeb is cut off: {hist[0]['state']}: {hist[0]['cause']}")
        assert hist[0]["nodes"][0]["state"] == "stopped" and hist[0]["nodes"][1]["state"] == "running"
        assert hist[0]["state"] in ("lost", "stopping", "running") and "nodeb" in (hist[0]["cause"] or "")
    finally:
        nodeb.ns.heal()
    # the next contact with nodeb delivers the stop that was asked for while it was away
    try:
        wait_for(
            lambda: (
                c.cli("history", check=False)
                and next((r for r in _agent_runs(nodeb) if r["id"] == rid), {}).get("state") in ("stopped", "failed", "succeeded")
            ),
            timeout=120,
            interval=2.0,
            what="nodeb's node to end",
        )
    except AssertionError:
        raise AssertionError(
            json.dumps(next((r for r in _agent_runs(nodeb) if r["id"] == rid), {}))[:3000] + nodeb.agent.log()[-3000:]
        ) from None
    print(
        "nodeb after heal:",
        json.dumps({k: v for k, v in next(r for r in _agent_runs(nodeb) if r["id"] == rid).items() if k in ("state", "cause", "ended")}),
    )
    hist = c.cli_json("history", f"id:{rid}")
    print(f"history after heal: {hist[0]['state']}: {hist[0]['cause']}")
    # nodeb ended with nodea's stop (the trainer's agreed stop step) or by the stop delivered on reconnect
    assert (
        hist[0]["state"] == "stopped"
        and hist[0]["nodes"][0]["state"] == "stopped"
        and hist[0]["nodes"][1]["state"] in ("stopped", "succeeded")
    ), hist[0]
    from gpudeck.console.history.replica import History

    h = History(c.gpudeck_home / "history.db")
    try:
        for host in h.hosts():
            if host.name in ("nodea", "nodeb"):
                seqs = h.seqs(host.name, host.epoch or "")
                assert seqs == list(range(1, len(seqs) + 1)), f"{host.name}: gap or duplicate"
        assert h.pending_stops("nodeb") == []
    finally:
        h.close()
