"""Provides the rules for comparing two python environment fingerprints, and their labels.

Both sides apply them: the agent (pre-flight, rebuild's proof) and the console (the run diff, rollback's
check), so they live in the wire package. Stdlib + msgspec + the protocol only.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

import msgspec

from gpudeck.agents.wire.protocol import EnvFingerprint


class EnvChange(msgspec.Struct, frozen=True):
    """One difference between two fingerprints: ``key`` went from ``a`` to ``b`` (None: absent)."""

    key: str  # python_version | torch | torch_cuda | torch_git | driver | nccl | cudnn | transformers | python | prefix | package:<name>
    a: str | None
    b: str | None
    core: bool = False  # one of the fields that decide whether a known-good configuration still works


# The fields that change what a training run does, in the order diff reports them.
CORE_KEYS: tuple[str, ...] = ("python_version", "torch", "torch_cuda", "torch_git", "driver", "nccl", "cudnn", "transformers")
PATH_KEYS: tuple[str, ...] = ("python", "prefix")
# rebuild compares everything except where the environment lives and the host's driver
REBUILD_IGNORES: frozenset[str] = frozenset({"python", "prefix", "driver"})

EDITABLE = "  # editable"
NCCL = re.compile(r"nvidia-nccl(?:-cu(\d+))?")
CUDNN = re.compile(r"nvidia-cudnn(?:-cu(\d+))?")


def normalize(name: str) -> str:
    """A distribution name normalized per PEP 503 (``Foo_Bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_freeze_line(line: str) -> tuple[str | None, str | None, bool]:
    """(name, direct URL or None, editable) of one freeze line."""
    text = line.strip()
    editable = text.endswith(EDITABLE.strip()) or text.startswith("-e ")
    text = text.split(" #", 1)[0].strip()
    if text.startswith("-e "):
        return None, text[3:].strip(), True
    if " @ " in text:
        name, url = text.split(" @ ", 1)
        return normalize(name.strip()), url.strip(), editable
    name = re.split(r"[=<>!~;\[ ]", text, maxsplit=1)[0]
    return (normalize(name) if name else None), None, editable


def _package_views(fp: EnvFingerprint) -> dict[str, str]:
    """name -> version, with where it came from for direct-URL installs (so a PyPI 1.0 and a git 1.0 differ)."""
    views = dict(fp.packages)
    for line in fp.freeze:
        name, url, editable = parse_freeze_line(line)
        if name is not None and url is not None:
            views[name] = f"{views.get(name, '?')} @ {url}" + (" (editable)" if editable else "")
    return views


def _covered(name: str, a: Mapping[str, str], b: Mapping[str, str]) -> bool:
    """Whether a package's change is already reported by a core key (torch, transformers, NCCL, cuDNN)."""
    if name in ("torch", "transformers"):
        return True
    # same library name on both sides: the nccl/cudnn key says it; a cu12 -> cu13 swap still shows as -/+
    return bool(NCCL.fullmatch(name) or CUDNN.fullmatch(name)) and name in a and name in b


def diff(a: EnvFingerprint, b: EnvFingerprint, *, ignore: Collection[str] = ()) -> list[EnvChange]:
    """What changed from ``a`` to ``b``: core keys first, then interpreter paths, then packages by name; [] when identical.

    ``ignore`` names keys to leave out (e.g. ``REBUILD_IGNORES`` to compare two copies of one environment).
    """
    changes: list[EnvChange] = []
    for key in CORE_KEYS:
        if key in ignore:
            continue
        if key == "torch_git" and a.torch != b.torch:
            continue  # a different torch version says more; the git hash matters for two builds of one version
        va, vb = getattr(a, key), getattr(b, key)
        if va != vb:
            changes.append(EnvChange(key, va, vb, core=True))
    for key in PATH_KEYS:
        if key not in ignore and getattr(a, key) != getattr(b, key):
            changes.append(EnvChange(key, getattr(a, key), getattr(b, key)))
    if a.freeze_hash and a.freeze_hash == b.freeze_hash and a.packages == b.packages:
        return changes
    pa, pb = _package_views(a), _package_views(b)
    for name in sorted(pa.keys() | pb.keys()):
        key = f"package:{name}"
        if key in ignore or _covered(name, pa, pb):
            continue
        if pa.get(name) != pb.get(name):
            changes.append(EnvChange(key, pa.get(name), pb.get(name)))
    return changes


LABELS = {
    "python_version": "python",
    "torch": "torch",
    "torch_cuda": "torch CUDA build",
    "torch_git": "torch git",
    "driver": "driver",
    "nccl": "NCCL",
    "cudnn": "cuDNN",
    "transformers": "transformers",
    "python": "interpreter",
    "prefix": "environment",
}


def describe(changes: list[EnvChange]) -> list[str]:
    """One human line per change, e.g. ``torch 2.6.0+cu124 -> 2.7.0+cu128``, ``+ package foo 1.0``."""
    lines: list[str] = []
    for c in changes:
        if c.key.startswith("package:"):
            name = c.key[len("package:") :]
            if c.a is None:
                lines.append(f"+ package {name} {c.b}")
            elif c.b is None:
                lines.append(f"- package {name} {c.a}")
            else:
                lines.append(f"package {name} {c.a} -> {c.b}")
        elif c.key == "python" and c.b is None:
            lines.append(f"interpreter {c.a} no longer exists")
        else:
            label = LABELS.get(c.key, c.key)
            none = "none (CPU build)" if c.key == "torch_cuda" else "none"
            lines.append(f"{label} {c.a if c.a is not None else none} -> {c.b if c.b is not None else none}")
    return lines
