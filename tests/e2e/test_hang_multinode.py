"""A hang on the second node of a two-node gloo run (network namespaces, as tests/e2e/test_multinode.py): both nodes
raise it and triage their own ranks; `gpudeck triage RUN` asks both and names the sleeping rank on node b."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import GetEvents
from tests.agent_harness import ROOT, wait_for
from tests.e2e.test_multinode import TRAIN, cluster  # noqa: F401 (the fixture)
from tests.sshd_harness import ConsoleSide

pytest.importorskip("torch")
pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)  # a hang limit: two nodes of real training on a loaded 2-core machine take minutes
def test_a_hang_on_node_b_is_triaged_with_evidence_from_both_nodes(cluster: ConsoleSide, tmp_path: Path) -> None:  # noqa: F811
    c = cluster
    cp = c.cli(
        "launch", "--hosts", "nodea,nodeb", "--kind", "fsdp", "--nproc-per-node", "1", "--python", sys.executable,
        "--cwd", str(ROOT), "--fresh", "--hang-after", "5", "--env", "GPUDECK_TEST_SLEEP_AT_STEP=6:1:600", "--json",
        "--", *TRAIN, "--max-steps", "10000", "--checkpoint-every", "10000", "--out", str(tmp_path / "out"),
        timeout=180,
    )  # fmt: skip
    rid = str(json.loads(cp.stdout)["id"])

    def stored(host: str) -> list[dict]:
        return [e["data"]["triage"] for e in c.cli_json("show", rid, "--host", host)["events"] if e["kind"] == "triage"]

    def triaged(node: int) -> bool:
        """The node's agent journalled its triage. Asked over the agent's socket: a console `show` is an SSH round and
        a Python start, seconds of CPU taken from the ranks on 2 cores; what the console shows is checked after."""
        events = c.hosts[node].agent.ask(GetEvents(after_seq=0))["events"]
        return any(e["kind"] == "triage" and e.get("run_id") == rid for e in events)

    wait_for(lambda: triaged(1), timeout=420, interval=0.25, what="node b's triage")
    tb = stored("nodeb")[0]
    assert tb["culprit"].startswith("rank 1 ") and "maybe_sleep_for_test" in tb["culprit"], tb["culprit"]
    wait_for(lambda: triaged(0), timeout=60, interval=0.25, what="node a's triage")
    ta = stored("nodea")[0]
    assert "rank 0" in ta["culprit"] and "waits in" in ta["culprit"] and "another host" in ta["culprit"], ta["culprit"]
    both = json.loads(c.cli("triage", rid, "--json", timeout=120).stdout)
    assert sorted(t["host"] for t in both["triages"]) == ["nodea", "nodeb"] and both["failed"] == []
    by_host = {t["host"]: t for t in both["triages"]}
    assert [e["rank"] for e in by_host["nodeb"]["ranks"]] == [1] and by_host["nodeb"]["ranks"][0]["method"] == "faulthandler"
    assert [e["rank"] for e in by_host["nodea"]["ranks"]] == [0] and by_host["nodea"]["ranks"][0]["in_collective"] is True
