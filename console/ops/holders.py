"""Provides reclaim-and-launch: when pre-flight refuses a launch because stale or foreign processes hold its GPUs, name
exactly those processes, stop them (verified), pre-flight again and launch; the CLI's ``--reclaim-holders`` and the
Launch dialog's "Reclaim these and launch" both call :func:`reclaim_and_launch`.

What is reclaimed is what the agent's ``gpu_holders`` check named, nothing else:

- a STALE process (of an ended run) or a FOREIGN one (no gpudeck run) of the launch's operator is stopped;
- a process of **another user** (or of an unknown user) is refused: gpudeck does not stop someone else's work
  for you; it is named with its user and the fix is to ask them, pick other GPUs, or ``--force``;
- a process NVML reports and the OS here cannot see (another container) cannot be reclaimed and is refused;
- GPU memory no visible process explains (``details["unaccounted"]``: another PID namespace, the driver) has no
  pid to stop: reclaiming cannot fix it, so nothing is stopped;
- a process of a **live run** never blocks pre-flight (it is that run's), so it is never in the list; if the memory
  is short because of one, the other failed checks say so and nothing is stopped.

Any refused holder, or any failed check reclaiming cannot fix, refuses the whole action before anything is
stopped. After the reclaim, a survivor stops the flow (nothing launches); otherwise pre-flight runs again and
the launch goes ahead only if it passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import Snapshot, StopResult
from gpudeck.console.core.fmt import duration, gib
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.errors import OpsError
from gpudeck.console.ops.launch import LaunchPlan, LaunchResult, NodeOutcome, launch, preflight
from gpudeck.console.ops.stop import reclaim

HOLDERS_CHECK = "gpu_holders"
GRACE_S = 10.0


@dataclass(frozen=True)
class Holder:
    """One process pre-flight named as holding a GPU the launch needs: who it is, what it holds, and whether it may go."""

    host: str
    pid: int
    attribution: str  # STALE | FOREIGN | NO_SUCH_PROCESS
    user: str | None
    gpu_bytes: dict[int, int]
    run_id: str | None = None
    run_ended: float | None = None
    started: float | None = None  # the process's create time (its age), from the host's snapshot
    cmdline: tuple[str, ...] = ()
    refused: str | None = None  # why reclaim-and-launch will not stop it (None: it will)
    container: str = ""  # the container it runs in, seen from the host ('docker:trainer'), from the host's snapshot

    @property
    def held_bytes(self) -> int:
        """GPU memory it holds in all."""
        return sum(self.gpu_bytes.values())

    def who(self) -> str:
        """What it is, in words: 'stale, run r-1b2c (ended 2h ago)', 'foreign (not a gpudeck run)'."""
        if self.attribution == "STALE":
            ended = f", ended {duration(time.time() - self.run_ended)} ago" if self.run_ended else ""
            return f"stale, of ended run {self.run_id or '?'}{ended}"
        if self.attribution == "NO_SUCH_PROCESS":
            return "not visible here (another container or PID namespace)"
        return "foreign (not a gpudeck run)"

    def line(self) -> str:
        """One line of the list: pid, user, run, GiB per GPU, age, what it is, command, and a refusal if any."""
        gpus = ", ".join(f"GPU {g}: {gib(b)} GiB" for g, b in sorted(self.gpu_bytes.items()))
        age = duration(time.time() - self.started) if self.started else "-"
        text = (
            f"{self.host}:{self.pid:<8} user {self.user or '?':<10} run {self.run_id or '-':<12} {gpus}  age {age}  "
            f"{self.who()}  `{' '.join(self.cmdline)[:60]}`"
        ) + (f"  in container {self.container}" if self.container else "")
        return text + (f"  — REFUSED: {self.refused}" if self.refused else "")


@dataclass(frozen=True)
class HolderPlan:
    """What reclaim-and-launch would stop, what it refuses, and the failures reclaiming cannot fix."""

    holders: tuple[Holder, ...]
    other_failures: tuple[str, ...] = ()  # 'host: check: message' of failed checks other than gpu_holders

    @property
    def to_stop(self) -> list[Holder]:
        """The holders that will be stopped."""
        return [h for h in self.holders if h.refused is None]

    @property
    def blocked(self) -> str | None:
        """Why nothing may be stopped (None: the reclaim may go ahead)."""
        refused = [h for h in self.holders if h.refused]
        if refused:
            return "; ".join(f"pid {h.pid} on {h.host}: {h.refused}" for h in refused)
        if self.other_failures:
            return "reclaiming would not make pre-flight pass: " + "; ".join(self.other_failures)
        if not self.holders:
            return "pre-flight named no process to reclaim"
        return None

    def pids(self) -> dict[str, list[int]]:
        """The pids to stop, by host."""
        out: dict[str, list[int]] = {}
        for h in self.to_stop:
            out.setdefault(h.host, []).append(h.pid)
        return out

    def lines(self) -> list[str]:
        """The list as the operator reads it before saying yes (every holder, refused ones named as such)."""
        return [h.line() for h in self.holders]


def _failed(outcome: NodeOutcome) -> list[Any]:
    assert outcome.preflight is not None
    return [c for c in outcome.preflight.checks if not c.ok and not c.overridden]


def holder_plan(outcomes: list[NodeOutcome], snapshots: dict[str, Snapshot], operator: str | None) -> HolderPlan:
    """The plan from pre-flight's verdicts (which pids block) and each host's snapshot (their age); ``operator``: who asks."""
    by_pid: dict[str, dict[int, Any]] = {}
    for host, snap in snapshots.items():
        by_pid[host] = {p.pid: p for g in snap.gpus for p in g.processes}
    holders: dict[tuple[str, int], dict[str, Any]] = {}
    others: list[str] = []
    memory: list[tuple[str, dict[str, Any]]] = []
    for o in outcomes:
        if o.error is not None:
            others.append(f"{o.host}: pre-flight could not run: {o.error}")
            continue
        if o.preflight is None or o.preflight.ok:
            continue
        for c in _failed(o):
            if c.name != HOLDERS_CHECK:
                if c.name == "gpu_memory" and any(ch.name == HOLDERS_CHECK for ch in _failed(o)):
                    memory.append((o.host, c.details))  # short memory may be what the reclaim frees: weighed below
                    continue
                others.append(f"{o.host}: {c.name}: {c.message}")
                continue
            for u in c.details.get("unaccounted") or []:  # memory no visible process explains: no pid to stop
                others.append(
                    f"{o.host}: GPU {u.get('gpu')}: {gib(int(u.get('used_bytes') or 0))} GiB is held by no process visible there "
                    "(another PID namespace or the driver): it cannot be reclaimed from here"
                )
            for d in c.details.get("holders") or []:
                pid = int(d["pid"])
                entry = holders.setdefault((o.host, pid), {**d, "gpu_bytes": {}})
                entry["gpu_bytes"][int(d["gpu"])] = int(d.get("used_bytes") or 0)
    out = []
    for (host, pid), d in holders.items():
        proc = by_pid.get(host, {}).get(pid)
        user = d.get("user")
        refused = None
        if d["attribution"] == "NO_SUCH_PROCESS":
            refused = "the OS here cannot see it (another container): stop it where it runs, pick other GPUs, or --force"
        elif d["attribution"] not in ("STALE", "FOREIGN"):
            refused = f"it is {d['attribution']}, not a stale or foreign process: stop it yourself"
        elif not user or user != operator:
            refused = (
                f"it belongs to {'another user' if not user else 'user ' + user}, not to you ({operator or '?'}): "
                f"ask {user or 'its owner'} to stop it, pick other GPUs with --gpus, or launch anyway with --force"
            )
        out.append(
            Holder(
                host=host,
                pid=pid,
                attribution=str(d["attribution"]),
                user=user,
                gpu_bytes=dict(d["gpu_bytes"]),
                run_id=d.get("run_id"),
                run_ended=d.get("run_ended"),
                started=getattr(proc, "create_time", None),
                cmdline=tuple(d.get("cmdline") or ()),
                refused=refused,
                container=proc.container.label() if proc is not None and proc.container is not None else "",
            )
        )
    out.sort(key=lambda h: (h.host, min(h.gpu_bytes, default=0), -h.held_bytes, h.pid))
    others.extend(_short_after(memory, out))
    return HolderPlan(tuple(out), tuple(others))


def _short_after(memory: list[tuple[str, dict[str, Any]]], holders: list[Holder]) -> list[str]:
    """The GPUs whose memory stays short even once the holders that may go are stopped (reclaiming cannot fix those)."""
    short = []
    for host, details in memory:
        need = int(details.get("need_bytes") or 0)
        for g, free in (details.get("free_bytes") or {}).items():
            back = sum(h.gpu_bytes.get(int(g), 0) for h in holders if h.host == host and h.refused is None)
            if int(free) + back < need:
                short.append(
                    f"{host}: GPU {g} would have {gib(int(free) + back)} GiB free after the reclaim, the run needs {gib(need)} GiB"
                    " (the rest is held by live runs or processes not named here)"
                )
    return short


async def plan_holders(fleet: Fleet, plan: LaunchPlan, outcomes: list[NodeOutcome]) -> HolderPlan:
    """:func:`holder_plan` for these pre-flight verdicts, with each refusing host's snapshot fetched for the ages."""
    hosts = [o.host for o in outcomes if o.preflight is not None and not o.preflight.ok]
    snaps = await asyncio.gather(*(fleet.snapshot(h) for h in hosts), return_exceptions=True)
    got = {h: s for h, s in zip(hosts, snaps) if isinstance(s, Snapshot)}
    return holder_plan(outcomes, got, plan.spec.operator)


@dataclass
class ReclaimLaunch:
    """What reclaim-and-launch did, step by step: the plan, each host's verified reclaim, the second pre-flight, the launch."""

    holders: HolderPlan
    reclaimed: list[tuple[str, StopResult | str]] = field(default_factory=list)
    second: list[NodeOutcome] = field(default_factory=list)
    result: LaunchResult | None = None
    refused: str | None = None  # why it stopped before launching (None: it launched)


def reclaimed_text(host: str, res: StopResult | str) -> str:
    """One host's verified reclaim in a line: what ended and the GiB freed per GPU (or why it failed)."""
    if isinstance(res, str):
        return f"{host}: reclaim failed: {res}"
    per_gpu = ", ".join(
        f"GPU {f.gpu}: {gib(f.freed_bytes)} GiB freed" for f in res.freed if f.freed_bytes or f.before_bytes != f.after_bytes
    )
    ended = ", ".join(f"pid {p.pid} ({p.how})" for p in res.stopped) or "nothing ended"
    text = f"{host}: {ended} in {res.seconds:.1f} s; {per_gpu or 'no GPU memory came back'}"
    if not res.gpu_verified and res.gpu_note:
        text += f" ({res.gpu_note})"
    if res.survivors:
        text += "; SURVIVED: " + ", ".join(f"pid {p.pid} ({p.status or '?'})" for p in res.survivors)
    return text


async def reclaim_and_launch(
    fleet: Fleet,
    plan: LaunchPlan,
    holders: HolderPlan,
    request_id: str = "",
    grace_s: float = GRACE_S,
    step: Callable[[str], None] | None = None,
) -> ReclaimLaunch:
    """Stop exactly ``holders.to_stop`` (verified), pre-flight again, and launch if it passes; ``step`` hears each step.

    Refuses before stopping anything when ``holders.blocked``; a survivor or a second pre-flight failure stops the
    flow with ``refused`` set (nothing launched)."""
    say = step or (lambda _t: None)
    out = ReclaimLaunch(holders)
    if holders.blocked:
        out.refused = holders.blocked
        return out
    pids = holders.pids()
    say(f"reclaiming {sum(len(p) for p in pids.values())} process(es): SIGTERM, {grace_s:.0f} s grace, SIGKILL, then NVML verifies")
    out.reclaimed = await reclaim(fleet, pids, grace_s)
    for host, res in out.reclaimed:
        say(reclaimed_text(host, res))
    bad = [h for h, r in out.reclaimed if isinstance(r, str) or r.survivors]
    if bad:
        out.refused = f"the reclaim did not end every process on {', '.join(bad)}: nothing was launched"
        return out
    say(f"pre-flight again on {', '.join(plan.hosts)}")
    out.second = await preflight(fleet, plan)
    still = [o for o in out.second if o.error is not None or (o.preflight is not None and not o.preflight.ok)]
    if still:
        why = []
        for o in still:
            if o.error is not None:
                why.append(f"{o.host}: {o.error}")
            else:
                why.extend(f"{o.host}: {c.name}: {c.message}" for c in _failed(o))
        out.refused = "pre-flight still fails after the reclaim, nothing was launched: " + "; ".join(why)
        return out
    say(f"pre-flight passed; launching on {', '.join(plan.hosts)}")
    try:
        out.result = await launch(fleet, plan, request_id=request_id)
    except AgentError as exc:
        raise OpsError(f"the holders were reclaimed but the launch failed: {exc.message}") from None
    return out
