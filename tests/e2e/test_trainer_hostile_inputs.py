"""Hostile and broken inputs to the trainers' entry points: each is one line on stderr, no traceback, exit code 2.

Each case runs the real ``python -m gpudeck.trainers.*`` (one process, no torchrun) and checks stdout is
empty of tracebacks and stderr holds exactly one line naming what is wrong. docs/trainers.md's *Limits*
table lists the same inputs and the lines they print.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

from tests.trainer_harness import DFLASH_SMALL, FSDP_SMALL, Runs

FSDP = "gpudeck.trainers.fsdp_lm"
DFLASH = "gpudeck.trainers.dflash"
PREPARE = "gpudeck.trainers.prepare"


@pytest.fixture(scope="module")
def runs():
    r = Runs()
    yield r
    r.teardown()


def refused(runs: Runs, module: str, args: list[str], out: Path) -> str:
    """Run and return the one stderr line; fails unless exit 2, one line, no traceback."""
    p, _ = runs.start(module, args, out, stderr=subprocess.PIPE)
    stdout, stderr = p.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert p.returncode == 2, (p.returncode, stdout[-2000:], stderr[-3000:])
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def config_file(tmp_path: Path, **fields) -> Path:
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 320, **fields}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000 is out of bounds (1 to 1,024)"),
        ({"vocab_size": 4 * 10**9}, "vocab_size = 4000000000 is out of bounds (1 to 1,048,576)"),
        ({"hidden_size": "4096"}, "hidden_size = '4096' is out of bounds (a positive integer <= 65,536)"),
        ({"intermediate_size": -1}, "intermediate_size = -1 is out of bounds (1 to 262,144)"),
        (
            {"hidden_size": 65536, "num_hidden_layers": 1024, "intermediate_size": 262144},
            "is out of bounds (at most 2,000,000,000,000, from hidden_size",
        ),
    ],
)
def test_fsdp_lm_model_config_out_of_bounds(runs, tmp_path, fields, expected) -> None:
    cfg = config_file(tmp_path, **fields)
    line = refused(runs, FSDP, ["--model-config", str(cfg), "--max-steps", "1", "--fresh"], tmp_path / "o")
    assert f"--model-config {cfg}:" in line and expected in line, line


def test_fsdp_lm_unknown_model_config(runs, tmp_path) -> None:
    line = refused(runs, FSDP, ["--model-config", "no-such", "--max-steps", "1", "--fresh"], tmp_path / "o")
    assert "--model-config 'no-such': not a preset" in line


def prepared(runs: Runs, tmp_path: Path) -> Path:
    folder = tmp_path / "prepared"
    p, _ = runs.start(PREPARE, ["--corpus-bytes", "200000"], folder)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    return folder


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("tokens_file", "/etc/passwd", "tokens_file '/etc/passwd' is not a file name inside the folder"),
        ("index_file", "../../x.idx.npy", "index_file '../../x.idx.npy' is not a file name inside the folder"),
        ("tokens_file", "link.bin", "tokens_file 'link.bin' leads outside the folder"),
    ],
)
def test_prepared_manifest_paths_stay_in_the_folder(runs, tmp_path, field, value, expected) -> None:
    folder = prepared(runs, tmp_path)
    (folder / "link.bin").symlink_to("/etc/passwd")
    manifest = json.loads((folder / "gpudeck_prepared.json").read_text())
    manifest["splits"]["train"][field] = value
    (folder / "gpudeck_prepared.json").write_text(json.dumps(manifest))
    line = refused(runs, FSDP, [*FSDP_SMALL, "--data", str(folder), "--max-steps", "1", "--fresh"], tmp_path / "o")
    assert expected in line, line


def test_a_pickled_index_file_is_refused(runs, tmp_path) -> None:
    folder = prepared(runs, tmp_path)
    index = folder / json.loads((folder / "gpudeck_prepared.json").read_text())["splits"]["train"]["index_file"]
    np.save(index, np.array([object()], dtype=object), allow_pickle=True)
    line = refused(runs, FSDP, [*FSDP_SMALL, "--data", str(folder), "--max-steps", "1", "--fresh"], tmp_path / "o")
    assert "is not an index prepare wrote" in line, line


def test_a_bad_jsonl_record(runs, tmp_path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"\n')
    line = refused(runs, FSDP, [*FSDP_SMALL, "--data", str(data), "--max-steps", "1", "--fresh"], tmp_path / "o")
    assert f"{data}:2: not valid JSON" in line, line
    line = refused(runs, PREPARE, ["--data", str(data)], tmp_path / "p")
    assert line.startswith("prepare: ") and f"{data}:2: not valid JSON" in line, line
    records = tmp_path / "r.jsonl"
    records.write_text('{"prompt": "a", "response": "b"}\n["not", "a", "record"]\n')
    line = refused(runs, DFLASH, [*DFLASH_SMALL, "--data", str(records), "--max-steps", "1", "--fresh"], tmp_path / "q")
    assert f"{records}:2: record 2 lacks a prompt/response pair" in line, line


def test_a_bad_option_is_one_line(runs, tmp_path) -> None:
    line = refused(runs, FSDP, [*FSDP_SMALL, "--seq-len", "0", "--fresh"], tmp_path / "o")
    assert line.startswith("python -m gpudeck.trainers.fsdp_lm: error: argument --seq-len") and "(see --help)" in line, line
    line = refused(runs, DFLASH, [*DFLASH_SMALL, "--block-size", "100000", "--fresh"], tmp_path / "o")
    assert "--block-size must be in 2..1024" in line, line


def test_dflash_drafter_config_out_of_bounds(runs, tmp_path) -> None:
    cfg = tmp_path / "drafter.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 10**9, "block_size": 4}))
    line = refused(runs, DFLASH, [*DFLASH_SMALL, "--drafter-config", str(cfg), "--max-steps", "1", "--fresh"], tmp_path / "o")
    assert f"--drafter-config {cfg}: num_hidden_layers = 1000000000 is out of bounds (1 to 1,024)" in line, line
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "layer_types": ["full_attention"] * 5000}))
    line = refused(runs, DFLASH, [*DFLASH_SMALL, "--drafter-config", str(cfg), "--max-steps", "1", "--fresh"], tmp_path / "o")
    assert "layer_types" in line and "at most 1024 entries" in line, line


def test_dflash_target_folder_config_out_of_bounds(runs, tmp_path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(config_file(tmp_path, num_attention_heads=10**6), target / "config.json")
    args = [a for a in DFLASH_SMALL]
    i = args.index("--target-config")
    del args[i : i + 2]
    line = refused(runs, DFLASH, [*args, "--target", str(target), "--max-steps", "1", "--fresh"], tmp_path / "o")
    assert f"--target {target}: num_attention_heads = 1000000 is out of bounds (1 to 1,024)" in line, line
