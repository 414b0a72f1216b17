"""Provides relaunch and rollback: a recorded run becomes an intent again, always with an explicit start (failure 6).

:func:`intent_from_spec` reads a recorded spec back into the intent that
built it (the trainer's options without the start, the interpreter, ranks per
node, hosts), so a relaunch goes through :func:`~gpudeck.console.ops.launch.plan_launch`
like any launch and gives the same argv except the start. Rollback swaps in
a known-good run's python environment (and, with ``config_from``, its
configuration) after proving that environment still matches its fingerprint
(:func:`check_environment`), or rebuilding it from its recorded freeze.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from gpudeck.agents.wire import envdiff
from gpudeck.agents.wire.protocol import EnvFingerprint, LaunchSpec
from gpudeck.console.core import config as cfg
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.errors import OpsError
from gpudeck.console.ops.intent import CALLER_ENV, LaunchIntent, shared_fields
from gpudeck.console.ops.launch import is_trainer, node_env
from gpudeck.trainers.contract import TRAINER_MODULES, strip_start

_TORCHRUN_FLAGS_WITH_VALUE = (
    "--nnodes",
    "--node-rank",
    "--nproc-per-node",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-conf",
    "--local-addr",
)


def _is_python(exe: str) -> bool:
    name = Path(exe).name
    return name.startswith("python") and all(c.isdigit() or c == "." for c in name[6:])


def _torchrun_options(rest: list[str]) -> tuple[dict[str, str], bool, list[str]] | None:
    """The options gpudeck gives torchrun, ``--standalone``, and the program after them; None if others are there."""
    opts: dict[str, str] = {}
    standalone = False
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--standalone":
            standalone = True
            i += 1
        elif a in _TORCHRUN_FLAGS_WITH_VALUE and i + 1 < len(rest):
            opts[a] = rest[i + 1]
            i += 2
        else:
            break
    return (opts, standalone, rest[i:]) if rest[i:] else None


def intent_from_spec(spec: LaunchSpec, host: str, conf: cfg.Config | None = None) -> LaunchIntent:
    """The intent a recorded spec was launched from (start left out: a relaunch asks for it again)."""
    argv = list(spec.argv)
    module = TRAINER_MODULES.get(spec.kind)
    python = spec.python
    nproc: int | None = None
    hosts: tuple[str, ...] = ()
    rdzv_host: str | None = None
    env = dict(spec.env)
    program = argv
    if argv and _is_python(argv[0]) and argv[1:3] == ["-m", "torch.distributed.run"]:
        parsed = _torchrun_options(argv[3:])
        if parsed is not None:
            opts, _standalone, rest = parsed
            if "--nproc-per-node" in opts and opts["--nproc-per-node"].isdigit():
                python = python or argv[0]
                nproc = int(opts["--nproc-per-node"])
                program = rest
                if spec.nodes and len(spec.nodes) > 1:
                    hosts = tuple(spec.nodes)
                    rdzv_host = opts.get("--rdzv-endpoint", "").rpartition(":")[0] or None
                    # the node's own config environment is added again per host when the run is planned
                    own = node_env((conf or cfg.load(extra_hosts=list(hosts))).settings(host))
                    env = {k: v for k, v in env.items() if own.get(k) != v}
    elif argv and _is_python(argv[0]) and module is not None and argv[1:3] == ["-m", module]:
        python = python or argv[0]
        program = argv[1:]
    trainer_args: list[str] | None = None
    if module is not None and program[:2] == ["-m", module]:
        trainer_args = strip_start(program[2:])
        if trainer_args and not trainer_args[0].startswith("-"):
            trainer_args = None  # a positional first: keep the whole command
    if trainer_args is not None:
        gpus = len(spec.gpus) if spec.gpus else 1
        intent_argv = tuple(trainer_args)
        if nproc is None and gpus > 1:
            nproc = 1  # recorded as one process over several GPUs: relaunched as recorded (the form shows it)
        elif nproc is not None and not hosts and nproc == gpus:
            nproc = None  # one rank per GPU, as planned by default
    elif hosts:
        intent_argv = tuple(
            strip_start(program) if spec.start and is_trainer(program, spec.kind) else program
        )  # what torchrun starts on every node
    else:
        intent_argv = tuple(strip_start(argv) if spec.start and is_trainer(argv, spec.kind) else argv)
        python, nproc, rdzv_host = spec.python, None, None
    if host == cfg.LOCAL or hosts:
        env = {k: v for k, v in env.items() if k not in CALLER_ENV}  # the caller's environment is taken again
    return LaunchIntent(
        host=host,
        kind=spec.kind,
        argv=intent_argv,
        gpus=",".join(map(str, spec.gpus)) if spec.gpus is not None else None,
        nproc_per_node=nproc,
        start=None,
        python=python,
        env=env,
        claims=spec.claims,
        hosts=hosts,
        rdzv_host=rdzv_host,
        **shared_fields(
            spec,
            rdzv_port=spec.rdzv_port if not hosts else (spec.rdzv_port or None),
            expected_ranks=spec.expected_ranks if not hosts and trainer_args is None else None,
        ),
    )


def relaunch_intent(
    spec: LaunchSpec, run_id: str, host: str, start: str | None, conf: cfg.Config | None = None, to_host: str | None = None
) -> LaunchIntent:
    """A recorded run (on ``host``) again: same configuration, the given (explicit) start, the run as its parent."""
    intent = intent_from_spec(spec, host, conf)
    return dataclasses.replace(intent, host=to_host or host, start=start, parent=run_id, operator=None)


def with_python(argv: list[str], python: str) -> list[str]:
    """``argv`` run by another interpreter (its first element, when that is a python)."""
    if argv and _is_python(argv[0]):
        return [python, *argv[1:]]
    return list(argv)


def rollback_intent(
    run: LaunchSpec,
    run_id: str,
    good: LaunchSpec,
    host: str,
    start: str | None,
    python: str,
    config_from: bool,
    conf: cfg.Config | None = None,
    good_host: str | None = None,
) -> LaunchIntent:
    """Relaunch ``run`` (on ``host``) in ``good``'s environment (``python``), with ``good``'s configuration too when ``config_from``.

    The run keeps its name and, unless the configuration comes from ``good``, its GPUs.
    """
    base = good if config_from else run
    intent = intent_from_spec(base, (good_host or host) if config_from else host, conf)
    argv = intent.argv if intent.trainer_args else tuple(with_python(list(intent.argv), python))
    return dataclasses.replace(intent, host=host, argv=argv, python=python, name=run.name, start=start, parent=run_id, operator=None)


# ----------------------------------------------------------------------------- the known-good environment


@dataclass(frozen=True)
class EnvironmentCheck:
    """The known-good environment on the host now, against its record: what changed, and the driver (which rollback cannot change)."""

    python: str
    changes: list[envdiff.EnvChange]
    driver: list[envdiff.EnvChange]

    @property
    def holds(self) -> bool:
        """Whether the environment still matches its fingerprint."""
        return not self.changes

    def describe(self, limit: int = 40) -> list[str]:
        """What changed, meaningful first."""
        return envdiff.describe(self.changes)[:limit]


def recorded_environment(good_id: str, env: EnvFingerprint | None) -> EnvFingerprint:
    """The fingerprint a rollback goes back to; a run without one cannot be rolled back to."""
    if env is None or not env.python:
        raise OpsError(f"run {good_id} has no recorded environment fingerprint: it cannot be rolled back to (pick a run that recorded one)")
    return env


async def check_environment(fleet: Fleet, host: str, recorded: EnvFingerprint) -> EnvironmentCheck:
    """Fingerprint the recorded interpreter on ``host`` now and compare (the driver and the prefix aside)."""
    current = await fleet.fingerprint(host, recorded.python)
    return EnvironmentCheck(
        python=recorded.python,
        changes=envdiff.diff(recorded, current, ignore=("driver", "prefix")),
        driver=[c for c in envdiff.diff(recorded, current) if c.key == "driver"],
    )


async def rebuild_environment(fleet: Fleet, host: str, recorded: EnvFingerprint) -> tuple[str, str]:
    """Recreate the recorded environment from its freeze in a new virtual environment; (python, path) once it matches."""
    rebuilt = await fleet.rebuild_env(host, recorded)
    again = envdiff.diff(recorded, rebuilt.env, ignore=envdiff.REBUILD_IGNORES)
    if again:
        raise OpsError(f"the rebuilt environment at {rebuilt.path} still differs: " + "; ".join(envdiff.describe(again)))
    return rebuilt.env.python, rebuilt.path or rebuilt.env.prefix or "(its own prefix)"


class EnvironmentChanged(OpsError):
    """The known-good environment no longer matches its fingerprint and no rebuild was asked for: nothing started (exit 1,
    an operation refused, as docs/cli.md says; not a usage error: the same command with --rebuild-env may go on)."""


def changed_environment(good_id: str, host: str, check: EnvironmentCheck) -> OpsError:
    """The refusal when the known-good environment moved and no rebuild was asked for."""
    lines = "\n  ".join(check.describe())
    return EnvironmentChanged(
        f"{good_id}'s environment ({check.python}) no longer matches its fingerprint on {host}; nothing was started. What changed:\n  {lines}\n"
        "rebuild it from the recorded freeze in a new virtual environment (--rebuild-env; the console offers it)"
    )
