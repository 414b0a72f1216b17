"""The installed layout: every package folder of the checkout is installed under the gpudeck namespace."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import gpudeck.agents

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_installed_under_the_gpudeck_namespace() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {
        str(p.parent.relative_to(ROOT)).replace("/", ".")
        for top in ("console", "agents", "trainers")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert {f"gpudeck.{d}" for d in dirs} == set(conf["packages"]), "add the new package to [tool.setuptools] packages"
    assert conf["package-dir"] == {f"gpudeck.{t}": t for t in ("console", "agents", "trainers")}


def test_one_version_string_from_the_package_metadata() -> None:
    assert gpudeck.agents.__version__ == version("gpudeck")


def test_a_run_launched_before_the_runs_move_is_still_recognised_by_its_shim() -> None:
    """Runs alive across an upgrade were started with agents/shim.py; rediscovery accepts that path too."""
    from pathlib import Path

    from gpudeck.agents.runs.launch import SHIM, SHIMS

    assert SHIM.endswith(str(Path("agents", "runs", "shim.py")))
    assert any(s.endswith(str(Path("agents", "shim.py"))) and "runs" not in Path(s).parts[-2:] for s in SHIMS)
