"""The cross-node gate's rules on hand-made fingerprints: the majority (2 vs 1, a 1 vs 1 tie), only the rows that differ,
the table, the way past, what is recorded, and the loaded-NCCL keys in the run diff (issue 32)."""

from __future__ import annotations

import pytest

from gpudeck.agents.wire.envdiff import (
    NO_FINGERPRINT,
    describe,
    diff,
    env_gate,
    gate_values,
    is_gate_name,
    libnccl_where,
    majority,
)
from gpudeck.agents.wire.protocol import EnvFingerprint
from gpudeck.console.ops.errors import IntentError
from gpudeck.console.ops.gate import check_allowed

SHA_A = "a1" * 32
SHA_B = "a1" * 10 + "ff" * 22  # shares its first 20 hex digits with SHA_A


def _fp(prefix: str = "/envs/a", **kw: object) -> EnvFingerprint:
    base: dict[str, object] = dict(
        python=f"{prefix}/bin/python",
        prefix=prefix,
        python_version="3.11.7",
        torch="2.9.0+cu128",
        torch_cuda="12.8",
        nccl="2.27.3",
        nccl_runtime="2.27.3",
        libnccl=f"{prefix}/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2",
        libnccl_sha256=SHA_A,
        transformers="4.57.1",
        driver="570.124.06",
        dist_env={"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "eth0"},
    )
    base.update(kw)
    return EnvFingerprint(**base)  # type: ignore[arg-type]


H100 = "NVIDIA H100 80GB HBM3"


def test_majority_two_against_one_names_the_odd_node() -> None:
    m = majority(["2.27.3", "2.28.9", "2.27.3"])
    assert m.found and m.value == "2.27.3" and m.odd == [1] and m.split == [2, 1]


def test_majority_of_one_against_one_is_a_tie() -> None:
    m = majority(["2.27.3", "2.28.9"])
    assert not m.found and m.odd == [] and m.split == [1, 1]
    assert not majority(["a", "a", "b", "b"]).found
    assert not majority(["a", "b", "c"]).found
    none_wins = majority([None, None, "x"])  # an absent value can be the majority's too
    assert none_wins.found and none_wins.value is None and none_wins.odd == [2]


def test_three_nodes_one_odd_gets_one_table_of_only_the_differing_rows() -> None:
    hosts = ["gpu1", "gpu2", "gpu3"]
    nodes = [
        gate_values(_fp("/envs/a"), H100, {}),
        # the socket interface is each host's own (not compared); NCCL_DEBUG is the run's
        gate_values(
            _fp("/opt/venv", nccl_runtime="2.28.9", libnccl_sha256=SHA_B), H100, {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "ib0"}
        ),
        gate_values(_fp("/envs/a"), H100, {}),
    ]
    gate = env_gate(hosts, nodes)
    # the venvs live in different folders with one layout: the libnccl path agrees as <env>/..., the python path is no row
    assert [r.name for r in gate.rows] == ["nccl_runtime", "libnccl_sha256", "NCCL_DEBUG"]
    assert gate.refused
    assert gate.odd_nodes() == {"gpu2": ["nccl_runtime", "libnccl_sha256", "NCCL_DEBUG"]}
    table = gate.table()
    print("\n" + "\n".join(gate.refusal("r-0123abcd")))
    assert table[0].split() == ["gpu1", "gpu2", "gpu3"]
    assert table[1].split() == ["nccl_runtime", "2.27.3", "2.28.9", "2.27.3"]
    assert table[2].split() == ["libnccl_sha256", SHA_A[:24], SHA_B[:24], SHA_A[:24]]  # cut where they still differ
    assert table[3].split() == ["NCCL_DEBUG", "(unset)", "INFO", "(unset)"]
    assert gate.verdict() == ["gpu2 differs from the majority (gpu1, gpu3) in: nccl_runtime, libnccl_sha256, NCCL_DEBUG"]
    assert gate.fix() == (
        "to launch anyway (recorded with the run): --allow-env-diff nccl_runtime --allow-env-diff libnccl_sha256 --allow-env-diff NCCL_DEBUG"
    )
    assert gate.recorded()[0] == "nccl_runtime: gpu1 2.27.3 | gpu2 2.28.9 | gpu3 2.27.3"


def test_past_eight_nodes_the_odd_ones_are_among_those_shown() -> None:
    hosts = [f"n{i:02d}" for i in range(12)]
    nodes = [gate_values(_fp(transformers="4.56.0" if i == 10 else "4.57.1"), H100, {}) for i in range(12)]
    gate = env_gate(hosts, nodes)
    assert gate.table()[0].split() == ["n10", "n00", "n01", "n02", "n03", "n04", "n05", "n06"]
    assert gate.table()[-1] == "... and 4 more node(s) not shown (--json lists every node)"
    assert gate.verdict() == ["n10 differs from the majority (n00, n01, n02, n03, n04, n05, ...) in: transformers"]


def test_two_nodes_that_differ_are_a_tie_and_it_says_so() -> None:
    gate = env_gate(["nodea", "nodeb"], [gate_values(_fp(), H100, {}), gate_values(_fp(transformers="4.56.0"), H100, {})])
    assert [r.name for r in gate.rows] == ["transformers"] and gate.odd_nodes() == {}
    (line,) = gate.verdict()
    assert line.startswith("no majority for transformers (1 vs 1 of 2 nodes): the gate cannot tell which node is odd")


def test_identical_nodes_pass_and_allowed_rows_do_not_refuse() -> None:
    same = env_gate(["a", "b"], [gate_values(_fp(), H100, {}), gate_values(_fp("/other"), H100, {})])
    assert same.rows == [] and not same.refused and same.table() == []
    nodes = [gate_values(_fp(), H100, {}), gate_values(_fp(), "NVIDIA A100-SXM4-80GB", {"TORCH_NCCL_BLOCKING_WAIT": "1"})]
    part = env_gate(["a", "b"], nodes, allowed=["gpu"])
    assert part.refused and part.fix().endswith("--allow-env-diff TORCH_NCCL_BLOCKING_WAIT")
    assert "(allowed)" in part.table()[1]
    assert not env_gate(["a", "b"], nodes, allowed=["gpu", "TORCH_NCCL_BLOCKING_WAIT"]).refused


def test_a_node_without_a_fingerprint_differs_in_every_row_and_the_note_says_why() -> None:
    gate = env_gate(["a", "b"], [gate_values(_fp(), H100, {}), gate_values(None, None, {})], notes=["b: cannot fingerprint python3: ..."])
    assert {"torch", "transformers", "gpu", "NCCL_IB_DISABLE"} <= {r.name for r in gate.rows}
    assert "NCCL_SOCKET_IFNAME" not in {r.name for r in gate.rows}  # each host names its own interfaces
    assert gate.rows[0].values == ["3.11.7", NO_FINGERPRINT]
    assert "b: cannot fingerprint python3: ..." in gate.refusal()


def test_far_side_values_are_printable_bounded_and_secrets_stay_hidden() -> None:
    evil = _fp(transformers="4.57.1\x1b[2J\x1b]0;pwned\x07" + "x" * 500)
    nodes = [gate_values(_fp(), H100, {"TORCH_API_TOKEN": "hunter2"}), gate_values(evil, H100, {"TORCH_API_TOKEN": "swordfish"})]
    gate = env_gate(["a", "b"], nodes)
    text = "\n".join(gate.refusal())
    assert "\x1b" not in text and "\x07" not in text and max(len(ln) for ln in gate.table()) < 200
    assert "hunter2" not in text and "swordfish" not in text and "(value hidden)" in text
    assert "TORCH_API_TOKEN" in [r.name for r in gate.rows]  # the values differ, so the row is there


def test_allow_env_diff_names_are_checked() -> None:
    assert check_allowed(["transformers", "NCCL_DEBUG", "transformers"], multinode=True) == ["NCCL_DEBUG", "transformers"]
    assert check_allowed([], multinode=False) == []
    with pytest.raises(IntentError, match="multi-node launch only"):
        check_allowed(["torch"], multinode=False)
    with pytest.raises(IntentError, match="not a row of the cross-node gate"):
        check_allowed(["PATH"], multinode=True)
    assert is_gate_name("TORCH_NCCL_ASYNC_ERROR_HANDLING") and not is_gate_name("NCCL_x y") and not is_gate_name("all")


def test_the_run_diff_shows_the_loaded_libnccl_and_skips_records_older_than_the_probe() -> None:
    a = _fp()
    moved = _fp(libnccl="/usr/lib/x86_64-linux-gnu/libnccl.so.2", libnccl_sha256=SHA_B, nccl_runtime="2.28.9")
    assert libnccl_where(a) == "<env>/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
    changes = diff(a, moved)
    assert [c.key for c in changes] == ["nccl_runtime", "libnccl", "libnccl_sha256"]
    assert describe(changes)[:2] == [
        "NCCL (torch reports) 2.27.3 -> 2.28.9",
        "libnccl loaded <env>/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2 -> /usr/lib/x86_64-linux-gnu/libnccl.so.2",
    ]
    older = _fp(nccl_runtime=None, libnccl=None, libnccl_sha256=None)  # recorded before the probe existed
    assert diff(older, moved) == [] and diff(moved, older) == []
    assert diff(a, _fp("/elsewhere"), ignore=("python", "prefix")) == []  # same layout in another folder


def test_a_launch_naming_too_many_or_too_long_gate_rows_is_refused_by_the_agent_and_recorded_rows_are_bounded() -> None:
    from gpudeck.agents.runs.launch import MAX_ENV_DIFF_CHARS, MAX_ENV_DIFFS, validate
    from gpudeck.agents.wire.envdiff import MAX_RECORDED_ROW_CHARS
    from gpudeck.agents.wire.errors import BadRequest
    from gpudeck.agents.wire.protocol import LaunchSpec

    validate(LaunchSpec(argv=["true"], allow_env_diff=["transformers"] * MAX_ENV_DIFFS, env_diffs=["x" * MAX_RECORDED_ROW_CHARS]))
    for spec in (
        LaunchSpec(argv=["true"], allow_env_diff=["transformers"] * (MAX_ENV_DIFFS + 1)),
        LaunchSpec(argv=["true"], env_diffs=["x" * (MAX_ENV_DIFF_CHARS + 1)]),
    ):
        with pytest.raises(BadRequest, match="limit"):
            validate(spec)
    hosts = [f"node-{i:04d}" for i in range(1024)]
    nodes = [gate_values(_fp(transformers=f"4.{i}.0"), H100, {}) for i in range(1024)]
    row = env_gate(hosts, nodes).recorded()[0]
    assert len(row) == MAX_RECORDED_ROW_CHARS and row.endswith("...")
    validate(LaunchSpec(argv=["true"], env_diffs=env_gate(hosts, nodes).recorded()))  # what the console records passes
