"""Provides the agent wire protocol: msgspec Structs, tagged unions, JSON lines, frame limits.

One JSON object per line, in both directions. Every message has a ``type`` tag
and a client-made ``request_id``; replies and stream items echo the
``request_id`` of the request they answer, so one connection can carry many
requests and streams at once. Anything the agent cannot act on gets an
``Error`` reply with a ``code`` and a ``message`` that says what to do, and the
connection stays up.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Union

import msgspec

PROTOCOL_VERSION = 1
# The versions spoken: this one and the one before (N-1..N), so hosts and consoles need not upgrade in lock-step. The
# agent answers a Hello of either with a HelloReply whose ``version`` is the client's (the connection speaks it); a
# client whose Hello of N is refused by an older agent says Hello again with N-1. Anything else is refused naming both.
OLDEST_PROTOCOL_VERSION = PROTOCOL_VERSION - 1


def speaks(version: int) -> bool:
    """Whether this side speaks protocol ``version`` (OLDEST_PROTOCOL_VERSION..PROTOCOL_VERSION)."""
    return OLDEST_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION


def versions_spoken() -> str:
    """The versions this side speaks, for messages: "0 and 1"."""
    return f"{OLDEST_PROTOCOL_VERSION} and {PROTOCOL_VERSION}"


MAX_FRAME = 1 << 20  # bytes in one line, newline excluded
MAX_ARGV = 4096  # arguments in one launch
MAX_NAME = 256  # characters in a run's name (every table line shows it: a 120 KB name made each 120,083 characters wide)
MAX_OUTPUT_CHUNK = 256 * 1024
# A GetSnapshot is answered from the agent's latest sample while it is at most this old and nothing it shows
# changed state since (runs, events, the journal); a client that needs a sample made for it asks max_age_s=0
SNAPSHOT_MAX_AGE_S = 1.0

RunState = Literal[
    "pending",
    "preflight_failed",
    "starting",
    "running",
    "stopping",
    "succeeded",
    "failed",
    "stopped",
    "lost",
]
TERMINAL_STATES: frozenset[str] = frozenset({"preflight_failed", "succeeded", "failed", "stopped", "lost"})
LIVE_STATES: frozenset[str] = frozenset({"pending", "starting", "running", "stopping"})


# gc=False on every wire struct: they are plain data (no reference cycles), and untracked they cost the
# cyclic garbage collector nothing, where a console holding 256 hosts' snapshots otherwise pays for them in
# every full collection (pauses of tens of milliseconds between key presses)
class _Msg(msgspec.Struct, gc=False, kw_only=True, tag_field="type", omit_defaults=True):
    request_id: str = ""


# ----------------------------------------------------------------------------- records


class Container(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True, frozen=True):
    """The container a process runs in, as the host's cgroup path names it (``agents/observe/containers.py``).

    Every text field holds only ``[A-Za-z0-9_.-]`` and ``\\xNN`` escapes, bounded: the agent escaped it. ``runtime`` is
    a plain string, not a closed set, so a newer agent naming a runtime this side does not know still decodes.
    """

    runtime: str  # docker | podman | lxc | kubernetes
    id: str  # 64 hex digits (docker, podman, a Kubernetes container; "" for a process in a pod's own group); LXC: its name
    name: str | None = None  # the runtime's own name for it, from its files (None: not found there); LXC: Proxmox's hostname
    engine: str | None = None  # kubernetes: containerd | cri-o | docker, where the cgroup path says
    pod_uid: str | None = None  # kubernetes
    pod: str | None = None  # kubernetes: the pod's name, from /var/log/pods
    namespace: str | None = None  # kubernetes: the pod's namespace
    owner_uid: int | None = None  # its group lies below this user's own systemd instance: a rootless container (that user's claim)

    def label(self) -> str:
        """One table cell: ``docker:trainer``, ``podman:1a2b3c4d5e6f``, ``lxc:200(trainer)``, ``k8s:ns/pod/ctr``; a
        rootless one ends in ``@uid1000`` (the user whose session holds it)."""
        owner = f"@uid{self.owner_uid}" if self.owner_uid is not None else ""
        if self.runtime == "kubernetes":
            pod = f"{self.namespace}/{self.pod}" if self.namespace and self.pod else f"pod-{(self.pod_uid or '?')[:8]}"
            ctr = self.name or self.id[:12]
            return (f"k8s:{pod}/{ctr}" if ctr else f"k8s:{pod}") + owner
        if self.runtime == "lxc":
            return (f"lxc:{self.id}({self.name})" if self.name and self.name != self.id else f"lxc:{self.id}") + owner
        return f"{self.runtime}:{self.name or self.id[:12]}{owner}"


class GpuProcess(msgspec.Struct, gc=False, kw_only=True):  # every field always on the wire: scripts read "attribution"
    """One process NVML reports on a GPU, attributed to a run where possible."""

    pid: int
    gpu: int
    used_bytes: int | None = None  # None: the driver does not say (e.g. MIG, some containers)
    kind: Literal["compute", "graphics"] = "compute"
    # RUN: member of a live run; STALE: member of an ended run; FOREIGN: no run;
    # NO_SUCH_PROCESS: NVML sees the pid, the OS does not.
    attribution: Literal["RUN", "STALE", "FOREIGN", "NO_SUCH_PROCESS"] = "FOREIGN"
    run_id: str | None = None
    rank: int | None = None
    user: str | None = None
    status: str | None = None  # psutil status: running, sleeping, zombie, disk-sleep, ...
    create_time: float | None = None
    cmdline: tuple[str, ...] = ()
    container: Container | None = None  # the container it runs in, seen from the host (None: none, or not told)


class Gpu(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """One GPU as NVML sees it (a compact snapshot leaves the static uuid, name and total out after the first)."""

    index: int
    uuid: str = ""
    name: str = ""
    memory_used: int
    memory_total: int = 0
    util_gpu: int | None = None  # percent
    util_mem: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    unaccounted_bytes: int | None = None  # used memory that no visible process accounts for
    processes: tuple[GpuProcess, ...] = ()


class UnaccountedMemory(msgspec.Struct, gc=False, kw_only=True):  # every field always on the wire: scripts read "holder"
    """GPU memory that no process visible to the agent explains: a holder that cannot be signalled from here."""

    gpu: int
    used_bytes: int
    holder: bool = True  # at or over the threshold (agents/safety/unaccounted.py): pre-flight and reclaim count it
    note: str = ""  # where it may be held and what to do


class NamespaceInfo(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """The PID namespace the agent runs in (NVML lists only that namespace's processes) and the container markers seen."""

    pid_namespace: Literal["host", "isolated", "unknown"] = "unknown"
    container_markers: tuple[str, ...] = ()  # /.dockerenv, /run/.containerenv, container= in pid 1's environment, /proc/1/cgroup
    evidence: tuple[str, ...] = ()  # how the PID namespace was told
    label: str = ""  # one line for `agent status` and the console


class ProcInfo(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """A process of interest: a run member or a GPU holder."""

    pid: int
    ppid: int | None = None
    pgid: int | None = None
    sid: int | None = None
    user: str | None = None
    create_time: float | None = None
    status: str | None = None
    rss: int | None = None
    cpu_seconds: float | None = None  # user + system CPU time so far
    cmdline: tuple[str, ...] = ()
    run_id: str | None = None
    rank: int | None = None
    local_rank: int | None = None


class Member(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """A process that belongs to a run, identified by (pid, create_time) to survive PID reuse."""

    pid: int
    create_time: float
    role: str = "worker"  # shim | leader | worker
    rank: int | None = None
    local_rank: int | None = None
    first_seen: float = 0.0
    cmdline: tuple[str, ...] = ()
    # how the agent knows it belongs: "cgroup" (in the run's group), "tag" (GPUDECK_RUN_ID), "ancestry"
    # (a descendant of the run's shim, or in its session / process group, without the tag); "" for the shim
    found_by: str = ""
    tagged: bool = True  # False: in the run (its group or its tree) without the GPUDECK_RUN_ID tag


class Reported(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """A process the agent saw near a run and did not treat as a member (or could not stop), and why."""

    pid: int
    create_time: float | None = None
    uid: int | None = None
    cmdline: list[str] = []
    why: str = ""


class ContainmentInfo(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """How a run is contained, and what the kernel counted for it where it keeps a group."""

    level: str  # "systemd" | "cgroupfs" | "tag"
    label: str  # "cgroup (systemd scope)" | "cgroup (cgroupfs)" | "tag + ancestry only: <why no cgroup>"
    group: str | None = None  # the cgroup v2 directory
    cpu_seconds: float | None = None  # cpu.stat usage_usec
    memory_peak_bytes: int | None = None  # memory.peak
    oom_kills: int | None = None  # memory.events oom_kill
    figures_note: str = ""  # which figures are not available, and why
    outside: list[Reported] = []  # tagged processes outside the group: reported, never signalled
    untagged: list[int] = []  # pids in the group (members) without the tag
    other_uid: list[Reported] = []  # tagged processes of another uid: reported, never signalled


class Claims(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """What the operator says a run is (checked against what is observed: failure 7)."""

    gpus: int | None = None
    params: int | None = None
    world_size: int | None = None
    tokens_per_s: float | None = None
    dataset_samples: int | None = None
    note: str | None = None


class LaunchSpec(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """What to run. ``argv`` is a list and is never given to a shell."""

    argv: list[str]
    name: str | None = None
    kind: Literal["command", "fsdp", "dflash"] = "command"
    gpus: list[int] | None = None  # sets CUDA_VISIBLE_DEVICES; None leaves it alone
    env: dict[str, str] = {}
    cwd: str | None = None
    start: str | None = None  # "fresh" | "resume N" for trainers
    operator: str | None = None
    parent: str | None = None  # run this one relaunches / rolls back
    python: str | None = None  # the interpreter of the run's environment (fingerprinted, pre-flighted)
    need_gib: float | None = None  # GPU memory each GPU needs; None: estimated for fsdp/dflash
    force: bool = False  # launch despite FOREIGN/STALE holders on the GPUs (recorded)
    rdzv_port: int | None = None  # torchrun rendezvous port that must be free
    checkpoint_dir: str | None = None  # where checkpoints go (room checked; --resume N looked up)
    on_rank_death: Literal["alert", "stop"] = "alert"
    # a live run whose steps stop advancing: triage (evidence, then the alert), alert only, or triage then stop
    on_hang: Literal["triage", "alert", "stop"] = "triage"
    straggler_window: int | None = None  # steps each rank's compute time is compared over (None: 8)
    hang_after_s: float | None = None  # the floor of the hang threshold (None: 120 s); the threshold is max(5 x median step, this)
    expected_ranks: int | None = None  # known from torchrun arguments; the manifest's world size otherwise
    claims: Claims | None = None
    # multi-node: every node has the same run id; node_rank 0 is the rendezvous host
    run_id: str | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    nodes: list[str] = []
    # multi-node: the cross-node environment differences launched past (`--allow-env-diff NAME`, recorded), and the
    # gate's differing rows as they were at launch ("transformers: nodea 5.25.0 | nodeb 4.57.1")
    allow_env_diff: list[str] = []
    env_diffs: list[str] = []


class RankTelemetry(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """What one rank reported last."""

    rank: int
    role: str | None = None
    device: str | None = None
    gpu_uuid: str | None = None
    pid: int | None = None
    step: int | None = None
    last_seen: float | None = None
    host: str | None = None  # from the manifest (multi-node: which host the rank runs on)
    stack_signal: str | None = None  # the signal its faulthandler dumps all threads' stacks on, into RUN_DIR/stacks
    flight_recorder: str | None = None  # "request_file": it dumps its Flight Recorder as JSON on the agent's request
    compute_recent: list[float] = []  # seconds computing (not waiting in collectives) of its last steps, newest last
    wait_recent: list[float] = []  # seconds waiting in collectives of the same steps


class RunTelemetry(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """The latest of a run's telemetry (trainers/common/telemetry.py's records, folded)."""

    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    queue_depth: float | None = None
    tau: float | None = None
    world_size: int | None = None
    params_total: int | None = None
    params_trainable: int | None = None
    config_hash: str | None = None
    dataset_samples: int | None = None
    dataset_tokens: int | None = None
    start: str | None = None
    last_checkpoint: int | None = None
    last_ts: float | None = None
    done: bool = False
    error: str | None = None
    bad_lines: int = 0  # telemetry lines the reader refused (each refused by itself; supervision goes on)
    last_rejection: str | None = None  # the latest, e.g. "telemetry line 812 rejected: nesting deeper than 64"
    tps_history: list[float] = []
    ranks: dict[str, RankTelemetry] = {}
    last_step_ts: float | None = None  # when the newest step record was written (the trainer's clock)
    step_period_s: float | None = None  # median seconds per step over the recent steps


class Alert(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """A health or claims problem of a live run (failures 4 and 7); raised once, cleared when it ends."""

    kind: Literal["rank_exited", "heartbeat_lost", "gpu_idle", "throughput_drop", "claim_mismatch", "node_lost", "hang", "straggler"]
    message: str  # says what happened and what to do
    ts: float
    severity: Literal["warning", "critical"] = "warning"
    rank: int | None = None
    gpu: int | None = None
    pid: int | None = None
    data: dict[str, Any] = {}
    cleared: float | None = None


class PreflightCheck(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """One pre-flight check and its verdict."""

    name: str  # gpus_exist | gpu_memory | gpu_holders | rdzv_port | checkpoint_room | python_env | resume_checkpoint
    ok: bool
    message: str  # on failure: what is wrong and the fix
    overridden: bool = False  # failed but --force was given (only gpu_holders may be)
    details: dict[str, Any] = {}


class MemoryEstimate(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """GPU memory a trainer run needs per GPU, and how that was worked out."""

    per_gpu_bytes: int
    params: int = 0
    method: str = (
        ""  # e.g. "given with --need-gib" or "llama config: 1.10e9 params x 16 B (fp32 master + AdamW) / 4 GPUs + activations ..."
    )
    parts: dict[str, int] = {}


class PreflightResult(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """The verdict of pre-flight on one host: nothing starts unless ``ok``."""

    ok: bool
    host: str = ""
    checks: list[PreflightCheck] = []
    estimate: MemoryEstimate | None = None
    forced: bool = False
    seconds: float = 0.0


class EnvFingerprint(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """A python environment as recorded at launch (failure 5)."""

    python: str  # the interpreter path
    python_version: str | None = None
    prefix: str | None = None  # sys.prefix (the venv)
    torch: str | None = None
    torch_cuda: str | None = None  # CUDA build, e.g. "13.0"; None for a CPU build
    torch_git: str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    transformers: str | None = None
    driver: str | None = None  # NVIDIA driver version (NVML), None without a GPU
    # what `import torch` actually loads (the metadata can say another NCCL than the library that is mapped):
    nccl_runtime: str | None = None  # torch.cuda.nccl.version(), e.g. "2.28.9"; None: not probed or a CPU build
    libnccl: str | None = None  # path of the libnccl mapped after `import torch`, "none (CPU build)", or "not loaded"
    libnccl_sha256: str | None = None  # sha256 of that file (None: no file, or too large to hash)
    dist_env: dict[str, str] = {}  # NCCL_* / TORCH_* variables the probe saw (secret-looking values as a digest)
    packages: dict[str, str] = {}  # distribution name (normalized) -> version
    freeze: list[str] = []  # requirement lines, pip freeze style
    freeze_hash: str = ""  # sha256 of the sorted freeze lines
    taken: float = 0.0
    error: str | None = None  # why the fingerprint is incomplete


class ClaimRow(msgspec.Struct, gc=False, omit_defaults=True):
    """One line of claimed vs observed (``gpudeck verify RUN``); ``ok`` is None when one side is unknown."""

    what: str  # params | params (model config) | world size | GPUs | dataset samples | dataset tokens | tokens/s
    claimed: int | float | None = None
    observed: int | float | None = None
    ok: bool | None = None
    source: str = ""  # where the claim comes from: "claims", "run name '...'", "--gpus 0,1", "manifest", ...
    detail: str = ""  # e.g. "GPU 0, GPU 1" for observed GPUs


class Leftover(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """A process that ``gpudeck reclaim`` offers to stop, and why it is a leftover."""

    pid: int
    create_time: float | None = None
    # orphan: alive, belongs to an ended run; foreign: holds GPU memory, no run; zombie / disk_sleep: holds GPU
    # memory in that state; no_such_process: NVML reports it, the OS does not; live: a member of a live run
    kind: Literal["orphan", "foreign", "zombie", "disk_sleep", "no_such_process", "live"]
    run_id: str | None = None
    run_state: str | None = None
    run_ended: float | None = None
    run_cause: str | None = None
    rank: int | None = None
    user: str | None = None
    status: str | None = None
    ppid: int | None = None
    cmdline: list[str] = []
    gpu_bytes: dict[int, int] = {}  # GPU index -> bytes NVML says it holds
    found_by: str = ""  # how it is known to be the run's: "cgroup", "tag", "ancestry" (as for a stop), "" for a GPU holder
    rss: int | None = None
    cpu_percent: float | None = None
    note: str = ""  # what to do about it
    container: Container | None = None  # the container it runs in, seen from the host (None: none, or not told)


class RunInfo(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """A run as the agent's journal knows it."""

    id: str
    host: str
    state: RunState
    spec: LaunchSpec
    name: str | None = None
    cause: str | None = None
    exit_code: int | None = None
    signal: str | None = None
    created: float = 0.0
    started: float | None = None
    ended: float | None = None
    request_id: str | None = None
    run_dir: str | None = None
    members: list[Member] = []
    telemetry: RunTelemetry | None = None  # live runs only (the journal keeps the records as events)
    alerts: list[Alert] = []
    preflight: PreflightResult | None = None
    env: EnvFingerprint | None = None
    containment: ContainmentInfo | None = None


class RankEvidence(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """What a triage found about one rank's process (or, without ranks, one member of the run)."""

    rank: int | None = None
    pid: int
    host: str = ""
    state: str | None = None  # running, sleeping, disk-sleep (D), zombie, stopped ... (psutil's words)
    cpu_percent: float | None = None  # over the triage's sampling interval
    gpu: int | None = None
    gpu_util: int | None = None
    gpu_memory: int | None = None  # bytes the rank's pid holds on its GPU
    method: str = ""  # faulthandler | py-spy | none
    method_why: str = ""  # why that method (or why none could be used)
    stacks: str = ""  # every thread's Python stack, as the method wrote it (bounded)
    where: str = ""  # the innermost frame of the main thread: "time.sleep in fsdp_lm.py:123 (maybe_sleep_for_test)"
    in_collective: bool | None = None  # the main thread is inside torch.distributed / a collective wait


class Triage(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """Evidence from every rank of a run, gathered when a hang is raised or on demand (``gpudeck triage RUN``)."""

    run_id: str
    ts: float
    reason: str  # "hang alert" | "on demand"
    culprit: str  # one line: who is stuck where, and what the others do
    seconds: float = 0.0  # how long gathering took
    ranks: list[RankEvidence] = []
    flight_recorder: str = ""  # torch's Flight Recorder summary, or why there is none
    missing: list[str] = []  # what could not be gathered, and why


class StoppedProcess(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """One member process and how the stop ended it."""

    pid: int
    cmdline: list[str] = []
    role: str = "worker"
    how: Literal["exited", "SIGTERM", "SIGKILL", "already_gone", "survived", "zombie"] = "exited"
    status: str | None = None  # survivors: psutil status (e.g. disk-sleep); stopped: "zombie" while its parent has not reaped it


class GpuFreed(msgspec.Struct, gc=False, kw_only=True):
    """Memory on one GPU before and after a stop."""

    gpu: int
    before_bytes: int
    after_bytes: int
    freed_bytes: int


class StopResult(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """The verified outcome of stopping a run (or reclaiming processes)."""

    run_id: str | None
    state: str
    stopped: list[StoppedProcess] = []
    survivors: list[StoppedProcess] = []
    needed_kill: list[int] = []
    gpu_verified: bool = False
    gpu_note: str = ""
    still_on_gpu: list[GpuProcess] = []
    freed: list[GpuFreed] = []
    freed_bytes: int = 0
    seconds: float = 0.0
    message: str = ""
    containment: str = ""  # the level the stop went through, as its label says
    group_note: str = ""  # what became of the run's cgroup (emptied and removed, or kept and why)
    reported: list[Reported] = []  # seen and not signalled (outside the group, another uid), or not findable at this level
    resumed_after_s: float | None = None  # a stop an earlier agent began: the seconds already spent when this agent took it over
    grace_shortened_s: float | None = None  # a later stop asked for a shorter grace: the grace that applied, in seconds
    # what was not stopped and still holds memory: the rest of the same run(s), others on the GPUs the stopped ones held
    still_held: list[GpuProcess] = []
    unaccounted: list[UnaccountedMemory] = []  # on those GPUs, held by no process visible here


class Event(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """A journal event; ``(epoch, seq)`` identifies it forever."""

    seq: int
    ts: float
    kind: str
    run_id: str | None = None
    data: dict[str, Any] = {}


class Snapshot(_Msg, tag="snapshot", kw_only=True, omit_defaults=False):  # every field present for scripts
    """The host at one instant: GPUs, their processes attributed, live runs."""

    host: str
    ts: float
    epoch: str
    gpus: list[Gpu] = []
    gpu_error: str | None = None  # why there are no GPUs ("NVML: driver not loaded", ...)
    storage_error: str | None = None  # the journal cannot be written right now (disk full): what is shown may lag
    journal_note: str | None = None  # the journal was found deleted/replaced/corrupt and recreated (what, when, where moved)
    simulated: bool = False
    runs: list[RunInfo] = []
    processes: list[ProcInfo] = []  # members of live runs and STALE survivors
    last_seq: int = 0
    sample_ms: float = 0.0
    compact: bool = False  # the GPUs' static fields (uuid, name, memory_total, power_limit_w) are those of the stream's first snapshot
    namespace: NamespaceInfo | None = None  # the agent's PID namespace (None: an older agent)
    unaccounted: list[UnaccountedMemory] = []  # per GPU, memory no visible process explains (holders and the small rest)


# ----------------------------------------------------------------------------- requests


class Hello(_Msg, tag="hello", kw_only=True):
    """First message a client sends; the agent answers with HelloReply or a version Error."""

    version: int = PROTOCOL_VERSION
    client: str = ""
    host_alias: str = ""  # the name the client knows this host by (used in messages that name commands to run)


class Ping(_Msg, tag="ping", kw_only=True):
    """Liveness check."""


class GetSnapshot(_Msg, tag="get_snapshot", kw_only=True):
    """One snapshot: GPUs, processes and run figures sampled at most ``max_age_s`` ago (``ts`` says when); which runs
    are live, their states and the journal's (``last_seq``, problems) as they are now (a state change or an event since
    the sample makes the agent sample again). ``max_age_s`` 0 asks for a sample made for this request; a larger bound than SNAPSHOT_MAX_AGE_S is taken as
    that, a negative one is refused (``bad_request``)."""

    max_age_s: float = SNAPSHOT_MAX_AGE_S


class WatchSnapshots(_Msg, tag="watch_snapshots", kw_only=True):
    """A snapshot every ``interval_s`` (a fixed rate) until cancelled; ``compact``: static GPU fields only in the first.

    ``phase_s``: where in each interval they go out, after every whole ``interval_s`` of the wall clock (taken modulo
    the interval; negative or not finite is refused). A console following a big fleet spreads its hosts over a few
    phases, so it never takes every host's snapshot in one turn of its event loop (an agent that predates the field
    ignores it and sends on the whole interval)."""

    interval_s: float = 1.0
    compact: bool = False
    phase_s: float = 0.0


class Launch(_Msg, tag="launch", kw_only=True):
    """Start a run. A retry with the same request_id returns the first result."""

    spec: LaunchSpec


class ListRuns(_Msg, tag="list_runs", kw_only=True):
    """All runs in the journal, newest first."""

    limit: int = 1000


class GetRun(_Msg, tag="get_run", kw_only=True):
    """One run by id (a unique prefix is accepted)."""

    run_id: str


class Stop(_Msg, tag="stop", kw_only=True):
    """Stop a run: TERM to every member, grace, KILL, reap, verify."""

    run_id: str
    grace_s: float = 30.0
    reason: str = ""  # recorded as the cause instead of "stopped by operator" (e.g. a policy that stopped it)


class GetEvents(_Msg, tag="get_events", kw_only=True):
    """Events after ``after_seq``; with ``follow`` the stream stays open; ``wait_s`` (without follow): a long poll
    that answers as soon as there is an event, or empty after ``wait_s`` (one batch in flight: natural back-pressure)."""

    after_seq: int = 0
    limit: int = 10000
    follow: bool = False
    wait_s: float = 0.0


class ReadOutput(_Msg, tag="read_output", kw_only=True):
    """A run's output from byte ``offset`` (negative: that many bytes before the end); ``follow`` streams new bytes."""

    run_id: str
    offset: int = 0
    max_bytes: int = MAX_OUTPUT_CHUNK
    follow: bool = False


class GetMetrics(_Msg, tag="get_metrics", kw_only=True):
    """A run's step metrics from its telemetry, thinned to at most ``max_points``."""

    run_id: str
    max_points: int = 300


class Cancel(_Msg, tag="cancel", kw_only=True):
    """End the stream started by the request with ``target``."""

    target: str


class Preflight(_Msg, tag="preflight", kw_only=True):
    """Run pre-flight for a spec without launching anything."""

    spec: LaunchSpec


class ListLeftovers(_Msg, tag="list_leftovers", kw_only=True):
    """Processes ``reclaim`` would offer: orphans of ended runs, FOREIGN / zombie / D-state GPU holders, ghosts."""

    include_live: bool = False


class Reclaim(_Msg, tag="reclaim", kw_only=True):
    """Stop exactly these pids (TERM, grace, KILL, verify); members of live runs only with ``include_live``."""

    pids: list[int]
    grace_s: float = 10.0
    include_live: bool = False


class Fingerprint(_Msg, tag="fingerprint", kw_only=True):
    """Fingerprint a python environment on the host.

    ``env`` is put on top of the agent's environment for the probe, as a launch's environment is on top of it for the
    run: the cross-node gate sends the run's, so an ``LD_LIBRARY_PATH`` given with ``--env`` decides which libnccl the
    probe finds, as it will for the run. Checked as a launch's environment is (names non-empty, no ``=`` or NUL).
    """

    python: str
    env: dict[str, str] = {}


class RebuildEnv(_Msg, tag="rebuild_env", kw_only=True):
    """Recreate a recorded environment in a new venv under the agent's state dir and prove it matches."""

    env: EnvFingerprint


class VerifyRun(_Msg, tag="verify_run", kw_only=True):
    """Claims vs observed for one run."""

    run_id: str


class TriageRun(_Msg, tag="triage_run", kw_only=True):
    """Gather a triage of a live run now (stacks, states, CPU, GPU of every rank); stored with the run."""

    run_id: str


Request = Union[
    Hello,
    Ping,
    GetSnapshot,
    WatchSnapshots,
    Launch,
    ListRuns,
    GetRun,
    Stop,
    GetEvents,
    ReadOutput,
    GetMetrics,
    Cancel,
    Preflight,
    ListLeftovers,
    Reclaim,
    Fingerprint,
    RebuildEnv,
    VerifyRun,
    TriageRun,
]

# ----------------------------------------------------------------------------- replies


class HelloReply(_Msg, tag="hello_reply", kw_only=True):
    """The agent's identity."""

    version: int = PROTOCOL_VERSION
    agent_version: str
    host: str
    epoch: str
    pid: int
    uid: int
    state_dir: str
    gpu_error: str | None = None
    simulated: bool = False  # GPUDECK_SIMULATE_GPUS: the GPUs this agent reports are simulated, not read through NVML
    containment: str | None = None  # the containment this agent gives its runs (its label)
    journal: str | None = None  # the journal's story when it is not plain: recreated (why, when, moved where), or a problem now
    namespace: NamespaceInfo | None = None  # the agent's PID namespace and container markers (None: an older agent)


class Pong(_Msg, tag="pong", kw_only=True):
    """Reply to Ping."""

    ts: float


class LaunchReply(_Msg, tag="launch_reply", kw_only=True):
    """The run that a Launch started (or the run of an earlier Launch with the same request_id)."""

    run: RunInfo
    duplicate: bool = False


class RunList(_Msg, tag="run_list", kw_only=True):
    """Reply to ListRuns."""

    runs: list[RunInfo]


class RunReply(_Msg, tag="run_reply", kw_only=True):
    """Reply to GetRun."""

    run: RunInfo


class StopReply(_Msg, tag="stop_reply", kw_only=True):
    """Reply to Stop."""

    result: StopResult


class EventBatch(_Msg, tag="event_batch", kw_only=True):
    """Events in seq order; ``last_seq`` is the journal's newest seq when sent."""

    epoch: str
    events: list[Event]
    last_seq: int


class OutputChunk(_Msg, tag="output_chunk", kw_only=True):
    """Bytes of a run's output starting at ``offset`` (decoded as UTF-8 with replacement)."""

    run_id: str
    offset: int
    next_offset: int
    data: str
    run_ended: bool = False


class Metrics(_Msg, tag="metrics", kw_only=True):
    """Step series of one run (index-aligned lists; None where a step did not report the figure)."""

    run_id: str
    steps: list[int] = []
    loss: list[float | None] = []
    tokens_per_s: list[float | None] = []
    mfu: list[float | None] = []
    total_steps: int = 0


class PreflightReply(_Msg, tag="preflight_reply", kw_only=True):
    """Reply to Preflight."""

    result: PreflightResult


class LeftoverList(_Msg, tag="leftover_list", kw_only=True):
    """Reply to ListLeftovers, with the GPUs as sampled at the same time."""

    leftovers: list[Leftover] = []
    gpus: list[Gpu] = []
    gpu_error: str | None = None
    unaccounted: list[UnaccountedMemory] = []  # held by no process visible here: listed, never signalled


class FingerprintReply(_Msg, tag="fingerprint_reply", kw_only=True):
    """Reply to Fingerprint and RebuildEnv."""

    env: EnvFingerprint
    path: str | None = None  # RebuildEnv: the new environment's folder


class VerifyReply(_Msg, tag="verify_reply", kw_only=True):
    """Reply to VerifyRun."""

    run_id: str
    rows: list[ClaimRow] = []
    alerts: list[Alert] = []


class TriageReply(_Msg, tag="triage_reply", kw_only=True):
    """Reply to TriageRun."""

    triage: Triage


class StreamEnd(_Msg, tag="stream_end", kw_only=True):
    """A stream ended (cancelled, or nothing more will come)."""

    reason: str = ""


class Error(_Msg, tag="error", kw_only=True):
    """A typed failure; ``message`` says what happened and what to do."""

    code: str
    message: str


Reply = Union[
    HelloReply,
    Pong,
    Snapshot,
    LaunchReply,
    RunList,
    RunReply,
    StopReply,
    EventBatch,
    OutputChunk,
    Metrics,
    PreflightReply,
    LeftoverList,
    FingerprintReply,
    VerifyReply,
    TriageReply,
    StreamEnd,
    Error,
]

# ----------------------------------------------------------------------------- codecs

_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(Request)
_reply_decoder = msgspec.json.Decoder(Reply)
_any_decoder = msgspec.json.Decoder()


def scrub_text(text: str) -> str:
    """``text`` with every lone surrogate (``'\\ud800'``, a ``surrogateescape``d byte) replaced by U+FFFD; a valid
    surrogate pair becomes its character. UTF-8 (and so msgspec, the wire and SQLite's JSON) cannot hold a lone one."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def scrub(obj: Any, _depth: int = 0) -> Any:
    """Plain data (dicts, lists, strings, numbers) with every string :func:`scrub_text`-ed, keys too; bounded depth."""
    if isinstance(obj, str):
        return scrub_text(obj)
    if _depth > 256:  # deeper than any message: cut (our own data never nests like this)
        return None
    if isinstance(obj, dict):
        return {scrub(k, _depth + 1): scrub(v, _depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, _depth + 1) for v in obj]
    return obj


def encode_safe(obj: Any) -> bytes:
    """``obj`` (a Struct or plain data) as JSON; a string holding a lone surrogate, which msgspec refuses to encode,
    goes out with U+FFFD in its place instead of failing the whole message (a run's name, output or telemetry may
    hold one). The fast path is msgspec's own: the scrub runs only when it refuses."""
    try:
        return _encoder.encode(obj)
    except UnicodeEncodeError:
        return _encoder.encode(scrub(msgspec.to_builtins(obj)))


def encode(msg: msgspec.Struct) -> bytes:
    """One message as one line, newline included (lone surrogates replaced: :func:`encode_safe`)."""
    return encode_safe(msg) + b"\n"


def _lenient(line: bytes) -> bytes | None:
    """A line msgspec refused, re-encoded with its lone-surrogate escapes (``"\\ud800"``, as Python's ``json.dumps``
    writes a ``surrogateescape``d string) as U+FFFD; None when it is not valid JSON for other reasons too."""
    if b"\\u" not in line:
        return None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    try:
        return _encoder.encode(scrub(obj))
    except (TypeError, ValueError, OverflowError):
        return None


def _salvage_request_id(line: bytes) -> str:
    """Best effort: the request_id of a line that failed validation, so the error can be matched."""
    try:
        obj = _any_decoder.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return ""
    if isinstance(obj, dict):
        rid = obj.get("request_id")
        if isinstance(rid, str) and len(rid) <= 200:
            return rid
    return ""


def decode_request(line: bytes) -> Request | Error:
    """Decode one line into a request, or into the Error that should be sent back."""
    try:
        return _request_decoder.decode(line)
    except msgspec.ValidationError as exc:
        rid = _salvage_request_id(line)
        return Error(
            request_id=rid, code="bad_message", message=f"message not understood: {exc}; see agents/wire/protocol.py for the message types"
        )
    except msgspec.DecodeError as exc:
        fixed = _lenient(line)
        if fixed is not None:
            return decode_request(fixed)  # lone surrogates only: decoded with U+FFFD in their place
        return Error(code="bad_json", message=f"not valid JSON: {exc}; send one JSON object per line")
    except RecursionError:
        return Error(code="bad_json", message="the message nests too deeply; send flat JSON objects, one per line")


def decode_reply(line: bytes) -> Reply:
    """Decode one line from the agent; raises msgspec errors on garbage."""
    return _reply_decoder.decode(line)


def to_builtins(msg: Any) -> Any:
    """A Struct (or list of them) as plain JSON-ready Python objects."""
    return msgspec.to_builtins(msg)


# What is trimmed around a frame: JSON's own whitespace only. bytes.strip() would also drop \x0b and \x0c, which JSON
# does not allow, and turn a frame that is not JSON (b"\x0b0") into one that is (b"0"): the sender would be told its
# message had the wrong shape when it was not JSON at all.
JSON_SPACE = b" \t\r\n"


class FrameReader:
    """Splits a byte stream into lines, bounded by ``max_frame``; sans-IO.

    ``feed`` returns complete frames; a frame longer than ``max_frame`` is
    discarded up to its newline and reported once as ``None`` so the caller
    can answer with an error while the connection stays usable.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        # the unfinished frame's chunks, as they came (joined once, when its newline comes): no buffer grown and cut
        # back per chunk, which under load cost more than the decoding (bench/RESULTS.md 32-sync)
        self._parts: list[bytes] = []
        self._pending = 0
        self._discarding = False

    def feed(self, data: bytes) -> list[bytes | None]:
        """Add bytes; return complete frames (None marks an oversized frame)."""
        if not self._parts and not self._discarding and data.find(b"\n") == len(data) - 1 and len(data) <= self.max_frame + 1:
            line = data[:-1].strip(JSON_SPACE)  # the common case: exactly one whole frame (no copy)
            return [line] if line else []
        out: list[bytes | None] = []
        start, end = 0, len(data)
        while start < end:
            nl = data.find(b"\n", start)
            if nl < 0:  # the rest is part of a frame still to come
                if self._discarding:
                    return out
                self._pending += end - start
                if self._pending > self.max_frame:  # reported as soon as it is too long, then dropped up to its newline
                    self._discarding = True
                    self._parts.clear()
                    self._pending = 0
                    out.append(None)
                else:
                    self._parts.append(bytes(data[start:]) if start else bytes(data))
                return out
            if self._discarding:
                self._discarding = False
            elif self._pending + nl - start > self.max_frame:
                out.append(None)
            else:
                line = bytes(data[start:nl])
                if self._parts:
                    self._parts.append(line)
                    line = b"".join(self._parts)
                line = line.strip(JSON_SPACE)
                if line:
                    out.append(line)
            self._parts.clear()
            self._pending = 0
            start = nl + 1
        return out

    @property
    def pending(self) -> int:
        """Bytes buffered without a newline yet."""
        return self._pending


def new_run_id() -> str:
    """A short, unique run id such as ``r-7f3a9c21`` (the console makes one for a multi-node run, the agent otherwise)."""
    return "r-" + uuid.uuid4().hex[:8]
