"""Provides the rules for comparing two python environment fingerprints, and their labels.

Both sides apply them: the agent (pre-flight, rebuild's proof) and the console (the run diff, rollback's
check), so they live in the wire package. Stdlib + msgspec + the protocol only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Mapping, Sequence

import msgspec

from gpudeck.agents.wire.protocol import EnvFingerprint


class EnvChange(msgspec.Struct, frozen=True):
    """One difference between two fingerprints: ``key`` went from ``a`` to ``b`` (None: absent)."""

    key: str  # python_version | torch | torch_cuda | torch_git | driver | nccl | cudnn | transformers | python | prefix | package:<name>
    a: str | None
    b: str | None
    core: bool = False  # one of the fields that decide whether a known-good configuration still works


# The fields that change what a training run does, in the order diff reports them.
CORE_KEYS: tuple[str, ...] = (
    "python_version",
    "torch",
    "torch_cuda",
    "torch_git",
    "driver",
    "nccl",
    "nccl_runtime",
    "libnccl",
    "libnccl_sha256",
    "cudnn",
    "transformers",
)
# what `import torch` loaded: fingerprints older than the probe lack these, so they are compared only when both have them
LOADED_KEYS: frozenset[str] = frozenset({"nccl_runtime", "libnccl", "libnccl_sha256"})
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


def libnccl_where(fp: EnvFingerprint) -> str | None:
    """The loaded libnccl as compared: inside the environment as ``<env>/...`` (two venvs with one layout agree), else its path."""
    path = fp.libnccl
    if path and fp.prefix and path.startswith(fp.prefix.rstrip("/") + "/"):
        return "<env>/" + path[len(fp.prefix.rstrip("/")) + 1 :]
    return path


def field_value(fp: EnvFingerprint, key: str) -> str | None:
    """One fingerprint field as compared (the loaded libnccl relative to its environment)."""
    return libnccl_where(fp) if key == "libnccl" else getattr(fp, key)


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
        va, vb = field_value(a, key), field_value(b, key)
        if key in LOADED_KEYS and (va is None or vb is None):
            continue
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
    "nccl_runtime": "NCCL (torch reports)",
    "libnccl": "libnccl loaded",
    "libnccl_sha256": "libnccl sha256",
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


# ----------------------------------------------------------------------------- the cross-node gate

# What must agree on every node of a multi-node run, in the order the gate's table shows it; then one row per
# NCCL_* / TORCH_* variable the run gets. A row's name is what `--allow-env-diff NAME` takes.
GATE_KEYS: tuple[str, ...] = (
    "python_version",
    "torch",
    "torch_cuda",
    "nccl_runtime",
    "libnccl",
    "libnccl_sha256",
    "transformers",
    "driver",
    "gpu",
)
GATE_LABELS = {**LABELS, "gpu": "GPU model"}
GATE_ENV_PREFIXES = ("NCCL_", "TORCH_")
# names of each host's own hardware (eth1 on one host is eth2 on the next; a host config's nccl_socket_ifname sets it):
# they differ by design, so they are not compared
PER_HOST_ENV = frozenset({"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"})
NO_FINGERPRINT = "(no fingerprint)"
UNSET = "(unset)"
MAX_GATE_COLUMNS = 8  # nodes shown side by side; the JSON has them all
MAX_RECORDED_ROWS = 64  # rows of a launch past the gate kept in its record (LaunchSpec.env_diffs)
MAX_RECORDED_ROW_CHARS = 2000  # one recorded row, all its nodes' values (a longer one ends with "...")
_CELL = 48
_SECRET_LOOKING = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|PRIVATE", re.IGNORECASE)


def shown_env_value(name: str, value: str) -> str:
    """A variable's value as recorded and shown: a secret-looking name's value only as a digest (a difference still shows)."""
    if _SECRET_LOOKING.search(name) and value:
        return f"sha256:{hashlib.sha256(value.encode(errors='replace')).hexdigest()[:16]} (value hidden)"
    return value


def gate_names(values: Mapping[str, str | None]) -> list[str]:
    """Every name a node's gate values hold (what `--allow-env-diff` accepts): the gate keys, then ``NCCL_*`` / ``TORCH_*``."""
    return [*GATE_KEYS, *sorted(k for k in values if k not in GATE_KEYS)]


def is_gate_name(name: str) -> bool:
    """Whether ``name`` can be given to ``--allow-env-diff``: a gate key or an ``NCCL_*`` / ``TORCH_*`` variable's name."""
    return name in GATE_KEYS or (name.startswith(GATE_ENV_PREFIXES) and bool(re.fullmatch(r"[A-Z][A-Z0-9_]{0,127}", name)))


def gate_values(fp: EnvFingerprint | None, gpu: str | None, spec_env: Mapping[str, str]) -> dict[str, str | None]:
    """One node's values for the gate: its fingerprint's gated fields, its GPU model, and the ``NCCL_*`` / ``TORCH_*``
    variables the run gets there (the agent's environment as the probe saw it, the launch's on top)."""
    out: dict[str, str | None] = {k: (NO_FINGERPRINT if fp is None else field_value(fp, k)) for k in GATE_KEYS if k != "gpu"}
    out["gpu"] = gpu
    env = dict(fp.dist_env) if fp is not None else {}
    env.update({k: shown_env_value(k, v) for k, v in spec_env.items() if k.startswith(GATE_ENV_PREFIXES)})
    out.update(sorted((k, v) for k, v in env.items() if k not in PER_HOST_ENV))
    return out


class Majority(msgspec.Struct, frozen=True):
    """How the nodes' values of one row split: the majority's value (when more than half agree) and who differs."""

    found: bool
    value: str | None
    odd: list[int]  # node indices that differ from the majority ([] when there is none)
    split: list[int]  # the sizes of the groups of equal values, largest first (e.g. [2, 1], or [1, 1] for a tie)


def majority(values: Sequence[str | None]) -> Majority:
    """The value more than half the nodes hold, and the nodes that differ from it; none in a tie (1 vs 1, 2 vs 2, 1 vs 1 vs 1)."""
    groups: dict[str | None, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(v, []).append(i)
    split = sorted((len(g) for g in groups.values()), reverse=True)
    for v, members in groups.items():
        if 2 * len(members) > len(values):
            return Majority(True, v, [i for i in range(len(values)) if values[i] != v], split)
    return Majority(False, None, [], split)


class GateRow(msgspec.Struct, frozen=True):
    """One thing that differs between the nodes: its name (what --allow-env-diff takes), label, each node's value."""

    name: str
    label: str
    values: list[str | None]  # node order
    majority: Majority
    allowed: bool = False


class EnvGate(msgspec.Struct, frozen=True):
    """The cross-node comparison of a multi-node launch: only the rows that differ; refused unless each is allowed."""

    hosts: list[str]
    rows: list[GateRow]
    notes: list[str] = []  # a node whose fingerprint is missing or incomplete, and why

    @property
    def refused(self) -> bool:
        """Whether the launch must not start: a row differs that `--allow-env-diff` did not name."""
        return any(not r.allowed for r in self.rows)

    def odd_nodes(self) -> dict[str, list[str]]:
        """host -> the labels of the rows where it differs from the majority."""
        out: dict[str, list[str]] = {}
        for r in self.rows:
            for i in r.majority.odd:
                out.setdefault(self.hosts[i], []).append(r.name)
        return out

    def table(self) -> list[str]:
        """The rows that differ, node by node (at most MAX_GATE_COLUMNS nodes side by side, the odd ones first)."""
        if not self.rows:
            return []
        order = list(range(len(self.hosts)))
        if len(order) > MAX_GATE_COLUMNS:  # the odd nodes first, so that they are among those shown
            odd = set(self.odd_nodes())
            order = sorted(order, key=lambda i: (self.hosts[i] not in odd, i))[:MAX_GATE_COLUMNS]
        header = ["", *(_cell(self.hosts[i]) for i in order)]
        lines = [header]
        for r in self.rows:
            shown = _shown_row(r)
            lines.append([r.name + ("  (allowed)" if r.allowed else ""), *(shown[i] for i in order)])
        widths = [max(len(row[c]) for row in lines) for c in range(len(header))]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
        if len(order) < len(self.hosts):
            text.append(f"... and {len(self.hosts) - len(order)} more node(s) not shown (--json lists every node)")
        return text

    def verdict(self) -> list[str]:
        """Which node differs from the majority, row by row; where there is no majority, that it is a tie."""
        lines = []
        for host, names in self.odd_nodes().items():
            others = [h for h in self.hosts if h != host and h not in self.odd_nodes()]
            lines.append(
                f"{host} differs from the majority ({', '.join(others[:6])}{', ...' if len(others) > 6 else ''}) in: {', '.join(names)}"
            )
        ties = [r for r in self.rows if not r.majority.found]
        if ties:
            split = " vs ".join(str(n) for n in ties[0].majority.split)
            lines.append(
                f"no majority for {', '.join(r.name for r in ties)} ({split} of {len(self.hosts)} nodes): the gate cannot tell "
                "which node is odd; compare each node's environment with one a run worked in (`gpudeck diff RUN_A RUN_B`)"
            )
        return lines

    def fix(self) -> str:
        """How to launch anyway (recorded with the run)."""
        names = [r.name for r in self.rows if not r.allowed]
        return "to launch anyway (recorded with the run): " + " ".join(f"--allow-env-diff {n}" for n in names)

    def refusal(self, run_id: str = "") -> list[str]:
        """What a refused launch prints: the table, who differs from the majority, why a node is incomplete, the way past."""
        head = f"the nodes' environments differ: nothing was started on any host{f' (run {run_id})' if run_id else ''}"
        return [head, *("  " + ln for ln in self.table()), *self.verdict(), *self.notes[:16], self.fix()]

    def recorded(self) -> list[str]:
        """The rows as the run's record keeps them: ``transformers: nodea 5.25.0 | nodeb 4.57.1``."""
        rows = [
            f"{r.name}: " + " | ".join(f"{h} {v if v is not None else 'none'}"[:300] for h, v in zip(self.hosts, r.values))
            for r in self.rows
        ][:MAX_RECORDED_ROWS]
        return [row if len(row) <= MAX_RECORDED_ROW_CHARS else row[: MAX_RECORDED_ROW_CHARS - 3] + "..." for row in rows]


def _cell(value: str | None, width: int = _CELL) -> str:
    """A value as a table cell: printable, bounded (a long path keeps its tail)."""
    text = "".join(c if c.isprintable() else "?" for c in (value if value is not None else "none"))
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def _shown_row(r: GateRow) -> list[str]:
    """A row's cells; digests cut to the shortest prefix (12 or more) that still tells them apart."""
    if r.name != "libnccl_sha256":
        return [_cell(v if v is not None or not r.name.startswith(GATE_ENV_PREFIXES) else UNSET) for v in r.values]
    digests = {v for v in r.values if v}
    n = 12
    while n < 64 and len({d[:n] for d in digests}) < len(digests):
        n += 4
    return [_cell(v[:n] if v else None) for v in r.values]


def env_gate(
    hosts: Sequence[str], nodes: Sequence[Mapping[str, str | None]], allowed: Collection[str] = (), notes: Sequence[str] = ()
) -> EnvGate:
    """Compare the nodes' gate values (:func:`gate_values`, node order): the rows that differ, each with its majority."""
    names: list[str] = []
    for node in nodes:
        names += [n for n in gate_names(node) if n not in names]
    order = [*GATE_KEYS, *sorted(n for n in names if n not in GATE_KEYS)]
    rows = []
    for name in order:
        values = [node.get(name) for node in nodes]
        if len(set(values)) > 1:
            rows.append(GateRow(name, GATE_LABELS.get(name, name), values, majority(values), allowed=name in allowed))
    return EnvGate(list(hosts), rows, list(notes))
