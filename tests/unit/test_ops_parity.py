"""Parity: the CLI path and the Launch screen's path give byte-identical specs for every way to ask for a run.

The CLI path parses ``gpudeck launch ...`` into an intent (console/cli/main.py); the
screen path turns the dialog's form into one (console/tui/screens/launch.py); both
are planned by console/ops. Relaunch and rollback go through the same layer,
and a relaunch of any recorded spec gives the same argv except the start, in
the recorded python.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from gpudeck.agents.wire.protocol import EnvFingerprint, LaunchReply, LaunchSpec, PreflightResult, RunInfo, Snapshot
from gpudeck.console.cli.main import intent_from_args
from gpudeck.console.cli.parser import build_parser
from gpudeck.console.core import config as cfg
from gpudeck.console.ops import Caller, IntentError, LaunchIntent, LaunchPlan, plan_launch, relaunch_intent, rollback_intent
from gpudeck.console.ops.launch import with_start
from gpudeck.console.tui.screens.launch import LaunchForm, form_from, intent_from_form

CALLER = Caller(operator="op", cwd="/work/here", env={"PATH": "/usr/bin:/bin", "VIRTUAL_ENV": "/venv"})
CONF = cfg.Config(
    hosts=(
        cfg.HostSettings("local"),
        cfg.HostSettings("gpu1", rdzv_host="10.0.0.1", nccl_socket_ifname="eth1"),
        cfg.HostSettings("gpu2", nccl_socket_ifname="eth2", env={"X": "2"}),
    ),
    path=Path("/nonexistent/config.toml"),
)
RID = "r-0123abcd"

# name, CLI arguments after `gpudeck launch`, the same ask as the Launch screen's form
CASES: list[tuple[str, list[str], dict[str, str]]] = [
    ("command, local", ["--", "python", "train.py", "--lr", "3e-4"], dict(host="local", args="python train.py --lr 3e-4")),
    (
        "command, 2 GPUs on gpu1",
        ["--host", "gpu1", "--gpus", "0,1", "--name", "n", "--", "sleep", "1"],
        dict(host="gpu1", gpus="0,1", name="n", args="sleep 1"),
    ),
    (
        "fsdp, 1 GPU, fresh",
        ["--host", "gpu1", "--kind", "fsdp", "--gpus", "0", "--fresh", "--", "--model-config", "tiny", "--out", "/o"],
        dict(host="gpu1", kind="fsdp", gpus="0", start="fresh", args="--model-config tiny --out /o"),
    ),
    (
        "fsdp, GPUs 0,1, fresh",
        ["--host", "gpu1", "--kind", "fsdp", "--gpus", "0,1", "--fresh", "--", "--out", "/o"],
        dict(host="gpu1", kind="fsdp", gpus="0,1", start="fresh", args="--out /o"),
    ),
    (
        "fsdp, GPUs 0-3, 2 ranks, resume 200",
        ["--host", "gpu1", "--kind", "fsdp", "--gpus", "0-3", "--nproc-per-node", "2", "--resume", "200", "--", "--out", "/o"],
        dict(host="gpu1", kind="fsdp", gpus="0,1,2,3", ranks="2", start="resume", resume_step="200", args="--out /o"),
    ),
    (
        "dflash, local, 1 GPU, resume latest",
        ["--kind", "dflash", "--gpus", "1", "--resume", "latest", "--python", "/venv/bin/python", "--", "--target", "t"],
        dict(host="local", kind="dflash", gpus="1", start="resume", resume_step="latest", python="/venv/bin/python", args="--target t"),
    ),
    (
        "dflash, 3 GPUs, fresh, python",
        [
            "--host",
            "gpu2",
            "--kind",
            "dflash",
            "--gpus",
            "0,1,2",
            "--fresh",
            "--python",
            "/opt/py/bin/python3",
            "--",
            "--target-ranks",
            "0",
            "--drafter-ranks",
            "1,2",
        ],
        dict(
            host="gpu2",
            kind="dflash",
            gpus="0,1,2",
            start="fresh",
            python="/opt/py/bin/python3",
            args="--target-ranks 0 --drafter-ranks 1,2",
        ),
    ),
    (
        "fsdp, two hosts, 2 ranks each, fresh",
        ["--hosts", "gpu1,gpu2", "--kind", "fsdp", "--gpus", "0,1", "--fresh", "--", "--out", "/o"],
        dict(host="local", hosts="gpu1,gpu2", kind="fsdp", gpus="0,1", start="fresh", args="--out /o"),
    ),
    (
        "dflash, two hosts, 4 ranks each, resume 10",
        ["--hosts", "gpu2,gpu1", "--kind", "dflash", "--nproc-per-node", "4", "--resume", "10", "--", "--target", "t"],
        dict(host="local", hosts="gpu2,gpu1", kind="dflash", ranks="4", start="resume", resume_step="10", args="--target t"),
    ),
    (
        "command with the GiB each GPU needs",
        ["--gpus", "0", "--need-gib", "40.5", "--", "python", "train.py"],
        dict(host="local", gpus="0", need_gib="40.5", args="python train.py"),
    ),
    (
        "command, two hosts, a module",
        ["--hosts", "gpu1,gpu2", "--nproc-per-node", "2", "--", "-m", "mypkg.train", "--x", "1"],
        dict(host="local", hosts="gpu1,gpu2", ranks="2", args="-m mypkg.train --x 1"),
    ),
]


def encode(plan: LaunchPlan) -> bytes:
    return msgspec.json.encode([[h, s] for h, s in plan.nodes])


def cli_plan(argv: list[str]) -> LaunchPlan:
    return plan_launch(intent_from_args(build_parser().parse_args(["launch", *argv])), CALLER, CONF, run_id=RID)


def screen_plan(form: dict[str, str], base: LaunchIntent | None = None) -> LaunchPlan:
    return plan_launch(intent_from_form(LaunchForm(**form), base), CALLER, CONF, run_id=RID)


@pytest.mark.parametrize("name,argv,form", CASES, ids=[c[0] for c in CASES])
def test_the_cli_and_the_screen_build_the_same_spec(name: str, argv: list[str], form: dict[str, str]) -> None:
    assert encode(cli_plan(argv)) == encode(screen_plan(form))


def test_fsdp_on_two_gpus_is_two_ranks_from_both() -> None:
    """The drift that started this: the screen ran one process that saw two GPUs."""
    for plan in (cli_plan(CASES[3][1]), screen_plan(CASES[3][2])):
        assert plan.spec.argv[:6] == ["python3", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        assert plan.spec.argv[6:8] == ["-m", "gpudeck.trainers.fsdp_lm"]


def _recorded(plan: LaunchPlan) -> list[tuple[str, msgspec.Struct]]:
    """What the agents record: the specs as launched, decoded again (as a history row holds them)."""
    return [(h, msgspec.json.decode(msgspec.json.encode(s), type=type(s))) for h, s in plan.nodes]


@pytest.mark.parametrize("name,argv,form", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("start", ["fresh", "resume 7"])
def test_relaunch_round_trips_from_both(name: str, argv: list[str], form: dict[str, str], start: str) -> None:
    original = cli_plan(argv)
    host, spec = _recorded(original)[0]
    # the CLI: gpudeck relaunch RUN --fresh | --resume N
    cli = plan_launch(relaunch_intent(spec, "r-old", host, start, CONF), CALLER, CONF, run_id=RID)
    # the console: R on the Run screen fills the form from the run; the operator picks the start and confirms
    base = relaunch_intent(spec, "r-old", host, None, CONF)
    fields = {**form_from(base), "host": host}
    choice, _, step = start.partition(" ")
    screen = screen_plan({**fields, "start": choice, "resume_step": step}, base)
    assert encode(cli) == encode(screen)
    trainer = spec.kind != "command"
    for (_, old), (_, new) in zip(original.nodes, cli.nodes):
        want = with_start(old.argv, start) if trainer else old.argv
        assert new.argv == want  # the same command, only the start asked again (never the interpreter or --fresh twice)
        assert new.argv.count("--fresh") <= 1 and new.argv.count(new.argv[0]) == 1
        assert new.python == old.python or new.python == old.argv[0]  # the recorded interpreter, not the console's
        assert new.parent == "r-old" and new.gpus == old.gpus and new.env == old.env and new.cwd == old.cwd


# specs recorded by other hands: older gpudeck versions, a hand-written torchrun, a script's own --fresh
LEGACY = [
    LaunchSpec(
        argv=["/venv/bin/python", "-m", "gpudeck.trainers.fsdp_lm", "--out", "/o", "--fresh"], kind="fsdp", gpus=[0, 1], start="fresh"
    ),
    LaunchSpec(
        argv=["torchrun", "--nproc-per-node", "4", "-m", "gpudeck.trainers.dflash", "--target", "t", "--resume", "9"],
        kind="dflash",
        start="resume 9",
    ),
    LaunchSpec(argv=["python3", "my_script.py", "--fresh"], kind="command", start="fresh", env={"A": "1"}, cwd="/w"),
    LaunchSpec(argv=["python3", "-m", "gpudeck.trainers.fsdp_lm", "--fresh", "--out", "o"], kind="command", gpus=[3]),
    LaunchSpec(argv=["bash", "-c", "echo hi"], name="sh", python="/usr/bin/python3"),
]


@pytest.mark.parametrize(
    "spec", LEGACY, ids=["one process on 2 GPUs", "torchrun by hand", "a script's own --fresh", "a trainer as a command", "a shell"]
)
@pytest.mark.parametrize("start", ["fresh", "resume 7"])
def test_relaunch_of_any_recorded_spec_round_trips(spec: LaunchSpec, start: str) -> None:
    new = plan_launch(relaunch_intent(spec, "r-old", "gpu1", start), CALLER, CONF).spec
    trainer = spec.kind != "command" or "gpudeck.trainers.fsdp_lm" in spec.argv
    assert new.argv == (with_start(spec.argv, start) if trainer else spec.argv)
    assert new.python == spec.python or new.python == spec.argv[0]
    assert (new.gpus, new.env, new.cwd, new.name, new.kind) == (spec.gpus, spec.env, spec.cwd, spec.name, spec.kind)


GOOD_ENV = EnvFingerprint(python="/good/venv/bin/python", python_version="3.11.9", torch="2.7.1", freeze_hash="abc")


@pytest.mark.parametrize("config_from", [False, True], ids=["its environment", "with --config-from"])
@pytest.mark.parametrize("run_case,good_case", [(3, 2), (0, 1), (5, 6), (7, 4), (8, 5), (9, 1)])
def test_rollback_is_one_decision(config_from: bool, run_case: int, good_case: int) -> None:
    run_host, run = _recorded(cli_plan(CASES[run_case][1]))[0]
    good_host, good = _recorded(cli_plan(CASES[good_case][1]))[0]
    python = GOOD_ENV.python
    cli = plan_launch(
        rollback_intent(run, "r-bad", good, run_host, "fresh", python, config_from, CONF, good_host=good_host), CALLER, CONF, run_id=RID
    )
    base = rollback_intent(run, "r-bad", good, run_host, None, python, config_from, CONF, good_host=good_host)
    needs_start = base.trainer_args or any("trainers." in a for a in base.argv)
    screen = screen_plan({**form_from(base), "host": run_host, "start": "fresh"}, base)
    assert encode(cli) == encode(screen)
    spec = cli.spec
    src = good if config_from else run
    assert spec.python == python and spec.parent == "r-bad" and spec.name == run.name
    assert spec.gpus == src.gpus
    if needs_start or spec.kind != "command":
        assert spec.argv[0] == python and spec.argv[-1] == "--fresh"
    elif src.argv[0].startswith("python"):
        assert spec.argv == [python, *src.argv[1:]]


# ----------------------------------------------------------------------------- bad input: one message for one mistake

MISTAKES = [
    (["--gpus", "0,a", "--", "x"], dict(host="local", gpus="0,a", args="x"), "gpus: '0,a' is not a GPU list"),
    (["--kind", "fsdp", "--", "--out", "o"], dict(host="local", kind="fsdp", args="--out o"), "start: no start given"),
    (
        ["--kind", "fsdp", "--resume", "abc", "--", "--out", "o"],
        dict(host="local", kind="fsdp", start="resume", resume_step="abc", args="--out o"),
        "start: resume step 'abc' is not a step",
    ),
    (
        ["--hosts", "gpu1,gpu1", "--kind", "fsdp", "--fresh"],
        dict(host="local", hosts="gpu1,gpu1", kind="fsdp", start="fresh"),
        "hosts: a host is listed twice",
    ),
    (["--"], dict(host="local", args=""), "command: launch needs a command"),
    (["--gpus", "0,,1", "--", "x"], dict(host="local", gpus="0,,1", args="x"), "gpus: '0,,1' is not a GPU list: an entry is empty"),
    (["--gpus", "3-1", "--", "x"], dict(host="local", gpus="3-1", args="x"), "gpus: '3-1' is not a GPU list: the range 3-1 runs backwards"),
    (["--gpus", "0,0", "--", "x"], dict(host="local", gpus="0,0", args="x"), "gpus: '0,0' names a GPU more than once"),
    (["--kind", "bogus", "--", "x"], dict(host="local", kind="bogus", args="x"), "kind: 'bogus' is not a kind; choose one of command"),
    (
        ["--kind", "fsdp", "--gpus", "0,1", "--nproc-per-node", "0", "--fresh", "--", "--out", "o"],
        dict(host="local", kind="fsdp", gpus="0,1", ranks="0", start="fresh", args="--out o"),
        "ranks per node: 0 is not 1 or more",
    ),
    (["--host", "bad host", "--", "x"], dict(host="bad host", args="x"), "host: 'bad host' is not a host name"),
]


@pytest.mark.parametrize("argv,form,message", MISTAKES, ids=[m[2].split(":")[0] + " " + str(i) for i, m in enumerate(MISTAKES)])
def test_the_same_mistake_gets_the_same_message(argv: list[str], form: dict[str, str], message: str) -> None:
    with pytest.raises(IntentError) as from_cli:
        cli_plan(argv)
    with pytest.raises(IntentError) as from_screen:
        screen_plan(form)
    assert str(from_cli.value) == str(from_screen.value)
    assert str(from_cli.value).startswith(message)


# mistakes only the CLI can make (the Launch dialog has no field for them): still one check, in ops, naming the field
CLI_ONLY = [
    (["--env", "NCCL_DEBUG", "--", "x"], "env: 'NCCL_DEBUG' is not NAME=VALUE; write it as NAME=VALUE"),
    (["--env", "=1", "--", "x"], "env: '=1' is not NAME=VALUE"),
    (["--on-rank-death", "panic", "--", "x"], "on rank death: 'panic' is not a choice; choose alert or stop"),
    (["--expected-ranks", "0", "--", "x"], "expected ranks: 0 is not 1 or more"),
    (["--rdzv-port", "70000", "--", "x"], "rendezvous port: 70000 is not a port"),
]


@pytest.mark.parametrize(
    "argv,message", [(m[0], m[2]) for m in MISTAKES] + CLI_ONLY, ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_the_cli_prints_the_operations_layers_message_and_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the operator sees from `gpudeck launch ...`: the ops message word for word (not argparse's own), exit 2, nothing started."""
    from gpudeck.console.cli.main import main

    assert main(["launch", *argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"gpudeck: {message}"), out.err
    assert out.err.count("\n") == 1  # one line: the field, what is wrong, the fix


def test_the_intent_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        LaunchIntent().kind = "fsdp"  # type: ignore[misc]


# ----------------------------------------------------------------------------- --request-id: one key, one launch


class _Agents:
    """The agents' side of Launch as far as ops sees it: a request id already seen returns its first run (duplicate)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], RunInfo] = {}
        self.started: list[tuple[str, LaunchSpec]] = []

    async def preflight(self, host: str, spec: LaunchSpec) -> PreflightResult:
        return PreflightResult(ok=True, host=host)

    async def launch(self, host: str, spec: LaunchSpec, request_id: str = "") -> LaunchReply:
        if request_id and (host, request_id) in self.by_key:
            return LaunchReply(run=self.by_key[(host, request_id)], duplicate=True)
        run = RunInfo(id=spec.run_id or f"r-{len(self.started):08x}", host=host, state="running", spec=spec)
        self.started.append((host, spec))
        if request_id:
            self.by_key[(host, request_id)] = run
        return LaunchReply(run=run)

    async def stop(self, host: str, run_id: str, grace_s: float) -> None:
        return None

    async def fingerprint(
        self, host: str, python: str, env: dict[str, str] | None = None
    ) -> EnvFingerprint:  # the cross-node gate: every node alike
        return EnvFingerprint(python=python, torch="2.9.0")

    async def snapshot(self, host: str) -> Snapshot:
        return Snapshot(host=host, ts=0.0, epoch="e")


@pytest.mark.parametrize(
    "argv", [["--host", "gpu1", "--", "sleep", "1"], ["--hosts", "gpu1,gpu2", "--kind", "fsdp", "--fresh", "--", "--out", "/o"]]
)
def test_a_request_id_reused_for_another_command_is_refused_not_answered_with_the_first_run(argv: list[str]) -> None:
    import asyncio

    from gpudeck.console.ops import OpsError
    from gpudeck.console.ops.launch import launch

    agents = _Agents()
    first = asyncio.run(launch(agents, cli_plan(argv), request_id="k1"))  # type: ignore[arg-type]
    again = asyncio.run(launch(agents, cli_plan(argv), request_id="k1"))  # type: ignore[arg-type]
    assert [n.reply.run.id for n in again.nodes] == [n.reply.run.id for n in first.nodes]  # a retry: the same run, nothing new
    assert all(n.reply.duplicate for n in again.nodes) and len(agents.started) == len(first.nodes)
    other = [*argv[:-1], "/elsewhere"]
    with pytest.raises(OpsError, match="request id: 'k1' was already used for another launch") as refused:
        asyncio.run(launch(agents, cli_plan(other), request_id="k1"))  # type: ignore[arg-type]
    assert "give a new --request-id" in refused.value.message and len(agents.started) == len(first.nodes)


def test_a_request_id_covers_the_whole_intent_and_a_multi_node_retry_draws_a_new_run_id_harmlessly() -> None:
    """A retry plans again, so a multi-node run's id (in its spec and its torchrun argv) is new each time: not a difference.
    Any field of the intent is: env, name, cwd, claims, options; each is named (env by its variable names only)."""
    import asyncio

    from gpudeck.console.ops import OpsError
    from gpudeck.console.ops.launch import launch

    def plan(argv: list[str], rid: str) -> LaunchPlan:
        return plan_launch(intent_from_args(build_parser().parse_args(["launch", *argv])), CALLER, CONF, run_id=rid)

    base = ["--hosts", "gpu1,gpu2", "--kind", "fsdp", "--fresh", "--name", "n", "--env", "A=1", "--env", "HF_TOKEN=t1"]
    agents = _Agents()
    first = asyncio.run(launch(agents, plan([*base, "--", "--out", "/o"], "r-00000001"), request_id="k2"))  # type: ignore[arg-type]
    again = asyncio.run(launch(agents, plan([*base, "--", "--out", "/o"], "r-00000002"), request_id="k2"))  # type: ignore[arg-type]
    assert [n.reply.run.id for n in again.nodes] == [n.reply.run.id for n in first.nodes] == ["r-00000001"] * 2
    for extra, field in (
        (["--env", "A=2"], "env (A)"),
        (["--env", "HF_TOKEN=t2"], "env (HF_TOKEN)"),
        (["--name", "m"], "name (it was 'n', now 'm')"),
        (["--cwd", "/elsewhere"], "cwd"),
        (["--claim-params", "1B"], "claims"),
        (["--checkpoint-dir", "/ck"], "checkpoint_dir"),
        (["--python", "/opt/py/bin/python3"], "python"),
    ):
        with pytest.raises(OpsError) as refused:
            asyncio.run(launch(agents, plan([*base, *extra, "--", "--out", "/o"], "r-00000003"), request_id="k2"))  # type: ignore[arg-type]
        assert field in refused.value.message and "t1" not in refused.value.message and "t2" not in refused.value.message, extra
    assert len(agents.started) == 2  # the two nodes of the first launch, nothing more


def test_straggler_window_is_a_launch_option_kept_by_relaunch_and_checked() -> None:
    spec = cli_plan(["--straggler-window", "20", "--hang-after", "300", "--", "python", "train.py"]).spec
    assert spec.straggler_window == 20 and spec.hang_after_s == 300
    assert plan_launch(relaunch_intent(spec, "r-old", "local", "fresh"), CALLER, CONF).spec.straggler_window == 20
    assert cli_plan(["--", "python", "train.py"]).spec.straggler_window is None  # the agent's 8
    with pytest.raises(IntentError, match="straggler window: 0 is not 1 or more"):
        cli_plan(["--straggler-window", "0", "--", "python", "train.py"])
