"""Tests for trainers/contract.py: one table each, and every side reads it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from gpudeck.trainers import contract

ROOT = Path(__file__).resolve().parents[2]


def test_contract_is_stdlib_only() -> None:
    tree = ast.parse((ROOT / "trainers" / "contract.py").read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= {"__future__", "re", "dataclasses", "typing", "gpudeck.trainers.presets"}, mods


def test_the_kind_table_is_written_once() -> None:
    """No other source file spells the kind -> module table (the trainers name themselves, that is all)."""
    modules = set(contract.TRAINER_MODULES.values())
    copies = []
    for path in [*ROOT.glob("console/**/*.py"), *ROOT.glob("agents/*.py")]:
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Constant) and n.value in modules for n in ast.walk(tree)):
            copies.append(str(path.relative_to(ROOT)))
    assert copies == [], copies


def test_start_flags_round_trip() -> None:
    argv = ["--out", "o", "--resume", "100", "--fresh", "--new-run-dir", "--resume=7", "--lr", "1"]
    assert contract.strip_start(argv) == ["--out", "o", "--lr", "1"]
    assert contract.start_argv("fresh") == ["--fresh"]
    assert contract.start_argv("resume 40") == ["--resume", "40"]
    with pytest.raises(ValueError):
        contract.start_argv("later")


def test_checkpoint_layout_is_the_trainers() -> None:
    pytest.importorskip("torch")
    ckpt = importlib.import_module("gpudeck.trainers.common.checkpoint")
    assert ckpt.checkpoint_path("o", 5).name == contract.step_dirname(5)
    assert ckpt.CHECKPOINTS_DIRNAME == contract.CHECKPOINTS_DIRNAME
    assert ckpt.MARKER_FILE == contract.CHECKPOINT_MARKER


@pytest.mark.parametrize("trainer", sorted(contract.TRAINER_MODULES.values()))
def test_declared_defaults_follow_the_trainers(trainer: str) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    real = importlib.import_module(trainer + ".config").build_parser()
    by_flag = {s: a for a in real._actions for s in a.option_strings}
    for arg in contract.trainer_args(trainer):
        assert arg.flag in by_flag, arg.flag
        default = by_flag[arg.flag].default
        if arg.takes == "flag":
            assert default in (False, None), arg.flag
        elif arg.default is not None:
            assert default == arg.default, (arg.flag, default, arg.default)


def test_index_lists() -> None:
    assert contract.parse_index_list("0-3") == [0, 1, 2, 3]
    assert contract.parse_index_list("1,0") == [0, 1]
    with pytest.raises(ValueError):
        contract.parse_index_list("3-1")
