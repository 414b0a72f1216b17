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
