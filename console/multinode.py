"""Provides runs across several hosts: one run id, one node per host, one combined record.

Training across hosts is torch.distributed's job (torchrun's c10d rendezvous,
NCCL or gloo); gpudeck places the pieces, starts each host's node with the
same run id, watches and stops them together, and shows them as one run:

- every node runs ``torchrun --nnodes N --node-rank i --nproc-per-node G
  --rdzv-backend c10d --rdzv-endpoint <first host>:<port> --rdzv-id <run id>``;
- the rendezvous address is the first host as the others reach it: its
  ``rdzv_host`` from the config, else its SSH HostName;
- per host, ``nccl_socket_ifname`` / ``gloo_socket_ifname`` / ``env`` from the
  config go into that node's environment;
- the combined state is running while every node runs; the first node to fail
  is named in the cause; a node whose host is unreachable and never reported
  its end is ``lost``.
"""

from __future__ import annotations

import getpass
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from agents.protocol import LIVE_STATES, TERMINAL_STATES, LaunchSpec
from agents.supervisor import new_run_id
from console import config as cfg

DEFAULT_RDZV_PORT = 29400


class MultiNodeError(Exception):
    """A multi-node launch cannot be placed as asked; the message says what to change."""


def ssh_hostname(name: str, config_paths: Sequence[str]) -> str | None:
    """The HostName that ``~/.ssh/config`` gives ``name`` (None when the config names none)."""
    from asyncssh.config import SSHClientConfig

    try:
        conf = SSHClientConfig.load(None, list(config_paths), False, False, False, getpass.getuser(), "", name, ())
    except (OSError, ValueError):
        return None
    value = conf.get("Hostname")
    return str(value) if value else None


def rendezvous_host(first: cfg.HostSettings, config_paths: Sequence[str], override: str | None = None) -> str:
    """The address the other nodes reach the first host at."""
    if override:
        return override
    if first.rdzv_host:
        return first.rdzv_host
    if first.name == cfg.LOCAL:
        raise MultiNodeError("the first host is 'local': give --rdzv-host ADDRESS (how the other hosts reach this machine), or put another host first")
    return ssh_hostname(first.name, config_paths) or first.name


def node_env(settings: cfg.HostSettings) -> dict[str, str]:
    """The environment a host's config adds to its node (interfaces, extra variables)."""
    env = dict(settings.env)
    if settings.nccl_socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = settings.nccl_socket_ifname
    if settings.gloo_socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = settings.gloo_socket_ifname
    return env


def node_specs(
    base: LaunchSpec,
    hosts: list[cfg.HostSettings],
    *,
    python: str,
    program: list[str],
    nproc_per_node: int,
    rdzv_host: str,
    rdzv_port: int = DEFAULT_RDZV_PORT,
    run_id: str | None = None,
    local_addrs: list[str | None] | None = None,
) -> list[tuple[str, LaunchSpec]]:
    """One spec per host: the same run id, its node rank, torchrun around ``program`` (``-m module args`` or ``script args``)."""
    if len(hosts) < 2:
        raise MultiNodeError("a multi-node run needs at least two hosts: --hosts gpu1,gpu2")
    if len({h.name for h in hosts}) != len(hosts):
        raise MultiNodeError("a host is listed twice in --hosts")
    rid = run_id or new_run_id()
    names = [h.name for h in hosts]
    # the address each node's workers are reached at (torchrun --local-addr; else torchrun guesses from the hostname)
    local_addrs = local_addrs or [rdzv_host if i == 0 else h.rdzv_host for i, h in enumerate(hosts)]
    out = []
    for rank, h in enumerate(hosts):
        argv = [
            python, "-m", "torch.distributed.run",
            "--nnodes", str(len(hosts)), "--node-rank", str(rank), "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rdzv_host}:{rdzv_port}", "--rdzv-id", rid,
            # say who hosts the rendezvous store: the address may not be one torchrun recognises as its own (NAT, several NICs)
            "--rdzv-conf", f"is_host={'true' if rank == 0 else 'false'}",
            *(["--local-addr", local_addrs[rank]] if local_addrs[rank] else []),
            *program,
        ]
        env = {**node_env(h), **base.env}
        out.append((h.name, msgspec.structs.replace(
            base, argv=argv, env=env, run_id=rid, nnodes=len(hosts), node_rank=rank, nodes=names,
            rdzv_port=rdzv_port if rank == 0 else None, expected_ranks=nproc_per_node,
        )))
    return out


# ----------------------------------------------------------------------------- one record


@dataclass
class CombinedRun:
    """A run as one record across its nodes (or the single row of a one-host run)."""

    id: str
    hosts: list[str]
    state: str
    cause: str | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    ranks_seen: int = 0
    world_size: int | None = None
    started: float | None = None
    ended: float | None = None

    def as_row(self) -> dict[str, Any]:
        """The first node's row with the combined fields (what `history` and `runs` print)."""
        base = dict(self.rows[0]) if self.rows else {"id": self.id}
        base.update(host="+".join(self.hosts), hosts=self.hosts, state=self.state, cause=self.cause, ranks_seen=self.ranks_seen,
                    started=self.started, ended=self.ended, nodes=[{"host": r["host"], "state": r["state"], "cause": r.get("cause")} for r in self.rows])
        if self.world_size is not None:
            base["world_size"] = self.world_size
        return base


def _node_rank(row: dict[str, Any]) -> int:
    spec = row.get("spec") or {}
    nr = spec.get("node_rank")
    return int(nr) if isinstance(nr, int) else 0


def _first_trouble(row: dict[str, Any]) -> float:
    """When this node's trouble began: its earliest rank death (when the rank was first seen gone), else its end."""
    times = [float(row.get("ended") or 0) or float("inf")]
    for a in row.get("alerts") or []:
        if not isinstance(a, dict) or a.get("kind") != "rank_exited":
            continue
        data = a.get("data") or {}
        if isinstance(data.get("gone_since"), (int, float)):
            times.append(float(data["gone_since"]))
        elif isinstance(a.get("ts"), (int, float)):
            times.append(float(a["ts"]) - float(data.get("gone_s") or 0))
    return min(times)


def combine(rows: list[dict[str, Any]], unreachable: set[str] | None = None) -> CombinedRun:
    """One record from a run's rows on several hosts (history rows or RunInfo dicts)."""
    rows = sorted(rows, key=_node_rank)
    unreachable = unreachable or set()
    states = [r["state"] for r in rows]
    hosts = [r["host"] for r in rows]
    spec = rows[0].get("spec") or {}
    expected = len(spec.get("nodes") or []) or len(rows)
    starts = [r["started"] for r in rows if r.get("started")]
    ends = [r["ended"] for r in rows if r.get("ended")]
    cause: str | None = None
    lost = [r for r in rows if r["state"] in LIVE_STATES and r["host"] in unreachable]
    failed = sorted((r for r in rows if r["state"] in ("failed", "lost", "preflight_failed")), key=_first_trouble)
    missing = expected - len(rows)
    absent = [h for h in (spec.get("nodes") or []) if h not in hosts]
    stopped = [r for r in rows if r["state"] == "stopped"]
    t_stop = min((r.get("ended") or 0) for r in stopped) if stopped else 0.0
    if stopped and not missing and all(s in TERMINAL_STATES for s in states) and all((r.get("ended") or 0) >= t_stop - 5 for r in rows):
        # an operator's stop of some nodes: the others end with it (a trainer's agreed stop, lost peers)
        state = "stopped"
        others = [r for r in rows if r["state"] != "stopped"]
        cause = stopped[0].get("cause") or "stopped"
        if others:
            cause += "; " + ", ".join(f"node {_node_rank(r)} ({r['host']}) ended with it: {r.get('cause') or r['state']}" for r in others)
    elif all(s in ("running",) for s in states) and not lost and not missing:
        state = "running"
    elif all(s in ("running",) for s in states) and absent and not lost:
        state = "running"
        cause = "; ".join(f"node {h} not reachable: not observed" for h in absent)
    elif failed:
        state = "failed" if failed[0]["state"] != "lost" else "lost"
        first = failed[0]
        cause = f"node {_node_rank(first)} ({first['host']}) failed first: {first.get('cause') or first['state']}"
    elif lost and all(s in TERMINAL_STATES for r, s in zip(rows, states) if r not in lost):
        state = "lost"
        cause = "; ".join(f"node {_node_rank(r)} ({r['host']}) became unreachable and never reported back" for r in lost)
    elif any(s in ("stopping",) for s in states):
        state = "stopping"
    elif any(s in LIVE_STATES for s in states):
        state = "running"
        if lost:
            cause = "; ".join(f"node {_node_rank(r)} ({r['host']}) unreachable: its end is not known yet" for r in lost)
    elif all(s == "succeeded" for s in states):
        state, cause = "succeeded", rows[0].get("cause")
    elif all(s == "stopped" for s in states):
        state, cause = "stopped", rows[0].get("cause")
    else:
        state = "failed"
        cause = "; ".join(f"{r['host']}: {r['state']}" for r in rows)
    if missing > 0 and state in TERMINAL_STATES and cause is None:
        cause = f"{missing} node(s) never reported"
    return CombinedRun(
        id=rows[0]["id"], hosts=hosts, state=state, cause=cause, rows=rows,
        ranks_seen=sum(int(r.get("ranks_seen") or len({m.get('rank') for m in r.get('members') or [] if m.get('rank') is not None})) for r in rows),
        world_size=next((r.get("world_size") for r in rows if r.get("world_size")), None),
        started=min(starts) if starts else None,
        ended=max(ends) if ends and state in TERMINAL_STATES else None,
    )


def group(rows: list[dict[str, Any]], unreachable: set[str] | None = None) -> list[dict[str, Any]]:
    """Rows with the nodes of each multi-node run folded into one (order kept: newest first)."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []
    for r in rows:
        if r["id"] not in by_id:
            order.append(r["id"])
        by_id.setdefault(r["id"], []).append(r)
    out = []
    for rid in order:
        rs = by_id[rid]
        multi = len(rs) > 1 or ((rs[0].get("spec") or {}).get("nnodes") or 1) > 1
        out.append(combine(rs, unreachable).as_row() if multi else rs[0])
    return out


def program_of(argv: list[str], kind: str, trainer_args: bool) -> list[str]:
    """What torchrun runs: ``-m trainers.X args`` for --kind with trainer arguments, else the argv (a script or ``-m module``)."""
    if trainer_args:
        return ["-m", "trainers.fsdp_lm" if kind == "fsdp" else "trainers.dflash", *argv]
    if argv and (argv[0] == "-m" or argv[0].endswith(".py")):
        return list(argv)
    if len(argv) >= 3 and Path(argv[0]).name.startswith("python") and argv[1] == "-m":
        return list(argv[1:])  # `python -m module ...`: torchrun brings its own python
    raise MultiNodeError("a multi-node run's command is what torchrun starts on each node: `-m package.module ARGS` or `script.py ARGS` (or --kind fsdp -- TRAINER ARGS)")
