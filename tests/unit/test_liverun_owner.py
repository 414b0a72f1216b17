"""A LiveRun is the one writer of its own fields: no module of agents/ but agents/runs/liverun.py assigns one.

Every other module calls the LiveRun's methods that say what happened (``lr.mark_seen_alive(now)``, not
``lr.last_seen_alive = now``). The walk flags ``x.field = ...``, ``x.field += ...`` and ``x.field: T = ...`` (also inside
tuple targets) where ``field`` is a LiveRun field name. ``self.field`` is an object's own business and is not flagged.

A LiveRun field name that is also a field of a wire record (ContainmentInfo.group, say) is ambiguous by name alone;
for those names only an assignment on a name that holds a LiveRun by the code's convention (LIVE_NAMES) is flagged.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import msgspec

from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.wire import protocol

AGENTS = Path(__file__).resolve().parents[2] / "agents"
OWNER = Path("runs") / "liverun.py"

LIVERUN_FIELDS = frozenset(f.name for f in dataclasses.fields(LiveRun))
# fields of the wire records (RunInfo, ContainmentInfo, ...): a name shared with a LiveRun field is ambiguous by itself
WIRE_FIELDS = frozenset(
    name
    for obj in vars(protocol).values()
    if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj is not msgspec.Struct
    for name in obj.__struct_fields__
)
AMBIGUOUS = LIVERUN_FIELDS & WIRE_FIELDS
LIVE_NAMES = frozenset({"lr", "live", "live_run", "liverun"})  # what agents/ calls a LiveRun


def _stores(node: ast.AST) -> list[ast.Attribute]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    return [t for tgt in targets for t in ast.walk(tgt) if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)]


def outside_assignments(path: Path, root: Path) -> list[str]:
    """Every assignment to a LiveRun field in one file, as 'file:line: text'."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        for attr in _stores(node):
            if attr.attr not in LIVERUN_FIELDS:
                continue
            base = attr.value.id if isinstance(attr.value, ast.Name) else None
            if base in ("self", "cls"):
                continue
            if attr.attr in AMBIGUOUS and base not in LIVE_NAMES:
                continue
            found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def all_outside_assignments(root: Path = AGENTS) -> list[str]:
    """Every assignment to a LiveRun field under ``root`` (agents/) outside agents/runs/liverun.py."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root) != OWNER:
            out += outside_assignments(path, root)
    return out


def test_only_liverun_assigns_a_liveruns_fields() -> None:
    found = all_outside_assignments()
    assert not found, (
        f"{len(found)} assignment(s) to a LiveRun's fields outside agents/runs/liverun.py (call a LiveRun method):\n" + "\n".join(found)
    )


def test_the_name_sets_are_what_the_check_assumes() -> None:
    """The LiveRun fields are read from the class (a new field is covered); the only collision with the wire records is group."""
    assert {"info", "shim", "last_seen_alive", "triage_task"} <= LIVERUN_FIELDS
    assert "members" in WIRE_FIELDS  # the wire records were found
    assert AMBIGUOUS == {"group"}, (
        f"a LiveRun field shares a name with a wire record's field: {sorted(AMBIGUOUS)}; decide how it is told apart"
    )


def test_the_check_finds_an_assignment(tmp_path: Path) -> None:
    """The walker is not blind: plain, augmented, annotated and tuple assignments are reported; the owner, self and
    an ambiguous name on a wire record are not."""
    fake = tmp_path / "agents"
    (fake / "runs").mkdir(parents=True)
    (fake / "runs" / "liverun.py").write_text("def f(lr):\n    lr.shim = None\n")
    (fake / "m.py").write_text(
        "class C:\n"
        "    def __init__(self):\n"
        "        self.health = None\n"
        "def f(lr, run, x):\n"
        "    lr.last_seen_alive = 1.0\n"
        "    x.rejections_journaled += 1\n"
        "    lr.held_step: tuple | None = None\n"
        "    a, lr.first_death = 1, None\n"
        "    run.containment.group = 'g'\n"
        "    lr.group = None\n"
        "    lr.reported_pids.add(1)\n"
        "    run.state = 'ended'\n"
    )
    assert all_outside_assignments(fake) == [
        "agents/m.py:5: lr.last_seen_alive = 1.0",
        "agents/m.py:6: x.rejections_journaled += 1",
        "agents/m.py:7: lr.held_step: tuple | None = None",
        "agents/m.py:8: a, lr.first_death = (1, None)",
        "agents/m.py:10: lr.group = None",
    ]
