"""Issue 32, the run report, end to end: real runs (real processes on SIMULATED GPUs) under a real agent, reported
through the real ``gpudeck report`` CLI from the history it syncs:

- a run claimed as 1B parameters on 4 GPUs with 4 ranks that was 3M parameters holding one GPU with one rank: the
  report marks params, GPUs and world size CONTRADICTED, each with both sources (claim and manifest / GPU ledger);
- a run that exited 0 having written nothing says ENDED WITH NO OUTPUT and its claim NO EVIDENCE;
- a relaunch names its parent and compares against it;
- ``--json`` keeps its schema's keys;
- a hostile run name, argv and output reach the Markdown escaped: no raw HTML, no control characters, no extra table
  cells, no line break inside a cell; an ``--env`` secret never appears.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_harness import ROOT, AgentProc, run_state, simulated_agent, wait_for

pytestmark = pytest.mark.slow
PY = sys.executable
RANKS = str(Path(__file__).parent / "progs" / "ranks.py")
JSON_KEYS = {
    "schema",
    "made",
    "run",
    "claims",
    "contradicted",
    "no_evidence",
    "manifest",
    "gpus",
    "curve",
    "environment",
    "incidents",
    "preflight",
    "ending",
    "leftovers",
}
CLAIM_KEYS = {"what", "claimed", "claim_source", "evidence", "evidence_source", "verdict", "detail"}


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    yield from simulated_agent(gpudeck_home, monkeypatch, "4:H200:141")


def _ended(a: AgentProc, rid: str, timeout: float = 90) -> dict:
    ended = ("succeeded", "failed", "stopped", "lost")
    wait_for(lambda: run_state(a, rid) in ended, timeout, interval=0.5, what=f"{rid} to end")  # over the socket: no CLI per poll
    return next(r for r in a.cli_json("runs") if r["id"] == rid)  # the run as the CLI shows it


def _claim(doc: dict, what: str) -> dict:
    return next(c for c in doc["claims"] if c["what"] == what)


def test_claims_that_differ_from_what_the_run_held_are_contradicted_with_both_sources(sim_agent: AgentProc) -> None:
    a = sim_agent
    claims = ["--claim-gpus", "4", "--claim-params", "1B", "--claim-world-size", "4", "--env", "HF_TOKEN=hf_secret_value_123"]
    one_rank = [PY, RANKS, str(ROOT.parent), "1", "--sim-gib", "6", "--seconds", "4"]  # rank 0 holds 6 GiB on GPU 0
    rid = a.cli("launch", "--name", "llama-1b-4gpu", *claims, "--", *one_rank).stdout.strip()
    assert _ended(a, rid)["state"] == "succeeded"
    doc = json.loads(a.cli("report", rid, "--json").stdout)
    assert set(doc) == JSON_KEYS and doc["schema"] == "gpudeck.report/1"
    assert all(set(c) == CLAIM_KEYS for c in doc["claims"])
    params, gpus, world = _claim(doc, "params"), _claim(doc, "GPUs"), _claim(doc, "world size")
    assert (params["claimed"], params["evidence"], params["verdict"]) == (1_000_000_000, 3_066_112, "CONTRADICTED"), params
    assert params["claim_source"] == "launch --claim-*" and "manifest" in params["evidence_source"]
    assert (gpus["claimed"], gpus["evidence"], gpus["verdict"]) == (4, 1, "CONTRADICTED"), gpus
    assert "ledger" in gpus["evidence_source"] and gpus["detail"] == "GPU 0"
    assert (world["claimed"], world["evidence"], world["verdict"]) == (4, 1, "CONTRADICTED"), world
    assert {"params", "GPUs", "world size"} <= set(doc["contradicted"])
    fp = doc["gpus"]["footprint"]
    assert [(f["gpu"], f["peak"]) for f in fp] == [(0, 6 * 2**30)], fp
    assert doc["manifest"]["params_total"] == 3_066_112 and doc["curve"]["steps"] >= 1
    assert doc["ending"]["state"] == "succeeded" and doc["ending"]["verdict"].startswith("SUCCEEDED"), doc["ending"]

    md = a.cli("report", rid, "--no-sync").stdout
    print("\n" + md)  # the integrator's record of a real report
    assert md.startswith(f"# Run report: {rid} (llama-1b-4gpu) on local")
    assert "| GPUs | 4 | launch --claim-\\* | 1 | GPU ledger (gpu_hold events) | **CONTRADICTED** | GPU 0 |" in md
    assert "> **CONTRADICTED**: the evidence contradicts the claimed params, world size, GPUs" in md
    row = next(line for line in md.splitlines() if line.startswith("| params |"))
    assert "1,000,000,000" in row and "3,066,112" in row and "trainer manifest" in row and "**CONTRADICTED**" in row
    row = next(line for line in md.splitlines() if line.startswith("| GPUs |"))
    assert "| 4 |" in row and "| 1 |" in row and "GPU ledger" in row and "**CONTRADICTED**" in row
    assert "hf_secret_value_123" not in md and "hf_secret_value_123" not in json.dumps(doc)

    # a relaunch names its parent and is compared against it
    new = a.cli_json("relaunch", rid)["id"]
    _ended(a, new)
    child = json.loads(a.cli("report", new, "--json").stdout)
    assert child["environment"]["parent"] == rid and child["run"]["parent"] == rid
    text = a.cli("report", new, "--no-sync").stdout
    assert f"Parent: {rid}" in text


def test_a_run_that_ended_with_no_output_says_so(agent: AgentProc) -> None:
    rid = agent.cli("launch", "--name", "true_1b_results", "--claim-params", "1.21B", "--", "true").stdout.strip()
    assert _ended(agent, rid)["state"] == "succeeded"
    doc = json.loads(agent.cli("report", rid, "--json").stdout)
    end = doc["ending"]
    assert end["output_bytes"] == 0 and end["exit_code"] == 0, end
    assert end["verdict"].startswith("ENDED WITH NO OUTPUT"), end
    assert _claim(doc, "params")["verdict"] == "NO EVIDENCE" and "params" in doc["no_evidence"]
    md = agent.cli("report", rid).stdout
    assert "> **Outcome**: ENDED WITH NO OUTPUT" in md and "> **NO EVIDENCE**: nothing recorded backs the claimed params" in md
    assert "**NO EVIDENCE**: the trainer wrote no manifest" in md and "no training step was recorded" in md
    # without the agent (--no-sync) the history alone still says there is no evidence of work
    md = agent.cli("report", rid, "--no-sync").stdout
    assert "ENDED WITH NO EVIDENCE OF WORK" in md


HOSTILE_NAME = "evil|<b>x</b>`*[y](http://e)`\x1b]0;owned\x07"
HOSTILE_OUT = "import sys; print('| a | b |\\n<script>alert(1)</script>\\x1b[2J\\u202eevil'); sys.exit(3)"


def test_a_hostile_run_name_argv_and_output_are_escaped(agent: AgentProc) -> None:
    cp = agent.cli("launch", "--name", HOSTILE_NAME, "--", PY, "-c", HOSTILE_OUT, check=False)
    if cp.returncode != 0:  # a name with controls may be refused at launch: the rest of it still gets through
        cp = agent.cli("launch", "--name", "evil|<b>x</b>`*[y](http://e)`", "--", PY, "-c", HOSTILE_OUT)
    rid = cp.stdout.strip()
    assert _ended(agent, rid)["state"] == "failed"
    md = agent.cli("report", rid).stdout
    print("\n" + md)
    assert "<b>" not in md and "<script>" not in md and "&lt;script&gt;" in md
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f\u202e]", md), "a control character reached the Markdown"
    assert not re.search(r"(?<!\\)\]\(", md) and r"\[y\](http" in md  # the run's name makes no link
    # every table keeps its column count: an unescaped '|' from the run would add cells
    tables: list[list[str]] = []
    for line in md.splitlines():
        if line.startswith("|"):
            if tables and tables[-1]:
                tables[-1].append(line)
            else:
                tables.append([line])
        elif tables and tables[-1]:
            tables.append([])
    for t in (t for t in tables if t):
        widths = {len(re.split(r"(?<!\\)\|", line)) for line in t}
        assert len(widths) == 1, t
    doc = json.loads(agent.cli("report", rid, "--json").stdout)
    assert doc["ending"]["exit_code"] == 3 and "<script>" in "\n".join(doc["ending"]["output_tail"])  # JSON keeps the data
