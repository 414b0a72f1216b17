"""Provides the typed payloads of the agent's journal events: one msgspec tagged union, one type per kind.

The journal stores each event as ``(seq, ts, kind, run_id, data)`` with ``data`` a JSON object; the kind
is the tag. :func:`validate` checks a payload against its kind's type when it is appended (callers keep
passing ``kind`` + ``dict``); :func:`decode` turns a stored or received payload back into its typed
struct, for the journal's own readers and the console's history alike.

Versions: every payload has ``v`` (omitted while it is 1, so journals written before this module read as
version 1 unchanged). A payload whose shape changes gets a new ``v`` and the decoder keeps accepting the
old one. Unknown fields are ignored (a newer agent may add some); a kind this module does not know decodes
to :class:`Unknown` rather than failing, so an old console reads a newer agent's journal.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import (
    Alert,
    ClaimRow,
    Container,
    ContainmentInfo,
    EnvFingerprint,
    LaunchSpec,
    PreflightResult,
    StopResult,
    Triage,
)

TAG = "event_kind"  # the tag field; put next to the payload's own fields only while converting, never stored
PAYLOAD_VERSION = 1
MAX_PAYLOAD_BYTES = 1 << 20  # a stored payload longer than this is refused by decode() (the wire's frame limit)


class BadEvent(AgentError):
    """A journal event whose payload does not match its kind's type (a bug in the writer, or a corrupt record)."""

    code = "bad_event"


class Payload(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field=TAG):
    """Base of every payload: the version of its shape."""

    v: int = PAYLOAD_VERSION


class RunCreated(Payload, tag="run_created"):
    state: str
    spec: LaunchSpec
    name: str | None = None


class RunState(Payload, tag="run_state"):
    """A run's state change; carries what a replica needs to rebuild the run row."""

    state: str
    cause: str | None = None
    pid: int | None = None
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    cause_class: str | None = None
    grace_s: float | None = None  # state "stopping": the grace the operator asked for
    stop_started: float | None = None  # state "stopping": when the stop began (wall clock; a restarted agent counts from it)
    containment: ContainmentInfo | None = None  # at the end: the run's containment and the kernel's figures for its group
    stop: StopResult | None = None  # state "stopped": the verified outcome
    lingering: list[int] = []
    evidence: str | None = None  # what the change was decided on (agents/runs/states.py names each kind)
    ended_by: str | None = None  # a run ended without an exit status: what its ``ended`` time is (the last evidence)


class RunAdopted(Payload, tag="run_adopted"):
    state: str
    evidence: str | None = None
    resume_stop: bool = False
    stop_started: float | None = None  # a stop an earlier agent began, finished by this one
    containment: str | None = None  # the containment found again (its label)


class ShimLost(Payload, tag="shim_lost"):
    """A live run's shim (the parent of its command) is gone without an exit status while members still run:
    the run stays live and supervised (the kernel's group, or the tag + ancestry, says it lives)."""

    note: str
    shim_pid: int | None = None
    members: int = 0  # processes still in the group (or tagged members alive)


class Containment(Payload, tag="containment"):
    """How a run is contained (written once at launch, again when re-adoption finds its group)."""

    containment: ContainmentInfo


class MemberBrief(msgspec.Struct, kw_only=True, omit_defaults=True):
    pid: int
    rank: int | None = None
    local_rank: int | None = None
    cmdline: list[str] = []


class Members(Payload, tag="members"):
    added: list[MemberBrief] = []
    updated: list[MemberBrief] = []  # already journaled, now with their rank: replaced, not added


class Telemetry(Payload, tag="telemetry"):
    """One record of the run's telemetry.jsonl (the trainer's schema, kept as it was written) and its offset."""

    record: dict[str, Any]
    offset: int = 0


class TelemetryRejected(Payload, tag="telemetry_rejected"):
    """A line of the run's telemetry.jsonl the reader refused (by itself: the run's other lines go on)."""

    line: int
    offset: int
    reason: str


class AlertRaised(Payload, tag="alert"):
    alert: Alert


class AlertCleared(Payload, tag="alert_cleared"):
    alert: Alert


class TriageTaken(Payload, tag="triage"):
    """Evidence from every rank of a live run (agents/health/triage.py): on a hang alert, or on demand."""

    triage: Triage


class Claims(Payload, tag="claims"):
    rows: list[ClaimRow] = []


class Preflight(Payload, tag="preflight"):
    result: PreflightResult


class EnvFingerprinted(Payload, tag="env_fingerprint"):
    env: EnvFingerprint


class Reclaimed(StopResult, kw_only=True, omit_defaults=True, tag_field=TAG, tag="reclaimed"):
    """A StopResult (flattened), for a stop of an ended run or a reclaim; ``pids`` are the run's processes reclaimed."""

    pids: list[int] = []
    v: int = PAYLOAD_VERSION


class AgentStarted(Payload, tag="agent_started"):
    pid: int
    version: str = ""
    gpu_error: str | None = None
    adopted: list[str] = []


class EnvRebuilt(Payload, tag="env_rebuilt", rename={"from_": "from"}):
    path: str
    from_: str | None = None
    freeze_hash: str | None = None
    python: str | None = None


class JournalRecreated(Payload, tag="journal_recreated"):
    """The journal's file was found deleted, replaced or corrupt: a new one (this epoch) was started; ``runs`` are the
    live runs re-recorded in it (re-adopted through their containment when the old file could not be read)."""

    reason: str  # deleted | replaced | corrupt | missing
    detail: str = ""
    moved_to: str | None = None  # where the old file was moved aside (journal.db.corrupt-<UTC time>)
    previous_epoch: str | None = None
    runs: list[str] = []
    at_start: bool = False


class GpuHold(Payload, tag="gpu_hold"):
    """One change in who holds a GPU's memory: the GPU ledger (agents/observe/ledger.py).

    A hold is one holder on one GPU, from the first sample that shows it to the first that does not: a process
    (``pid`` and ``create_time``) or the GPU's memory no visible process explains (``attribution`` UNACCOUNTED, no
    pid). ``change``: ``start``; ``level`` (it moved by a step: 1 GiB or 10 % of the GPU, whichever is larger);
    ``attribution`` (RUN became STALE: its run ended and it lives on; or its container became known after its
    start); ``continued`` (an agent restart found it still holding); ``end`` (``evidence`` says what showed it). Every record carries the whole hold (start, peak so far),
    so any one of them, after compaction, still says who held what since when.
    """

    change: Literal["start", "level", "attribution", "continued", "end"]
    hold: str  # the hold's id, the same in each of its records
    gpu: int
    uuid: str = ""
    pid: int | None = None
    create_time: float | None = None
    user: str | None = None
    container: Container | None = None  # the container it runs in, seen from the host (its attribution's)
    run: str | None = None
    rank: int | None = None
    attribution: str = "FOREIGN"  # RUN | STALE | FOREIGN | NO_SUCH_PROCESS | UNACCOUNTED
    bytes: int | None = None  # held at this record (None: the driver does not say)
    peak: int | None = None  # the most it held since it started, as sampled
    started: float = 0.0  # when the hold was first seen (wall clock)
    evidence: str | None = None  # end and continued: what the change was decided on
    last_seen: float | None = None  # an end decided after an agent restart: when it was last recorded holding


class Void(Payload, tag="void"):
    """Holds the seq of a write that failed after its seq was handed out (seqs have no gaps)."""

    reason: str


class Unknown(msgspec.Struct, kw_only=True):
    """What :func:`decode` gives for a kind this version does not know (a newer agent's)."""

    kind: str
    data: dict[str, Any]


EventPayload = Union[
    RunCreated,
    RunState,
    RunAdopted,
    ShimLost,
    Containment,
    Members,
    Telemetry,
    TelemetryRejected,
    AlertRaised,
    AlertCleared,
    TriageTaken,
    Claims,
    Preflight,
    EnvFingerprinted,
    Reclaimed,
    AgentStarted,
    EnvRebuilt,
    JournalRecreated,
    GpuHold,
    Void,
]
KINDS: dict[str, type] = {t.__struct_config__.tag: t for t in EventPayload.__args__}  # type: ignore[attr-defined]

_json = msgspec.json.Decoder(dict[str, Any])


def _check_version(kind: str, p: Payload | Reclaimed) -> None:
    if p.v > PAYLOAD_VERSION:
        raise BadEvent(f"event {kind!r} has payload version {p.v}; this gpudeck reads up to {PAYLOAD_VERSION}: upgrade it")


def validate(kind: str, data: dict[str, Any]) -> Payload | Reclaimed:
    """The typed payload of an event about to be appended; BadEvent names the kind, the field and the fix."""
    t = KINDS.get(kind)
    if t is None:
        raise BadEvent(
            f"unknown journal event kind {kind!r}: add its payload type to agents/wire/events.py (known: {', '.join(sorted(KINDS))})"
        )
    if not isinstance(data, dict):
        raise BadEvent(f"event {kind!r}: the payload must be a JSON object, got {type(data).__name__}")
    try:
        p: Payload | Reclaimed = msgspec.convert({**data, TAG: kind}, t, str_keys=True)
    except msgspec.ValidationError as exc:
        raise BadEvent(f"event {kind!r}: {exc}; see {t.__name__} in agents/wire/events.py for its fields") from None
    _check_version(kind, p)
    return p


def decode(kind: str, data: dict[str, Any] | bytes | str) -> Payload | Reclaimed | Unknown:
    """A stored or received payload as its typed struct; JSON text is bounded by MAX_PAYLOAD_BYTES.

    Old records (no ``v``) read as version 1; unknown kinds give :class:`Unknown`; a payload that does not
    fit its kind's type raises BadEvent naming the field.
    """
    if isinstance(data, (bytes, str)):
        raw = data.encode() if isinstance(data, str) else data
        if len(raw) > MAX_PAYLOAD_BYTES:
            raise BadEvent(f"event {kind!r}: payload of {len(raw)} bytes is over the {MAX_PAYLOAD_BYTES}-byte limit")
        try:
            data = _json.decode(raw)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise BadEvent(f"event {kind!r}: the payload is not a JSON object ({exc})") from None
    t = KINDS.get(kind)
    if t is None:
        return Unknown(kind=kind, data=dict(data))
    return validate(kind, data)


def to_data(p: Payload | Reclaimed) -> dict[str, Any]:
    """A typed payload as the dict the journal stores (no tag; ``v`` only when it is not 1)."""
    d = msgspec.to_builtins(p)
    d.pop(TAG, None)
    return d
