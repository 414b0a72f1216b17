"""Provides how a recorded run becomes a new launch: relaunch and rollback, always with an explicit start (failure 6).

There is no default start: ``fresh`` (step 0, the trainer's ``--fresh``) or
``resume N`` (``--resume N``), chosen every time. The new spec records the
run it comes from as its parent. Rollback swaps in a known-good run's python
environment (and, with ``config_from``, its configuration).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from agents.protocol import LaunchSpec

_START_FLAGS = ("--fresh", "--resume", "--new-run-dir")
_PY = re.compile(r"(^|/)python[0-9.]*$")
TRAINER_MODULES = ("trainers.fsdp_lm", "trainers.dflash")


class StartRequired(Exception):
    """Relaunch and rollback need ``--fresh`` or ``--resume N``: there is no default."""


def parse_start(fresh: bool, resume: str | None) -> str:
    """``fresh`` or ``resume N`` from the two options; StartRequired says how when neither or both are given."""
    if fresh and resume is not None:
        raise StartRequired("give --fresh or --resume N, not both")
    if fresh:
        return "fresh"
    if resume is not None:
        if resume != "latest" and not (resume.isdigit() and int(resume) >= 0):
            raise StartRequired(f"--resume {resume!r}: give a step number (the checkpoint to continue from) or 'latest'")
        return f"resume {resume}"
    raise StartRequired(
        "say how this run starts: --fresh (from step 0, new checkpoints) or --resume N (continue from checkpoint step N); "
        "there is no default, so 'start from scratch' can never be read as 'resume'"
    )


def is_trainer(argv: list[str], kind: str) -> bool:
    """Whether the argv runs one of gpudeck's trainers (which take --fresh / --resume)."""
    return kind in ("fsdp", "dflash") or any(a in TRAINER_MODULES for a in argv)


def with_start(argv: list[str], start: str) -> list[str]:
    """``argv`` with its start flags replaced by ``start`` (``fresh`` | ``resume N``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--fresh", "--new-run-dir"):
            continue
        if a == "--resume":
            skip = True
            continue
        if a.startswith("--resume="):
            continue
        out.append(a)
    if start == "fresh":
        return [*out, "--fresh"]
    return [*out, "--resume", start.split(" ", 1)[1]]


def with_python(argv: list[str], python: str) -> list[str]:
    """``argv`` run by another interpreter (its first element, when that is a python)."""
    if argv and _PY.search(argv[0]):
        return [python, *argv[1:]]
    return list(argv)


def spec_from_row(row: dict[str, Any]) -> LaunchSpec:
    """The LaunchSpec a history row recorded."""
    spec = dict(row.get("spec") or {})
    spec.setdefault("argv", row.get("argv") or [])
    return msgspec.convert(spec, LaunchSpec)


def relaunch_spec(row: dict[str, Any], start: str, *, python: str | None = None, config_from: dict[str, Any] | None = None, operator: str | None = None) -> LaunchSpec:
    """A new spec from a recorded run: same config (or ``config_from``'s), explicit ``start``, optional other python."""
    base = spec_from_row(config_from or row)
    argv = list(base.argv)
    if python is not None:
        argv = with_python(argv, python)
    if is_trainer(argv, base.kind):
        argv = with_start(argv, start)
    return msgspec.structs.replace(
        base,
        argv=argv,
        start=start,
        python=python or base.python,
        parent=row["id"],
        operator=operator or base.operator,
        run_id=None,
        force=False,
    )
