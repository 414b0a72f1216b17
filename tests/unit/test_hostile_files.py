"""Files a run (or its operator) controls, read by the agent: a run's exit.json and the model / drafter configs the
memory estimate reads. Whatever they hold — nesting 100,000 deep, megabytes, invalid UTF-8, numbers past any type,
values of the wrong type — the reader gives a sane answer or a typed error that names the file, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from gpudeck.agents.runs.ending import ExitFacts, decide, read_exit_record
from gpudeck.agents.safety.estimate import EstimateError, estimate
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import LaunchSpec, RunInfo

DEEP = b"[" * 100_000 + b"]" * 100_000
HOSTILE_EXIT = {
    "deep": b'{"returncode": ' + DEEP + b"}",
    "deep_object": b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    "huge": b'{"returncode": 0, "note": "' + b"x" * (8 << 20) + b'"}',
    "invalid_utf8": b'{"returncode": 1, "note": "\xff\xfe\xed\xa0\x80"}',
    "lone_surrogate_escape": b'{"returncode": 1, "note": "\\ud800"}',
    "wrong_types": json.dumps({"returncode": "zero", "signal": 9, "ended": "yesterday", "launch_error": {"a": 1}, "note": [1]}).encode(),
    "bool_code": b'{"returncode": true, "signal": null}',
    "huge_int": b'{"returncode": 123456789012345678901234567890}',
    "huge_float": b'{"returncode": 3, "ended": 1e308, "signal": ["SIGKILL"]}',
    "not_an_object": b"[1, 2, 3]",
    "empty": b"",
    "nul_bytes": b"\x00" * 4096,
}


def _run(tmp_path: Path) -> RunInfo:
    return RunInfo(id="r-x", host="h", state="running", spec=LaunchSpec(argv=["x"]), created=time.time(), run_dir=str(tmp_path))


@pytest.mark.parametrize("name", sorted(HOSTILE_EXIT))
def test_a_hostile_exit_json_gives_a_sane_exit_cause(tmp_path: Path, name: str) -> None:
    (tmp_path / "exit.json").write_bytes(HOSTILE_EXIT[name])
    rec = read_exit_record(str(tmp_path))
    assert rec is None or isinstance(rec, dict)
    for shim_rc in (None, 3):
        facts = ExitFacts(record=rec, shim_returncode=shim_rc, output_tail="", output_reason=None, telemetry_evidence="")
        end = decide(_run(tmp_path), facts)
        assert end.state in ("succeeded", "failed", "lost")
        assert isinstance(end.cause, str) and len(end.cause) < 5000
        assert end.exit_code is None or isinstance(end.exit_code, int) and not isinstance(end.exit_code, bool)
        assert end.signal is None or isinstance(end.signal, str)
        assert isinstance(end.ended, float) and math.isfinite(end.ended) and end.ended < 1e11
    print(f"\n{name}: record {rec!r:.80}; cause with the shim's code 3: {end.cause[:100]!r}")


def test_a_fifo_or_a_link_in_place_of_exit_json_is_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "exit.json")
    t0 = time.monotonic()
    assert read_exit_record(str(tmp_path)) is None  # a FIFO with no writer would block an open() for ever
    assert time.monotonic() - t0 < 30
    (tmp_path / "exit.json").unlink()
    (tmp_path / "elsewhere.json").write_text('{"returncode": 0}')
    (tmp_path / "exit.json").symlink_to(tmp_path / "elsewhere.json")
    assert read_exit_record(str(tmp_path)) is None


def test_the_shims_own_record_still_reads_as_before(tmp_path: Path) -> None:
    (tmp_path / "exit.json").write_text(json.dumps({"returncode": 0, "signal": None, "ended": 1796170000.5}))
    assert read_exit_record(str(tmp_path)) == {"returncode": 0, "ended": 1796170000.5}
    (tmp_path / "exit.json").write_text(json.dumps({"returncode": None, "signal": "SIGKILL", "ended": 1796170000.5}))
    end = decide(
        _run(tmp_path),
        ExitFacts(record=read_exit_record(str(tmp_path)), shim_returncode=None, output_tail="", output_reason=None, telemetry_evidence=""),
    )
    assert (end.state, end.cause, end.signal) == ("failed", "killed by SIGKILL", "SIGKILL")


# ---------------------------------------------------------------------- the memory estimate's config files

HOSTILE_CONFIG = {
    "deep": b'{"model_type": "llama", "x": ' + DEEP + b"}",
    "huge_int_literal": b'{"model_type": "llama", "hidden_size": ' + b"9" * 5000 + b"}",
    "int_past_2_53": json.dumps({"model_type": "llama", "hidden_size": 2**60}).encode(),
    "nan": b'{"model_type": "llama", "hidden_size": NaN}',
    "infinity": b'{"model_type": "llama", "rope_theta": Infinity}',
    "invalid_utf8": b'{"model_type": "llama\xff"}',
    "kv_heads_a_string": json.dumps({"model_type": "llama", "num_key_value_heads": "eight"}).encode(),
    "head_dim_a_list": json.dumps({"model_type": "llama", "head_dim": [128]}).encode(),
    "hidden_a_float": json.dumps({"model_type": "llama", "hidden_size": 1e300}).encode(),
    "model_type_a_dict": json.dumps({"model_type": {"llama": 1}}).encode(),
    "not_an_object": b'"llama"',
    "too_big": b'{"model_type": "llama", "pad": "' + b"x" * (17 << 20) + b'"}',
}


def _fsdp_spec(config: Path) -> LaunchSpec:
    return LaunchSpec(kind="fsdp", argv=["python", "-m", "gpudeck.trainers.fsdp_lm", "--model-config", str(config)], cwd=str(config.parent))


@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIG))
def test_a_hostile_model_config_is_a_typed_error_that_names_the_file(tmp_path: Path, name: str) -> None:
    cfg = tmp_path / f"{name}.json"
    cfg.write_bytes(HOSTILE_CONFIG[name])
    with pytest.raises(EstimateError) as info:
        estimate(_fsdp_spec(cfg))
    assert str(cfg) in info.value.message, info.value.message
    assert "--need-gib" in info.value.message
    print(f"\n{name}: {info.value.message[:160]}")


HOSTILE_DRAFTER = {
    "deep": b'{"num_hidden_layers": 1, "dflash_config": ' + DEEP + b"}",
    "layer_types_a_number": json.dumps({"layer_types": 5}).encode(),
    "dflash_config_a_list": json.dumps({"dflash_config": [1, 2]}).encode(),
    "target_layer_ids_a_string": json.dumps({"dflash_config": {"target_layer_ids": "all"}}).encode(),
    "layers_huge": json.dumps({"num_hidden_layers": 10**30}).encode(),
    "layers_past_2_53": json.dumps({"num_hidden_layers": 2**53 + 1}).encode(),
    "block_size_a_string": json.dumps({"block_size": "big", "num_hidden_layers": "two"}).encode(),
    "heads_negative": json.dumps({"num_attention_heads": -4, "intermediate_size": 0}).encode(),
    "huge_int_literal": b'{"num_hidden_layers": ' + b"1" * 10000 + b"}",
    "nan": b'{"block_size": NaN}',
    "invalid_utf8": b'{"layer_types": ["\xff"]}',
}


def _dflash_spec(tmp_path: Path, drafter: Path) -> LaunchSpec:
    (tmp_path / "target").mkdir(exist_ok=True)
    target = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64}
    target.update({"intermediate_size": 3072, "num_hidden_layers": 8, "vocab_size": 32000})
    (tmp_path / "target" / "config.json").write_text(json.dumps(target))
    argv = ["python", "-m", "gpudeck.trainers.dflash", "--target", str(tmp_path / "target"), "--drafter-config", str(drafter)]
    return LaunchSpec(kind="dflash", argv=[*argv, "--fresh", "--out", "o"], cwd=str(tmp_path))


@pytest.mark.parametrize("name", sorted(HOSTILE_DRAFTER))
def test_a_hostile_drafter_config_gives_an_estimate_or_a_typed_error_naming_the_file(tmp_path: Path, name: str) -> None:
    cfg = tmp_path / f"{name}.json"
    cfg.write_bytes(HOSTILE_DRAFTER[name])
    try:
        e = estimate(_dflash_spec(tmp_path, cfg))
    except AgentError as exc:
        assert isinstance(exc, EstimateError)
        assert str(cfg) in exc.message, exc.message
        print(f"\n{name}: typed error: {exc.message[:160]}")
        return
    # what is of the wrong type in a drafter config falls back to the defaults (as the trainer's own reader does)
    assert e is not None and e.per_gpu_bytes > 0 and math.isfinite(float(e.per_gpu_bytes))
    print(f"\n{name}: estimate {e.per_gpu_bytes / 2**30:.1f} GiB ({e.method[:100]})")
