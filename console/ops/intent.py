"""Provides the intents an operator states (launch, relaunch, rollback) and their validation: each field once, here.

A front-end fills an intent with what the operator typed (the CLI from its
options, a screen from its form) and hands it to :mod:`gpudeck.console.ops.launch`;
every mistake comes back as an :class:`~gpudeck.console.ops.errors.IntentError` that
names the field and the fix, the same words in the CLI and in the console.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from gpudeck.agents.wire.protocol import MAX_NAME, Claims
from gpudeck.console.core import config as cfg
from gpudeck.console.ops.errors import IntentError
from gpudeck.trainers.contract import KINDS, TRAINER_MODULES, parse_index_list

LaunchKind = Literal["command", "fsdp", "dflash"]  # LaunchSpec.kind; KINDS lists the same

# passed from the caller's shell to a local run, so it resolves commands as the caller would
CALLER_ENV = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE")
DEFAULT_PYTHON = "python3"  # a trainer's interpreter when none is given: the host's python3 (the local caller's PATH)
_SIZE = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


@dataclass(frozen=True)
class Caller:
    """Who asks, from where: the operator, the working directory and the environment a local run inherits."""

    operator: str | None
    cwd: str
    env: Mapping[str, str]

    @classmethod
    def here(cls) -> Caller:
        """This process's operator, directory and the part of its environment a local run inherits."""
        return cls(operator=getpass.getuser(), cwd=os.getcwd(), env={k: os.environ[k] for k in CALLER_ENV if k in os.environ})


@dataclass(frozen=True)
class ClaimsIntent:
    """What the operator claims about a run (checked against what is observed); text as typed."""

    gpus: int | None = None
    params: str | None = None  # '771M', '1.1B', '4'
    world_size: int | None = None
    tokens_per_s: float | None = None
    note: str | None = None


@dataclass(frozen=True)
class LaunchIntent:
    """A launch as the operator asks for it, before anything is built.

    ``argv``: for ``fsdp``/``dflash`` the trainer's own options (when empty or the first starts with ``-``;
    the command is built, under torchrun for several ranks), else the whole command. ``gpus``: ``0,1`` or
    ``0-3``. ``start``: ``fresh`` or ``resume N`` (``resume latest``). ``hosts``: two or more for one run
    across hosts (then ``host`` is ignored).
    """

    host: str = cfg.LOCAL
    kind: str = "command"
    argv: tuple[str, ...] = ()
    gpus: str | None = None
    nproc_per_node: int | None = None
    start: str | None = None
    python: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    name: str | None = None
    cwd: str | None = None
    claims: ClaimsIntent | Claims | None = None
    hosts: tuple[str, ...] = ()
    need_gib: float | None = None
    force: bool = False
    rdzv_port: int | None = None
    rdzv_host: str | None = None
    checkpoint_dir: str | None = None
    on_rank_death: str = "alert"
    on_hang: str = "triage"
    hang_after_s: float | None = None
    straggler_window: int | None = None  # steps each rank's compute time is compared over (None: the agent's 8)
    expected_ranks: int | None = None
    parent: str | None = None
    operator: str | None = None  # None: the caller's
    allow_env_diff: tuple[str, ...] = ()  # multi-node: the cross-node gate's rows to launch past (recorded)

    @property
    def trainer_args(self) -> bool:
        """Whether ``argv`` holds a trainer's options (the command is built), not a whole command."""
        return self.kind in TRAINER_MODULES and (not self.argv or self.argv[0].startswith("-"))


# the fields a LaunchSpec and a LaunchIntent share by name and meaning, copied as they are in both directions (a launch
# records them, a relaunch reads them back): one list, so a field added to both is carried by both without a third copy
SHARED_FIELDS = (
    "name",
    "cwd",
    "need_gib",
    "rdzv_port",
    "checkpoint_dir",
    "on_rank_death",
    "on_hang",
    "hang_after_s",
    "straggler_window",
    "expected_ranks",
    "operator",
)


def shared_fields(source: object, **override: object) -> dict[str, Any]:
    """The :data:`SHARED_FIELDS` of a LaunchSpec or a LaunchIntent, with ``override`` on top: the one copy between them."""
    out: dict[str, Any] = {f: getattr(source, f) for f in SHARED_FIELDS}
    out.update(override)
    return out


# ----------------------------------------------------------------------------- fields


def start_of(fresh: bool, resume: str | None) -> str | None:
    """The CLI's ``--fresh`` / ``--resume N`` as a start (None: neither given); both at once is refused."""
    if fresh and resume is not None:
        raise IntentError("start", "both fresh and resume were given", "choose one: --fresh or --resume N")
    if fresh:
        return "fresh"
    return None if resume is None else f"resume {resume}"


def check_start(start: str | None, needed: bool) -> str | None:
    """A start as ``fresh`` | ``resume N`` | ``resume latest``; IntentError names the fix."""
    if start is None or not start.strip():
        if needed:
            raise IntentError(
                "start",
                "no start given",
                "choose fresh (step 0, new checkpoints; --fresh) or resume N (continue from checkpoint step N; --resume N): "
                "there is no default, so 'start from scratch' can never be read as 'resume'",
            )
        return None
    words = start.split()
    if words == ["fresh"]:
        return "fresh"
    if len(words) == 2 and words[0] == "resume" and (words[1] == "latest" or words[1].isdigit()):
        return f"resume {words[1] if words[1] == 'latest' else int(words[1])}"
    if words[:1] == ["resume"]:
        step = " ".join(words[1:]) or "(none)"
        raise IntentError(
            "start", f"resume step {step!r} is not a step", "give the checkpoint step N to continue from (a number) or 'latest'"
        )
    raise IntentError("start", f"{start!r} is not a start", "choose fresh or resume N")


def check_gpus(text: str | None) -> list[int] | None:
    """``0,1`` / ``0-3`` -> indices (None: leave CUDA_VISIBLE_DEVICES alone).

    Stricter than the contract's parser, which skips an empty entry and folds a repeated index: ``0,,1``
    is a typo and ``0,0`` asks for one GPU twice, so both are refused here rather than read as ``0,1`` / ``0``.
    """
    if text is None or not str(text).strip():
        return None
    fix = "write indices like 0,1,2 or a range like 0-3"
    entries = [e.strip() for e in str(text).split(",")]
    if any(not e for e in entries):
        raise IntentError("gpus", f"{text!r} is not a GPU list: an entry is empty", fix + " (one index between commas)")
    for e in entries:
        lo, dash, hi = e.partition("-")
        if dash and lo.strip().isdigit() and hi.strip().isdigit() and int(lo) > int(hi):
            raise IntentError("gpus", f"{text!r} is not a GPU list: the range {e} runs backwards", f"write it low to high: {hi}-{lo}")
    try:
        gpus = parse_index_list(text)
    except ValueError:
        raise IntentError("gpus", f"{text!r} is not a GPU list", fix) from None
    asked = sum(int(e.partition("-")[2]) - int(e.partition("-")[0]) + 1 if "-" in e else 1 for e in entries)
    if asked != len(gpus):
        raise IntentError("gpus", f"{text!r} names a GPU more than once", "name each GPU once")
    return gpus


def check_name(name: str | None) -> str | None:
    """A run's name as given, within the agent's limit (:data:`~gpudeck.agents.wire.protocol.MAX_NAME` characters)."""
    if name is not None and len(name) > MAX_NAME:
        raise IntentError("name", f"{len(name):,} characters is too long", f"give a name of at most {MAX_NAME} characters")
    return name


def check_env(env: Mapping[str, str]) -> dict[str, str]:
    """Extra environment; a name must be non-empty and hold no '=' (nor NUL)."""
    for k, v in env.items():
        if not k or "=" in k or "\x00" in k or "\x00" in v:
            raise IntentError("env", f"{k!r} is not an environment variable name", "give NAME=VALUE with a name that holds no '='")
    return dict(env)


def env_items(items: list[str] | None) -> dict[str, str]:
    """``NAME=VALUE`` items (the CLI's ``--env``, repeatable) as a mapping."""
    env: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise IntentError("env", f"{item!r} is not NAME=VALUE", "write it as NAME=VALUE, e.g. --env NCCL_DEBUG=INFO")
        env[name] = value
    return env


def check_count(text: str | None, field_name: str) -> int | None:
    """'771M', '1.1B', '4' -> an integer."""
    if text is None:
        return None
    t = str(text).strip().lower().replace(",", "").replace("_", "")
    mult = _SIZE.get(t[-1:])
    try:
        value = int(float(t[:-1]) * mult) if mult else int(t)
    except ValueError:
        raise IntentError(field_name, f"{text!r} is not a count", "write 4, 771M or 1.1B") from None
    if value < 0:
        raise IntentError(field_name, f"{text!r} is negative", "give a count of 0 or more")
    return value


def check_claims(claims: ClaimsIntent | Claims | None) -> Claims | None:
    """Claims as recorded with the run (a relaunch carries the recorded ones as they are)."""
    if claims is None or isinstance(claims, Claims):
        return claims
    if claims.gpus is None and not claims.params and claims.world_size is None and claims.tokens_per_s is None and not claims.note:
        return None
    for name, value in (("claim gpus", claims.gpus), ("claim world size", claims.world_size)):
        if value is not None and value < 1:
            raise IntentError(name, f"{value} is not a count of 1 or more", "give how many the run is claimed to use")
    return Claims(
        gpus=claims.gpus,
        params=check_count(claims.params, "claim params"),
        world_size=claims.world_size,
        tokens_per_s=claims.tokens_per_s,
        note=claims.note,
    )


def check_positive(value: int | None, field_name: str, fix: str) -> int | None:
    """An optional count that must be 1 or more."""
    if value is not None and value < 1:
        raise IntentError(field_name, f"{value} is not 1 or more", fix)
    return value


def count_text(text: str, field_name: str, fix: str) -> int | None:
    """A count typed into a form field ('' leaves it out)."""
    t = text.strip()
    if not t:
        return None
    if not t.lstrip("-").isdigit():
        raise IntentError(field_name, f"{text!r} is not a number", fix)
    return int(t)  # its range is checked with the rest of the intent (plan_launch), the same for every front-end


def form_start(choice: str, step: str) -> str | None:
    """A form's start choice (fresh | resume, with its step) as a start."""
    if choice == "fresh":
        return "fresh"
    if choice == "resume":
        return f"resume {step.strip()}"
    return None


def check_kind(kind: str) -> LaunchKind:
    """One of the launch kinds."""
    if kind not in KINDS:
        raise IntentError("kind", f"{kind!r} is not a kind", f"choose one of {', '.join(KINDS)}")
    return cast(LaunchKind, kind)  # checked against KINDS just above


def check_host(host: str) -> str:
    """The one host of a launch: a name the config can hold (``local`` is this machine)."""
    try:
        return cfg.check_host_name(host)
    except cfg.ConfigError:
        raise IntentError(
            "host", f"{host!r} is not a host name", f"give the name of a Host entry in ~/.ssh/config ({cfg.HOST_NAME_RULE}) or local"
        ) from None


def check_hosts(hosts: tuple[str, ...]) -> list[str]:
    """The hosts of a multi-node run: two or more, each once."""
    names = [h.strip() for h in hosts if h.strip()]
    if len(names) < 2:
        raise IntentError("hosts", "a multi-node run needs at least two hosts", "write --hosts gpu1,gpu2 (or launch on one --host)")
    if len(set(names)) != len(names):
        raise IntentError("hosts", "a host is listed twice", "name each host once")
    for n in names:
        try:
            cfg.check_host_name(n)
        except cfg.ConfigError as exc:
            raise IntentError("hosts", str(exc), "use a name from ~/.ssh/config") from None
    return names
