"""``gpudeck history --json`` and ``show --json`` print the same bytes for the same history, typed records or not.

The expected outputs in ``golden/`` were written by this file's ``__main__`` with the console as it was
before history rows became typed records (``dict[str, Any]`` rows; commit b16c723), from the very
history built here: the fixture runs, a multi-node run on two hosts, a ``--env`` secret, members, an
alert, step metrics and a quarantined event. Regenerate them only for a deliberate change of the
scripted format (``python -m tests.functional.test_json_output --write tests/functional/golden``).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import msgspec
import pytest

from gpudeck.agents.wire.protocol import Event, LaunchSpec, RunInfo
from gpudeck.console.cli.main import main
from gpudeck.console.core import fmt
from gpudeck.console.history.replica import History
from tests.functional.fixture_fleet import GOOD, LIVE, T0, fill_history, history_events

GOLDEN = Path(__file__).parent / "golden"
MULTI = "r-4a11b0de"
NOW = T0 + 600.0

COMMANDS: dict[str, list[str]] = {
    "history": ["history", "--json", "--no-sync"],
    "history-secrets": ["history", "--json", "--no-sync", "--show-secrets"],
    "history-failed": ["history", "--json", "--no-sync", "state:failed"],
    "show-live": ["show", LIVE, "--json", "--no-sync"],
    "show-good": ["show", GOOD, "--json", "--no-sync"],
    "show-node": ["show", MULTI, "--host", "nodeb", "--json", "--no-sync"],
    "show-node-secrets": ["show", MULTI, "--host", "nodea", "--json", "--no-sync", "--show-secrets"],
    "problems": ["history", "--problems", "--json", "--no-sync"],
}


def _multinode(host: str, rank: int, state: str, ended: float) -> RunInfo:
    return RunInfo(
        id=MULTI,
        host=host,
        state=state,  # type: ignore[arg-type]
        name="two-nodes",
        spec=LaunchSpec(
            argv=["python3", "-m", "torch.distributed.run", "--nnodes", "2", "-m", "gpudeck.trainers.fsdp_lm", "--fresh"],
            kind="fsdp",
            gpus=[0, 1],
            start="fresh",
            env={"HF_TOKEN": "hf_secret_value", "NCCL_DEBUG": "INFO"},
            nodes=["nodea", "nodeb"],
            node_rank=rank,
            nnodes=2,
            run_id=MULTI,
        ),
        created=T0 - 7200,
        started=T0 - 7190,
        ended=ended,
        cause="exit code 1" if state == "failed" else "exit code 0",
        exit_code=1 if state == "failed" else 0,
    )


def build(home: Path) -> None:
    """The history every command here reads."""
    h = History(home / "history.db")
    try:
        h.cursor("gpu1", "e")
        fill_history(h)
        for i, (host, state, ended) in enumerate((("nodea", "succeeded", T0 - 3000.0), ("nodeb", "failed", T0 - 3100.0))):
            h.cursor(host, "e")
            members = (
                T0 - 7185,
                "members",
                {"added": [{"pid": 900 + i, "role": "rank", "rank": i, "local_rank": 0, "cmdline": ["python3"]}]},
            )
            step = (T0 - 7000, "telemetry", {"record": {"type": "step", "rank": 0, "step": 7, "loss": 1.5, "tokens_per_s": 900.0 + i}})
            h.submit(host, "e", history_events(_multinode(host, i, state, ended), 1, None, [members, step])).result(30)
        bad = Event(seq=99, ts=T0 - 10, kind="telemetry", run_id=LIVE, data={"record": {"type": "step", "step": 2**64}})
        h.submit("gpu1", "e", [bad]).result(30)
    finally:
        h.close()


def outputs(home: Path) -> dict[str, str]:
    """What each command prints on stdout (the clock pinned, so elapsed figures and quarantine times are the same every time)."""
    out: dict[str, str] = {}
    was, os.environ["GPUDECK_HOME"] = os.environ.get("GPUDECK_HOME"), str(home)
    clock = fmt.time.time
    fmt.time.time = lambda: NOW  # type: ignore[assignment]
    try:
        build(home)
        for name, argv in COMMANDS.items():
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(argv) == 0, name
            out[name] = buf.getvalue()
    finally:
        fmt.time.time = clock  # type: ignore[assignment]
        if was is None:
            del os.environ["GPUDECK_HOME"]
        else:
            os.environ["GPUDECK_HOME"] = was
    return out


@pytest.fixture(scope="module")
def printed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return outputs(tmp_path_factory.mktemp("home"))


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_json_output_is_byte_for_byte_what_it_was(printed: dict[str, str], name: str) -> None:
    want = (GOLDEN / f"{name}.json").read_text()
    assert printed[name] == want


def test_the_golden_outputs_say_what_they_should(printed: dict[str, str]) -> None:
    """The expected files are not just any bytes: the multi-node run is one row, secrets are redacted unless asked."""
    rows = msgspec.json.decode(printed["history"])
    multi = next(r for r in rows if r["id"] == MULTI)
    assert multi["host"] == "nodea+nodeb" and multi["hosts"] == ["nodea", "nodeb"] and multi["state"] == "failed"
    assert [n["host"] for n in multi["nodes"]] == ["nodea", "nodeb"] and multi["spec"]["env"]["HF_TOKEN"] == "REDACTED"
    assert "hf_secret_value" in printed["history-secrets"] and "hf_secret_value" not in printed["history"]
    live = msgspec.json.decode(printed["show-live"])
    assert live["id"] == LIVE and live["figures"]["tokens_per_s"] is not None and live["events"]
    # every key `history --json` has (issue 30), the median as the history computes it
    assert set(msgspec.json.decode(printed["history"])[0]) <= set(live) and live["tokens_per_s_median"] == live["figures"]["tokens_per_s"]
    assert "hf_secret_value" in printed["show-node-secrets"] and "hf_secret_value" not in printed["show-node"]
    assert msgspec.json.decode(printed["problems"])[0]["seq"] == 99


if __name__ == "__main__":  # write the expected outputs: --write DIR
    import tempfile

    target = Path(sys.argv[sys.argv.index("--write") + 1])
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        for name, text in outputs(Path(d)).items():
            (target / f"{name}.json").write_text(text)
