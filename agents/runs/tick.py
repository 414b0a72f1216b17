"""Provides the supervision tick: a look at every live run, read in a thread, judged on the event loop.

A tick has two halves. :func:`scan` runs in a worker thread and does every read
whose cost grows with the host or the run: parentage (tag-level runs only), one
GPU sample with each holder attributed to its run, each member's liveness, and
one :func:`look` per run (its cgroup's processes, new members' identities, the
group's kernel figures). :func:`judge` runs on the event loop and only applies
what was read: members added, ends decided, the health rules, alerts journaled.
A run whose members changed between the two halves (a request handler ran
meanwhile) is looked at again on the loop, so nothing stale is applied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.health import triage
from gpudeck.agents.health.rules import Baseline, observe
from gpudeck.agents.observe.procs import StatLine, alive
from gpudeck.agents.runs import ending, run_telemetry
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.safety import unaccounted
from gpudeck.agents.safety.containment import GroupFigures, put_figures
from gpudeck.agents.safety.membership import Discovery, discover, proc_tree
from gpudeck.agents.wire.errors import StorageError
from gpudeck.agents.wire.protocol import Gpu, Member

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor

log = logging.getLogger("gpudeck.agent")

RANK_DEATH_STOP_GRACE_S = 30.0  # --on-rank-death stop: the grace the survivors get to checkpoint
LEDGER_IDLE_S = 1.0  # an agent with no live run samples its GPUs this often for the ledger (with runs: every tick)
FRESH_S = 0.05  # a process-table refresh this recent (the agent's sampler thread does one right before the tick) is reused


@dataclass
class Look:
    """One look at a run's processes, taken against ``members`` (applied only while the run still has that list)."""

    members: list[Member]
    found: Discovery
    figures: GroupFigures | None = None


@dataclass
class Scan:
    """What a tick read off the loop."""

    tree: dict[int, StatLine] | None = None
    gpus: list[Gpu] | None = None  # attributed
    alive_now: dict[tuple[int, float], bool] = field(default_factory=dict)
    looks: dict[str, Look] = field(default_factory=dict)


def _watched(sup: Supervisor) -> list[LiveRun]:
    """The runs a tick judges: live, not launching, not being stopped."""
    return [
        lr
        for lr in sup.runs.live()
        if lr.info.state in ("running", "starting", "stopping") and not lr.launching and not sup.runs.stopping(lr.id)
    ]


def look(sup: Supervisor, lr: LiveRun, tree: dict[int, StatLine] | None) -> Look:
    """Read a run's processes now (safe in a worker thread: it reads, it changes nothing)."""
    members = lr.info.members
    if lr.group is None and tree is None:
        tree = proc_tree()
    found = discover(lr.info, sup.procs, lr.group, tree, sup.uid)
    return Look(members=members, found=found, figures=lr.group.figures() if lr.group is not None else None)


def apply_look(sup: Supervisor, lr: LiveRun, lk: Look, alive_now: dict[tuple[int, float], bool] | None = None) -> bool:
    """Fold a look into the run (on the loop): its containment's report, new and updated members journaled."""
    run = lr.info
    d = lk.found
    info = run.containment
    if info is not None:
        if lr.group is not None and d.in_group is not None:
            info.untagged = sorted(set(info.untagged) & d.in_group | set(d.untagged))
        if lk.figures is not None:
            put_figures(info, lk.figures)
        info.outside = d.outside
        info.other_uid = d.other_uid
        for r in d.outside + d.other_uid:
            if r.pid not in lr.reported_pids:
                lr.reported_pids.add(r.pid)
                log.warning("run %s: pid %d %s", run.id, r.pid, r.why)
    if not d.new and not d.updated:
        return False
    known = alive_now or {}

    def lives(m: Member) -> bool:
        got = known.get((m.pid, m.create_time))
        return alive(m.pid, m.create_time) if got is None else got

    # workers that came and went (shell helpers, finished DataLoader workers) leave the list;
    # the journal's "members" events keep their history
    members = [d.replaces.get(id(m), m) for m in run.members if m.role in ("shim", "leader") or lives(m)] + d.new

    def brief(ms: list[Member]) -> list[dict]:
        out = []
        for m in ms:
            b: dict = {"pid": m.pid, "rank": m.rank, "local_rank": m.local_rank, "cmdline": m.cmdline[:8]}
            if m.found_by:
                b["found_by"] = m.found_by
            if not m.tagged:
                b["tagged"] = False
            out.append(b)
        return out

    data = {"added": brief(d.new)}
    if d.updated:
        data["updated"] = brief(d.updated)  # members already journaled, now with their rank: replaced, not added
    sup.runs.update(run, "members", data, members=members)
    return True


def discover_members(sup: Supervisor, lr: LiveRun, tree: dict[int, StatLine] | None) -> bool:
    """Look at a run and apply it at once (adoption, stop: where the loop waits for the answer anyway)."""
    return apply_look(sup, lr, look(sup, lr, tree))


def scan(sup: Supervisor, runs: list[LiveRun]) -> Scan:
    """The reading half of a tick (a worker thread): parentage, the attributed GPU sample, liveness, one look per run."""
    want_tree = any(lr.group is None and lr.info.state in ("running", "starting") for lr in runs)
    got = Scan()
    got.tree = sup.tree.scan() if want_tree else None
    if sup.gpus.available and (runs or sup.ledger.enabled):  # a run being launched: the ledger's sample still
        got.gpus = sup.attributed_gpus(sup.gpus.sample())
        feed_ledger(sup, got.gpus)
    got.alive_now = {(m.pid, m.create_time): alive(m.pid, m.create_time) for lr in runs for m in lr.info.members}
    for lr in runs:
        got.looks[lr.id] = look(sup, lr, got.tree)
    return got


def feed_ledger(sup: Supervisor, gpus: list[Gpu], idle: bool = False) -> None:
    """The GPU ledger gets the tick's attributed sample (agents/observe/ledger.py); a failure of it is logged, never
    the tick's (supervision goes on without the ledger)."""
    if not sup.ledger.enabled:
        return
    try:
        held = {u.gpu: u.used_bytes for u in unaccounted.holders(gpus, None, sup.gpus.simulated)}
        sup.ledger.observe(gpus, held, idle=idle)
        if sup.ledger.compact_due():
            sup.ledger.compact()
    except StorageError:
        raise  # the tick says so in every snapshot and retries
    except Exception:
        log.exception("GPU ledger: this sample was not recorded")


def _ledger_sample(sup: Supervisor) -> None:
    """An idle agent's sample for the ledger (a worker thread): the table refreshed, one attributed GPU sample."""
    sup.procs.refresh(max_age=FRESH_S)
    # a snapshot a watching console asked for this last second is the look (its pids and bytes: set when it was
    # sampled, whatever its attribution is doing meanwhile); without one, a sample of our own
    recent = getattr(sup.gpus, "last_sample", None)
    raw = recent[1] if recent is not None and time.monotonic() - recent[0] < LEDGER_IDLE_S else None
    if raw is not None and sup.ledger.unchanged(raw, remember=False):
        return  # the same processes hold the same bytes: nothing to attribute, nothing to record
    raw = sup.gpus.sample()
    if sup.ledger.unchanged(raw):
        return
    feed_ledger(sup, sup.attributed_gpus(raw), idle=True)


def judge(sup: Supervisor, got: Scan) -> None:
    """The deciding half of a tick (on the loop): telemetry folded, members applied, ends decided, health judged."""
    for lr in sup.runs.live():
        run = lr.info
        if run.state not in ("running", "starting", "stopping") or sup.runs.get(run.id) is not lr:
            continue
        run_telemetry.poll(sup, lr)
        if sup.runs.stopping(run.id) or lr.launching:
            continue
        lk = got.looks.get(run.id)
        if lk is not None and lk.members is run.members:
            apply_look(sup, lr, lk, got.alive_now)
        else:  # changed (or started) since the scan: looked at again, here
            discover_members(sup, lr, got.tree)
        life = ending.liveness(lr)
        if not life.alive:
            ending.finish(sup, lr)
            continue
        lr.mark_seen_alive(time.time())
        ending.note_shim_gone(sup, lr, life)
        check_health(sup, lr, got.gpus or [], got.alive_now)
    sup.runs.settle_emptied_groups()


def refresh(sup: Supervisor) -> None:
    """One supervision tick, all on the calling thread (tests, benchmarks; the agent uses :func:`tick`)."""
    sup.procs.refresh()
    judge(sup, scan(sup, _watched(sup)))


def _refreshed_scan(sup: Supervisor, runs: list[LiveRun]) -> Scan:
    # the agent's sampler thread refreshed the table a moment ago (then this reads nothing again); a caller without
    # one (tests, benchmarks) pays for the re-check of every tagged process here, in the thread, not on the loop
    sup.procs.refresh(max_age=FRESH_S)
    return scan(sup, runs)


async def tick(sup: Supervisor) -> None:
    """One supervision tick: the reading half in a thread, the deciding half back on the loop."""
    if not sup.runs.any_live():
        sup.procs.refresh(max_age=FRESH_S)  # idle: nothing tagged to re-check, and no thread hop for nothing
        if sup.runs.ended_groups():
            judge(sup, Scan())
        if sup.gpus.available and sup.ledger.due(LEDGER_IDLE_S):
            await asyncio.to_thread(_ledger_sample, sup)
        return
    got = await asyncio.to_thread(_refreshed_scan, sup, _watched(sup))
    judge(sup, got)  # back on the loop: request handlers may have changed runs meanwhile, so judge what is there now


def poll_shims(sup: Supervisor) -> None:
    """Reap this agent's own children (the shims) so none lingers as a zombie."""
    for lr in sup.runs.live():
        if lr.shim is not None:
            lr.shim.poll()


def check_health(sup: Supervisor, lr: LiveRun, gpus: list[Gpu], alive_now: dict[tuple[int, float], bool]) -> None:
    """The health rules over one observation of the run; alerts journaled; --on-rank-death stop acted on."""
    run = lr.info
    health = lr.health_state()

    def is_alive(m: Member) -> bool:
        known = alive_now.get((m.pid, m.create_time))
        return alive(m.pid, m.create_time) if known is None else known

    obs = observe(run, time.time(), gpus, is_alive, stopping=run.state == "stopping")
    lr.note_observation(obs)
    raised = health.update(obs, baseline(sup, lr))
    cleared = health.cleared_since_last()
    if raised or cleared:
        items: list[tuple[str, str | None, dict]] = [("alert", run.id, {"alert": msgspec.to_builtins(a)}) for a in raised]
        items += [("alert_cleared", run.id, {"alert": msgspec.to_builtins(a)}) for a in cleared]
        sup.runs.emit_many(items, f"run {run.id}'s {len(items)} alert event(s)")
        for a in raised:
            log.warning("run %s: %s", run.id, a.message)
            if a.kind == "rank_exited":
                lr.note_rank_death(a)
    run.alerts = health.active
    triage.on_alerts(sup, lr, raised)  # --on-hang: evidence from every rank (then a stop) when a hang is raised
    if health.wants_stop and not sup.runs.stopping(run.id):
        death = lr.first_death
        why = f"a rank died ({death.message.split(':')[0]})" if death else "a rank died"
        sup.spawn_bg(
            sup.stop(
                run.id, RANK_DEATH_STOP_GRACE_S, reason=f"stopped by gpudeck: {why} and the run was launched with --on-rank-death stop"
            )
        )


def baseline(sup: Supervisor, lr: LiveRun) -> Baseline | None:
    """The median throughput of the newest earlier run with the same config (looked up once per run)."""
    if lr.baseline_known():
        return lr.baseline_value()
    tel = lr.info.telemetry
    if tel is None or not tel.config_hash:
        return None  # not known yet: look again next tick
    found = sup.journal.throughput_baseline(tel.config_hash, tel.world_size, exclude=lr.id)
    lr.set_baseline(Baseline(run_id=found[0], median_tokens_per_s=found[1], config_hash=tel.config_hash) if found else None)
    return lr.baseline_value()
