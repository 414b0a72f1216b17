"""Provides network namespaces for the fault tests: fleet hosts behind veth links that are cut, degraded and healed for real.

Each :class:`Netns` is one host's network: a namespace of its own, joined to
the root namespace (where the console, i.e. the test process, stays) by a veth
pair with a /30 from 198.18.0.0/16 (RFC 2544's benchmarking range, never a
real network). :class:`NsSshHost` runs sshd *and* the agent inside it; sshd
listens on the namespace's address only.

Faults:

- :meth:`Netns.cut` ``"down"``: the link goes down (the console gets
  "network unreachable" at once: an ``unreachable`` route with a high metric
  under the link's own route makes sure the default route never carries the
  namespace's packets off the machine); ``"drop"``: every packet is dropped both
  ways (a silent blackhole, like a dead switch port — the harder case, where
  only keepalives notice).
- :meth:`Netns.impair`: delay and random loss on the host's egress, like
  ``tc qdisc add dev <if> root netem delay 200ms loss 10%``. Where the kernel
  has no netem (``CONFIG_NET_SCH_NETEM`` unset, as on this CI's kernel), the
  same is done in userspace: an iptables ``NFQUEUE`` rule hands every packet
  to a small netlink program (``python -m tests.netns_harness nfqueue ...``)
  that drops a seeded share of them and releases the rest after the delay. Packets are
  still delayed and lost in the kernel's path, TCP retransmits for real.
- :meth:`Netns.heal` undoes either.

Names are unique per test process and namespace (``gdns-<pid>-<n>``);
:class:`NetnsPool` removes everything it made at teardown, even on failure,
and sweeps leftovers of test processes that died (by their recorded pid).
Needs root, ``ip`` (iproute2) and, without netem, ``iptables``.
"""

from __future__ import annotations

import atexit
import fcntl
import heapq
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tests.agent_harness import AgentProc
from tests.sshd_harness import SshHost

NS_PREFIX = "gdns"
SUBNET = (198, 18)  # 198.18.0.0/16 of the RFC 2544 benchmarking range
LOCK_PATH = Path("/tmp/gpudeck-netns.lock")
GUARD_METRIC = 10000  # the unreachable route that stands in for a namespace's link while it is down
_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-(\d+)$")
_counter = iter(range(1, 1 << 30))
_netem: bool | None = None  # does this kernel have sch_netem (probed once)

CutHow = Literal["down", "drop"]


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, or a tool is missing); the message says what to install."""


def _run(argv: list[str], check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and cp.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {cp.returncode}: {cp.stderr.strip()}")
    return cp


def require_netns(need_impair: bool = False) -> None:
    """Raise NetnsUnavailable unless namespaces can be made, cut and degraded here (``need_impair`` needs no more today)."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespace tests need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("`ip` is missing: apt-get install -y iproute2")
    # a "drop" cut and an impairment need netem, or iptables where the kernel has no netem
    if not (shutil.which("tc") and has_netem()) and shutil.which("iptables") is None:
        raise NetnsUnavailable(
            "this kernel has no netem and `iptables` is missing (DROP and NFQUEUE stand in for netem): apt-get install -y iptables"
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _ns_names() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.strip()]


def _ns_pids(name: str) -> list[int]:
    out = _run(["ip", "netns", "pids", name], check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _kill_ns_processes(name: str, grace_s: float = 3.0) -> None:
    """Every process inside a namespace this harness made is one of ours: TERM, then KILL, by pid."""
    pids = _ns_pids(name)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in _ns_pids(name)]
        if pids:
            time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sweep_stale() -> list[str]:
    """Remove namespaces (and their veths) left by test processes that are gone; returns their names."""
    removed = []
    for name in _ns_names():
        m = _NS_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_ns_processes(name, 1.0)
            _run(["ip", "link", "del", _host_if(int(m.group(1)), int(m.group(2)))], check=False)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def _host_if(pid: int, n: int) -> str:
    return f"gd{pid % 100000}h{n}"  # at most 15 bytes, as IFNAMSIZ wants


def _used_slots() -> set[int]:
    used = set()
    out = _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    for m in re.finditer(rf"inet {SUBNET[0]}\.{SUBNET[1]}\.(\d+)\.(\d+)/", out):
        used.add(int(m.group(1)) * 64 + int(m.group(2)) // 4)
    return used


def has_netem() -> bool:
    """Whether this kernel has the netem qdisc (probed once, on the lo of a throwaway namespace)."""
    global _netem
    if _netem is None:
        probe = f"{NS_PREFIX}-{os.getpid()}-0"  # the pool counts from 1; sweep_stale still finds it if we die here
        _run(["ip", "netns", "add", probe], check=False)
        try:
            cp = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
            _netem = cp.returncode == 0
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    return _netem


@dataclass
class Impairment:
    """What :meth:`Netns.impair` set up, and the figures the userspace path counted."""

    delay_ms: float
    loss_pct: float
    via: str  # "netem" or "nfqueue"
    proc: subprocess.Popen | None = None
    packets: int = 0
    dropped: int = 0


@dataclass
class Netns:
    """One host's network namespace and its veth link to the root namespace."""

    name: str
    index: int
    host_if: str
    ns_if: str
    host_addr: str
    ns_addr: str
    state: str = "up"  # up | down | drop | impaired
    impairment: Impairment | None = None
    _removed: bool = field(default=False, repr=False)

    @property
    def subnet(self) -> str:
        """The link's /30 (host end .1, namespace end .2 of it)."""
        a, b, c, d = (int(x) for x in self.host_addr.split("."))
        return f"{a}.{b}.{c}.{d - 1}/30"

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside the namespace and wait for it."""
        return _run(self.exec_argv(argv), check=check)

    def pids(self) -> list[int]:
        """Processes living in this namespace."""
        return _ns_pids(self.name)

    # ------------------------------------------------------------------ faults

    def cut(self, how: CutHow = "drop") -> None:
        """Cut the host off: ``down`` the link, or ``drop`` every packet both ways (a blackhole)."""
        self.heal()
        if how == "down":
            _run(["ip", "link", "set", self.host_if, "down"])
        elif has_netem():
            self.run(["tc", "qdisc", "replace", "dev", self.ns_if, "root", "netem", "loss", "100%"])
            _run(["tc", "qdisc", "replace", "dev", self.host_if, "root", "netem", "loss", "100%"])
        else:
            self.run(["iptables", "-I", "INPUT", "1", "-i", self.ns_if, "-j", "DROP"])
            self.run(["iptables", "-I", "OUTPUT", "1", "-o", self.ns_if, "-j", "DROP"])
        self.state = how

    def impair(self, delay_ms: float = 200.0, loss_pct: float = 10.0, seed: int = 0) -> Impairment:
        """Delay and randomly drop the host's outgoing packets (netem where the kernel has it, else NFQUEUE)."""
        self.heal()
        if has_netem():
            self.run(["tc", "qdisc", "replace", "dev", self.ns_if, "root", "netem", "delay", f"{delay_ms:g}ms", "loss", f"{loss_pct:g}%"])
            self.impairment = Impairment(delay_ms, loss_pct, "netem")
        else:
            if shutil.which("iptables") is None:
                raise NetnsUnavailable(
                    "this kernel has no netem and `iptables` is missing for the NFQUEUE fallback: apt-get install -y iptables"
                )
            qnum = self.index % 65000 + 1
            proc = subprocess.Popen(
                self.exec_argv(
                    [sys.executable, "-m", "tests.netns_harness", "nfqueue", str(qnum), str(delay_ms), str(loss_pct), str(seed)]
                ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
                start_new_session=True,
            )
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if line != "bound":
                proc.kill()
                raise RuntimeError(f"the NFQUEUE delayer did not start: {line} {proc.stdout.read()[-2000:]}")
            # --queue-bypass: if the delayer dies, packets flow instead of vanishing
            self.run(["iptables", "-A", "OUTPUT", "-o", self.ns_if, "-j", "NFQUEUE", "--queue-num", str(qnum), "--queue-bypass"])
            self.impairment = Impairment(delay_ms, loss_pct, "nfqueue", proc)
        self.state = "impaired"
        return self.impairment

    def heal(self) -> Impairment | None:
        """Undo any cut or impairment; returns the impairment that was in force (with its packet counts)."""
        was = self.impairment
        if self.state == "down":
            _run(["ip", "link", "set", self.host_if, "up"])
        if self.state in ("drop", "impaired"):
            if has_netem():
                self.run(["tc", "qdisc", "del", "dev", self.ns_if, "root"], check=False)
                _run(["tc", "qdisc", "del", "dev", self.host_if, "root"], check=False)
            else:
                self.run(["iptables", "-F", "INPUT"], check=False)
                self.run(["iptables", "-F", "OUTPUT"], check=False)
        if was is not None and was.proc is not None:
            was.proc.send_signal(signal.SIGTERM)
            try:
                out, _ = was.proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                was.proc.kill()
                out, _ = was.proc.communicate(timeout=5)
            m = re.search(r"packets=(\d+) dropped=(\d+)", out or "")
            if m:
                was.packets, was.dropped = int(m.group(1)), int(m.group(2))
        self.impairment = None
        self.state = "up"
        return was

    # ------------------------------------------------------------------ teardown

    def remove(self) -> None:
        """Kill what runs inside, delete the veth pair and the namespace (idempotent)."""
        if self._removed:
            return
        self._removed = True
        try:
            self.heal()
        except Exception:
            pass
        _kill_ns_processes(self.name)
        LOCK_PATH.touch(exist_ok=True)
        with open(LOCK_PATH) as lock:
            # freeing a slot is one step too, under the lock its creation takes: otherwise another test process could
            # take the slot once our address is gone and then lose its guard route to our `route del` below, and with
            # its link down its packets would follow the default route off the namespace (a connect that succeeded
            # during a "down" cut: tests/e2e/test_partition.py in fresh-clone CI at 1e42541)
            fcntl.flock(lock, fcntl.LOCK_EX)
            _run(["ip", "route", "del", "unreachable", self.subnet, "metric", str(GUARD_METRIC)], check=False)
            _run(["ip", "link", "del", self.host_if], check=False)
            _run(["ip", "netns", "del", self.name], check=False)


class NetnsPool:
    """Makes namespaces for one test and removes every one of them at teardown."""

    def __init__(self) -> None:
        require_netns()
        sweep_stale()
        self.items: list[Netns] = []

    def create(self) -> Netns:
        """A new namespace with lo up and a veth link to the root namespace, addresses on both ends."""
        n = next(_counter)
        pid = os.getpid()
        name = f"{NS_PREFIX}-{pid}-{n}"
        host_if, ns_if = _host_if(pid, n), f"gd{pid % 100000}p{n}"
        LOCK_PATH.touch(exist_ok=True)
        with open(LOCK_PATH) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # address choice and creation are one step across test processes
            used = _used_slots()
            index = next(i for i in range(1, 256 * 64) if i not in used)
            a, b = index // 64, (index % 64) * 4
            host_addr, ns_addr = f"{SUBNET[0]}.{SUBNET[1]}.{a}.{b + 1}", f"{SUBNET[0]}.{SUBNET[1]}.{a}.{b + 2}"
            ns = Netns(name=name, index=index, host_if=host_if, ns_if=ns_if, host_addr=host_addr, ns_addr=ns_addr)
            self.items.append(ns)  # registered first, so a half-made one is removed too
            _run(["ip", "netns", "add", name])
            _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if])
            _run(["ip", "link", "set", ns_if, "netns", name])
            # with the link down its connected route goes away and the default route would carry packets for
            # the namespace off this machine: an unreachable route under it keeps them here (ENETUNREACH instead)
            _run(["ip", "route", "replace", "unreachable", ns.subnet, "metric", str(GUARD_METRIC)])
            _run(["ip", "addr", "add", f"{host_addr}/30", "dev", host_if])
            _run(["ip", "link", "set", host_if, "up"])
            ns.run(["ip", "addr", "add", f"{ns_addr}/30", "dev", ns_if])
            ns.run(["ip", "link", "set", ns_if, "up"])
            ns.run(["ip", "link", "set", "lo", "up"])
        return ns

    def cleanup(self) -> None:
        """Remove every namespace this pool made."""
        for ns in reversed(self.items):
            ns.remove()
        self.items.clear()


_pools: list[NetnsPool] = []


@atexit.register
def _cleanup_all() -> None:
    for p in _pools:
        p.cleanup()


@contextmanager
def netns_pool() -> Iterator[NetnsPool]:
    """A pool whose namespaces are removed when the block ends, however it ends."""
    pool = NetnsPool()
    _pools.append(pool)
    try:
        yield pool
    finally:
        pool.cleanup()
        _pools.remove(pool)


# ---------------------------------------------------------------------- hosts inside a namespace


class NsAgentProc(AgentProc):
    """A real agent process started inside a network namespace (it needs no network; its socket is a path)."""

    def __init__(self, home: Path, netns: str) -> None:
        super().__init__(home)
        self.netns = netns

    def start(self) -> NsAgentProc:
        # `ip netns exec` execs the command after setns, so proc.pid is the agent itself
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, sys.executable, "-m", "gpudeck.agents", "serve", "--state-dir", str(self.state_dir)],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if (self.state_dir / "sock" / "agent.sock").exists() and self._answers():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}; log: {self.log()}")
            time.sleep(0.05)
        raise RuntimeError(f"agent did not come up; log: {self.log()}")


class NsSshHost(SshHost):
    """A fleet host living in its own namespace: sshd on the namespace's address, port 22, and the agent beside it."""

    def __init__(self, name: str, client_pub: str, ns: Netns) -> None:
        super().__init__(name, client_pub, address=ns.ns_addr, netns=ns.name, port=22)
        self.ns = ns
        self.agent = NsAgentProc(self.home, ns.name)


# ---------------------------------------------------------------------- sockets of a process


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket a process holds, as /proc/<pid>/net/tcp{,6} lists it."""

    family: str  # tcp | tcp6
    local: str
    remote: str
    state: str  # LISTEN, ESTABLISHED, ...
    inode: int


_TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def socket_inodes(pid: int) -> set[int]:
    """Inodes of every socket among a process's open fds."""
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _addr(hexaddr: str) -> str:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return f"[{socket.inet_ntop(socket.AF_INET6, words)}]:{int(port, 16)}"


def tcp_sockets(pid: int) -> list[TcpSocket]:
    """TCP sockets (listening or connected, IPv4 or IPv6) held by ``pid``, read in the pid's own network namespace."""
    inodes = socket_inodes(pid)
    found: list[TcpSocket] = []
    for fam in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{fam}").read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            parts = ln.split()
            if len(parts) > 9 and int(parts[9]) in inodes:
                found.append(TcpSocket(fam, _addr(parts[1]), _addr(parts[2]), _TCP_STATES.get(parts[3], parts[3]), int(parts[9])))
    return found


# ---------------------------------------------------------------------- the NFQUEUE delayer (netem in userspace)

_NFNL_SUBSYS_QUEUE = 3
_NFQNL_MSG_PACKET, _NFQNL_MSG_VERDICT, _NFQNL_MSG_CONFIG = 0, 1, 2
_NFQA_CFG_CMD, _NFQA_CFG_PARAMS, _NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
_NFQA_PACKET_HDR, _NFQA_VERDICT_HDR = 1, 2
_NFQNL_CFG_CMD_BIND = 1
_NFQNL_COPY_META = 1
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_ERROR = 2
_NF_DROP, _NF_ACCEPT = 0, 1


def _nlattr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * ((4 - n % 4) % 4)


def _nfq_msg(mtype: int, qnum: int, attrs: list[bytes], flags: int = _NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(qnum)) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), (_NFNL_SUBSYS_QUEUE << 8) | mtype, flags, 0, 0) + body


def _nfq_config(sock: socket.socket, qnum: int, attrs: list[bytes]) -> None:
    sock.send(_nfq_msg(_NFQNL_MSG_CONFIG, qnum, attrs, _NLM_F_REQUEST | _NLM_F_ACK))
    reply = sock.recv(4096)
    _len, mtype, _fl, _seq, _pid = struct.unpack_from("=IHHII", reply)
    if mtype == _NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", reply, 16)
        if err != 0:
            raise OSError(-err, f"NFQUEUE config failed: {os.strerror(-err)}")


def nfqueue_delayer(qnum: int, delay_ms: float, loss_pct: float, seed: int) -> int:
    """Hold every packet of NFQUEUE ``qnum`` for ``delay_ms`` and drop ``loss_pct`` percent of them (seeded)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    _nfq_config(sock, qnum, [_nlattr(_NFQA_CFG_CMD, struct.pack("=BBH", _NFQNL_CFG_CMD_BIND, 0, socket.htons(socket.AF_INET)))])
    _nfq_config(
        sock,
        qnum,
        [_nlattr(_NFQA_CFG_PARAMS, struct.pack("!IB", 0, _NFQNL_COPY_META)), _nlattr(_NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 1 << 16))],
    )
    rng = random.Random(seed)
    delay = delay_ms / 1000.0
    loss = loss_pct / 100.0
    pending: list[tuple[float, int]] = []
    counts = {"packets": 0, "dropped": 0}
    stop = False

    def on_term(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    sock.setblocking(False)
    print("bound", flush=True)
    packet_type = (_NFNL_SUBSYS_QUEUE << 8) | _NFQNL_MSG_PACKET

    def verdict(pkt_id: int, v: int) -> None:
        sock.send(_nfq_msg(_NFQNL_MSG_VERDICT, qnum, [_nlattr(_NFQA_VERDICT_HDR, struct.pack("!II", v, pkt_id))]))

    while not stop:
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else 0.5
        try:
            ready, _, _ = select.select([sock], [], [], timeout)
        except InterruptedError:
            continue
        while ready:
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                break
            off = 0
            while off + 16 <= len(data):
                ln, mtype, _fl, _seq, _pid = struct.unpack_from("=IHHII", data, off)
                if ln < 16:
                    break
                if mtype == packet_type:
                    a = off + 20  # nlmsghdr + nfgenmsg
                    while a + 4 <= off + ln:
                        alen, atype = struct.unpack_from("=HH", data, a)
                        if alen < 4:
                            break
                        if atype & 0x7FFF == _NFQA_PACKET_HDR:
                            (pkt_id,) = struct.unpack_from("!I", data, a + 4)
                            counts["packets"] += 1
                            if rng.random() < loss:
                                counts["dropped"] += 1
                                verdict(pkt_id, _NF_DROP)
                            else:
                                heapq.heappush(pending, (time.monotonic() + delay, pkt_id))
                        a += (alen + 3) & ~3
                off += (ln + 3) & ~3
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            verdict(heapq.heappop(pending)[1], _NF_ACCEPT)
    for _, pkt_id in pending:  # let the rest go on the way out
        verdict(pkt_id, _NF_ACCEPT)
    print(f"packets={counts['packets']} dropped={counts['dropped']}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "nfqueue":
        sys.exit(nfqueue_delayer(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])))
    print("usage: python -m tests.netns_harness nfqueue QNUM DELAY_MS LOSS_PCT SEED", file=sys.stderr)
    sys.exit(2)
