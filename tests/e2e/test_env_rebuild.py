"""Rebuild a recorded environment for real: venvs made with `python -m venv`, packages from the package index, no mocks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from gpudeck.agents.safety.envs import EnvError, fingerprint, rebuild, verify
from gpudeck.agents.wire.envdiff import REBUILD_IGNORES, EnvChange, describe, diff
from gpudeck.agents.wire.protocol import EnvFingerprint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", *args], check=True)


@pytest.fixture(params=["pip", "uv"])
def installer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the rebuild with pip (uv taken off PATH) and, where uv is installed, with uv."""
    uv = shutil.which("uv")
    if request.param == "uv" and uv is None:
        pytest.skip("uv is not on PATH on this machine; the pip path covers rebuild")
    if request.param == "pip" and uv is not None:
        keep = [d for d in os.environ.get("PATH", "").split(os.pathsep) if not (Path(d) / "uv").exists()]
        monkeypatch.setenv("PATH", os.pathsep.join(keep))
        assert shutil.which("uv") is None
    yield request.param


def test_verify_then_rebuild_from_the_record(tmp_path: Path, installer: str) -> None:
    a = tmp_path / "A"
    subprocess.run([sys.executable, "-m", "venv", str(a)], check=True)
    py_a = a / "bin" / "python"
    pip(py_a, "six==1.16.0", "idna==3.7")
    # a record without setuptools: the rebuilt venv must also drop the copy `python -m venv` brings (on 3.11)
    subprocess.run([str(py_a), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=True)

    recorded = fingerprint(str(py_a))
    assert recorded.packages["six"] == "1.16.0" and recorded.packages["idna"] == "3.7"
    assert "six==1.16.0" in recorded.freeze and "idna==3.7" in recorded.freeze
    assert "pip" in recorded.packages and "setuptools" not in recorded.packages
    assert recorded.torch is None and recorded.transformers is None
    assert verify(recorded) == []

    # the environment moves under the record
    pip(py_a, "six==1.17.0")
    changes = verify(recorded)
    assert changes == [EnvChange("package:six", "1.16.0", "1.17.0", core=False)]
    assert describe(changes) == ["package six 1.16.0 -> 1.17.0"]

    b = tmp_path / "B"
    rebuilt = rebuild(recorded, b)
    assert rebuilt.prefix == str(b) and rebuilt.python == str(b / "bin" / "python")
    assert diff(recorded, rebuilt, ignore=REBUILD_IGNORES) == []
    assert rebuilt.packages == recorded.packages and rebuilt.freeze_hash == recorded.freeze_hash
    log = (b / "rebuild.log").read_text()
    assert ("uv pip install" in log) if installer == "uv" else ("-m pip install --no-deps -r" in log)
    # B is a real environment: its six is the recorded one
    out = subprocess.run(
        [str(b / "bin" / "python"), "-c", "import six; print(six.__version__)"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1.16.0"
    assert verify(rebuilt) == []
    # A still has the moved six: the rebuild did not touch it
    assert verify(recorded) == changes


def test_rebuild_proves_the_result_matches(tmp_path: Path, installer: str) -> None:
    # a record whose package list disagrees with its freeze: the installed result cannot match, and rebuild must say so
    a = tmp_path / "A"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(a)], check=True)
    base = fingerprint(str(a / "bin" / "python"))
    recorded = msgspec.structs.replace(base, packages={"idna": "3.6"}, freeze=["idna==3.7"])
    with pytest.raises(EnvError) as e:
        rebuild(recorded, tmp_path / "B", log=tmp_path / "B.log")
    assert "does not match the record: package idna 3.6 -> 3.7" in e.value.message
    assert str(tmp_path / "B.log") in e.value.message and (tmp_path / "B.log").exists()


def test_rebuild_refuses_what_it_cannot_reproduce_up_front(tmp_path: Path) -> None:
    rec = EnvFingerprint(
        python=sys.executable,
        python_version="3.11.7",
        packages={"six": "1.16.0", "mylib": "0.3", "data-tool": "1.0"},
        freeze=[
            "data-tool @ file:///srv/nowhere/data_tool-1.0-py3-none-any.whl",
            "mylib @ file:///home/me/mylib  # editable",
            "six==1.16.0",
        ],
    )
    dest = tmp_path / "B"
    with pytest.raises(EnvError) as e:
        rebuild(rec, dest)
    msg = e.value.message
    assert "mylib @ file:///home/me/mylib (editable)" in msg and "data_tool-1.0-py3-none-any.whl (the file is gone)" in msg
    assert "six" not in msg
    assert not dest.exists()  # refused before anything was created

    # the project venv's own record (gpudeck is installed from this checkout) is refused the same way
    project = fingerprint(sys.executable)
    if any("# editable" in ln for ln in project.freeze):
        with pytest.raises(EnvError, match=r"gpudeck @ file://.* \(editable\)"):
            rebuild(project, dest)
        assert not dest.exists()

    # a folder that already holds something is not overwritten
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(EnvError, match="already exists and is not empty"):
        rebuild(msgspec.structs.replace(rec, freeze=["six==1.16.0"], packages={"six": "1.16.0"}), dest)
    assert (dest / "keep.txt").read_text() == "mine"

    # no interpreter of the recorded version: says which were found and what to install
    with pytest.raises(EnvError, match=r"no Python 3\.4\.1 on this host .* install Python 3\.4\.1"):
        rebuild(msgspec.structs.replace(rec, python="/gone/bin/python", python_version="3.4.1", freeze=["six==1.16.0"]), tmp_path / "C")
    assert not (tmp_path / "C").exists()
