"""Provides launch planning and launching: an intent becomes the spec of every node, then runs (all or nothing).

:func:`plan_launch` is the one place a :class:`~gpudeck.agents.wire.protocol.LaunchSpec` is
built. A trainer kind with trainer options becomes ``python -m trainers.X``, or
``python -m torch.distributed.run --standalone --nproc-per-node N -m
trainers.X`` when several ranks are asked for (``--nproc-per-node``, else one
per GPU). Several hosts become one run with one id, one torchrun node per host:

- every node runs ``torchrun --nnodes N --node-rank i --nproc-per-node G
  --rdzv-backend c10d --rdzv-endpoint <first host>:<port> --rdzv-id <run id>``;
- the rendezvous address is the first host as the others reach it: its
  ``rdzv_host`` from the config, else its SSH HostName;
- per host, ``nccl_socket_ifname`` / ``gloo_socket_ifname`` / ``env`` from the
  config go into that node's environment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from gpudeck.agents.wire.envdiff import EnvGate
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import LaunchReply, LaunchSpec, PreflightResult, new_run_id
from gpudeck.console.core import config as cfg
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops import gate as env_gate
from gpudeck.console.ops.errors import IntentError, OpsError
from gpudeck.console.ops.intent import (
    DEFAULT_PYTHON,
    Caller,
    LaunchIntent,
    check_claims,
    check_env,
    check_gpus,
    check_host,
    check_hosts,
    check_kind,
    check_name,
    check_positive,
    check_start,
    shared_fields,
)
from gpudeck.trainers.contract import TRAINER_MODULES, start_argv, strip_start

DEFAULT_RDZV_PORT = 29400


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch will start: one (host, spec) per node; several nodes share one run id."""

    nodes: tuple[tuple[str, LaunchSpec], ...]
    nproc_per_node: int
    rdzv_endpoint: str | None = None

    @property
    def hosts(self) -> list[str]:
        """The hosts, node rank order."""
        return [h for h, _ in self.nodes]

    @property
    def multinode(self) -> bool:
        """Whether this is one run across several hosts."""
        return len(self.nodes) > 1

    @property
    def spec(self) -> LaunchSpec:
        """The first node's spec (the only one of a one-host run)."""
        return self.nodes[0][1]


@dataclass
class NodeOutcome:
    """One node's answer: its reply, or the error that kept it from starting."""

    host: str
    reply: LaunchReply | None = None
    error: str | None = None
    preflight: PreflightResult | None = None


@dataclass
class LaunchResult:
    """What a launch did: ``running`` (every node started), ``preflight_failed`` (nothing started) or ``launch_failed``
    (a node could not start; the ones that did were stopped)."""

    verdict: str
    plan: LaunchPlan
    nodes: list[NodeOutcome] = field(default_factory=list)
    gate: EnvGate | None = None  # multi-node: the cross-node comparison (refused: ``gate.refused``)

    @property
    def run_id(self) -> str:
        """The run's id (the agent's for a one-host run)."""
        for n in self.nodes:
            if n.reply is not None:
                return n.reply.run.id
        return self.plan.spec.run_id or ""

    @property
    def failed(self) -> list[NodeOutcome]:
        """The nodes that refused or could not be reached."""
        return [
            n
            for n in self.nodes
            if n.error is not None
            or (n.reply is not None and n.reply.run.state == "preflight_failed")
            or (n.preflight is not None and not n.preflight.ok)
        ]


def is_trainer(argv: Sequence[str], kind: str) -> bool:
    """Whether the argv runs one of gpudeck's trainers (which take --fresh / --resume)."""
    return kind in TRAINER_MODULES or any(a in TRAINER_MODULES.values() for a in argv)


def with_start(argv: Sequence[str], start: str) -> list[str]:
    """``argv`` with its start options replaced by ``start``'s."""
    return [*strip_start(list(argv)), *start_argv(start)]


# ----------------------------------------------------------------------------- planning


def _program(intent: LaunchIntent, start: str | None) -> list[str]:
    """What torchrun (or python) runs: ``-m trainers.X ARGS`` for trainer options, else the command."""
    argv = list(intent.argv)
    if intent.trainer_args:
        args = with_start(argv, start) if start else argv
        return ["-m", TRAINER_MODULES[intent.kind], *args]
    if start is not None and is_trainer(argv, intent.kind):
        argv = with_start(argv, start)
    return argv


def plan_launch(
    intent: LaunchIntent,
    caller: Caller,
    conf: cfg.Config | None = None,
    ssh_config_paths: Sequence[str] = (),
    run_id: str | None = None,
    verb: str = "launch",
) -> LaunchPlan:
    """Validate every field of ``intent`` and build the spec of every node; IntentError names the field and the fix.

    ``verb``: the command that asks (``launch`` or ``preflight``), as the messages name it."""
    kind = check_kind(intent.kind)
    gpus = check_gpus(intent.gpus)
    env = check_env(intent.env)
    check_name(intent.name)
    claims = check_claims(intent.claims)
    nproc = check_positive(
        intent.nproc_per_node, "ranks per node", "give how many ranks each host starts (1 or more), or leave it out: one per GPU"
    )
    check_positive(intent.expected_ranks, "expected ranks", "give the ranks the run must have, or leave it out")
    if intent.on_rank_death not in ("alert", "stop"):
        raise IntentError("on rank death", f"{intent.on_rank_death!r} is not a choice", "choose alert or stop")
    if intent.on_hang not in ("triage", "alert", "stop"):
        raise IntentError("on hang", f"{intent.on_hang!r} is not a choice", "choose triage, alert or stop")
    if intent.hang_after_s is not None and not intent.hang_after_s > 0:
        raise IntentError(
            "hang after", f"{intent.hang_after_s} is not a positive number of seconds", "give seconds, e.g. 300, or leave it out (120)"
        )
    check_positive(
        intent.straggler_window,
        "straggler window",
        "give the steps each rank's compute time is compared over, e.g. 20, or leave it out (8)",
    )
    if intent.need_gib is not None and intent.need_gib < 0:
        raise IntentError("need GiB", f"{intent.need_gib} is negative", "give the GiB each GPU needs")
    if intent.rdzv_port is not None and not 0 < intent.rdzv_port < 65536:
        raise IntentError("rendezvous port", f"{intent.rdzv_port} is not a port", "give a port between 1 and 65535")
    if intent.python is not None and not intent.python.strip():
        raise IntentError("python", "the interpreter is empty", "give a python interpreter (a path or a name on PATH), or leave it out")
    if not intent.argv and kind not in TRAINER_MODULES:
        raise IntentError(
            "command",
            f"{verb} needs a command",
            f"give the command after --, e.g. `gpudeck {verb} -- python train.py` (or --kind fsdp -- --model-config llama-1b --out DIR)",
        )
    if nproc is not None and kind not in TRAINER_MODULES and not intent.hosts:
        raise IntentError(
            "ranks per node",
            "only a trainer kind (fsdp, dflash) or a multi-node run is started under torchrun by gpudeck",
            "put torchrun in the command yourself, or choose --kind fsdp/dflash",
        )
    start = check_start(intent.start, needed=intent.trainer_args)
    allow_env_diff = env_gate.check_allowed(intent.allow_env_diff, bool(intent.hosts))
    if not intent.hosts:
        check_host(intent.host or cfg.LOCAL)
    python = intent.python or DEFAULT_PYTHON
    n = nproc or (len(gpus) if gpus else 1)
    program = _program(intent, start)
    base = LaunchSpec(
        argv=[],
        kind=kind,
        gpus=gpus,
        env=env,
        start=start,
        parent=intent.parent,
        python=intent.python,
        force=intent.force,
        claims=claims,
        **shared_fields(intent, name=(intent.name or "").strip() or None, operator=intent.operator or caller.operator),
    )
    if intent.hosts:
        base.allow_env_diff = allow_env_diff
        return _plan_multinode(intent, base, program, python, n, nproc, conf, ssh_config_paths, run_id)
    host = intent.host or cfg.LOCAL
    if host == cfg.LOCAL:
        # a local launch runs in the caller's environment: `python` means the python of this shell;
        # on another host the agent's own environment applies (the caller's PATH means nothing there)
        base.env = {**caller.env, **env}
        base.cwd = os.path.abspath(os.path.join(caller.cwd, intent.cwd)) if intent.cwd else caller.cwd
    if intent.trainer_args:
        if n > 1:
            base.argv = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *program]
        else:
            base.argv = [python, *program]
    else:
        base.argv = program
    return LaunchPlan(nodes=((host, base),), nproc_per_node=n)


def rendezvous_host(first: cfg.HostSettings, config_paths: Sequence[str], override: str | None = None) -> str:
    """The address the other nodes reach the first host at."""
    if override:
        return override
    if first.rdzv_host:
        return first.rdzv_host
    if first.name == cfg.LOCAL:
        raise IntentError(
            "rendezvous host",
            "the first host is 'local'",
            "give --rdzv-host ADDRESS (how the other hosts reach this machine), or put another host first",
        )
    from gpudeck.console.fleet.transport import ssh_hostname  # asyncssh comes with it: a multi-node launch only

    return ssh_hostname(first.name, config_paths) or first.name


def node_env(settings: cfg.HostSettings) -> dict[str, str]:
    """The environment a host's config adds to its node (interfaces, extra variables)."""
    env = dict(settings.env)
    if settings.nccl_socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = settings.nccl_socket_ifname
    if settings.gloo_socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = settings.gloo_socket_ifname
    return env


def _torchrun_program(program: list[str]) -> list[str]:
    """What torchrun starts on each node: ``-m module args`` or ``script args`` (``python -m x`` loses its python)."""
    if program and (program[0] == "-m" or program[0].endswith(".py")):
        return program
    if len(program) >= 3 and Path(program[0]).name.startswith("python") and program[1] == "-m":
        return program[1:]  # torchrun brings its own python
    raise IntentError(
        "command",
        "a multi-node run's command is what torchrun starts on each node",
        "give `-m package.module ARGS` or `script.py ARGS` (or --kind fsdp -- TRAINER ARGS)",
    )


def _plan_multinode(
    intent: LaunchIntent,
    base: LaunchSpec,
    program: list[str],
    python: str,
    n: int,
    nproc: int | None,
    conf: cfg.Config | None,
    ssh_config_paths: Sequence[str],
    run_id: str | None,
) -> LaunchPlan:
    names = check_hosts(intent.hosts)
    conf = conf or cfg.load(extra_hosts=names)
    hosts = [conf.settings(h) for h in names]
    rdzv_host = rendezvous_host(hosts[0], ssh_config_paths, intent.rdzv_host)
    rdzv_port = intent.rdzv_port or DEFAULT_RDZV_PORT
    prog = _torchrun_program(program)
    rid = run_id or new_run_id()
    # the address each node's workers are reached at (torchrun --local-addr; else torchrun guesses from the hostname)
    local_addrs = [rdzv_host if i == 0 else h.rdzv_host for i, h in enumerate(hosts)]
    nodes = []
    for rank, h in enumerate(hosts):
        argv = [
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(hosts)),
            "--node-rank",
            str(rank),
            "--nproc-per-node",
            str(n),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{rdzv_host}:{rdzv_port}",
            "--rdzv-id",
            rid,
            # say who hosts the rendezvous store: the address may not be one torchrun recognises as its own (NAT, several NICs)
            "--rdzv-conf",
            f"is_host={'true' if rank == 0 else 'false'}",
            *(["--local-addr", local_addrs[rank]] if local_addrs[rank] else []),
            *prog,
        ]
        nodes.append(
            (
                h.name,
                msgspec.structs.replace(
                    base,
                    argv=argv,
                    env={**node_env(h), **base.env},
                    run_id=rid,
                    nnodes=len(hosts),
                    node_rank=rank,
                    nodes=names,
                    rdzv_port=rdzv_port if rank == 0 else None,
                    expected_ranks=intent.expected_ranks or n,
                ),
            )
        )
    return LaunchPlan(nodes=tuple(nodes), nproc_per_node=n, rdzv_endpoint=f"{rdzv_host}:{rdzv_port}")


def plan_here(intent: LaunchIntent, run_id: str | None = None, verb: str = "launch", conf: cfg.Config | None = None) -> LaunchPlan:
    """:func:`plan_launch` for this process's caller, the fleet's config (``conf``: the one a console's fleet follows;
    None: read the config file) and the user's SSH config (what the CLI and the console use)."""
    from gpudeck.console.fleet.transport import SshOptions

    paths = SshOptions().config_paths() if intent.hosts else ()
    return plan_launch(intent, Caller.here(), conf=conf, ssh_config_paths=paths, run_id=run_id, verb=verb)


# ----------------------------------------------------------------------------- running


def request_id() -> str:
    """A fresh idempotency key: a retried launch with it never starts a second run."""
    return f"ops-{uuid.uuid4().hex[:12]}"


async def preflight(fleet: Fleet, plan: LaunchPlan) -> list[NodeOutcome]:
    """Pre-flight every node (nothing starts)."""
    checks = await asyncio.gather(*(fleet.preflight(h, sp) for h, sp in plan.nodes), return_exceptions=True)
    out = []
    for (h, _), c in zip(plan.nodes, checks):
        if isinstance(c, AgentError):
            out.append(NodeOutcome(h, error=c.message))
        elif isinstance(c, BaseException):
            raise c
        else:
            out.append(NodeOutcome(h, preflight=c))
    return out


async def launch(fleet: Fleet, plan: LaunchPlan, request_id: str = "") -> LaunchResult:
    """Start the plan: one node directly (the agent pre-flights it); several only if every node passes pre-flight."""
    if not plan.multinode:
        host, spec = plan.nodes[0]
        reply = await fleet.launch(host, spec, request_id=request_id)
        if reply.duplicate:
            refuse_reused_request(reply.run.spec, spec, request_id)
        verdict = "preflight_failed" if reply.run.state == "preflight_failed" else "running"
        return LaunchResult(verdict, plan, [NodeOutcome(host, reply=reply)])
    checks, gate = await asyncio.gather(preflight(fleet, plan), env_gate.check(fleet, plan.nodes))
    bad = [c for c in checks if c.error is not None or (c.preflight is not None and not c.preflight.ok)]
    if bad:
        # the failing nodes are recorded as preflight_failed there (the agent runs the same checks again)
        failing = {c.host for c in bad if c.error is None}
        await asyncio.gather(*(fleet.launch(h, sp) for h, sp in plan.nodes if h in failing), return_exceptions=True)
        return LaunchResult("preflight_failed", plan, checks, gate=gate)
    if gate.refused:
        return LaunchResult("preflight_failed", plan, checks, gate=gate)
    if gate.rows:  # launched past differences --allow-env-diff named: every node's record says which, with the values
        plan = dataclasses.replace(plan, nodes=env_gate.record(plan.nodes, gate))
    replies = await asyncio.gather(
        *(fleet.launch(h, sp, request_id=f"{request_id}-{i}" if request_id else "") for i, (h, sp) in enumerate(plan.nodes)),
        return_exceptions=True,
    )
    nodes = []
    for (h, sp), r in zip(plan.nodes, replies):
        if isinstance(r, AgentError):
            nodes.append(NodeOutcome(h, error=r.message))
        elif isinstance(r, BaseException):
            raise r
        else:
            if r.duplicate:  # node i's key is f"{request_id}-{i}": the same key for another command is refused here too
                refuse_reused_request(r.run.spec, sp, request_id)
            nodes.append(NodeOutcome(h, reply=r))
    result = LaunchResult("running", plan, nodes, gate=gate)
    if result.failed:
        # all or nothing: stop the nodes that did start
        rid = plan.spec.run_id or ""
        started = [n.host for n in nodes if n.reply is not None and n.reply.run.state != "preflight_failed"]
        await asyncio.gather(*(fleet.stop(h, rid, 5.0) for h in started), return_exceptions=True)
        result.verdict = "launch_failed"
    return result


# what the agent fills in or a new plan draws afresh: never part of a launch's intent
_NOT_INTENT = ("run_id",)


def intent_differences(previous: LaunchSpec, spec: LaunchSpec) -> list[str]:
    """The fields of two launch specs that differ (the whole launch intent: argv, env, name, cwd, python, hosts, claims,
    options); a multi-node run's own id, drawn anew by every plan, is left out (also where the argv carries it)."""
    a, b = msgspec.structs.asdict(previous), msgspec.structs.asdict(spec)
    if previous.run_id and spec.run_id:
        a["argv"] = [spec.run_id if x == previous.run_id else x for x in previous.argv]
    return [f for f in a if f not in _NOT_INTENT and a[f] != b[f]]


def _differs(field_name: str, previous: LaunchSpec, spec: LaunchSpec) -> str:
    """How one field differs, in words; values of --env are never shown (they may be secrets), only the names."""
    if field_name == "env":
        a, b = previous.env, spec.env
        names = sorted({k for k in a.keys() | b.keys() if a.get(k) != b.get(k)})
        return "env (" + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") + ")"
    return f"{field_name} (it was {getattr(previous, field_name)!r}, now {getattr(spec, field_name)!r})"[:200]


def refuse_reused_request(previous: LaunchSpec, spec: LaunchSpec, request_id: str) -> None:
    """A request id names one launch: the same id with any difference in the launch is refused, not answered with the first run."""
    fields = intent_differences(previous, spec)
    if fields:
        raise OpsError(
            f"request id: {request_id!r} was already used for another launch ({' '.join(previous.argv)[:120]}): it differs in "
            + "; ".join(_differs(f, previous, spec) for f in fields)
            + ": a retry must repeat the same launch; give a new --request-id for a new launch"
        )
