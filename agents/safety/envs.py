"""Provides python environment fingerprints: take one, diff two, verify one still holds, rebuild one (failure 5).

A fingerprint is taken at every launch, so it must be fast: the interpreter
runs a stdlib-only probe (``python -I -c PROBE``) that reads the installed
distributions through ``importlib.metadata`` and torch's ``torch/version.py``
as text. torch itself is never imported here (that takes seconds and may
initialise CUDA); ``check_imports_torch`` is the separate, slow check that
pre-flight runs.

When torch is installed, a second probe imports it (``python -c LOADED``, the run's environment) and
reads what is actually loaded: the NCCL version torch reports, the path of the libnccl mapped into the
process (``/proc/self/maps``), and the ``NCCL_*`` / ``TORCH_*`` variables the run gets. Package metadata
can name another NCCL than the library that is mapped (marin-community/marin#7344), so the cross-node
gate compares what is loaded. The agent hashes the library itself (sha256, bounded, cached by inode).

``rebuild`` recreates a recorded environment from its freeze in a new virtual
environment (``uv`` when it is on PATH, else ``python -m venv`` + pip) and
proves the result matches the record before anyone launches in it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any
from urllib.parse import unquote, urlsplit

import msgspec

from gpudeck.agents.wire.envdiff import (
    CUDNN,
    EDITABLE,
    NCCL,
    REBUILD_IGNORES,
    EnvChange,
    describe,
    diff,
    normalize,
    parse_freeze_line,
    shown_env_value,
)
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import EnvFingerprint


class EnvError(AgentError):
    """A python environment cannot be fingerprinted, does not match its record, or cannot be rebuilt."""

    code = "env"


class PythonMissing(EnvError):
    """The interpreter named by a launch or a record does not exist on this host."""


_PROBE_MARK = "GPUDECK-ENV "
_TORCH_MARK = "GPUDECK-TORCH "
# torch wheels with these local labels live on download.pytorch.org, not PyPI
_TORCH_WHEELS = frozenset({"torch", "torchvision", "torchaudio"})
_TORCH_LABEL = re.compile(r"\+(cu\d+|cpu|rocm[\d.]+|xpu)$")

# Runs inside the probed interpreter: stdlib only, Python >= 3.8 syntax, never imports torch.
PROBE = r"""
import ast, json, os, platform, sys
from importlib import metadata, util

def headers(dist):
    # reading two header lines is much faster than parsing the whole METADATA (with its long description)
    name = version = None
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or dist.read_text("")
    for line in (text or "").splitlines():
        if not line:
            break
        if name is None and line.startswith("Name:"):
            name = line[5:].strip()
        elif version is None and line.startswith("Version:"):
            version = line[8:].strip()
    if not name or not version:
        name, version = dist.metadata["Name"], dist.version
    return name, version

def torch_version_file(dist):
    if dist is not None:
        path = str(dist.locate_file("torch/version.py"))
        if os.path.isfile(path):
            return path
        # dist.files parses RECORD (15k lines for torch): only when the usual place is empty
        for f in dist.files or ():
            if str(f).replace(os.sep, "/").endswith("torch/version.py") and os.path.isfile(str(dist.locate_file(f))):
                return str(dist.locate_file(f))
    spec = util.find_spec("torch")  # finds, does not import, a top-level package
    if spec is not None and spec.origin:
        path = os.path.join(os.path.dirname(spec.origin), "version.py")
        if os.path.isfile(path):
            return path
    return None

def torch_info(path):
    found = {}
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Name) and t.id in ("__version__", "cuda", "git_version") and isinstance(value, ast.Constant):
                v = value.value
                found[t.id] = None if v is None else str(v)
    return {"version": found.get("__version__"), "cuda": found.get("cuda"), "git": found.get("git_version")}

out = {"python_version": platform.python_version(), "prefix": sys.prefix, "dists": [], "torch": None, "errors": []}
torch_dist = None
for dist in metadata.distributions():
    try:
        name, version = headers(dist)
    except Exception as e:
        out["errors"].append("unreadable distribution at %s: %s" % (getattr(dist, "_path", "?"), e))
        continue
    if not name or version is None:
        continue
    try:
        direct = dist.read_text("direct_url.json")
    except Exception:
        direct = None
    out["dists"].append([name, str(version), direct])
    if torch_dist is None and name.lower() == "torch":
        torch_dist = dist
try:
    has_torch = torch_dist is not None or util.find_spec("torch") is not None
except Exception:
    has_torch = False
if has_torch:
    path = None
    try:
        path = torch_version_file(torch_dist)
        if path is None:
            out["errors"].append("torch is installed but torch/version.py was not found: its CUDA build is unknown")
        else:
            out["torch"] = torch_info(path)
    except Exception as e:
        out["errors"].append("cannot read %s: %s" % (path, e))
sys.stdout.write("GPUDECK-ENV " + json.dumps(out) + "\n")
"""


# Runs inside the probed interpreter (a child process: `python -c LOADED`, the run's environment) after the metadata
# probe, only where torch is installed: loads torch there (seconds) and reports what it mapped. The agent itself never
# loads torch or transformers (tests/unit/test_agent_light.py): the probe names torch by string, through importlib,
# so no import statement of torch stands in agents/. Stdlib + the probed torch; Python >= 3.8 syntax.
LOADED = r"""
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]  # the current directory must not shadow the installed torch
import importlib, json, os
out = {"imported": False, "cuda": None, "hip": None, "nccl": None, "libs": [], "env": {}, "errors": []}
try:
    torch = importlib.import_module("torch")
    out["imported"] = True
    out["file"] = getattr(torch, "__file__", None)
    out["cuda"] = getattr(torch.version, "cuda", None)
    out["hip"] = getattr(torch.version, "hip", None)
    if out["cuda"] is not None:
        try:
            v = torch.cuda.nccl.version()  # loads and asks the library: no CUDA context is made
            out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, (tuple, list)) else str(v)
        except Exception as e:
            out["errors"].append("torch.cuda.nccl.version() failed: %s: %s" % (type(e).__name__, e))
except Exception as e:
    out["errors"].append("import torch failed: %s: %s" % (type(e).__name__, e))
try:
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(None, 5)
            if len(parts) == 6:
                path = parts[5]
                name = os.path.basename(path.replace(" (deleted)", ""))
                if name.startswith("libnccl") and ".so" in name and path not in out["libs"]:
                    out["libs"].append(path)
except OSError as e:
    out["errors"].append("cannot read /proc/self/maps: %s" % e)
out["env"] = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_"))}
sys.stdout.write("GPUDECK-LOADED " + json.dumps(out) + "\n")
"""

_LOADED_MARK = "GPUDECK-LOADED "
# what the loaded probe may send: it runs arbitrary site code (sitecustomize, .pth files), so it is read as hostile
_Short = Annotated[str, msgspec.Meta(max_length=200)]
_Path = Annotated[str, msgspec.Meta(max_length=4096)]
_EnvName = Annotated[str, msgspec.Meta(max_length=128, pattern=r"^(NCCL|TORCH)_[A-Za-z0-9_]*$")]
_EnvValue = Annotated[str, msgspec.Meta(max_length=1024)]
MAX_LOADED_LINE = 256 * 1024
MAX_DIST_ENV = 64
# a libnccl is 100-400 MB; past this it is not hashed (the row says so) rather than read without end
LIBNCCL_MAX_BYTES = 2 * 2**30
_LIBNCCL_NAME = re.compile(r"libnccl[A-Za-z0-9_.+-]{0,64}\.so(\.[0-9]+){0,4}")
CPU_BUILD = "none (CPU build)"
ROCM_BUILD = "none (ROCm build: RCCL)"
LINKED_IN = "none (NCCL linked into torch)"  # a CUDA build that reports an NCCL version but maps no libnccl file
NOT_LOADED = "not loaded"


class _Loaded(msgspec.Struct):
    imported: bool = False
    file: _Path | None = None  # torch's __init__.py, which a kept probe rests on
    cuda: _Short | None = None
    hip: _Short | None = None
    nccl: _Short | None = None
    libs: Annotated[list[_Path], msgspec.Meta(max_length=16)] = []
    env: Annotated[dict[_EnvName, _EnvValue], msgspec.Meta(max_length=MAX_DIST_ENV)] = {}
    errors: Annotated[list[Annotated[str, msgspec.Meta(max_length=2000)]], msgspec.Meta(max_length=8)] = []


class _ProbeTorch(msgspec.Struct):
    version: str | None = None
    cuda: str | None = None
    git: str | None = None


class _Probe(msgspec.Struct):
    python_version: str
    prefix: str
    dists: list[tuple[str, str, str | None]]
    torch: _ProbeTorch | None = None
    errors: list[str] = []


class _DirectUrl(msgspec.Struct):
    """PEP 610 direct_url.json, the parts a requirement line needs."""

    url: str
    subdirectory: str | None = None
    vcs_info: dict[str, Any] | None = None
    archive_info: dict[str, Any] | None = None
    dir_info: dict[str, Any] | None = None


class _TorchCheck(msgspec.Struct):
    version: str
    cuda: str | None
    available: bool
    count: int
    file: str | None = None


# ----------------------------------------------------------------------------- fingerprint


def _interpreter(python: str) -> str:
    """The absolute path of ``python`` (a path, or a name on PATH); PythonMissing when there is none."""
    if os.sep not in python:
        found = shutil.which(python)
        if found is None:
            raise PythonMissing(
                f"python {python} is not on this host's PATH: name the interpreter by its full path "
                f"(e.g. /path/to/venv/bin/python) or install it"
            )
        return found
    path = os.path.abspath(python)
    if not os.path.exists(path):
        dangling = f" (a link to {os.readlink(path)}, which is gone)" if os.path.islink(path) else ""
        raise PythonMissing(
            f"python {path} does not exist on this host{dangling}: the environment was moved or deleted; "
            f"launch with a python that exists, or recreate a recorded environment with "
            f"`gpudeck rollback RUN --to GOOD_RUN --rebuild-env`"
        )
    if not os.access(path, os.X_OK) or os.path.isdir(path):
        raise EnvError(f"python {path} is not an executable file: point the launch at the environment's bin/python")
    return path


def _tail(text: str, lines: int = 12, chars: int = 2000) -> str:
    """The last lines of a process's output, for an error message."""
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return "\n".join(kept)[-chars:]


def _direct_line(name: str, raw: str) -> str | None:
    """The requirement line for a distribution installed from a direct URL (PEP 610), None if the record is unusable."""
    try:
        d = msgspec.json.decode(raw, type=_DirectUrl)
    except msgspec.DecodeError:
        return None
    url = d.url
    if d.vcs_info is not None:
        vcs = str(d.vcs_info.get("vcs", "git"))
        commit = d.vcs_info.get("commit_id")
        url = f"{vcs}+{url}" + (f"@{commit}" if commit else "")
    if d.subdirectory:
        url += f"#subdirectory={d.subdirectory}"
    editable = d.dir_info is not None and bool(d.dir_info.get("editable"))
    return f"{name} @ {url}" + (EDITABLE if editable else "")


def _pick(packages: Mapping[str, str], pattern: re.Pattern[str], cuda: str | None) -> str | None:
    """The version of the nvidia-* library matching torch's CUDA major when several are installed."""
    hits = sorted((m.group(1), v) for n, v in packages.items() if (m := pattern.fullmatch(n)))
    if not hits:
        return None
    major = cuda.split(".")[0] if cuda else None
    for suffix, version in hits:
        if suffix == major:
            return version
    return hits[0][1]


def freeze_hash(freeze: list[str]) -> str:
    """sha256 of the sorted freeze lines joined by newlines."""
    return hashlib.sha256("\n".join(sorted(freeze)).encode()).hexdigest()


def _from_probe(python: str, probe: _Probe, driver: str | None) -> EnvFingerprint:
    """The fingerprint from what the probe read: names normalized, first of duplicates kept, freeze sorted."""
    packages: dict[str, str] = {}
    freeze: list[str] = []
    for raw_name, version, direct in probe.dists:
        name = normalize(raw_name)
        if name in packages:  # a shadowed copy further down sys.path: import uses the first
            continue
        packages[name] = version
        line = _direct_line(name, direct) if direct else None
        freeze.append(line or f"{name}=={version}")
    freeze.sort()
    torch = probe.torch or _ProbeTorch()
    torch_cuda = torch.cuda
    return EnvFingerprint(
        python=python,
        python_version=probe.python_version,
        prefix=probe.prefix,
        torch=torch.version or packages.get("torch"),
        torch_cuda=torch_cuda,
        torch_git=torch.git,
        cudnn=_pick(packages, CUDNN, torch_cuda),
        nccl=_pick(packages, NCCL, torch_cuda),
        transformers=packages.get("transformers"),
        driver=driver,
        packages=dict(sorted(packages.items())),
        freeze=freeze,
        freeze_hash=freeze_hash(freeze),
        taken=time.time(),
        error="; ".join(probe.errors) or None,
    )


def fingerprint(
    python: str,
    *,
    driver: str | None = None,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    loaded: bool = True,
) -> EnvFingerprint:
    """The fingerprint of the environment of ``python``; ``driver`` comes from NVML.

    The packages are read without importing torch; with ``loaded`` (and torch installed) a second probe
    imports it under ``env`` (the run's environment; None: this process's) and records what is loaded.
    """
    exe = _interpreter(python)
    try:
        proc = subprocess.run(
            [exe, "-I", "-c", PROBE], capture_output=True, text=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise EnvError(
            f"python {exe} did not finish the environment probe in {timeout:.0f} s (a hung or very slow filesystem?): "
            f"{_tail(err) or 'no output'}; check that `{exe} -c pass` returns"
        ) from None
    except OSError as e:
        raise EnvError(f"python {exe} cannot be started: {e}; point the launch at a working interpreter") from None
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(_PROBE_MARK)), None)
    if proc.returncode != 0 or line is None:
        raise EnvError(
            f"python {exe} failed the environment probe (exit {proc.returncode}): {_tail(proc.stderr) or 'no output'}; "
            f"it needs Python >= 3.8 with importlib.metadata; check `{exe} -I -c 'import importlib.metadata'`"
        )
    try:
        probe = msgspec.json.decode(line[len(_PROBE_MARK) :], type=_Probe)
    except msgspec.DecodeError as e:
        raise EnvError(f"python {exe} sent an unreadable environment probe result ({e}); this is a gpudeck bug, please report it") from None
    fp = _from_probe(exe, probe, driver)
    if loaded and fp.torch is not None:
        fp = _with_loaded(fp, env, timeout)
    return fp


# ----------------------------------------------------------------------------- what import torch loads

# (st_dev, st_ino, st_size, st_mtime_ns) -> sha256: a 300 MB libnccl is hashed once per agent, not at every launch
_DIGESTS: dict[tuple[int, int, int, int], str] = {}
_DIGESTS_KEPT = 32


def libnccl_digest(path: str) -> tuple[str | None, str | None]:
    """(sha256 of the libnccl at ``path``, None) or (None, why not): the name must be libnccl*.so*, a regular file
    of at most LIBNCCL_MAX_BYTES, opened without following a link in its last component."""
    if path.endswith(" (deleted)"):
        return None, (
            f"the loaded libnccl {path[: -len(' (deleted)')]} was deleted or replaced on disk after it was loaded: "
            "what runs is not what is installed; reinstall, then fingerprint again"
        )
    if not os.path.isabs(path) or not _LIBNCCL_NAME.fullmatch(os.path.basename(path)):
        return None, f"the loaded library {path[:200]!r} is not an absolute path to a libnccl*.so file: not hashed"
    try:
        # O_NONBLOCK: a FIFO put in the library's place never blocks the agent
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return None, f"cannot open the loaded libnccl {path}: {e.strerror or e}"
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None, f"the loaded libnccl {path} is not a regular file: not hashed"
        if st.st_size > LIBNCCL_MAX_BYTES:
            return None, f"the loaded libnccl {path} is {st.st_size:,} bytes, over the {LIBNCCL_MAX_BYTES:,} hashed: not hashed"
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if (known := _DIGESTS.get(key)) is not None:
            return known, None
        h = hashlib.sha256()
        left = st.st_size
        while left > 0 and (chunk := fh.read(min(left, 1 << 20))):
            h.update(chunk)
            left -= len(chunk)
        if left:
            return None, f"the loaded libnccl {path} shrank while it was hashed: not hashed"
    digest = h.hexdigest()
    if len(_DIGESTS) >= _DIGESTS_KEPT:
        _DIGESTS.pop(next(iter(_DIGESTS)))
    _DIGESTS[key] = digest
    return digest, None


# What an `import torch` probe saw, kept SEEN_FOR_S (pre-flight's import check runs the loaded probe in the same
# process; a plain python run, which pre-flight does not check, runs it for its fingerprint): the launch's fingerprint
# a moment later, and the next launches with the same interpreter and environment, read it instead of importing torch
# again (1.2-1.6 s each on a 2-core machine), as long as none of the files it rests on changed: the interpreter,
# torch's __init__.py, the folder torch is installed in (a pip install or uninstall there adds or removes an entry:
# its mtime moves) and the libraries the import loaded. Only the import check's own probe gives its verdict.
# (interpreter, environment digest) -> _Seen
SEEN_FOR_S = 60.0


@dataclass(frozen=True)
class _Seen:
    at: float  # monotonic
    files: tuple[tuple[str, int, int, int, int], ...]  # (path, st_dev, st_ino, st_size, st_mtime_ns) of each
    loaded: _Loaded
    verdict: tuple[bool, str] | None  # check_imports_torch's answer, when it was the one that probed


_SEEN: dict[tuple[str, str], _Seen] = {}
MAX_SEEN_PATH = 4096
NVIDIA_VERSION_FILE = "/proc/driver/nvidia/version"


def _files_sig(paths: list[str]) -> tuple[tuple[str, int, int, int, int], ...] | None:
    """The identity of each file (None when one cannot be read: nothing is kept, or a kept result is not used)."""
    out = []
    for path in paths:
        if not path or len(path) > MAX_SEEN_PATH or not os.path.isabs(path) or path.endswith(" (deleted)"):
            return None
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        out.append((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _keep_seen(exe: str, env: Mapping[str, str] | None, torch_file: str | None, loaded: _Loaded, verdict: tuple[bool, str] | None) -> None:
    if not torch_file or len(torch_file) > MAX_SEEN_PATH:
        return
    # the NVIDIA driver's version file too, where there is one: a driver reloaded meanwhile is a new file there
    driver = [NVIDIA_VERSION_FILE] if os.path.exists(NVIDIA_VERSION_FILE) else []
    files = _files_sig([exe, torch_file, os.path.dirname(os.path.dirname(torch_file)), *loaded.libs, *driver])
    if files is None:
        return
    if len(_SEEN) >= _DIGESTS_KEPT:
        _SEEN.pop(next(iter(_SEEN)))
    _SEEN[_env_key(exe, env)] = _Seen(time.monotonic(), files, loaded, verdict)


def _recent(exe: str, env: Mapping[str, str] | None) -> _Seen | None:
    """What a probe of ``exe`` under ``env`` saw within SEEN_FOR_S, if none of the files it rests on changed since."""
    seen = _SEEN.get(_env_key(exe, env))
    if seen is None or time.monotonic() - seen.at >= SEEN_FOR_S:
        return None
    if _files_sig([f[0] for f in seen.files]) != seen.files:
        return None
    return seen


def _env_key(exe: str, env: Mapping[str, str] | None) -> tuple[str, str]:
    text = "\0".join(f"{k}={v}" for k, v in sorted((env if env is not None else os.environ).items()))
    return exe, hashlib.sha256(text.encode(errors="replace")).hexdigest()


def _read_loaded(stdout: str) -> _Loaded | str:
    """The loaded probe's result from a process's output, or why it cannot be read (its line is hostile input)."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(_LOADED_MARK)), None)
    if line is None:
        return "the import-torch probe sent no result"
    if len(line) > MAX_LOADED_LINE:
        return f"the import-torch probe sent {len(line):,} characters, over the {MAX_LOADED_LINE:,} read: ignored"
    try:
        return msgspec.json.decode(line[len(_LOADED_MARK) :], type=_Loaded)
    except msgspec.DecodeError as e:
        return f"the import-torch probe sent an unreadable result ({str(e)[:200]}): ignored"


def _run_probe(exe: str, code: str, env: Mapping[str, str] | None, timeout: float) -> subprocess.CompletedProcess[str]:
    """``exe -c code`` (not isolated: the run's PYTHONPATH counts) under ``env`` (None: this process's), output captured."""
    return subprocess.run(
        [exe, "-c", code],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=dict(env) if env is not None else None,
    )


def _with_loaded(fp: EnvFingerprint, env: Mapping[str, str] | None, timeout: float) -> EnvFingerprint:
    """``fp`` with what `import torch` loads in its interpreter; a probe that fails leaves those fields None and says why."""
    problems = [fp.error] if fp.error else []

    def failed(why: str) -> EnvFingerprint:
        return msgspec.structs.replace(fp, error="; ".join([*problems, why]))

    seen = _recent(fp.python, env)
    if seen is not None:
        got: _Loaded | str = seen.loaded
    else:
        try:
            proc = _run_probe(fp.python, LOADED, env, timeout)
        except subprocess.TimeoutExpired:
            return failed(f"import torch in {fp.python} took more than {timeout:.0f} s: the loaded NCCL is unknown")
        except OSError as e:
            return failed(f"python {fp.python} cannot be started to import torch: {e}")
        if proc.returncode != 0:
            return failed(
                f"the import-torch probe failed (exit {proc.returncode}): {_tail(proc.stderr, lines=2, chars=500) or 'no output'}"
            )
        got = _read_loaded(proc.stdout)
        if not isinstance(got, str) and got.imported:
            _keep_seen(fp.python, env, got.file, got, None)  # the next launch of this python reads it (a plain python run too)
    if isinstance(got, str):
        return failed(got)
    problems += got.errors
    digest: str | None = None
    if got.libs:
        main = next((p for p in got.libs if os.path.basename(p).startswith("libnccl.so")), got.libs[0])
        digest, why = libnccl_digest(main)
        if why:
            problems.append(why)
        libnccl = main.removesuffix(" (deleted)")
    elif got.imported and got.hip is not None:
        libnccl = ROCM_BUILD
    elif got.imported and got.cuda is None:
        libnccl = CPU_BUILD
    elif got.imported:
        libnccl = LINKED_IN if got.nccl is not None else NOT_LOADED
    else:
        libnccl = None  # torch did not import: which build it is, is not known
    return msgspec.structs.replace(
        fp,
        nccl_runtime=got.nccl,
        libnccl=libnccl,
        libnccl_sha256=digest,
        dist_env={k: shown_env_value(k, v) for k, v in sorted(got.env.items())},
        error="; ".join(problems) or None,
    )


# ----------------------------------------------------------------------------- import torch


_TORCH_CHECK = f"""
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]  # the current directory must not shadow the installed torch
import json, torch
ok = torch.cuda.is_available()
sys.stdout.write({_TORCH_MARK!r} + json.dumps({{"version": torch.__version__, "cuda": torch.version.cuda,
    "available": ok, "count": torch.cuda.device_count() if ok else 0, "file": getattr(torch, "__file__", None)}}) + "\\n")
"""


def check_imports_torch(python: str, timeout: float = 120.0, *, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether ``import torch`` works in ``python`` (with the run's ``env``): (ok, what was found or what to do)."""
    try:
        exe = _interpreter(python)
    except EnvError as e:
        return False, e.message
    seen = _recent(exe, env)
    if seen is not None and seen.verdict is not None:
        ok, said = seen.verdict
        return ok, f"{said}; checked {time.monotonic() - seen.at:.0f} s ago, its files unchanged since"
    t0 = time.monotonic()
    try:
        proc = _run_probe(exe, _TORCH_CHECK + LOADED, env, timeout)
    except subprocess.TimeoutExpired:
        return False, (
            f"import torch in {exe} took more than {timeout:.0f} s (a slow network filesystem, or CUDA initialisation hanging "
            f"on a broken driver): time `{exe} -c 'import torch'` on this host"
        )
    except OSError as e:
        return False, f"python {exe} cannot be started: {e}; point the launch at a working interpreter"
    took = time.monotonic() - t0
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(_TORCH_MARK)), None)
    if proc.returncode != 0 or line is None:
        last = _tail(proc.stderr, lines=1) or f"exit code {proc.returncode}, no output"
        if "No module named 'torch'" in last:
            fix = f"install torch into that environment (`{exe} -m pip install torch`) or launch with the python of an environment that has it"
        else:
            fix = (
                f"torch is broken in that environment: reinstall it (`{exe} -m pip install --force-reinstall --no-deps torch==VERSION`) "
                f"or roll back to a run whose environment worked (`gpudeck rollback RUN --to GOOD_RUN`)"
            )
        return False, f"import torch failed in {exe}: {last}; {fix}"
    info = msgspec.json.decode(line[len(_TORCH_MARK) :], type=_TorchCheck)
    if info.cuda is None:
        cuda = "CPU build, CUDA not available"
    elif info.available:
        cuda = f"CUDA {info.cuda} build, CUDA available with {info.count} GPU(s)"
    else:
        cuda = f"CUDA {info.cuda} build, but CUDA is not available (no driver, or no GPU visible to it)"
    verdict = (True, f"torch {info.version} imports in {took:.1f} s ({cuda})")
    if not isinstance(loaded := _read_loaded(proc.stdout), str):
        _keep_seen(exe, env, info.file, loaded, verdict)
    return verdict


def verify(recorded: EnvFingerprint, *, driver: str | None = None, timeout: float = 60.0) -> list[EnvChange]:
    """What changed in ``recorded.python``'s environment since it was recorded; [] when it still matches.

    ``driver`` is this host's NVML driver version now (None without a GPU); it is compared like the rest.
    """
    try:
        now = fingerprint(recorded.python, driver=driver, timeout=timeout)
    except PythonMissing:
        return [EnvChange("python", recorded.python, None, core=True)]
    return diff(recorded, now)


# ----------------------------------------------------------------------------- rebuild


def _unreproducible(freeze: list[str]) -> list[str]:
    """The freeze lines an installer cannot reproduce from the record alone: editables and local directories or missing files."""
    bad: list[str] = []
    for line in freeze:
        name, url, editable = parse_freeze_line(line)
        if editable:
            bad.append(f"{line.split(' #', 1)[0].strip()} (editable)")
        elif url is not None and url.startswith("file:"):
            path = unquote(urlsplit(url.split("#", 1)[0]).path)
            if os.path.isdir(path):
                bad.append(f"{line} (a local directory: its contents may have changed since)")
            elif not os.path.isfile(path):
                bad.append(f"{line} (the file is gone)")
    return bad


def _python_version(exe: str, timeout: float) -> str | None:
    """The full version of an interpreter (``3.11.7``), None when it does not run."""
    argv = [exe, "-I", "-c", "import platform; print(platform.python_version())"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def _base_python(recorded: EnvFingerprint, patch_may_differ: bool) -> tuple[str, str]:
    """An interpreter to create the new venv with: (path, version), the record's exact version preferred."""
    want = recorded.python_version
    if not want:
        raise EnvError(
            "the recorded environment has no python version (its fingerprint failed): it cannot be rebuilt; pick another good run"
        )
    minor = ".".join(want.split(".")[:2])
    cands: list[str] = []
    if os.path.exists(recorded.python):
        cands.append(recorded.python)
    for name in (f"python{minor}", "python3"):
        if (found := shutil.which(name)) and found not in cands:
            cands.append(found)
    seen: list[tuple[str, str]] = [(c, v) for c in cands if (v := _python_version(c, 30.0))]
    for c, v in seen:
        if v == want:
            return c, v
    if patch_may_differ:
        for c, v in seen:
            if ".".join(v.split(".")[:2]) == minor:
                return c, v
    found_txt = ", ".join(f"{c} is {v}" for c, v in seen) or "none found"
    gone = "" if os.path.exists(recorded.python) else f"the recorded {recorded.python} is gone; "
    raise EnvError(
        f"no Python {want} on this host to rebuild the environment with ({gone}looked at python{minor} and python3 on PATH: {found_txt}): "
        f"install Python {want} (e.g. `uv python install {want}` or `pyenv install {want}`) and put it on PATH"
        + ("" if patch_may_differ else f", or allow another {minor}.x release (the rebuilt environment then differs in python_version)")
    )


def _installer_env(dest: Path) -> dict[str, str]:
    """The environment installers run with: nothing from outside the new venv may count as installed."""
    env = dict(os.environ)
    for k in ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "PIP_USER", "PIP_TARGET", "PIP_PREFIX", "CONDA_PREFIX"):
        env.pop(k, None)
    env.update(VIRTUAL_ENV=str(dest), PYTHONNOUSERSITE="1", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _run_logged(argv: list[str], fh: IO[bytes], log: Path, deadline: float, env: Mapping[str, str], what: str) -> None:
    """Run one installer step with its output appended to ``fh``; EnvError with the log's tail when it fails."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise EnvError(f"rebuilding the environment ran out of time before {what}; raise the timeout (log: {log})")
    fh.write(f"$ {shlex.join(argv)}\n".encode())
    fh.flush()
    # own session: a timeout must also stop the build backends pip started
    proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env), start_new_session=True)
    try:
        rc = proc.wait(timeout=remaining)
    except BaseException as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise EnvError(f"{what} did not finish within the rebuild timeout and was killed; raise the timeout (log: {log})") from None
        raise
    fh.write(f"[exit {rc}]\n".encode())
    fh.flush()
    if rc != 0:
        fh.seek(0)
        tail = _tail(fh.read().decode(errors="replace"))
        raise EnvError(
            f"{what} failed (exit {rc}):\n{tail}\nfull log: {log}; the half-built environment is left for inspection, remove it before retrying"
        )


def _torch_indexes(lines: list[str]) -> list[str]:
    """download.pytorch.org indexes for torch wheels pinned with a local build label (+cu128, +cpu, ...)."""
    urls: list[str] = []
    for line in lines:
        name, _, version = line.partition("==")
        if version and normalize(name) in _TORCH_WHEELS and (m := _TORCH_LABEL.search(version)):
            url = f"https://download.pytorch.org/whl/{m.group(1)}"
            if url not in urls:
                urls.append(url)
    return urls


def rebuild(
    recorded: EnvFingerprint,
    dest: Path,
    *,
    timeout: float = 1800.0,
    log: Path | None = None,
    driver: str | None = None,
    python_patch_may_differ: bool = False,
) -> EnvFingerprint:
    """Recreate ``recorded`` in a new venv at ``dest`` from its freeze, prove it matches, return its fingerprint.

    Refuses up front (nothing created) when the freeze holds editable or local-directory installs, when
    ``dest`` is not empty, or when no interpreter of the recorded version exists (another patch release of
    the same major.minor only with ``python_patch_may_differ``, and then python_version is not compared).
    The installers' output goes to ``log`` (default ``dest/rebuild.log``).
    """
    deadline = time.monotonic() + timeout
    dest = Path(dest).absolute()
    if not recorded.freeze:
        raise EnvError("the recorded environment has no package list (its fingerprint failed): it cannot be rebuilt; pick another good run")
    if bad := _unreproducible(recorded.freeze):
        raise EnvError(
            "the recorded environment cannot be rebuilt from its record, these were not installed from an index: "
            + "; ".join(bad)
            + ". Reinstall them by hand from their source into an environment and record a new good run, "
            "or roll back to another good run whose environment still matches its record"
        )
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise EnvError(f"{dest} already exists and is not empty: remove it or rebuild into a new folder")
    base, _ = _base_python(recorded, python_patch_may_differ)
    log = Path(log) if log is not None else dest / "rebuild.log"
    env = _installer_env(dest)
    uv = shutil.which("uv")
    lines = [ln.split(" #", 1)[0].strip() for ln in recorded.freeze]
    indexes = _torch_indexes(lines)
    py = str(dest / "bin" / "python")
    req = dest / "rebuild-requirements.txt"

    # the venv step runs before the log exists: the default log lives inside dest, which uv wants to create
    with tempfile.TemporaryFile() as first:
        create = [uv, "venv", "--python", base, str(dest)] if uv else [base, "-m", "venv", str(dest)]
        try:
            _run_logged(create, first, log, deadline, env, f"creating the virtual environment at {dest}")
        finally:
            first.seek(0)
            early = first.read()
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_bytes(early)
    req.write_text("\n".join(lines) + "\n")
    with open(log, "a+b") as fh:
        if uv:
            install = [uv, "pip", "install", "--python", py, "--no-deps", "-r", str(req)]
            for url in indexes:
                install += ["--extra-index-url", url]
            if indexes:  # pins are exact, so the best match over all indexes is the pinned file
                install += ["--index-strategy", "unsafe-best-match"]
        else:
            # pip/setuptools/wheel lines are ordinary pins here: pip replaces the venv's bundled copies with the recorded ones
            install = [py, "-m", "pip", "install", "--no-deps", "-r", str(req)]
            for url in indexes:
                install += ["--extra-index-url", url]
        _run_logged(install, fh, log, deadline, env, "installing the recorded packages")
        # what the venv brought along that the record does not have (pip, setuptools) goes, pip itself last
        now = fingerprint(py, timeout=max(1.0, deadline - time.monotonic()))
        extras = sorted(set(now.packages) - set(recorded.packages))
        for group in ([e for e in extras if e != "pip"], [e for e in extras if e == "pip"]):
            if group:
                argv = [uv, "pip", "uninstall", "--python", py, *group] if uv else [py, "-m", "pip", "uninstall", "-y", *group]
                _run_logged(argv, fh, log, deadline, env, f"removing {', '.join(group)} (not in the record)")
    now = fingerprint(py, driver=driver, timeout=max(1.0, deadline - time.monotonic()))
    ignore = set(REBUILD_IGNORES) | ({"python_version"} if python_patch_may_differ else set())
    changes = diff(recorded, now, ignore=ignore)
    if changes:
        raise EnvError(
            f"the rebuilt environment at {dest} does not match the record: "
            + "; ".join(describe(changes))
            + f". Nothing was launched in it; the installer log is {log}"
        )
    return now
