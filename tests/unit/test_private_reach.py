"""No module of agents/ reaches into another object's private members: ``x._name`` only where x is self or cls.

Allowed besides: dunder names; a class defined at module level in the same module (the module owns it: the
daemon's handler table names its connection's methods); and the documented standard-library names listed in
ALLOWED with the reason each is public despite its underscore.
"""

from __future__ import annotations

import ast
from pathlib import Path

AGENTS = Path(__file__).resolve().parents[2] / "agents"

# (object name, attribute): why it is allowed
ALLOWED = {
    ("os", "_exit"): "documented public API of the os module (exit without cleanup, after fork)",
}


def _module_classes(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


def private_reaches(path: Path, root: Path) -> list[str]:
    """Every ``x._name`` in one file that is not allowed, as 'file:line: text'."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    own_classes = _module_classes(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        base = node.value
        if isinstance(base, ast.Name):
            if base.id in ("self", "cls") or base.id in own_classes or (base.id, name) in ALLOWED:
                continue
        rel = path.relative_to(root.parent)
        found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def all_reaches(root: Path = AGENTS) -> list[str]:
    """Every disallowed private reach under ``root`` (agents/)."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        out += private_reaches(path, root)
    return out


def test_no_module_of_agents_reaches_into_another_objects_private_members() -> None:
    found = all_reaches()
    assert not found, f"{len(found)} private reach(es) in agents/ (give the owner a public method instead):\n" + "\n".join(found)


def test_the_check_finds_a_reach(tmp_path: Path) -> None:
    """The walker is not blind: a reach into another object's private member is reported with its line."""
    fake = tmp_path / "agents"
    fake.mkdir()
    (fake / "m.py").write_text(
        "import os\n"
        "class _Own:\n"
        "    def _h(self):\n"
        "        return self._x\n"
        "TABLE = {1: _Own._h}\n"
        "def f(sup):\n"
        "    os._exit(0)\n"
        "    return sup._live, sup.__dict__\n"
    )
    assert all_reaches(fake) == ["agents/m.py:8: sup._live"]
