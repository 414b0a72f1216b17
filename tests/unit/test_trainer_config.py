"""The trainers' typed configs: every option of each parser is a typed field, built once, frozen."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from gpudeck.trainers.common.config import TrainConfig
from gpudeck.trainers.dflash import config as dflash_config
from gpudeck.trainers.fsdp_lm import config as fsdp_config


@pytest.mark.parametrize(("module", "cls"), [(fsdp_config, fsdp_config.FsdpLmConfig), (dflash_config, dflash_config.DFlashConfig)])
def test_every_option_is_a_field_with_the_parsers_default(module, cls) -> None:
    parser = module.build_parser()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.dest in fields, f"{cls.__name__} lacks --{action.dest}"
        if action.default is not None and action.dest != "out":
            assert fields[action.dest].default == action.default, action.dest


def test_fsdp_lm_config_is_built_once_and_frozen() -> None:
    cfg = fsdp_config.parse_args(["--fresh", "--out", "o", "--seq-len", "64"])
    assert isinstance(cfg, fsdp_config.FsdpLmConfig) and cfg.seq_len == 64 and cfg.model_config == "tiny"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_len = 128  # type: ignore[misc]
    with pytest.raises(AttributeError):  # slots: nothing can be stashed on it
        object.__setattr__(cfg, "_layer_ids", [1])


def test_dflash_config_resolves_the_drafter_shape() -> None:
    cfg = dflash_config.parse_args(["--target-config", "tiny", "--fresh", "--out", "o"])
    assert (cfg.drafter_layers, cfg.block_size, cfg.target_config) == (
        dflash_config.DEFAULT_DRAFTER_LAYERS,
        dflash_config.DEFAULT_BLOCK_SIZE,
        "tiny",
    )
    assert cfg.batch_size == 2 and cfg.lr == 6e-4 and cfg.drafter_cfg is None


def test_an_undeclared_option_is_refused() -> None:
    ns = argparse.Namespace(out="o", surprise=1)
    with pytest.raises(TypeError, match="declares no field for surprise"):
        TrainConfig.from_args(ns)
