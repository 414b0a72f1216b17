"""Provides the console's typed records: a run as the history stores it, its events and step metrics, hosts and epochs.

The history (console/history/replica.py) returns these; the figures (console/ops/figures.py),
the diff (console/present/rundiff.py), the CLI and the screens read them. The scalar columns
of the ``runs`` table are typed fields. The JSON columns (the launch spec, the
environment fingerprint, members, the last telemetry records, alerts, pre-flight,
stop, claims) are kept as the agent recorded them, so ``--json`` prints exactly what
was recorded and a row written by another gpudeck version still loads; they are read
through the typed accessors here (:meth:`RunRecord.launch_spec`, ``env_fingerprint``,
``alert_list``, ``stop_result``, ``preflight_result``), never by key in a view.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import msgspec
from msgspec import UNSET, UnsetType

from gpudeck.agents.wire.protocol import Alert, EnvFingerprint, LaunchSpec, PreflightResult, RunInfo, Snapshot, StopResult, to_builtins

# A JSON object as the agent recorded it: free-form by design (a LaunchSpec or fingerprint of any gpudeck version,
# a trainer's manifest, a member's cmdline ...). Only the records' raw JSON columns and event payloads use it.
Recorded: TypeAlias = dict[str, Any]


class NodeState(msgspec.Struct, frozen=True):
    """One node of a multi-node run, as the combined record lists it."""

    host: str
    state: str
    cause: str | None = None


class RunRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One run on one host as the history's ``runs`` table holds it (a multi-node run: its combined record).

    Fields are in the table's column order (``--json`` prints them in it). ``tokens_per_s_median`` is
    set by the queries that read the metrics (``History.query``, ``ops.readings.find_runs``); ``hosts`` and
    ``nodes`` only on a multi-node run's combined record (console/fleet/multinode.py). Unset fields are left
    out of :meth:`as_json`.
    """

    host: str
    id: str
    epoch: str | None = None
    name: str | None = None
    kind: str | None = None
    state: str | None = None
    cause: str | None = None
    cause_class: str | None = None
    exit_code: int | None = None
    signal: str | None = None
    created: float | None = None
    started: float | None = None
    ended: float | None = None
    updated: float | None = None
    operator: str | None = None
    parent: str | None = None
    start: str | None = None
    cwd: str | None = None
    gpus: list[int] | None = None
    argv: list[str] = []
    spec: Recorded = {}  # the LaunchSpec as recorded: launch_spec() decodes it
    env: Recorded | None = None  # the environment fingerprint as recorded: env_fingerprint() decodes it
    env_hash: str | None = None
    env_torch: str | None = None
    members: list[Recorded] = []  # the processes seen, as the agent reported them (pid, role, rank, cmdline ...)
    ranks_seen: int | None = None
    params_total: int | None = None
    world_size: int | None = None
    config_hash: str | None = None
    dataset_samples: int | None = None
    dataset_tokens: int | None = None
    last_step: int | None = None
    last_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mem_peak_gib: float | None = None
    last_checkpoint: int | None = None
    tau: float | None = None
    final_step: int | None = None
    error: str | None = None
    telemetry: Recorded = {}  # the trainer's last record of each type (its manifest included), as written
    alerts: list[Recorded] = []  # as recorded (a cleared one carries 'cleared'): alert_list() decodes them
    alert_count: int | None = None
    preflight: Recorded | None = None  # the PreflightResult as recorded: preflight_result() decodes it
    stop: Recorded | None = None  # the verified StopResult as recorded: stop_result() decodes it
    claims: list[Recorded] = []  # claimed vs observed rows as recorded when the run ended
    tokens_per_s_median: float | None | UnsetType = UNSET
    hosts: list[str] | UnsetType = UNSET
    nodes: list[NodeState] | UnsetType = UNSET

    # ------------------------------------------------------------------ typed readings of the recorded JSON

    def launch_spec(self) -> LaunchSpec:
        """The LaunchSpec this run recorded (msgspec.ValidationError when it does not decode)."""
        spec = dict(self.spec) if isinstance(self.spec, dict) else {}
        spec.setdefault("argv", self.argv or [])
        return msgspec.convert(spec, LaunchSpec)

    def launch_spec_or_none(self) -> LaunchSpec | None:
        """The recorded LaunchSpec, or None when it is missing or not understood."""
        try:
            return self.launch_spec()
        except msgspec.ValidationError:
            return None

    def env_fingerprint(self) -> EnvFingerprint | None:
        """The recorded environment fingerprint, if any (and if it decodes)."""
        if not self.env:
            return None
        try:
            return msgspec.convert(self.env, EnvFingerprint)
        except msgspec.ValidationError:
            return None

    def alert_list(self) -> list[Alert]:
        """The recorded alerts that decode."""
        out: list[Alert] = []
        for a in self.alerts or []:
            try:
                out.append(msgspec.convert(a, Alert))
            except msgspec.ValidationError:
                continue
        return out

    def stop_result(self) -> StopResult | None:
        """The verified stop, when one was recorded (and decodes)."""
        if not self.stop:
            return None
        try:
            return msgspec.convert(self.stop, StopResult)
        except msgspec.ValidationError:
            return None

    def preflight_result(self) -> PreflightResult | None:
        """The recorded pre-flight result, when one was recorded (and decodes)."""
        if not self.preflight:
            return None
        try:
            return msgspec.convert(self.preflight, PreflightResult)
        except msgspec.ValidationError:
            return None

    @property
    def node_rank(self) -> int:
        """This node's rank in a multi-node run (0 for a one-host run)."""
        nr = self.spec.get("node_rank") if isinstance(self.spec, dict) else None
        return nr if isinstance(nr, int) else 0

    @property
    def spec_nodes(self) -> list[str]:
        """The hosts of the multi-node run this node belongs to, as recorded ([] for a one-host run)."""
        nodes = self.spec.get("nodes") if isinstance(self.spec, dict) else None
        return [str(n) for n in nodes] if isinstance(nodes, list) else []

    @property
    def spec_nnodes(self) -> int:
        """How many nodes the recorded spec asked for (1 for a one-host run)."""
        n = self.spec.get("nnodes") if isinstance(self.spec, dict) else None
        return n if isinstance(n, int) else 1

    def label(self) -> str:
        """The run in a few words for a diff's column: 'r-7f3a9c21 llama-1b on gpu1'."""
        return " ".join(str(x) for x in (self.id, self.name, "on", self.host) if x)

    def as_json(self) -> dict[str, Any]:
        """The record as ``gpudeck history --json`` / ``show --json`` print it (the printing edge: a JSON object)."""
        out: dict[str, Any] = to_builtins(self)  # a JSON object, printed as it is
        return out

    @classmethod
    def from_columns(cls, row: dict[str, object]) -> RunRecord:
        """A ``runs`` row as SQLite returns it (column name -> value, the JSON columns still text)."""
        return cls(**{k: _decode(k, v) for k, v in row.items() if k in _FIELDS})

    @classmethod
    def from_info(cls, r: RunInfo) -> RunRecord:
        """A run its agent reports (RunInfo) as a record (for a diff or a pick when the history does not hold it)."""
        tel = r.telemetry
        return cls(
            host=r.host,
            id=r.id,
            name=r.name,
            kind=r.spec.kind,
            state=r.state,
            cause=r.cause,
            exit_code=r.exit_code,
            signal=r.signal,
            created=r.created,
            started=r.started,
            ended=r.ended,
            operator=r.spec.operator,
            parent=r.spec.parent,
            start=r.spec.start,
            cwd=r.spec.cwd,
            gpus=r.spec.gpus,
            argv=list(r.spec.argv),
            spec=to_builtins(r.spec),
            env=to_builtins(r.env) if r.env is not None else None,
            env_hash=r.env.freeze_hash if r.env is not None else None,
            env_torch=r.env.torch if r.env is not None else None,
            members=[to_builtins(m) for m in r.members],
            ranks_seen=len({m.rank for m in r.members if m.rank is not None}),
            params_total=tel.params_total if tel else None,
            world_size=tel.world_size if tel else None,
            last_step=tel.step if tel else None,
            last_loss=tel.loss if tel else None,
            tokens_per_s=tel.tokens_per_s if tel else None,
            mfu=tel.mfu if tel else None,
            alerts=[to_builtins(a) for a in r.alerts],
            alert_count=len(r.alerts),
            preflight=to_builtins(r.preflight) if r.preflight is not None else None,
        )

    def overlaid(self, live: RunRecord) -> RunRecord:
        """This (recorded) record with what ``live`` knows (its fields that are set and not empty) on top."""
        changes = {
            f: v for f in _FIELDS if (v := getattr(live, f)) is not UNSET and v is not None and not (isinstance(v, (list, dict)) and not v)
        }
        return msgspec.structs.replace(self, **changes)


_FIELDS = frozenset(RunRecord.__struct_fields__)
JSON_COLUMNS: dict[str, object] = {  # the JSON columns and what an empty one reads as
    "gpus": None,
    "argv": [],
    "spec": {},
    "env": None,
    "members": [],
    "telemetry": {},
    "alerts": [],
    "preflight": None,
    "stop": None,
    "claims": [],
}


def loads(text: Any, default: Any) -> Any:
    """A JSON column's value (``default`` for NULL, empty or text that does not parse)."""
    if not isinstance(text, str) or not text:
        return default
    try:
        return json.loads(text)  # the stdlib's, as the history writes them (NaN included)
    except ValueError:
        return default


def _decode(column: str, value: Any) -> Any:
    if column in JSON_COLUMNS:
        return loads(value, JSON_COLUMNS[column])
    return value


class EventRecord(msgspec.Struct, frozen=True):
    """One journal event as the history holds it."""

    epoch: str
    seq: int
    ts: float
    kind: str
    data: Recorded  # the event's payload as the agent sent it (free-form per kind: agents/wire/protocol.py's Event)


class MetricPoint(msgspec.Struct, frozen=True):
    """One recorded training step's figures."""

    step: int
    ts: float | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mem_peak_gib: float | None = None


class HostRecord(msgspec.Struct, frozen=True):
    """A host the history has heard of, and its link state when last seen."""

    name: str
    epoch: str | None = None
    first_seen: float | None = None
    last_seen: float | None = None
    agent_version: str | None = None
    agent_host: str | None = None
    state: str | None = None
    error: str | None = None


class EpochRecord(msgspec.Struct, frozen=True):
    """One agent journal epoch seen for a host."""

    epoch: str
    first_seen: float | None = None
    last_seq: int | None = None
    replaces: str | None = None


class Problem(msgspec.Struct, frozen=True):
    """An event the history kept out (quarantined), raw, with why."""

    host: str
    epoch: str
    seq: int | None
    kind: str
    run_id: str | None
    error: str
    quarantined: float
    raw: str


# ----------------------------------------------------------------------------- a host's link (the fleet keeps them)

LinkState = Literal["connecting", "up", "unreachable", "version_mismatch", "host_key"]


@dataclass
class HostStatus:
    """What the console shows of one host's link."""

    name: str
    state: LinkState = "connecting"
    error: str | None = None
    last_seen: float | None = None
    snapshot: Snapshot | None = None
    agent_version: str | None = None
    epoch: str | None = None
    since: float = field(default_factory=time.time)
    # when the link last stopped working (the first failure, not the latest retry: retries pass through
    # 'connecting' and set ``since`` again); None while it is up or before its first attempt ended
    down_since: float | None = None
    transport: str = "ssh"  # "unix" for local
    synced_seq: int = 0  # last event seq held in history for the current epoch
    connects: int = 0


@dataclass
class SyncResult:
    """What one pass of history sync did for one host."""

    host: str
    ok: bool
    new_events: int = 0
    last_seq: int = 0
    epoch: str | None = None
    new_epoch: bool = False
    error: str | None = None
