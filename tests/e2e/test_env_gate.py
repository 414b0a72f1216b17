"""The cross-node gate (issue 32) on two network-namespace hosts that run different interpreters.

Each host is a namespace with its own sshd and agent, joined by a LAN (as in test_multinode). The launch names
``--python python3``, which each host resolves on its own agent's PATH, as on real hosts:

- nodea: the project's venv (the CPU torch, the real transformers);
- nodeb: a second venv whose site-packages holds a FAKE ``transformers`` 4.0.0 (a stub package, labelled as such)
  ahead of the project venv's packages (added by a .pth), so torch is the same and transformers is not; its agent's
  environment has ``TORCH_NCCL_BLOCKING_WAIT=1``, and its config entry gives the run ``NCCL_DEBUG=WARN``.

The launch is refused with one table of exactly those three rows, a tie (two nodes: no majority) said as such, and
the way past; ``--allow-env-diff`` for some of them still refuses the rest; for all of them the run starts, and every
node's record (the agents' and the console's history) keeps what was allowed and the differing values.
"""

from __future__ import annotations

import asyncio
import json
import site
import subprocess
import sys
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import GetRun
from tests.agent_harness import ROOT, wait_for
from tests.sshd_harness import ConsoleSide

pytest.importorskip("torch")
netns = pytest.importorskip("tests.netns_harness")
multinode = pytest.importorskip("tests.e2e.test_multinode")
pytestmark = pytest.mark.slow
FAKE_TRANSFORMERS = "4.0.0"


class PathAgent(netns.NsAgentProc):  # type: ignore[name-defined,misc]
    """An agent in a namespace whose PATH starts with ``bin`` (where ``python3`` resolves) and with ``extra`` environment."""

    def __init__(self, home: Path, ns: str, bin_dir: Path, extra: dict[str, str]) -> None:
        super().__init__(home, ns)
        self.bin_dir = bin_dir
        self.extra = extra

    @property
    def env(self) -> dict[str, str]:
        env = super().env
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        env.update(self.extra)
        return env


def other_interpreter(root: Path) -> Path:
    """A venv whose own site-packages has a FAKE transformers (not Hugging Face's) before the project venv's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    (purelib,) = list((root / "lib").glob("python3*/site-packages"))
    (purelib / "transformers").mkdir()
    (purelib / "transformers" / "__init__.py").write_text(f"# FAKE transformers for gpudeck's tests\n__version__ = '{FAKE_TRANSFORMERS}'\n")
    info = purelib / f"transformers-{FAKE_TRANSFORMERS}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {FAKE_TRANSFORMERS}\n\n")
    # processed after this folder: the project venv's torch (and its own .pth files) come after the fake transformers
    (purelib / "zz-project-venv.pth").write_text(f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n")
    return root / "bin"


cluster = multinode.cluster  # two hosts in namespaces on a LAN, each with sshd and an agent (test_multinode's)


@pytest.fixture
def two_interpreters(cluster: ConsoleSide, tmp_path: Path) -> ConsoleSide:
    """test_multinode's two hosts with their agents started again: ``python3`` on each one's PATH is another venv, nodeb's
    agent has a TORCH_ variable, and nodeb's config entry gives its runs NCCL_DEBUG."""
    bins = {"nodea": Path(sys.executable).parent, "nodeb": other_interpreter(tmp_path / "venv-b")}
    extra: dict[str, dict[str, str]] = {"nodea": {}, "nodeb": {"TORCH_NCCL_BLOCKING_WAIT": "1"}}
    for h in cluster.hosts:
        h.agent.stop()
        h.agent = PathAgent(h.home, h.ns.name, bins[h.name], extra[h.name]).start()
    conf = cluster.gpudeck_home / "config.toml"
    head, sep, tail = conf.read_text().rpartition('env = { OMP_NUM_THREADS = "1" }')  # the last host's: nodeb's
    assert sep and "[host.nodeb]" in head
    conf.write_text(head + 'env = { OMP_NUM_THREADS = "1", NCCL_DEBUG = "WARN" }' + tail)
    return cluster


def _launch(c: ConsoleSide, *extra: str, name: str) -> subprocess.CompletedProcess:
    return c.cli(
        "launch", "--hosts", "nodea,nodeb", "--python", "python3", "--cwd", str(ROOT), "--name", name, *extra, "--", "-m", "platform",
        check=False, timeout=240,
    )  # fmt: skip


def _agent_runs(c: ConsoleSide) -> list[list[dict]]:
    return [h.agent.cli_json("runs") for h in c.hosts]


@pytest.mark.timeout(600)
def test_the_gate_refuses_different_interpreters_with_one_table_and_allow_env_diff_launches_recorded(two_interpreters: ConsoleSide) -> None:
    c = two_interpreters
    cp = _launch(c, name="gate-refused")
    print("\n$ gpudeck launch --hosts nodea,nodeb --python python3 ... -- -m platform\n" + cp.stderr)
    assert cp.returncode == 1, cp
    err = cp.stderr
    lines = err.splitlines()
    head = next(i for i, ln in enumerate(lines) if "the nodes' environments differ" in ln)
    assert "nothing was started on any host" in lines[head]
    table = lines[head + 1 : head + 5]
    assert table[0].split() == ["nodea", "nodeb"]
    real = next(ln for ln in table if ln.split()[0] == "transformers").split()
    assert real[2] == FAKE_TRANSFORMERS and real[1] != FAKE_TRANSFORMERS  # nodea's is the project venv's real one
    assert [ln.split() for ln in table[2:]] == [["NCCL_DEBUG", "(unset)", "WARN"], ["TORCH_NCCL_BLOCKING_WAIT", "(unset)", "1"]]
    assert "no majority for transformers, NCCL_DEBUG, TORCH_NCCL_BLOCKING_WAIT (1 vs 1 of 2 nodes)" in err
    assert (
        "to launch anyway (recorded with the run): --allow-env-diff transformers --allow-env-diff NCCL_DEBUG "
        "--allow-env-diff TORCH_NCCL_BLOCKING_WAIT" in err
    )
    # only the rows that differ: python, torch, its CUDA build and the (absent) libnccl are the same on both
    for same in ("python_version", "torch ", "torch_cuda", "libnccl", "nccl_runtime"):
        assert f"\n  {same}" not in err, same
    assert _agent_runs(c) == [[], []]  # nothing started, nothing recorded as started on either host

    cp = c.cli("preflight", "--hosts", "nodea,nodeb", "--python", "python3", "--", "-m", "platform", check=False, timeout=240)
    assert cp.returncode == 1 and "--allow-env-diff transformers" in cp.stderr, cp

    cp = _launch(c, "--allow-env-diff", "transformers", "--json", name="gate-partly-allowed")
    assert cp.returncode == 1, cp
    refused = json.loads(cp.stdout)["env_gate"]
    assert refused["hosts"] == ["nodea", "nodeb"]
    assert [(r["name"], r["allowed"], r["values"]) for r in refused["rows"]] == [
        ("transformers", True, [real[1], FAKE_TRANSFORMERS]),
        ("NCCL_DEBUG", False, [None, "WARN"]),
        ("TORCH_NCCL_BLOCKING_WAIT", False, [None, "1"]),
    ]
    assert "transformers  (allowed)" in cp.stderr
    assert "--allow-env-diff NCCL_DEBUG --allow-env-diff TORCH_NCCL_BLOCKING_WAIT" in cp.stderr
    assert "--allow-env-diff transformers" not in cp.stderr

    allow = ["--allow-env-diff", "transformers", "--allow-env-diff", "NCCL_DEBUG", "--allow-env-diff", "TORCH_NCCL_BLOCKING_WAIT"]
    cp = _launch(c, *allow, "--json", name="gate-allowed")
    assert cp.returncode == 0, cp
    print(cp.stderr)
    assert "launched past environment differences in transformers, NCCL_DEBUG, TORCH_NCCL_BLOCKING_WAIT" in cp.stderr
    launched = json.loads(cp.stdout)
    rid = launched["id"]
    for node in launched["nodes"]:
        assert node["spec"]["allow_env_diff"] == ["NCCL_DEBUG", "TORCH_NCCL_BLOCKING_WAIT", "transformers"]
        assert f"transformers: nodea {real[1]} | nodeb {FAKE_TRANSFORMERS}" in node["spec"]["env_diffs"]

    def ended() -> bool:
        states = [(h.agent.ask(GetRun(run_id=rid)).get("run") or {}).get("state") for h in c.hosts]
        return all(s in ("succeeded", "failed", "stopped", "lost") for s in states)

    wait_for(ended, timeout=300, interval=0.5, what="the allowed two-node run to end")
    run_b = c.hosts[1].agent.ask(GetRun(run_id=rid))["run"]
    assert run_b["state"] == "succeeded", c.cli("tail", rid, "-n", "40", check=False).stdout
    # nodeb's own fingerprint, taken at launch under the run's environment: what it loaded and the NCCL_/TORCH_ it got
    assert run_b["env"]["transformers"] == FAKE_TRANSFORMERS and run_b["env"]["libnccl"] == "none (CPU build)"
    assert run_b["env"]["dist_env"] == {"NCCL_DEBUG": "WARN", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    hist = c.cli_json("history", "name:gate-allowed")
    assert len(hist) == 1 and hist[0]["spec"]["allow_env_diff"] == ["NCCL_DEBUG", "TORCH_NCCL_BLOCKING_WAIT", "transformers"]
    assert any(d.startswith("NCCL_DEBUG: nodea none | nodeb WARN") for d in hist[0]["spec"]["env_diffs"]), hist[0]["spec"]

    # the console's Launch dialog: the same gate refuses with the same table, and ctrl+g launches past exactly its rows
    got = asyncio.run(_console_launch_past_the_gate(c))
    print("\nthe Launch dialog after the gate refused:\n" + got["refused"])
    refused = got["refused"]
    assert "the nodes' environments differ: nothing was started on any host" in refused and "press ctrl+g" in refused, refused
    rows = [ln.split() for ln in refused.splitlines() if ln.split()[:1] in (["transformers"], ["NCCL_DEBUG"], ["TORCH_NCCL_BLOCKING_WAIT"])]
    # the same rows as the CLI's table: the console plans against the config its fleet follows (nodeb's NCCL_DEBUG)
    assert rows == [
        ["transformers", real[1], FAKE_TRANSFORMERS],
        ["NCCL_DEBUG", "(unset)", "WARN"],
        ["TORCH_NCCL_BLOCKING_WAIT", "(unset)", "1"],
    ], refused
    assert got["allow_button"] is True
    spec = next(r for r in _agent_runs(c)[1] if r["name"] == "gate-console")["spec"]
    assert spec["allow_env_diff"] == ["NCCL_DEBUG", "TORCH_NCCL_BLOCKING_WAIT", "transformers"], spec


async def _console_launch_past_the_gate(c: ConsoleSide) -> dict:
    """Open the console on both hosts, launch the same two-node run from the Launch dialog: refused by the gate, then
    ctrl+g. The dialog's error text and whether the way past was offered."""
    from textual.widgets import Button, Static

    from gpudeck.console.core import config as cfg
    from gpudeck.console.fleet.fleet import Fleet
    from gpudeck.console.history.replica import History
    from gpudeck.console.ops.context import Ops
    from gpudeck.console.tui.app import GpudeckApp
    from gpudeck.console.tui.screens.launch import LaunchDialog
    from gpudeck.console.tui.screens.run import RunScreen
    from tests.functional.helpers import mounted, open_launch, until

    history = History(c.gpudeck_home / "history-console.db")
    fleet = Fleet(config=cfg.load(c.gpudeck_home / "config.toml"), ssh=c.ssh_options(), history=history, state_dir=c.gpudeck_home / "agent")
    app = GpudeckApp(Ops.console(fleet))
    out: dict = {}
    try:
        async with app.run_test(size=(160, 50)) as pilot:
            await until(lambda: all(fleet.links[h].status.state == "up" for h in ("nodea", "nodeb")), timeout=60, what="both hosts up")
            dialog = await open_launch(pilot, hosts="nodea,nodeb", python="python3", name="gate-console", args="-m platform")
            await pilot.press("ctrl+s")  # pre-flight on both
            button = dialog.query_one("#launch", Button)
            await until(lambda: "Launch" in str(button.label) and not button.disabled, timeout=240, what="pre-flight on both nodes")
            await pilot.press("ctrl+s")  # launch: the gate refuses
            allow = dialog.query_one("#allow-env", Button)
            await until(lambda: allow.display, timeout=240, what="the gate's refusal and its way past")
            out["refused"] = str(dialog.query_one("#launch-error", Static).render())
            out["allow_button"] = bool(allow.display)
            await pilot.press("ctrl+g")
            await until(lambda: not mounted(app, LaunchDialog), timeout=240, what="the launch past the gate")
            await until(lambda: mounted(app, RunScreen), timeout=60, what="the launched run's screen")  # (opened on launch)
            await pilot.pause()
    finally:
        await fleet.close()
        history.close()
    return out
