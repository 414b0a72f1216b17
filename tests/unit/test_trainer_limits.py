"""Unit tests of the config bounds (trainers/common/limits.py, stdlib): refused before transformers or torch allocate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpudeck.trainers.common.limits import LIMITS, MAX_PARAMS, check_config, estimated_params, read_config_json
from gpudeck.trainers.errors import ConfigLimitError, InputError
from gpudeck.trainers.presets import PRESETS


def test_every_preset_is_within_bounds() -> None:
    for name, cfg in PRESETS.items():
        assert check_config(dict(cfg), name)


@pytest.mark.parametrize("field", sorted(LIMITS))
@pytest.mark.parametrize("bad", ["over", 0, True, 1.5, "8"])
def test_each_field_is_a_bounded_positive_integer(field: str, bad: object) -> None:
    value = LIMITS[field] + 1 if bad == "over" else bad
    with pytest.raises(ConfigLimitError) as exc:
        check_config({field: value}, "cfg.json")
    assert exc.value.field == field and str(exc.value).startswith(f"cfg.json: {field} = {value!r} is out of bounds")
    assert check_config({field: LIMITS[field] if field != "hidden_size" else 1}, "cfg.json")


def test_nested_text_config_and_layer_types_and_the_product() -> None:
    with pytest.raises(ConfigLimitError, match=r"cfg \[text_config\]: num_hidden_layers"):
        check_config({"text_config": {"num_hidden_layers": 10**9}}, "cfg")
    with pytest.raises(ConfigLimitError, match="layer_types"):
        check_config({"layer_types": ["full_attention"] * 5000}, "cfg")
    big = {"hidden_size": 65536, "num_hidden_layers": 1024, "intermediate_size": 262144, "vocab_size": 320}
    assert estimated_params(big) > MAX_PARAMS
    with pytest.raises(ConfigLimitError, match="estimated parameters"):
        check_config(big, "cfg")
    # Llama-3.1-405B's shape passes
    assert check_config({"hidden_size": 16384, "num_hidden_layers": 126, "intermediate_size": 53248, "vocab_size": 128256}, "405b")


def test_read_config_json_reads_folders_and_says_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert read_config_json(tmp_path, "--init-from x") == {"hidden_size": 64}
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(InputError, match="is not valid JSON"):
        read_config_json(tmp_path, "--init-from x")
    with pytest.raises(InputError, match="cannot read"):
        read_config_json(tmp_path / "nope.json", "--model-config nope.json")
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ConfigLimitError, match="a JSON object"):
        read_config_json(tmp_path, "--init-from x")
