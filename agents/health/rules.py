"""Provides the health rules of live runs (failure 4) and the check of their claims against what is observed (failure 7).

Pure and time-injected: nothing here calls psutil or NVML. The supervisor
gathers the facts of one run every tick into an ``Observation`` (``observe``
builds one from the run, the sampled GPUs and an ``alive`` test) and hands it
to that run's ``RunHealth``, which answers with the alerts raised by this
update. An alert is raised once per condition (kind + rank / GPU / claim); it
stays in ``active`` until the condition resolves, then its ``cleared`` is set,
it leaves ``active`` and ``cleared_since_last()`` returns it once.

Rules (thresholds are the module constants below):

1. ``rank_exited`` (critical): a rank seen alive earlier is gone while the run
   goes on (not stopping, not done). ``rank_death`` turns True, so the
   supervisor can apply ``--on-rank-death stop``.
2. ``heartbeat_lost`` (critical): a rank's process is alive but its telemetry
   is older than ``HEARTBEAT_LOST_S`` (only once it has reported).
3. ``gpu_idle`` (warning): a GPU of the running run at 0% utilisation for
   ``GPU_IDLE_S`` without a break.
4. ``throughput_drop`` (warning): tokens/s below ``THROUGHPUT_RATIO`` of the
   run's own 10-minute median, or of an earlier run's median with the same
   config (``Baseline``); it clears once every step for ``THROUGHPUT_RECOVER_S``
   is back at or above that line.
5. ``hang`` (critical): the run's steps stopped advancing while it goes on: no
   step record for ``hang_threshold`` (max(``HANG_STEP_FACTOR`` x its median
   step time, ``LaunchSpec.hang_after_s`` or ``HANG_AFTER_S``)); clears at the
   next step. The supervisor acts on ``--on-hang`` (agents/health/triage.py).
6. ``straggler`` (warning): a rank whose median compute time (not waiting in
   collectives) over its last ``straggler_window`` steps is at least
   ``STRAGGLER_RATIO`` x the median of the other ranks' medians; clears when it
   is back under that line.
7. ``claim_mismatch`` (warning): what the operator claims (``LaunchSpec.claims``,
   the run's name and note, ``--gpus``) differs from what is observed.

``obs.now`` is wall-clock time (``time.time()``): the trainers stamp their
telemetry with it, and heartbeat age is ``now - last_seen``.
"""

from __future__ import annotations

import re
import signal
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from gpudeck.agents.wire.protocol import Alert, ClaimRow, Claims, Gpu, Member, RunInfo, RunTelemetry

# ----------------------------------------------------------------------------- thresholds

HEARTBEAT_LOST_S = 20.0  # trainers beat every 5 s and promise at most 10 s apart: 20 s is two missed promises
GPU_IDLE_S = 60.0  # 0% utilisation this long, without a break, on a GPU of a running run
THROUGHPUT_RATIO = 0.6  # below this fraction of the reference median is a drop (and at/above it, recovered)
THROUGHPUT_WINDOW_S = 600.0  # the run's own median is over its steps of the last 10 minutes
THROUGHPUT_MIN_SAMPLES = 5  # the own median needs this many steps ...
THROUGHPUT_MIN_SPAN_S = 60.0  # ... spanning this long (the first steps compile and warm caches)
# A drop needs this many consecutive slow steps: one slow step (a recompile, the step after a
# checkpoint, a GC pause) is not a slower run. Recovery needs as many steps back above the line.
THROUGHPUT_CONFIRM_SAMPLES = 2
THROUGHPUT_RECOVER_S = 30.0  # a drop clears once throughput has been back above the line this long, every step
THROUGHPUT_HISTORY_MAX = 4096  # (ts, tokens/s) kept per run; at most 2 new steps a tick are seen anyway
HANG_AFTER_S = 120.0  # no step record this long (at least) is a hang; LaunchSpec.hang_after_s replaces it
HANG_STEP_FACTOR = 5.0  # ... or this many median step times, whichever is longer
STRAGGLER_RATIO = 1.3  # a rank computing this much longer than the median of the others is a straggler
STRAGGLER_WINDOW = 8  # steps each rank's median compute time is taken over (LaunchSpec.straggler_window replaces it)
RANK_EXIT_GRACE_S = 1.0  # a rank gone with no known exit code: two ticks, so a run ending normally closes first
# A rank that exited 0 while its peers go on and the run reported no "done": after this long the
# peers are waiting for it in a collective that never completes.
RANK_CLEAN_EXIT_GRACE_S = 30.0
CLAIM_SETTLE_S = 60.0  # without a first step in the telemetry, claims are checked this long after start
# parameter claims: names round down (Llama-3.2-1B is 1.24e9, Gemma-2b 2.5e9) but "1B" that is 771M is the lie
PARAMS_CLAIM_LOW = 0.9
PARAMS_CLAIM_HIGH = 1.3
PARAMS_CONFIG_TOL = 0.10  # manifest vs the parameter count worked out from the model config
DATASET_TOL = 0.10  # dataset samples: claimed vs the manifest
TPS_CLAIM_TOL = 0.20  # measured tokens/s may be this much below the claim; above it is never a mismatch
HISTORY_MAX = 200  # alerts (raised and cleared) a RunHealth keeps for history

GIB = 2**30


# ----------------------------------------------------------------------------- inputs and outputs


@dataclass(frozen=True)
class Observation:
    """The facts of one run at one tick, as the supervisor gathered them.

    ``live_ranks``: rank -> pid of the live process carrying that rank.
    ``exited_ranks``: rank -> (pid, exit code or None) for rank processes that
    were members and are gone (the health rules also notice ranks that leave
    ``live_ranks`` without being listed here; this adds the exit code).
    ``gpu_util``: every GPU of the host (index -> utilisation %, None: unknown);
    empty without GPUs. ``run_gpu_memory``: GPU index -> bytes the run's pids
    hold there per NVML; a key is present when a run pid is on that GPU (its
    bytes may be 0 when the driver does not say). Multi-node: union the
    ranks and GPUs of all hosts and set ``whole_run``. ``dataset_samples``,
    ``dataset_tokens``: from the manifest (None: read from the telemetry
    summary when it carries them). ``config_params``: the parameter count
    worked out from the model config (pre-flight's estimate).
    """

    now: float
    run: RunInfo
    live_ranks: dict[int, int] = field(default_factory=dict)
    exited_ranks: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    gpu_util: dict[int, int | None] = field(default_factory=dict)
    run_gpu_memory: dict[int, int] = field(default_factory=dict)
    gpu_uuids: dict[int, str] = field(default_factory=dict)
    stopping: bool = False
    dataset_samples: int | None = None
    dataset_tokens: int | None = None
    config_params: int | None = None
    whole_run: bool | None = None  # ranks/GPUs of all the run's hosts; None: True unless spec.nnodes > 1

    @property
    def covers_whole_run(self) -> bool:
        """True when the ranks and GPUs here are all of the run's (single node, or unioned over its hosts)."""
        return self.whole_run if self.whole_run is not None else (self.run.spec.nnodes or 1) <= 1


@dataclass(frozen=True)
class Baseline:
    """The median tokens/s of an earlier run with the same config (the supervisor finds it in the journal)."""

    run_id: str
    median_tokens_per_s: float
    config_hash: str = ""


@dataclass(frozen=True)
class NameClaims:
    """What a run's name or note claims, parsed conservatively (an ambiguous figure is no claim)."""

    gpus: int | None = None
    params: int | None = None
    tokens_per_s: float | None = None


# ----------------------------------------------------------------------------- building an observation


def observe(
    run: RunInfo,
    now: float,
    gpus: Sequence[Gpu],
    alive: Callable[[Member], bool],
    *,
    stopping: bool = False,
    exited_ranks: Mapping[int, tuple[int, int | None]] | None = None,
) -> Observation:
    """An Observation of ``run`` from the sampled GPUs and an ``alive(member)`` test (the supervisor's psutil check).

    A member's rank is its RANK tag, or the rank whose manifest names its pid
    (a trainer started without torchrun has no RANK but reports rank 0). When
    several live members carry one rank (DataLoader workers inherit RANK), the
    rank's process is the one its manifest names, else the oldest.
    """
    tel = run.telemetry
    pid_rank: dict[int, int] = {}
    manifest_pid: dict[int, int] = {}
    if tel is not None:
        for rt in tel.ranks.values():
            if rt.pid is not None:
                pid_rank[rt.pid] = rt.rank
                manifest_pid[rt.rank] = rt.pid
    candidates: dict[int, list[Member]] = {}
    for m in run.members:
        if m.role == "shim":
            continue
        rank = m.rank if m.rank is not None else pid_rank.get(m.pid)
        if rank is None or not alive(m):
            continue
        candidates.setdefault(rank, []).append(m)
    live: dict[int, int] = {}
    for rank, ms in candidates.items():
        named = next((m for m in ms if m.pid == manifest_pid.get(rank)), None)
        live[rank] = (named or min(ms, key=lambda m: m.create_time)).pid
    member_pids = {m.pid for m in run.members}
    held: dict[int, int] = {}
    for g in gpus:
        for p in g.processes:
            if p.run_id == run.id or p.pid in member_pids:
                held[g.index] = held.get(g.index, 0) + (p.used_bytes or 0)
    est = run.preflight.estimate if run.preflight is not None else None
    return Observation(
        now=now,
        run=run,
        live_ranks=live,
        exited_ranks=dict(exited_ranks or {}),
        gpu_util={g.index: g.util_gpu for g in gpus},
        run_gpu_memory=held,
        gpu_uuids={g.index: g.uuid for g in gpus},
        stopping=stopping,
        config_params=est.params if est is not None and est.params > 0 else None,
    )


# ----------------------------------------------------------------------------- claims in names

_GPU_RE = re.compile(
    r"(?<![0-9a-z.])(\d{1,3})\s*(?:[-_ ]?\s*gpus?|\s*x\s*(?:[abhlv]\d{2,3}s?|gpus?))(?![a-z])",
    re.IGNORECASE,
)
_PARAMS_RE = re.compile(
    r"(?<![0-9a-z.])(\d{1,4}(?:\.\d{1,3})?)\s*([mb])(\s*[-_ ]?\s*param(?:eter)?s?)?(?![0-9a-z])(?!\s*[-_ ]?\s*(?:tok|sample|step|seq|ctx|data|row|doc|line))",
    re.IGNORECASE,
)
_TPS_RE = re.compile(
    r"(?<![0-9a-z.,])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)\s*([km])?\s*tok(?:en)?s?\s*/\s*s(?:ec)?(?![a-z])",
    re.IGNORECASE,
)


_T = TypeVar("_T")


def _one(values: set[_T]) -> _T | None:
    """The single value, or None when there is none or several disagree (no guessing)."""
    return next(iter(values)) if len(values) == 1 else None


def parse_claims(text: str | None) -> NameClaims:
    """Claims a run name or note makes: "1b-4gpu", "4 GPUs", "8xH100", "1B params", "125m", "12k tok/s"."""
    if not text:
        return NameClaims()
    gpus = {int(m.group(1)) for m in _GPU_RE.finditer(text) if int(m.group(1)) > 0}
    params: set[int] = set()
    for m in _PARAMS_RE.finditer(text):
        number, billions, said = float(m.group(1)), m.group(2).lower() == "b", m.group(3) is not None
        if not billions and number < 100 and not said:
            continue  # "30m" is as often thirty minutes as 30M parameters; "125m" and "30m-params" are models
        value = int(round(number * (1e9 if billions else 1e6)))
        if value > 0:
            params.add(value)
    tps: set[float] = set()
    for m in _TPS_RE.finditer(text):
        rate = float(m.group(1).replace(",", "")) * {"k": 1e3, "m": 1e6}.get((m.group(2) or "").lower(), 1.0)
        if rate > 0:
            tps.add(rate)
    return NameClaims(gpus=_one(gpus), params=_one(params), tokens_per_s=_one(tps))


# ----------------------------------------------------------------------------- claims vs observed


def _claim_from(run: RunInfo, what: str) -> tuple[int | float | None, str]:
    """The claimed figure and where it comes from: explicit claims, then the run's name, then its note."""
    claims = run.spec.claims or Claims()
    explicit = getattr(claims, what)
    if explicit is not None:
        return explicit, "claims"
    name = run.name or run.spec.name
    from_name = getattr(parse_claims(name), what, None)
    if from_name is not None:
        return from_name, f"run name {name!r}"
    from_note = getattr(parse_claims(claims.note), what, None)
    if from_note is not None:
        return from_note, "note"
    return None, ""


def _manifest(obs: Observation, name: str) -> int | None:
    given = getattr(obs, name)
    if given is not None:
        return given
    # RunTelemetry carries the manifest's dataset figures once agents/observe/telemetry.py folds them
    value = getattr(obs.run.telemetry, name, None) if obs.run.telemetry is not None else None
    return value if isinstance(value, int) else None


def _within(observed: float, claimed: float, low: float, high: float) -> bool:
    return claimed * low <= observed <= claimed * high


def _gpu_list(gpus: Sequence[int]) -> str:
    return ", ".join(f"GPU {g}" for g in sorted(gpus)) or "none"


def _median_tps(tel: RunTelemetry | None) -> float | None:
    """Median of the telemetry summary's recent steps, once there are enough to mean anything."""
    if tel is None or len(tel.tps_history) < THROUGHPUT_MIN_SAMPLES:
        return None
    return float(statistics.median(tel.tps_history))


def claims_report(obs: Observation, measured_tokens_per_s: float | None = None, world_size_observed: int | None = None) -> list[ClaimRow]:
    """Claimed vs observed for every figure, rows included when nothing is claimed (``gpudeck verify RUN``).

    ``measured_tokens_per_s`` defaults to the median of the telemetry's recent
    steps; ``world_size_observed`` to the ranks live now.
    """
    run, tel = obs.run, obs.run.telemetry
    rows: list[ClaimRow] = []
    params_obs = tel.params_total if tel is not None else None
    claimed, source = _claim_from(run, "params")
    rows.append(
        ClaimRow(
            "params",
            claimed,
            params_obs,
            None if claimed is None or params_obs is None else _within(params_obs, claimed, PARAMS_CLAIM_LOW, PARAMS_CLAIM_HIGH),
            source,
            "manifest params_total" if params_obs is not None else "",
        )
    )
    if obs.config_params is not None:
        rows.append(
            ClaimRow(
                "params (model config)",
                obs.config_params,
                params_obs,
                None if params_obs is None else _within(params_obs, obs.config_params, 1 - PARAMS_CONFIG_TOL, 1 + PARAMS_CONFIG_TOL),
                "model config",
                "",
            )
        )

    ws_obs = world_size_observed if world_size_observed is not None else (len(obs.live_ranks) or None)
    explicit_ws = (run.spec.claims or Claims()).world_size
    if explicit_ws is not None:
        ws_claim, ws_source = explicit_ws, "claims"
    elif run.spec.expected_ranks is not None:
        ws_claim, ws_source = run.spec.expected_ranks, "torchrun arguments"
    elif tel is not None and tel.world_size is not None:
        ws_claim, ws_source = tel.world_size, "manifest"
    else:
        ws_claim, ws_source = None, ""
    # a multi-node run's ranks and GPUs are spread over hosts: one host's share is no mismatch
    # (pass the union of all hosts' ranks and GPUs to compare the whole run)
    partial = not obs.covers_whole_run
    ranks_text = ", ".join(f"rank {r}" for r in sorted(obs.live_ranks)) + (" (this host only: multi-node run)" if partial else "")
    rows.append(
        ClaimRow(
            "world size",
            ws_claim,
            ws_obs,
            None if ws_claim is None or ws_obs is None or partial else ws_obs == ws_claim,
            ws_source,
            ranks_text,
        )
    )

    gpu_claim, gpu_source = _claim_from(run, "gpus")
    if gpu_claim is None and run.spec.gpus:
        gpu_claim, gpu_source = len(run.spec.gpus), "--gpus " + ",".join(str(g) for g in run.spec.gpus)
    held = sorted(obs.run_gpu_memory)
    gpu_obs = len(held) if obs.gpu_util else None  # no GPUs here: nothing to observe
    from_flag = gpu_source.startswith("--gpus")
    gpu_partial = partial and not from_flag  # --gpus is this host's own share
    # --gpus makes GPUs visible; a run that holds memory on none of them (a CPU-only program) claims no GPU count
    # to be wrong about: no verdict (an assigned GPU left unused is gpu_idle's to say)
    unused = from_flag and gpu_obs == 0
    rows.append(
        ClaimRow(
            "GPUs",
            gpu_claim,
            gpu_obs,
            None if gpu_claim is None or gpu_obs is None or gpu_partial or unused else gpu_obs == gpu_claim,
            gpu_source,
            "holds no GPU memory (--gpus makes GPUs visible; a CPU-only program uses none)"
            if unused
            else _gpu_list(held)
            if gpu_obs is not None
            else "no GPUs on this host",
        )
    )

    samples = _manifest(obs, "dataset_samples")
    ds_claim, ds_source = _claim_from(run, "dataset_samples")
    rows.append(
        ClaimRow(
            "dataset samples",
            ds_claim,
            samples,
            None if ds_claim is None or samples is None else _within(samples, ds_claim, 1 - DATASET_TOL, 1 + DATASET_TOL),
            ds_source,
            "manifest" if samples is not None else "",
        )
    )
    tokens = _manifest(obs, "dataset_tokens")
    rows.append(ClaimRow("dataset tokens", None, tokens, None, "", "manifest" if tokens is not None else ""))

    measured = measured_tokens_per_s if measured_tokens_per_s is not None else _median_tps(tel)
    tps_claim, tps_source = _claim_from(run, "tokens_per_s")
    rows.append(
        ClaimRow(
            "tokens/s",
            tps_claim,
            measured,
            None if tps_claim is None or measured is None else measured >= tps_claim * (1 - TPS_CLAIM_TOL),
            tps_source,
            "median of recent steps" if measured is not None else "",
        )
    )
    return rows


def _fmt(what: str, value: int | float | None) -> str:
    if value is None:
        return "?"
    if what.startswith("params"):
        return f"{value / 1e9:.2f}B" if value >= 1e9 else f"{value / 1e6:.0f}M"
    if what == "tokens/s":
        return f"{value:,.0f} tok/s"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.0f}"


def _mismatch_message(row: ClaimRow, run: RunInfo) -> str:
    src = f" ({row.source})" if row.source else ""
    if row.what == "GPUs":
        return (
            f"claimed {row.claimed} GPU{'' if row.claimed == 1 else 's'}, observed {row.observed}: {row.detail}{src}; "
            f"the run's processes hold memory only there — check CUDA_VISIBLE_DEVICES and torchrun --nproc-per-node, then relaunch"
        )
    if row.what == "world size":
        return (
            f"claimed world size {row.claimed}, observed {row.observed} rank processes: {row.detail or 'none'}{src}; "
            f"check torchrun --nnodes/--nproc-per-node"
        )
    if row.what == "tokens/s":
        return f"claimed {_fmt(row.what, row.claimed)}, measured {_fmt(row.what, row.observed)}{src}; correct the claim or find what slows the run"
    return (
        f"claimed {_fmt(row.what, row.claimed)} {row.what}, observed {_fmt(row.what, row.observed)}{src}: "
        f"the trainer's manifest says otherwise — check the model config / dataset the run was given (`gpudeck verify {run.id}`)"
    )


# ----------------------------------------------------------------------------- the rules


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exited (exit code unknown)"
    if code < 0:
        try:
            return f"exited with code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exited with code {code}"
    return f"exited with code {code}"


def hang_floor(run: RunInfo) -> float:
    """The least the hang threshold is: ``--hang-after`` (``LaunchSpec.hang_after_s``), else ``HANG_AFTER_S``."""
    return run.spec.hang_after_s if run.spec.hang_after_s is not None and run.spec.hang_after_s > 0 else HANG_AFTER_S


def hang_threshold(run: RunInfo) -> float:
    """Seconds without a step record that make a hang: max(5 x the run's median step time, its floor (120 s))."""
    floor = hang_floor(run)
    period = run.telemetry.step_period_s if run.telemetry is not None else None
    return max(HANG_STEP_FACTOR * (period or 0.0), floor)


class RunHealth:
    """The health and claims state of one live run; feed it an Observation every tick.

    ``update`` returns the alerts raised by that update; ``cleared_since_last``
    returns, once, those whose condition resolved since it was last called;
    ``active`` lists the ones still standing; ``close`` clears all when the
    run ends.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._active: dict[tuple[str, str], Alert] = {}
        self._cleared: list[Alert] = []
        self._history: deque[Alert] = deque(maxlen=HISTORY_MAX)
        self._on_rank_death = "alert"
        # ranks
        self._seen: dict[int, int] = {}  # rank -> last pid seen alive
        self._gone_since: dict[int, float] = {}
        self._exit_codes: dict[int, int | None] = {}
        # GPUs
        self._idle_since: dict[int, float] = {}
        # throughput
        self._tps: deque[tuple[float, float]] = deque(maxlen=THROUGHPUT_HISTORY_MAX)
        self._last_step: int | None = None
        self._reference: dict[str, float] = {}  # frozen reference median while a drop alert stands
        self._recovered_since: dict[str, float] = {}  # subject -> since when every step is back above the line
        # claims
        self._first_update: float | None = None

    # ------------------------------------------------------------------ results

    @property
    def active(self) -> list[Alert]:
        """Alerts whose condition still holds, oldest first."""
        return sorted(self._active.values(), key=lambda a: a.ts)

    @property
    def history(self) -> list[Alert]:
        """Every alert raised (the last ``HISTORY_MAX``), cleared ones with their ``cleared`` time."""
        return list(self._history)

    @property
    def rank_death(self) -> bool:
        """True while a rank has exited and the run goes on (``--on-rank-death stop`` acts on it)."""
        return any(key[0] == "rank_exited" for key in self._active)

    @property
    def hung(self) -> Alert | None:
        """The standing hang alert, if any."""
        return self._active.get(("hang", "run"))

    @property
    def wants_stop(self) -> bool:
        """True when a rank died and the run was launched with ``--on-rank-death stop``."""
        return self.rank_death and self._on_rank_death == "stop"

    def first_gone(self, run: RunInfo) -> tuple[int, int, float] | None:
        """(rank, pid, when seen gone) of the rank that went first, alerted or not (the cause of a run that ended fast)."""
        if not self._gone_since:
            return None
        tel_ranks = run.telemetry.ranks if run.telemetry is not None else {}

        def order(item: tuple[int, float]) -> tuple[float, float, int]:
            rt = tel_ranks.get(str(item[0]))
            return (item[1], rt.last_seen if rt is not None and rt.last_seen is not None else float("inf"), item[0])

        rank, since = min(self._gone_since.items(), key=order)
        return rank, self._seen.get(rank, 0), since

    def cleared_since_last(self) -> list[Alert]:
        """Alerts cleared since the previous call (each returned once)."""
        out, self._cleared = self._cleared, []
        return out

    def close(self, now: float) -> list[Alert]:
        """The run ended: clear every active alert and return them (they do not come back from ``cleared_since_last``)."""
        out = list(self._active.values())
        for a in out:
            a.cleared = now
        self._active.clear()
        return out

    # ------------------------------------------------------------------ bookkeeping

    def _raise(self, raised: list[Alert], key: tuple[str, str], make: Callable[[], Alert]) -> None:
        if key in self._active:
            return
        alert = make()
        self._active[key] = alert
        self._history.append(alert)
        raised.append(alert)

    def _clear(self, key: tuple[str, str], now: float) -> None:
        alert = self._active.pop(key, None)
        if alert is not None:
            alert.cleared = now
            self._cleared.append(alert)

    def _clear_kind(self, kind: str, keep: set[str], now: float) -> None:
        for key in [k for k in self._active if k[0] == kind and k[1] not in keep]:
            self._clear(key, now)

    # ------------------------------------------------------------------ update

    def update(self, obs: Observation, baseline: Baseline | None = None) -> list[Alert]:
        """Apply one tick's facts; return the alerts raised by it (cleared ones: ``cleared_since_last``)."""
        run = obs.run
        if run.id != self.run_id:
            raise ValueError(f"observation of run {run.id} given to the health of run {self.run_id}: keep one RunHealth per run")
        self._on_rank_death = run.spec.on_rank_death
        if self._first_update is None:
            self._first_update = obs.now
        raised: list[Alert] = []
        tel = run.telemetry
        done = bool(tel is not None and tel.done)
        going_on = run.state in ("starting", "running") and not obs.stopping and not done
        self._ranks(obs, going_on, done, raised)
        self._heartbeats(obs, going_on, raised)
        self._gpus(obs, going_on and run.state == "running", raised)
        self._throughput(obs, going_on, baseline, raised)
        self._hang(obs, going_on and run.state == "running", raised)
        self._stragglers(obs, going_on and run.state == "running", raised)
        self._claims(obs, going_on, raised)
        return raised

    def _expected(self, obs: Observation) -> int | None:
        tel = obs.run.telemetry
        return obs.run.spec.expected_ranks or (tel.world_size if tel is not None else None)

    def _ranks(self, obs: Observation, going_on: bool, done: bool, raised: list[Alert]) -> None:
        now, run = obs.now, obs.run
        for rank, pid in obs.live_ranks.items():
            self._seen[rank] = pid
            self._gone_since.pop(rank, None)
            self._exit_codes.pop(rank, None)
            self._clear(("rank_exited", str(rank)), now)  # back (torchrun restarted it): the alert is over
        for rank, (pid, code) in obs.exited_ranks.items():
            if rank not in obs.live_ranks:
                self._seen.setdefault(rank, pid)
                self._exit_codes[rank] = code
        for rank in self._seen:
            if rank not in obs.live_ranks:
                self._gone_since.setdefault(rank, now)
        if not going_on:
            return
        expected = self._expected(obs) or len(self._seen)
        left = len(obs.live_ranks)
        tel_ranks = run.telemetry.ranks if run.telemetry is not None else {}

        def died_order(item: tuple[int, float]) -> tuple[float, float, int]:
            # ranks seen gone in the same tick: the one whose telemetry stopped first died first
            # (torchrun tears the others down within its monitor interval, after they kept stepping)
            rank, since = item
            rt = tel_ranks.get(str(rank))
            return (since, rt.last_seen if rt is not None and rt.last_seen is not None else float("inf"), rank)

        for rank, since in sorted(self._gone_since.items(), key=died_order):
            code = self._exit_codes.get(rank)
            gone_for = now - since
            if code == 0:
                if done or gone_for < RANK_CLEAN_EXIT_GRACE_S:
                    continue  # a rank that finished; its peers get RANK_CLEAN_EXIT_GRACE_S to finish too
            elif code is None and gone_for < RANK_EXIT_GRACE_S:
                continue
            pid = self._seen[rank]
            tel = run.telemetry
            ckpt = tel.last_checkpoint if tel is not None else None
            resume = f"relaunch with `--resume {ckpt}`" if ckpt is not None else "relaunch (no checkpoint recorded yet: it starts fresh)"
            action = (
                "stopping the run (--on-rank-death stop)" if run.spec.on_rank_death == "stop" else f"`gpudeck stop {run.id}` or {resume}"
            )
            self._raise(
                raised,
                ("rank_exited", str(rank)),
                lambda: Alert(
                    kind="rank_exited",
                    severity="critical",
                    ts=now,
                    rank=rank,
                    pid=pid,
                    message=f"rank {rank} (pid {pid}) {_exit_text(code)} while the run goes on: {left} of {expected} ranks left; {action}",
                    data={
                        "exit_code": code,
                        "live_ranks": sorted(obs.live_ranks),
                        "expected_ranks": expected,
                        "gone_s": round(gone_for, 1),
                        "last_checkpoint": ckpt,
                    },
                ),
            )

    def _heartbeats(self, obs: Observation, going_on: bool, raised: list[Alert]) -> None:
        now, tel = obs.now, obs.run.telemetry
        if not going_on:
            return  # stopping or done: standing alerts stay until close()
        lost: set[str] = set()
        if tel is not None:
            for rank, pid in obs.live_ranks.items():
                rt = tel.ranks.get(str(rank))
                if rt is None or rt.last_seen is None:
                    continue  # never reported: nothing to miss yet
                age = now - rt.last_seen
                if age <= HEARTBEAT_LOST_S:
                    continue
                lost.add(str(rank))
                self._raise(
                    raised,
                    ("heartbeat_lost", str(rank)),
                    lambda: Alert(
                        kind="heartbeat_lost",
                        severity="critical",
                        ts=now,
                        rank=rank,
                        pid=pid,
                        message=(
                            f"rank {rank} (pid {pid}) is alive but sent no telemetry for {age:.0f} s (heartbeats come every 5 s): "
                            f"it may be hung — `py-spy dump --pid {pid}` shows where"
                        ),
                        data={"seconds": round(age, 1), "last_seen": rt.last_seen, "step": rt.step},
                    ),
                )
        self._clear_kind("heartbeat_lost", lost, now)

    def _run_gpus(self, obs: Observation) -> list[int]:
        """The GPUs of the run: ``--gpus``, else where its pids hold memory or its ranks say they run."""
        if obs.run.spec.gpus:
            return [g for g in obs.run.spec.gpus if g in obs.gpu_util]
        gpus = set(obs.run_gpu_memory)
        tel = obs.run.telemetry
        if tel is not None:
            by_uuid = {u: i for i, u in obs.gpu_uuids.items()}
            gpus |= {by_uuid[rt.gpu_uuid] for rt in tel.ranks.values() if rt.gpu_uuid in by_uuid}
        return sorted(g for g in gpus if g in obs.gpu_util)

    def _gpus(self, obs: Observation, running: bool, raised: list[Alert]) -> None:
        now = obs.now
        if not running:
            self._idle_since.clear()  # idle while starting or stopping is expected; count afresh
            return
        gpus = self._run_gpus(obs)
        idle: set[str] = set()
        for g in gpus:
            util = obs.gpu_util.get(g)
            if util != 0:  # busy, or unknown (MIG, driver says nothing): not a continuous idle stretch
                self._idle_since.pop(g, None)
                continue
            since = self._idle_since.setdefault(g, now)
            idle_for = now - since
            idle.add(str(g))
            if idle_for < GPU_IDLE_S:
                continue
            held = obs.run_gpu_memory.get(g)
            pids = ", ".join(str(p) for _, p in sorted(obs.live_ranks.items()))
            where = f"with {held / GIB:.1f} GiB still held by the run" if held else "and the run holds no memory there"
            hint = f"`py-spy dump --pid PID` on its ranks (pids {pids})" if pids else "look at its output (`gpudeck tail`)"
            self._raise(
                raised,
                ("gpu_idle", str(g)),
                lambda: Alert(
                    kind="gpu_idle",
                    severity="warning",
                    ts=now,
                    gpu=g,
                    message=f"GPU {g} idle for {idle_for:.0f} s {where} (0% utilisation while the run is running): it may be stalled — {hint}, or `gpudeck stop {obs.run.id}`",
                    data={"seconds": round(idle_for, 1), "held_bytes": held, "uuid": obs.gpu_uuids.get(g)},
                ),
            )
        for g in [g for g in self._idle_since if g not in gpus]:
            del self._idle_since[g]
        self._clear_kind("gpu_idle", idle, now)

    def own_median(self, now: float) -> float | None:
        """The run's median tokens/s over the last 10 minutes, leaving out the steps under test; None until warmed up."""
        window = [(ts, v) for ts, v in self._tps if ts >= now - THROUGHPUT_WINDOW_S]
        ref = window[:-THROUGHPUT_CONFIRM_SAMPLES]
        if len(ref) < THROUGHPUT_MIN_SAMPLES or ref[-1][0] - ref[0][0] < THROUGHPUT_MIN_SPAN_S:
            return None
        return float(statistics.median(v for _, v in ref))

    def _throughput(self, obs: Observation, going_on: bool, baseline: Baseline | None, raised: list[Alert]) -> None:
        now, tel = obs.now, obs.run.telemetry
        if tel is not None and tel.step is not None and tel.step != self._last_step and tel.tokens_per_s is not None:
            self._last_step = tel.step
            self._tps.append((now, tel.tokens_per_s))
        if not going_on:
            return
        recent = [v for _, v in list(self._tps)[-THROUGHPUT_CONFIRM_SAMPLES:]]
        if len(recent) < THROUGHPUT_CONFIRM_SAMPLES:
            return
        latest = recent[-1]
        own = self.own_median(now)
        refs: dict[str, tuple[float | None, str, dict]] = {
            "own": (own, f"this run's 10-min median {own or 0:,.0f} tok/s", {}),
        }
        if baseline is not None and baseline.median_tokens_per_s > 0:
            # the first steps compile: compare with the baseline only once the run's own median exists
            refs["baseline"] = (
                baseline.median_tokens_per_s if own is not None else None,
                f"run {baseline.run_id}'s median {baseline.median_tokens_per_s:,.0f} tok/s (same config)",
                {"baseline_run": baseline.run_id, "config_hash": baseline.config_hash},
            )
        for subject, (median, what, extra) in refs.items():
            key = ("throughput_drop", subject)
            if key in self._active:
                frozen = self._reference.get(subject, median or 0.0)  # a long drop must not become the new normal
                if not all(v >= THROUGHPUT_RATIO * frozen for v in recent):
                    self._recovered_since.pop(subject, None)
                elif now - self._recovered_since.setdefault(subject, now) >= THROUGHPUT_RECOVER_S:
                    self._clear(key, now)
                    self._reference.pop(subject, None)
                    self._recovered_since.pop(subject, None)
                continue
            if median is None or median <= 0 or not all(v < THROUGHPUT_RATIO * median for v in recent):
                continue
            self._reference[subject] = median
            pct = 100 * latest / median
            self._raise(
                raised,
                key,
                lambda: Alert(
                    kind="throughput_drop",
                    severity="warning",
                    ts=now,
                    message=(
                        f"{latest:,.0f} tok/s is {pct:.0f}% of {what}: look for a lost or slow rank, a throttled GPU "
                        f"(`gpudeck status`), or data loading (`gpudeck triage {obs.run.id}`); it clears after "
                        f"{THROUGHPUT_RECOVER_S:.0f} s back above {100 * THROUGHPUT_RATIO:.0f}%"
                    ),
                    data={
                        "tokens_per_s": latest,
                        "median_tokens_per_s": median,
                        "ratio": round(latest / median, 3),
                        "compared_with": subject,
                        **extra,
                    },
                ),
            )

    def _hang(self, obs: Observation, running: bool, raised: list[Alert]) -> None:
        now, run, tel = obs.now, obs.run, obs.run.telemetry
        key = ("hang", "run")
        if not running or tel is None or tel.last_step_ts is None:
            return  # no step yet (still starting up), or stopping / done: a standing alert stays until close()
        age = now - tel.last_step_ts
        threshold = hang_threshold(run)
        if age < threshold:
            self._clear(key, now)  # a step came: the run moves again
            return
        period = tel.step_period_s
        ranks = sorted(obs.live_ranks)
        how = {
            "triage": f"gathering every rank's stacks now (`gpudeck triage {run.id}` shows them)",
            "alert": f"`gpudeck triage {run.id}` gathers every rank's stacks (--on-hang alert: nothing gathered by itself)",
            "stop": "gathering every rank's stacks, then stopping the run (--on-hang stop)",
        }[run.spec.on_hang]
        basis = f"max({HANG_STEP_FACTOR:g} x median step {period or 0:.2f} s, {hang_floor(run):.0f} s)"
        alive = f"{len(ranks)} rank{'' if len(ranks) == 1 else 's'} alive" if ranks else "its processes alive"
        self._raise(
            raised,
            key,
            lambda: Alert(
                kind="hang",
                severity="critical",
                ts=now,
                message=(
                    f"no step for {age:.0f} s (hang threshold {threshold:.0f} s: {basis}) after step {tel.step} "
                    f"with {alive}: the run is hung; {how}"
                ),
                data={
                    "seconds": round(age, 1),
                    "threshold_s": round(threshold, 1),
                    "step": tel.step,
                    "step_period_s": period,
                    "live_ranks": ranks,
                    "on_hang": run.spec.on_hang,
                },
            ),
        )

    def _stragglers(self, obs: Observation, running: bool, raised: list[Alert]) -> None:
        now, run, tel = obs.now, obs.run, obs.run.telemetry
        if not running or tel is None:
            return
        window = run.spec.straggler_window if run.spec.straggler_window else STRAGGLER_WINDOW
        medians: dict[int, float] = {}
        for rt in tel.ranks.values():
            if len(rt.compute_recent) >= window and rt.rank in obs.live_ranks:
                medians[rt.rank] = float(statistics.median(rt.compute_recent[-window:]))
        slow: set[str] = set()
        if len(medians) >= 2:
            by_uuid = {u: i for i, u in obs.gpu_uuids.items()}
            for rank, mine in sorted(medians.items()):
                others = float(statistics.median(v for r, v in medians.items() if r != rank))
                if others <= 0 or mine < STRAGGLER_RATIO * others:
                    continue
                slow.add(str(rank))
                rt = tel.ranks[str(rank)]
                gpu = by_uuid.get(rt.gpu_uuid or "")
                host = rt.host or run.host
                on = f"GPU {gpu}" if gpu is not None else (rt.device or "its device")
                ratio = mine / others
                self._raise(
                    raised,
                    ("straggler", str(rank)),
                    lambda: Alert(
                        kind="straggler",
                        severity="warning",
                        ts=now,
                        rank=rank,
                        gpu=gpu,
                        pid=obs.live_ranks.get(rank),
                        message=(
                            f"rank {rank} on {host} ({on}) is a straggler: it computes {mine * 1000:.0f} ms a step, "
                            f"{ratio:.2f}x the {others * 1000:.0f} ms median of the other ranks (median of {window} steps); "
                            f"every rank runs at its pace — look at its GPU's clocks and temperature (`gpudeck status`) "
                            f"or its host's load"
                        ),
                        data={
                            "host": host,
                            "device": rt.device,
                            "compute_s": round(mine, 4),
                            "others_compute_s": round(others, 4),
                            "ratio": round(ratio, 3),
                            "window": window,
                        },
                    ),
                )
        self._clear_kind("straggler", slow, now)

    def claims_report(self, obs: Observation) -> list[ClaimRow]:
        """Claimed vs observed, with this run's own throughput median when it has one."""
        return claims_report(obs, measured_tokens_per_s=self.own_median(obs.now))

    def _claims(self, obs: Observation, going_on: bool, raised: list[Alert]) -> None:
        now, run, tel = obs.now, obs.run, obs.run.telemetry
        if not going_on or run.state != "running":
            return
        started = run.started if run.started is not None else self._first_update or now
        # a first step, and every rank of this node's share of the ranks' own world size seen alive (a rank still
        # importing torch while rank 0 steps is not a missing rank); or a plain command has had time to spread out
        world = tel.world_size if tel is not None else None
        share = -(-world // max(1, run.spec.nnodes or 1)) if world else 0
        stepped = tel is not None and tel.step is not None and len(self._seen) >= share
        settled = stepped or now - started >= CLAIM_SETTLE_S
        if not settled:
            return
        # ranks seen at any time: a rank that died is rank_exited's alert, not a world-size claim
        rows = claims_report(obs, measured_tokens_per_s=self.own_median(now), world_size_observed=len(self._seen) or None)
        bad: set[str] = set()
        for row in rows:
            if row.ok is not False:
                continue
            bad.add(row.what)
            self._raise(
                raised,
                ("claim_mismatch", row.what),
                lambda: Alert(
                    kind="claim_mismatch",
                    severity="warning",
                    ts=now,
                    message=_mismatch_message(row, run),
                    data={"what": row.what, "claimed": row.claimed, "observed": row.observed, "source": row.source, "detail": row.detail},
                ),
            )
        self._clear_kind("claim_mismatch", bad, now)
