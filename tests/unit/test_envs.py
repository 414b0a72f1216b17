"""Environment fingerprints on real interpreters (the project venv, bare venvs, broken ones), and diff/describe on hand-made records."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import site
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import msgspec
import pytest

from gpudeck.agents.safety.envs import EnvError, PythonMissing, check_imports_torch, fingerprint, verify
from gpudeck.agents.wire.envdiff import REBUILD_IGNORES, EnvChange, describe, diff, normalize
from gpudeck.agents.wire.protocol import EnvFingerprint


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with nothing installed, not even pip (quick to make)."""
    d = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True)
    return d


def test_fingerprint_of_the_project_venv() -> None:
    t0 = time.monotonic()
    fp = fingerprint(sys.executable)
    first = time.monotonic() - t0
    t0 = time.monotonic()
    again = fingerprint(sys.executable)
    second = time.monotonic() - t0
    print(f"\nfingerprint({sys.executable}): {first * 1000:.0f} ms, then {second * 1000:.0f} ms; {len(fp.packages)} distributions")

    assert fp.python == sys.executable
    assert fp.prefix == sys.prefix
    assert fp.python_version == platform.python_version()
    assert fp.torch is not None and fp.torch.startswith("2.13.0")
    assert fp.torch_cuda is None  # the CPU build, read from torch/version.py
    assert fp.torch_git and len(fp.torch_git) == 40
    assert fp.nccl is None and fp.cudnn is None  # no nvidia-* wheels in a CPU env
    assert fp.transformers == metadata.version("transformers")
    assert fp.packages["msgspec"] == msgspec.__version__
    assert f"msgspec=={msgspec.__version__}" in fp.freeze
    assert fp.freeze == sorted(fp.freeze)
    assert fp.freeze_hash == hashlib.sha256("\n".join(fp.freeze).encode()).hexdigest()
    assert again.freeze_hash == fp.freeze_hash and again.freeze == fp.freeze
    assert fp.error is None
    assert "torch" not in sys.modules or fp.taken > 0  # the probe ran in its own interpreter
    assert diff(fp, again) == []


def test_direct_url_installs_are_marked() -> None:
    # gpudeck itself is installed from this checkout (PEP 610 direct_url.json); its line must say so.
    # Look in site-packages only: this process's sys.path starts with the checkout and its gpudeck.egg-info.
    dist = next(metadata.distributions(name="gpudeck", path=site.getsitepackages()))
    raw = dist.read_text("direct_url.json")
    fp = fingerprint(sys.executable)
    line = next(ln for ln in fp.freeze if ln.startswith("gpudeck"))
    if raw is None:
        assert line == f"gpudeck=={fp.packages['gpudeck']}"
    else:
        info = json.loads(raw)
        assert line.startswith(f"gpudeck @ {info['url']}")
        assert line.endswith("# editable") == bool(info.get("dir_info", {}).get("editable"))


def test_fingerprint_of_an_empty_venv_sees_only_that_venv(bare_venv: Path) -> None:
    fp = fingerprint(str(bare_venv / "bin" / "python"))
    assert fp.prefix == str(bare_venv)
    assert "msgspec" not in fp.packages and fp.torch is None and fp.transformers is None
    assert fp.freeze == [] and fp.freeze_hash == hashlib.sha256(b"").hexdigest()


def test_missing_interpreter_says_what_to_do(tmp_path: Path) -> None:
    gone = tmp_path / "venv" / "bin" / "python"
    with pytest.raises(PythonMissing) as e:
        fingerprint(str(gone))
    assert isinstance(e.value, EnvError) and e.value.code == "env"
    assert f"python {gone} does not exist on this host" in e.value.message
    assert "--rebuild-env" in e.value.message

    link = tmp_path / "python"
    link.symlink_to(tmp_path / "deleted-base" / "python3")
    with pytest.raises(PythonMissing, match="which is gone"):
        fingerprint(str(link))

    with pytest.raises(PythonMissing, match="not on this host's PATH"):
        fingerprint("python-gpudeck-no-such-name")

    # verify reports a missing interpreter as a change instead of raising
    changes = verify(EnvFingerprint(python=str(gone), python_version="3.11.7"))
    assert changes == [EnvChange("python", str(gone), None, core=True)]
    assert describe(changes) == [f"interpreter {gone} no longer exists"]


def test_a_failing_probe_carries_its_stderr(tmp_path: Path) -> None:
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'fatal: libpython3.11.so.1.0: cannot open shared object file' >&2\nexit 127\n")
    broken.chmod(0o755)
    with pytest.raises(EnvError) as e:
        fingerprint(str(broken))
    assert "exit 127" in e.value.message and "libpython3.11.so.1.0" in e.value.message

    slow = tmp_path / "slow-python"
    slow.write_text("#!/bin/sh\necho 'waiting on nfs' >&2\nexec sleep 30\n")
    slow.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(EnvError, match="did not finish the environment probe in 1 s"):
        fingerprint(str(slow), timeout=1.0)
    assert time.monotonic() - t0 < 10


def _fp(**kw: object) -> EnvFingerprint:
    base: dict[str, object] = dict(
        python="/envs/a/bin/python",
        prefix="/envs/a",
        python_version="3.11.7",
        torch="2.6.0+cu124",
        torch_cuda="12.4",
        torch_git="aaa",
        driver="550.54.15",
        nccl="2.21.5",
        cudnn="9.1.0.70",
        transformers="4.51.0",
        packages={
            "torch": "2.6.0+cu124",
            "transformers": "4.51.0",
            "nvidia-nccl-cu12": "2.21.5",
            "nvidia-cudnn-cu12": "9.1.0.70",
            "six": "1.16.0",
            "mylib": "0.3",
            "zzz": "1.0",
        },
    )
    base.update(kw)
    fp = EnvFingerprint(**base)  # type: ignore[arg-type]
    freeze = sorted(f"{n}=={v}" for n, v in fp.packages.items())
    return msgspec.structs.replace(fp, freeze=freeze, freeze_hash=hashlib.sha256("\n".join(freeze).encode()).hexdigest())


def test_diff_puts_core_keys_first_then_packages_by_name() -> None:
    a = _fp()
    assert diff(a, _fp()) == []
    pkgs = dict(a.packages)
    pkgs.update({"torch": "2.7.0+cu128", "transformers": "4.52.0", "nvidia-nccl-cu12": "2.26.2", "six": "1.17.0", "aaa": "0.1"})
    pkgs.pop("zzz")
    pkgs.pop("nvidia-cudnn-cu12")
    pkgs["nvidia-cudnn-cu13"] = "9.8.0"
    b = _fp(
        python="/envs/b/bin/python",
        prefix="/envs/b",
        python_version="3.12.3",
        torch="2.7.0+cu128",
        torch_cuda="12.8",
        torch_git="bbb",
        driver="570.86.10",
        nccl="2.26.2",
        cudnn="9.8.0",
        transformers="4.52.0",
        packages=pkgs,
    )
    changes = diff(a, b)
    assert [c.key for c in changes] == [
        "python_version",
        "torch",
        "torch_cuda",
        # torch_git is left out: the torch version already changed
        "driver",
        "nccl",
        "cudnn",
        "transformers",
        "python",
        "prefix",
        "package:aaa",
        # nvidia-cudnn swapped cu12 -> cu13: both show; nccl's same-name bump is the nccl key's; torch/transformers too
        "package:nvidia-cudnn-cu12",
        "package:nvidia-cudnn-cu13",
        "package:six",
        "package:zzz",
    ]
    assert [c.core for c in changes] == [True] * 7 + [False] * 7
    assert changes[1] == EnvChange("torch", "2.6.0+cu124", "2.7.0+cu128", core=True)
    assert describe(changes) == [
        "python 3.11.7 -> 3.12.3",
        "torch 2.6.0+cu124 -> 2.7.0+cu128",
        "torch CUDA build 12.4 -> 12.8",
        "driver 550.54.15 -> 570.86.10",
        "NCCL 2.21.5 -> 2.26.2",
        "cuDNN 9.1.0.70 -> 9.8.0",
        "transformers 4.51.0 -> 4.52.0",
        "interpreter /envs/a/bin/python -> /envs/b/bin/python",
        "environment /envs/a -> /envs/b",
        "+ package aaa 0.1",
        "- package nvidia-cudnn-cu12 9.1.0.70",
        "+ package nvidia-cudnn-cu13 9.8.0",
        "package six 1.16.0 -> 1.17.0",
        "- package zzz 1.0",
    ]
    # two copies of one environment differ only where they live
    same = msgspec.structs.replace(a, python="/envs/b/bin/python", prefix="/envs/b", driver=None)
    assert [c.key for c in diff(a, same)] == ["driver", "python", "prefix"]
    assert diff(a, same, ignore=REBUILD_IGNORES) == []


def test_diff_sees_rebuilt_torch_and_source_changes() -> None:
    a = _fp()
    # same version string, another build (a nightly, a source build): only the git hash says so
    assert diff(a, msgspec.structs.replace(a, torch_git="ccc")) == [EnvChange("torch_git", "aaa", "ccc", core=True)]
    # same version of mylib, but now from a git checkout: a different package
    b = msgspec.structs.replace(
        a, freeze=sorted([*(ln for ln in a.freeze if not ln.startswith("mylib")), "mylib @ git+https://example.com/mylib@abc123"])
    )
    b = msgspec.structs.replace(b, freeze_hash=hashlib.sha256("\n".join(b.freeze).encode()).hexdigest())
    assert diff(a, b) == [EnvChange("package:mylib", "0.3", "0.3 @ git+https://example.com/mylib@abc123")]
    # CPU build vs CUDA build reads as such
    cpu = msgspec.structs.replace(a, torch_cuda=None)
    assert describe(diff(cpu, a)) == ["torch CUDA build none (CPU build) -> 12.4"]


def test_normalize_follows_pep_503() -> None:
    assert normalize("Foo_Bar.baz") == "foo-bar-baz"
    assert normalize("nvidia_nccl__cu12") == "nvidia-nccl-cu12"


def test_check_imports_torch(bare_venv: Path) -> None:
    ok, msg = check_imports_torch(sys.executable)
    print(f"\n{msg}")
    assert ok, msg
    assert "torch 2.13.0" in msg and "CPU build" in msg

    py = str(bare_venv / "bin" / "python")
    ok, msg = check_imports_torch(py)
    assert not ok
    assert "No module named 'torch'" in msg and f"{py} -m pip install torch" in msg

    # the run's environment decides: a PYTHONPATH that shadows torch with a broken one is caught
    fake = bare_venv.parent / "shadow" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    ok, msg = check_imports_torch(py, env={**os.environ, "PYTHONPATH": str(fake.parent)})
    assert not ok and "libcudart.so.12" in msg and "--force-reinstall" in msg

    ok, msg = check_imports_torch(str(bare_venv / "nope"))
    assert not ok and "does not exist" in msg
