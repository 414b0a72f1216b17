"""Benchmark: what one ``gpudeck`` command costs, against ``python -c pass``, ``nvitop --help`` and ``ssh HOST true``.

Every command is a fresh process, as a user runs it: ``.venv/bin/gpudeck ...`` with the operator's environment of
:class:`tests.sshd_harness.ConsoleSide` (its own HOME, ``~/.ssh`` and GPUDECK_HOME, whose ``local`` agent is a real
agent, tests/agent_harness.py, with SIMULATED GPUs) and one more host, ``bench1``: a real OpenSSH server on a loopback
port (tests/sshd_harness.py) with its own agent, named in the temp GPUDECK_HOME's config. The peers run in the same
rounds: ``python -c pass`` (the interpreter's floor, with the same site-packages), ``nvitop --help`` (a GPU CLI users
call "quick"; skipped, saying so, when nvitop is not installed: ``pip install nvitop`` into the venv, a bench tool
only) and ``ssh bench1 true`` (OpenSSH's own client, to the same sshd, with a key of its own that is not locked to
``gpudeck agent dial``).

Commands run round-robin, one of each per round, so a burst of load on a shared machine falls on all of them alike;
after one warm-up round (the first call creates the history), each figure is the median wall time of ``--n`` rounds,
with its CPU time (user + system of the process and its children, from ``getrusage``), and its ratio to
``python -c pass`` and to its own peer. Goals (issue 30, on the 2-core test machine): ``--help`` and ``status --host
local`` under 150 ms, ``runs --host local --no-sync`` under 200 ms, ``status --host bench1`` within 100 ms of ``ssh
bench1 true``.

Every process runs as on a user's machine, with its bytecode cached: ``PYTHONDONTWRITEBYTECODE`` is removed from the
environment (the test machine's shells set it, and with it every call compiles gpudeck's sources again, which an
installed or once-run gpudeck never does; the warm-up round writes the ``__pycache__`` folders).

To measure another version (the base of a change), run this script with that version's venv python: the commands,
the remote host's ``gpudeck agent dial`` and the agents are the ones beside ``sys.executable``; ``--nvitop`` names the
peer's script when that venv has none. ``--base-bin DIR`` (another version's venv ``bin``) also measures that version's
``status`` over SSH in the same rounds: a second host, ``bench0``, whose sshd's forced command is that version's
``gpudeck agent dial`` (its agent is this version's; the wire is the same), so the two SSH figures share every round's
load.

A command that fails prints its exit code and stderr's last line instead of a figure (e.g. ``--no-sync`` on a
version of ``runs`` that does not have it).

Usage: python bench/cli.py [--n 10] [--no-ssh] [--only NAME,NAME] [--nvitop PATH] [--base-bin DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.sshd_harness import ConsoleSide, SshHost, keygen

BIN = Path(sys.executable).parent
GPUDECK = str(BIN / "gpudeck")
REMOTE = "bench1"
BASE_REMOTE = "bench0"  # --base-bin: the same kind of host, its forced command the other version's `gpudeck agent dial`


@dataclass
class Figure:
    """One command's samples: wall and CPU seconds per call, and the last failure if it failed."""

    name: str
    argv: list[str]
    peer: str | None = None  # the figure this one is compared with, besides `python -c pass`
    goal_ms: float | None = None  # absolute goal (ms) on the 2-core machine, or over the peer with peer_goal
    peer_goal: bool = False  # goal_ms is a margin over the peer's median, not an absolute time
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    failed: str | None = None

    def median_ms(self) -> float:
        return statistics.median(self.wall) * 1000


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(fig: Figure, env: dict[str, str]) -> None:
    """Run the command once; record its wall and CPU time, or why it failed."""
    cpu0 = _child_cpu()
    t0 = time.perf_counter()
    cp = subprocess.run(fig.argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    cpu = _child_cpu() - cpu0
    if cp.returncode != 0:
        last = (cp.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        fig.failed = f"exit {cp.returncode}: {last[:160]}"
        return
    fig.wall.append(wall)
    fig.cpu.append(cpu)


def figures(console: ConsoleSide, peer_key: Path | None, with_ssh: bool, nvitop: str | None, base_bin: Path | None = None) -> list[Figure]:
    """Every figure of the run, peers first."""
    out = [Figure("python -c pass", [sys.executable, "-c", "pass"])]
    nvitop = nvitop or shutil.which("nvitop", path=str(BIN)) or shutil.which("nvitop")
    if nvitop:
        out.append(Figure("nvitop --help", [nvitop, "--help"]))
    else:
        print("cli nvitop is not installed: compared with `python -c pass` only (pip install nvitop into the venv for the peer)")
    help_peer = "nvitop --help" if nvitop else None
    out += [
        Figure("gpudeck --help", [GPUDECK, "--help"], peer=help_peer, goal_ms=150),
        Figure("gpudeck --version", [GPUDECK, "--version"], peer=help_peer),
        Figure("gpudeck status --help", [GPUDECK, "status", "--help"], peer=help_peer, goal_ms=150),
        Figure("gpudeck status --host local", [GPUDECK, "status", "--host", "local"], goal_ms=150),
        Figure("gpudeck runs --host local --no-sync", [GPUDECK, "runs", "--host", "local", "--no-sync"], goal_ms=200),
        Figure("gpudeck runs --host local", [GPUDECK, "runs", "--host", "local"]),
    ]
    if with_ssh and peer_key is not None:
        ssh = [
            "ssh",
            "-F",
            str(console.ssh_config),
            "-i",
            str(peer_key),
            "-o",
            f"UserKnownHostsFile={console.known_hosts}",
            "-o",
            "BatchMode=yes",
        ]
        out += [
            Figure(f"ssh {REMOTE} true", [*ssh, REMOTE, "true"]),
            Figure(
                f"gpudeck status --host {REMOTE}",
                [GPUDECK, "status", "--host", REMOTE],
                peer=f"ssh {REMOTE} true",
                goal_ms=100,
                peer_goal=True,
            ),
            Figure("gpudeck runs", [GPUDECK, "runs"]),
        ]
        if base_bin is not None:
            out.append(
                Figure(
                    f"base status --host {BASE_REMOTE}",
                    [str(base_bin / "gpudeck"), "status", "--host", BASE_REMOTE],
                    peer=f"ssh {REMOTE} true",
                    goal_ms=100,
                    peer_goal=True,
                )
            )
    return out


def report(figs: list[Figure]) -> None:
    """One line per figure: median wall and CPU, and the ratios to `python -c pass` and to the figure's peer."""
    by = {f.name: f for f in figs}
    floor = by["python -c pass"]
    width = max(len(f.name) for f in figs)
    for f in figs:
        if f.failed and not f.wall:
            print(f"cli {f.name:<{width}}  failed: {f.failed}")
            continue
        ms = f.median_ms()
        line = f"cli {f.name:<{width}}  {ms:7.1f} ms median wall  {statistics.median(f.cpu) * 1000:6.1f} ms CPU  n={len(f.wall)}"
        if f is not floor and floor.wall:
            line += f"  {ms / floor.median_ms():4.1f}x python -c pass"
        peer = by.get(f.peer or "")
        if peer is not None and peer.wall:
            line += f"  {ms / peer.median_ms():4.2f}x {peer.name} ({ms - peer.median_ms():+.0f} ms)"
        if f.goal_ms is not None:
            if f.peer_goal and peer is not None and peer.wall:
                ok = ms - peer.median_ms() <= f.goal_ms
                line += f"  goal: within {f.goal_ms:g} ms of {peer.name}: {'met' if ok else 'MISSED'}"
            elif not f.peer_goal:
                line += f"  goal: under {f.goal_ms:g} ms: {'met' if ms < f.goal_ms else 'MISSED'}"
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10, help="measured rounds (default 10); each figure is the median")
    ap.add_argument("--no-ssh", action="store_true", help="leave out the SSH host (status over SSH, ssh true, runs)")
    ap.add_argument("--only", default=None, help="comma-separated figure names to keep (the peers are always kept)")
    ap.add_argument("--nvitop", default=None, help="the nvitop script (default: the one beside this python, else on PATH)")
    ap.add_argument("--base-bin", type=Path, default=None, help="another version's venv bin: its `status` over SSH in the same rounds")
    args = ap.parse_args()
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # as a user runs it: bytecode cached after the first call

    console = ConsoleSide()
    remote: SshHost | None = None
    base_remote: SshHost | None = None
    try:
        console.gpudeck_home.joinpath("config.toml").write_text(f'hosts = ["{REMOTE}"]\n' if not args.no_ssh else "hosts = []\n")
        os.environ["GPUDECK_SIMULATE_GPUS"] = "2"  # the agents' GPUs: SIMULATED (no GPU here), so status has rows to show
        console.local.start()
        peer_key: Path | None = None
        if not args.no_ssh:
            remote = SshHost(REMOTE, console.pub).start()
            console.add(remote)
            peer_key = console.ssh_dir / "id_peer"  # a second key, not locked to `gpudeck agent dial`: for `ssh HOST true`
            with open(remote.authorized, "a") as fh:
                fh.write(keygen(peer_key, "peer") + "\n")
            if args.base_bin is not None:
                base_remote = SshHost(BASE_REMOTE, console.pub)
                base_remote.authorized.write_text(f'restrict,command="{args.base_bin / "gpudeck"} agent dial" {console.pub}\n')
                base_remote.start()
                console.add(base_remote)
        env = console.env
        figs = figures(console, peer_key, not args.no_ssh, args.nvitop, args.base_bin)
        if args.only:
            keep = {s.strip() for s in args.only.split(",")}
            figs = [f for f in figs if f.name in keep or not f.name.startswith(("gpudeck", "base"))]
        load = os.getloadavg()
        print(
            f"cli {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start; python {sys.version.split()[0]}"
        )
        for f in figs:  # warm-up: the first call creates the history, starts nothing else
            run_once(f, env)
            f.wall.clear()
            f.cpu.clear()
        for _ in range(args.n):
            for f in figs:
                run_once(f, env)
        load = os.getloadavg()
        print(f"cli load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
        report(figs)
    finally:
        for r in (remote, base_remote):
            if r is not None:
                r.agent.stop()
        console.local.stop()
        console.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
