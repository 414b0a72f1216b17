"""Provides the cross-node gate of a multi-node launch: every node's interpreter fingerprinted, compared, refused on a difference.

Before the nodes of one run start, each host fingerprints the interpreter its node will run (the agent's
``Fingerprint`` request: python, torch and its CUDA build, the NCCL torch reports and the libnccl it
actually loads, transformers, the driver) and reports its GPU model; the ``NCCL_*`` / ``TORCH_*``
variables the run gets are the agent's with the launch's on top. Any difference refuses the launch
unless ``--allow-env-diff NAME`` names it; what was allowed is recorded in every node's spec. NCCL
mismatches across nodes hang collectives instead of failing them (NVIDIA/nccl#447), and package
metadata can name another NCCL than the one loaded (marin-community/marin#7344).

The comparison rules and the table live in :mod:`gpudeck.agents.wire.envdiff`; this module asks the hosts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec

from gpudeck.agents.wire.envdiff import EnvGate, env_gate, gate_values, is_gate_name
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import EnvFingerprint, LaunchSpec, Snapshot
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.errors import IntentError

MAX_ALLOWED = 64


def check_allowed(names: Sequence[str], multinode: bool) -> list[str]:
    """``--allow-env-diff`` names, checked: each a gate row's name; only for a multi-node launch."""
    if not names:
        return []
    if not multinode:
        raise IntentError("allow env diff", "it applies to a multi-node launch only", "give --hosts H1,H2 or leave --allow-env-diff out")
    bad = [n for n in names if not is_gate_name(n)]
    if bad or len(names) > MAX_ALLOWED:
        raise IntentError(
            "allow env diff",
            f"{', '.join(repr(n[:80]) for n in bad[:4]) or f'{len(names)} names'} "
            + ("is not a row of the cross-node gate" if bad else f"are more than {MAX_ALLOWED}"),
            "give a row's name as the refusal prints it: python_version, torch, torch_cuda, nccl_runtime, libnccl, "
            "libnccl_sha256, transformers, driver, gpu, or an NCCL_* / TORCH_* variable",
        )
    return sorted(set(names))


def gpu_model(snap: Snapshot | BaseException, gpus: list[int] | None) -> str | None:
    """The model of the GPUs a node uses (all of the host's when it names none); several models joined by ``+``."""
    if isinstance(snap, BaseException):
        return None
    names = sorted({g.name for g in snap.gpus if g.name and (gpus is None or g.index in gpus)})
    return " + ".join(names) if names else None


async def _node(fleet: Fleet, host: str, spec: LaunchSpec) -> tuple[dict[str, str | None], list[str]]:
    """One node's gate values and what kept its fingerprint incomplete."""
    python = spec.python or spec.argv[0]
    fp, snap = await asyncio.gather(fleet.fingerprint(host, python, spec.env), fleet.snapshot(host), return_exceptions=True)
    notes: list[str] = []
    if isinstance(fp, AgentError):
        notes.append(f"{host}: cannot fingerprint {python}: {fp.message}")
    elif isinstance(fp, BaseException):
        raise fp
    elif fp.error:
        notes.append(f"{host}: {fp.error}")
    if isinstance(snap, AgentError):
        notes.append(f"{host}: GPU model unknown: {snap.message}")
    elif isinstance(snap, BaseException):
        raise snap
    return gate_values(fp if isinstance(fp, EnvFingerprint) else None, gpu_model(snap, spec.gpus), spec.env), notes


async def check(fleet: Fleet, nodes: Sequence[tuple[str, LaunchSpec]]) -> EnvGate:
    """Fingerprint every node's interpreter (together) and compare; the gate says what differs and whether that refuses."""
    got = await asyncio.gather(*(_node(fleet, h, sp) for h, sp in nodes))
    allowed = nodes[0][1].allow_env_diff if nodes else []
    return env_gate([h for h, _ in nodes], [v for v, _ in got], allowed, [n for _, ns in got for n in ns])


def record(nodes: Sequence[tuple[str, LaunchSpec]], gate: EnvGate) -> tuple[tuple[str, LaunchSpec], ...]:
    """The nodes' specs with the differences launched past written in (every node's record keeps them)."""
    rows = gate.recorded()
    return tuple((h, msgspec.structs.replace(sp, env_diffs=rows)) for h, sp in nodes)
