"""No module of the console reaches into a library's private names outside a compat module (console/tui/compat/,
console/fleet/compat.py; console/tui/compat/README.md lists every reach there).

An AST walk over console/: a reach is an import of a library module with a private part (``textual._ansi_theme``) or of
a private name from one; ``obj._x`` on anything but ``self``/``cls``, a class or module of our own; ``self._x`` /
``cls._x`` / ``super()._x`` where ``_x`` is not our own code's (so it comes from a library base class); a method or
class attribute ``_x`` that overrides a library base class's; ``getattr``/``setattr``/``hasattr`` with a private name.
Dunder names (``__init__``) are not private. ``python tests/unit/test_private_reaches.py [ROOT]`` prints each reach.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ("console/tui/compat/", "console/fleet/compat.py")
OURS = "gpudeck"


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


@dataclass
class ClassInfo:
    """What our own code defines on one class: its members (methods, class attributes, ``self._x = ...``) and bases."""

    module: str
    bases: list[str]  # fully qualified where the import says so
    names: set[str] = field(default_factory=set)


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([OURS, *parts])


def imports_of(tree: ast.Module, module: str) -> dict[str, str]:
    """Local name -> the fully qualified name it was imported as."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + [node.module])
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def collect(root: Path) -> tuple[dict[Path, ast.Module], dict[str, ClassInfo], dict[Path, dict[str, str]]]:
    trees, classes, imports = {}, {}, {}
    for path in sorted((root / "console").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        mod = module_name(path, root)
        trees[path], imports[path] = tree, imports_of(tree, mod)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = []
                for b in node.bases:
                    d = dotted(b.value if isinstance(b, ast.Subscript) else b)
                    if d is None:
                        continue
                    head, _, rest = d.partition(".")
                    full = imports[path].get(head, f"{mod}.{head}")
                    bases.append(f"{full}.{rest}" if rest else full)
                info = classes[f"{mod}.{node.name}"] = ClassInfo(mod, bases)
                for sub in ast.walk(node):
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                        info.names.add(sub.name)
                    elif isinstance(sub, ast.Assign | ast.AnnAssign):
                        for t in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                            if isinstance(t, ast.Name):
                                info.names.add(t.id)
                            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                                info.names.add(t.attr)
    return trees, classes, imports


def library_class(name: str) -> type | None:
    mod, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), attr)
    except Exception:
        return None


def lineage(cls: str, classes: dict[str, ClassInfo]) -> tuple[set[str], list[type]]:
    """The names our code defines on ``cls`` and its bases of our own, and its library base classes."""
    ours: set[str] = set()
    libs: list[type] = []
    todo, seen = [cls], set()
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        info = classes.get(c)
        if info is not None:
            ours |= info.names
            todo.extend(info.bases)
        elif not c.startswith(OURS + "."):
            lib = library_class(c)
            if isinstance(lib, type) and lib is not object:
                libs.append(lib)
    return ours, libs


def defined_by(libs: list[type], name: str) -> bool:
    return any(name in vars(k) for lib in libs for k in lib.__mro__ if k is not object)


_SOURCE_NAMES: dict[type, set[str]] = {}


def library_names(libs: list[type]) -> set[str]:
    """The private names the library base classes define: members, and the fields their code sets on ``self``."""
    out: set[str] = set()
    for lib in libs:
        for k in lib.__mro__:
            if k is object:
                continue
            names = _SOURCE_NAMES.get(k)
            if names is None:
                names = {n for n in vars(k) if private(n)}
                try:
                    names |= set(re.findall(r"\bself\.(_[A-Za-z]\w*)", inspect.getsource(k)))
                except (OSError, TypeError):
                    pass
                _SOURCE_NAMES[k] = names
            out |= names
    return out


def reaches(root: Path = ROOT) -> Iterator[str]:
    """Every reach into a library's private names outside the compat modules, as 'path:line: what'."""
    trees, classes, imports = collect(root)
    for path, tree in trees.items():
        rel = path.relative_to(root).as_posix()
        if rel.startswith(COMPAT):
            continue
        mod = module_name(path, root)
        names = imports[path]
        local = {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import) and not getattr(node, "level", 0):
                mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for m in mods:
                    if not m.startswith(OURS) and m != "__future__" and any(private(p) for p in m.split(".")):
                        yield f"{rel}:{node.lineno}: import of {m}"
                if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith(OURS):
                    for a in node.names:
                        if private(a.name):
                            yield f"{rel}:{node.lineno}: import of {node.module}.{a.name}"
        for cls_node in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            ours, libs = lineage(f"{mod}.{cls_node.name}", classes)
            theirs = library_names(libs)
            ours -= theirs  # a library's field written by our code is still the library's
            own_bases_ours = set()
            for b in classes[f"{mod}.{cls_node.name}"].bases:
                own_bases_ours |= lineage(b, classes)[0]
            own_bases_ours -= theirs
            for item in cls_node.body:
                defined = []
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    defined = [item.name]
                elif isinstance(item, ast.Assign):
                    defined = [t.id for t in item.targets if isinstance(t, ast.Name)]
                for n in defined:
                    if private(n) and defined_by(libs, n):
                        yield f"{rel}:{item.lineno}: {cls_node.name}.{n} overrides a library's private name"
            for node in ast.walk(cls_node):
                if isinstance(node, ast.Attribute) and private(node.attr):
                    v = node.value
                    if isinstance(v, ast.Name) and v.id in ("self", "cls") and node.attr not in ours:
                        yield f"{rel}:{node.lineno}: {v.id}.{node.attr} (a library base class's)"
                    elif isinstance(v, ast.Call) and dotted(v.func) == "super" and node.attr not in own_bases_ours:
                        yield f"{rel}:{node.lineno}: super().{node.attr} (a library base class's)"
                elif isinstance(node, ast.Call) and dotted(node.func) in ("getattr", "setattr", "hasattr") and len(node.args) >= 2:
                    a0, a1 = node.args[0], node.args[1]
                    if isinstance(a1, ast.Constant) and isinstance(a1.value, str) and private(a1.value):
                        if not (isinstance(a0, ast.Name) and a0.id == "self" and a1.value in ours):
                            yield f"{rel}:{node.lineno}: {dotted(node.func)}(..., {a1.value!r})"
        in_class = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in ast.walk(c)}
        for node in ast.walk(tree):
            if id(node) in in_class:
                continue
            if isinstance(node, ast.Attribute) and private(node.attr) and not isinstance(node.value, ast.Call):
                base = dotted(node.value)
                head = (base or "").split(".")[0]
                if head in ("self", "cls") or head in local or names.get(head, "").startswith(OURS):
                    continue
                yield f"{rel}:{node.lineno}: {base or '<expr>'}.{node.attr}"
            elif isinstance(node, ast.Call) and dotted(node.func) in ("getattr", "setattr", "hasattr") and len(node.args) >= 2:
                a1 = node.args[1]
                if isinstance(a1, ast.Constant) and isinstance(a1.value, str) and private(a1.value):
                    yield f"{rel}:{node.lineno}: {dotted(node.func)}(..., {a1.value!r})"
        # attribute reaches inside classes on objects other than self/cls/super()
        for cls_node in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for node in ast.walk(cls_node):
                if isinstance(node, ast.Attribute) and private(node.attr):
                    v = node.value
                    if isinstance(v, ast.Call) or (isinstance(v, ast.Name) and v.id in ("self", "cls")):
                        continue
                    base = dotted(v)
                    head = (base or "").split(".")[0]
                    if head in local or names.get(head, "").startswith(OURS):
                        continue
                    yield f"{rel}:{node.lineno}: {base or '<expr>'}.{node.attr}"


def test_no_reach_into_a_library_private_name_outside_compat() -> None:
    found = sorted(set(reaches()))
    assert not found, "reaches into a library's private names outside compat (move them to a compat module):\n" + "\n".join(found)


def test_the_walk_finds_each_kind_of_reach(tmp_path: Path) -> None:
    """The counter is not vacuous: every kind of reach in a made-up module is found."""
    (tmp_path / "console").mkdir()
    (tmp_path / "console" / "bad.py").write_text(
        "from textual._ansi_theme import ALABASTER\n"
        "from textual.widgets import DataTable\n"
        "import asyncssh\n"
        "x = asyncssh.config.SSHClientConfig._handlers\n"
        "class T(DataTable):\n"
        "    def _render_cell(self, *a): return super()._render_cell(*a)\n"
        "    def f(self):\n"
        "        self._mine = 1\n"
        "        self._row_locations = {}\n"
        "        return self._data, self._mine, getattr(self, '_update_count')\n"
    )
    found = list(reaches(tmp_path))
    text = "\n".join(found)
    for what in (
        "import of textual._ansi_theme",
        "SSHClientConfig._handlers",
        "T._render_cell overrides",
        "super()._render_cell",
        "self._data",
        "self._row_locations",
        "getattr(..., '_update_count')",
    ):
        assert what in text, f"{what!r} not found in:\n{text}"
    assert "self._mine" not in text
    assert len(found) == 7


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    all_found = sorted(set(reaches(root)))
    print("\n".join(all_found))
    print(f"{len(all_found)} reach(es) into library private names outside compat under {root}")
