"""What `import torch` loads, fingerprinted on real interpreters (issue 32): the project venv's CPU torch, and a venv
holding a small FAKE torch package (labelled as such: a CUDA build whose ``torch.cuda.nccl.version()`` says 2.28.9 and
whose import maps a library named libnccl.so.2, while the nvidia-nccl-cu12 metadata says 2.30.7, as in
marin-community/marin#7344). The probe's answer is hostile input: oversized, malformed, or naming odd files."""

from __future__ import annotations

import _json
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import msgspec
import pytest

from gpudeck.agents.safety import envs
from gpudeck.agents.safety.envs import CPU_BUILD, check_imports_torch, fingerprint, libnccl_digest
from gpudeck.agents.wire.envdiff import diff

PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"


def fake_torch_venv(root: Path, *, nccl_runtime: str = "2.28.9", init_extra: str = "") -> tuple[Path, Path]:
    """A venv (no pip) with a FAKE torch 2.9.0+cu128 that maps site-packages/nvidia/nccl/lib/libnccl.so.2 (a copy of a
    small shared object of this Python's, named so) and reports ``nccl_runtime``; returns (its python, that library)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = root / "lib" / PYVER / "site-packages"
    lib = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    shutil.copy(_json.__file__, lib)  # any loadable ELF object: dlopen maps it, nothing in it runs
    torch = site / "torch"
    (torch / "cuda").mkdir(parents=True)
    (torch / "__init__.py").write_text(
        "# FAKE torch for gpudeck's tests: not PyTorch\n"
        "import ctypes, os\n"
        "_nccl = ctypes.CDLL(os.path.join(os.path.dirname(__file__), '..', 'nvidia', 'nccl', 'lib', 'libnccl.so.2'))\n"
        "from . import version, cuda\n"
        "__version__ = version.__version__\n" + init_extra
    )
    (torch / "version.py").write_text("__version__ = '2.9.0+cu128'\ncuda = '12.8'\ngit_version = '" + "f" * 40 + "'\n")
    (torch / "cuda" / "__init__.py").write_text(
        "from . import nccl\ndef is_available():\n    return False\ndef device_count():\n    return 0\n"
    )
    major, minor, patch = (int(x) for x in nccl_runtime.split("."))
    (torch / "cuda" / "nccl.py").write_text(f"def version():\n    return ({major}, {minor}, {patch})\n")
    for name, version in (("torch", "2.9.0+cu128"), ("nvidia_nccl_cu12", "2.30.7")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n\n")
    return root / "bin" / "python", lib


def test_the_cpu_build_records_no_libnccl() -> None:
    fp = fingerprint(sys.executable, env={**os.environ, "NCCL_DEBUG": "WARN", "TORCH_HUB_TOKEN": "hunter2"})
    assert fp.torch_cuda is None and fp.libnccl == CPU_BUILD and fp.libnccl_sha256 is None and fp.nccl_runtime is None
    assert fp.dist_env["NCCL_DEBUG"] == "WARN"
    assert fp.dist_env["TORCH_HUB_TOKEN"].endswith("(value hidden)") and "hunter2" not in str(fp.dist_env)
    assert fp.error is None
    assert fingerprint(sys.executable, loaded=False).libnccl is None  # the metadata-only fingerprint stays available


def test_the_loaded_libnccl_is_what_counts_not_the_metadata(tmp_path: Path) -> None:
    python, lib = fake_torch_venv(tmp_path / "fake")
    fp = fingerprint(str(python), env={"PATH": os.environ["PATH"], "NCCL_IB_DISABLE": "1"})
    print(f"\nFAKE torch: metadata NCCL {fp.nccl}, torch reports {fp.nccl_runtime}, loaded {fp.libnccl} sha256 {fp.libnccl_sha256}")
    assert fp.torch == "2.9.0+cu128" and fp.torch_cuda == "12.8"
    assert fp.nccl == "2.30.7" and fp.nccl_runtime == "2.28.9"  # the metadata lies; the gate and the diff use what runs
    assert fp.libnccl == str(lib.resolve())
    assert fp.libnccl_sha256 == hashlib.sha256(lib.read_bytes()).hexdigest()
    assert fp.dist_env == {"NCCL_IB_DISABLE": "1"} and fp.error is None

    other, _ = fake_torch_venv(tmp_path / "fake2", nccl_runtime="2.27.3")
    changes = diff(fp, fingerprint(str(other)), ignore=("python", "prefix"))
    assert [c.key for c in changes] == ["nccl_runtime"]  # same layout, same bytes: only the version torch reports


def test_pre_flights_import_check_feeds_the_launchs_fingerprint_torch_is_imported_once(tmp_path: Path) -> None:
    log = tmp_path / "imports.log"
    python, _ = fake_torch_venv(tmp_path / "fake", init_extra=f"open({str(log)!r}, 'a').write('import' + chr(10))\n")
    run_env = {"PATH": os.environ["PATH"], "NCCL_ALGO": "Ring"}
    ok, text = check_imports_torch(str(python), env=run_env)  # what pre-flight runs, then the launch fingerprints
    assert ok and "torch 2.9.0+cu128 imports" in text, text
    fp = fingerprint(str(python), env=run_env)
    assert fp.nccl_runtime == "2.28.9" and fp.dist_env == {"NCCL_ALGO": "Ring"}
    assert log.read_text().count("import") == 1
    other = fingerprint(str(python), env={**run_env, "NCCL_ALGO": "Tree"})  # another environment: probed afresh
    assert other.dist_env == {"NCCL_ALGO": "Tree"} and log.read_text().count("import") == 2


def test_a_hostile_probe_answer_is_bounded_and_named(tmp_path: Path) -> None:
    # the fake torch's import prints a forged result line last: an oversized one, then a malformed one
    huge, _ = fake_torch_venv(
        tmp_path / "huge", init_extra="import sys\nsys.stdout.write('GPUDECK-LOADED ' + 'x' * 300000 + chr(10))\nsys.exit(0)\n"
    )
    fp = fingerprint(str(huge))
    assert fp.libnccl is None and fp.libnccl_sha256 is None and "over the 262,144 read" in (fp.error or "")

    liar, _ = fake_torch_venv(
        tmp_path / "liar",
        init_extra="import sys, json\nsys.stdout.write('GPUDECK-LOADED ' + json.dumps({'libs': ['/etc/passwd'], "
        "'env': {'PATH': '/evil'}}) + chr(10))\nsys.exit(0)\n",
    )
    fp = fingerprint(str(liar))
    assert fp.libnccl is None and "unreadable result" in (fp.error or "")  # PATH is not an NCCL_/TORCH_ name

    cpu_or_not, _ = fake_torch_venv(
        tmp_path / "cpu-or-not",
        init_extra="import sys, json\nsys.stdout.write('GPUDECK-LOADED ' + json.dumps({}) + chr(10))\nsys.exit(0)\n",
    )
    assert fingerprint(str(cpu_or_not)).libnccl is None  # torch did not say it imported: not taken for a CPU build

    static, _ = fake_torch_venv(
        tmp_path / "static",
        init_extra="import sys, json\nsys.stdout.write('GPUDECK-LOADED ' + json.dumps({'imported': True, 'cuda': '11.8', 'nccl': '2.15.5'}) "
        "+ chr(10))\nsys.exit(0)\n",
    )
    assert fingerprint(str(static)).libnccl == "none (NCCL linked into torch)"  # older wheels link NCCL statically

    named, _ = fake_torch_venv(
        tmp_path / "named",
        init_extra="import sys, json\nsys.stdout.write('GPUDECK-LOADED ' + json.dumps({'cuda': '12.8', 'libs': ['/etc/passwd']}) + chr(10))\n"
        "sys.exit(0)\n",
    )
    fp = fingerprint(str(named))
    assert fp.libnccl == "/etc/passwd" and fp.libnccl_sha256 is None and "not an absolute path to a libnccl*.so file" in (fp.error or "")

    broken, _ = fake_torch_venv(tmp_path / "broken", init_extra="raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    fp = fingerprint(str(broken))
    # what was mapped before the import failed is still recorded; the failure is named
    assert fp.libnccl is not None and fp.libnccl.endswith("libnccl.so.2") and "libcudart.so.12" in (fp.error or "")


def test_libnccl_digest_refuses_what_is_not_a_plain_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fifo = tmp_path / "libnccl.so.2"
    os.mkfifo(fifo)
    assert libnccl_digest(str(fifo)) == (None, f"the loaded libnccl {fifo} is not a regular file: not hashed")
    real = tmp_path / "real" / "libnccl.so.2"
    real.parent.mkdir()
    real.write_bytes(b"\x7fELF" + b"\0" * 4096)
    link = tmp_path / "link" / "libnccl.so.2"
    link.parent.mkdir()
    link.symlink_to(real)
    digest, why = libnccl_digest(str(link))
    assert digest is None and "cannot open" in (why or "")
    assert libnccl_digest(str(real)) == (hashlib.sha256(real.read_bytes()).hexdigest(), None)
    assert "deleted or replaced" in (libnccl_digest(str(real) + " (deleted)")[1] or "")
    assert "not an absolute path" in (libnccl_digest("libnccl.so.2")[1] or "")
    monkeypatch.setattr(envs, "LIBNCCL_MAX_BYTES", 1024)
    big = tmp_path / "big" / "libnccl.so.2"
    big.parent.mkdir()
    big.write_bytes(b"\0" * 2048)
    assert "over the 1,024 hashed" in (libnccl_digest(str(big))[1] or "")


def test_the_digest_is_cached_by_inode_and_follows_a_change(tmp_path: Path) -> None:
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"one")
    first, _ = libnccl_digest(str(lib))
    assert libnccl_digest(str(lib))[0] == first == hashlib.sha256(b"one").hexdigest()
    lib.write_bytes(b"two!")  # another size (and mtime): hashed again
    assert libnccl_digest(str(lib))[0] == hashlib.sha256(b"two!").hexdigest()
    assert sysconfig.get_paths()["purelib"]  # (the fake venvs above put their site-packages where this Python does)


def test_the_next_launchs_import_check_reuses_the_probe_until_a_file_it_rests_on_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Launches one after another with the same interpreter and environment import torch once (1.2-1.6 s each on this
    machine): the next pre-flight says it reused the check, and any change under it (a package installed or removed
    beside torch, torch's own files, the loaded libnccl replaced) or SEEN_FOR_S passing probes again."""
    log = tmp_path / "imports.log"
    python, lib = fake_torch_venv(tmp_path / "fake", init_extra=f"open({str(log)!r}, 'a').write('import' + chr(10))\n")
    run_env = {"PATH": os.environ["PATH"]}

    def imports() -> int:
        return log.read_text().count("import")

    ok, first = check_imports_torch(str(python), env=run_env)
    assert ok and "torch 2.9.0+cu128 imports in" in first and "checked" not in first, first
    ok, again = check_imports_torch(str(python), env=run_env)  # the next launch
    assert ok and again.startswith(first) and "s ago, its files unchanged since" in again, again
    assert fingerprint(str(python), env=run_env).nccl_runtime == "2.28.9"
    assert imports() == 1

    site = lib.parents[3]
    (site / "numpy-2.4.0.dist-info").mkdir()  # a pip install beside torch: the folder's entries change
    ok, text = check_imports_torch(str(python), env=run_env)
    assert ok and "checked" not in text and imports() == 2, text
    assert "checked" in check_imports_torch(str(python), env=run_env)[1] and imports() == 2

    init = site / "torch" / "__init__.py"
    init.write_text(init.read_text() + "# reinstalled\n")  # torch's own files
    assert "checked" not in check_imports_torch(str(python), env=run_env)[1] and imports() == 3

    lib.unlink()  # the loaded libnccl replaced (a new inode, as an upgrade of the nvidia-nccl wheel makes it)
    shutil.copy(_json.__file__, lib)
    assert "checked" not in check_imports_torch(str(python), env=run_env)[1] and imports() == 4

    ok, broken = check_imports_torch(str(python), env={**run_env, "PYTHONPATH": str(tmp_path / "nothing")})  # another env
    assert ok and "checked" not in broken and imports() == 5

    monkeypatch.setattr(envs, "SEEN_FOR_S", 0.0)  # older than SEEN_FOR_S: probed again
    assert "checked" not in check_imports_torch(str(python), env=run_env)[1] and imports() == 6


def test_a_failed_import_check_is_never_reused(tmp_path: Path) -> None:
    python, _ = fake_torch_venv(tmp_path / "fake", init_extra="raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    for _ in range(2):
        ok, text = check_imports_torch(str(python), env={"PATH": os.environ["PATH"]})
        assert not ok and "libcudart.so.12" in text and "checked" not in text


def test_a_plain_python_runs_fingerprint_keeps_its_probe_for_the_next_launch(tmp_path: Path) -> None:
    """A plain python run is not import-checked by pre-flight; its fingerprint imports torch to see what loads, and
    the next launch of the same interpreter and environment reads that (its files unchanged) instead of importing
    torch again. The import check still probes for its own verdict, and a torch that fails to import is not kept."""
    log = tmp_path / "imports.log"
    python, lib = fake_torch_venv(tmp_path / "fake", init_extra=f"open({str(log)!r}, 'a').write('import' + chr(10))\n")
    run_env = {"PATH": os.environ["PATH"]}

    def imports() -> int:
        return log.read_text().count("import")

    first = fingerprint(str(python), env=run_env)
    assert first.nccl_runtime == "2.28.9" and first.libnccl == str(lib) and imports() == 1
    second = fingerprint(str(python), env=run_env)  # the next launch
    assert msgspec.structs.replace(second, taken=first.taken) == first and imports() == 1
    init = lib.parents[3] / "torch" / "__init__.py"
    init.write_text(init.read_text() + "# reinstalled\n")  # a file it rests on changed: probed again
    assert fingerprint(str(python), env=run_env).nccl_runtime == "2.28.9" and imports() == 2
    ok, text = check_imports_torch(str(python), env=run_env)  # no verdict was kept: the import check probes
    assert ok and "checked" not in text and imports() == 3

    broken, _ = fake_torch_venv(tmp_path / "broken", init_extra="raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    for _ in range(2):
        assert "import torch failed: ImportError: libcudart.so.12" in (fingerprint(str(broken), env=run_env).error or "")
        assert envs._recent(str(broken), run_env) is None
