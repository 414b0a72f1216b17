"""The import rules of ARCHITECTURE.md, enforced on the source (not on what happens to be installed)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RULES = {
    "agents": {"textual", "rich", "torch", "transformers", "console", "trainers"},
    "trainers": {"console", "agents", "textual", "rich"},
}
# The one exception: the agent reads the trainers' preset table (stdlib only) for memory estimates.
ALLOWED = {
    "agents": {"trainers.presets"},
    "trainers": set(),
}


def imported_modules(path: Path) -> set[str]:
    """Dotted names a file imports; ``from a.b import c`` gives ``a.b.c`` (c may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(node.module if a.name == "*" else f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value))
    return names


def imported_roots(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


def forbidden_imports(path: Path, package: str) -> list[str]:
    """Imports of ``path`` that break ``package``'s rule (the allowed exceptions and their members pass)."""
    allowed = ALLOWED[package]
    bad = []
    for name in imported_modules(path):
        if name.split(".")[0] not in RULES[package]:
            continue
        if any(name == ok or name.startswith(ok + ".") for ok in allowed):
            continue
        bad.append(name)
    return sorted(bad)


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_only_what_it_may(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    bad = {str(f.relative_to(ROOT)): forbidden_imports(f, package) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"forbidden imports: {bad}"


def test_the_exception_is_narrow(tmp_path: Path) -> None:
    """agents may import trainers.presets and nothing else of trainers, in any import form."""
    ok = tmp_path / "ok.py"
    ok.write_text("from trainers.presets import PRESETS\nfrom trainers import presets\nimport trainers.presets\n")
    assert forbidden_imports(ok, "agents") == []
    for line in ("from trainers import runtime", "import trainers", "from trainers.checkpoint import MARKER_FILE",
                 "import trainers.presets_extra", "__import__('trainers.fsdp_lm')", "from trainers import *"):
        bad = tmp_path / "bad.py"
        bad.write_text(line + "\n")
        assert forbidden_imports(bad, "agents"), line


def test_presets_import_only_the_stdlib() -> None:
    """trainers/presets.py is imported by the agent, which has no torch: it must stay stdlib only."""
    roots = imported_roots(ROOT / "trainers" / "presets.py")
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, f"trainers/presets.py imports {sorted(roots)}"


def test_only_console_imports_textual() -> None:
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT)
        # the console may; tests and benches drive it; build outputs and environments are not source
        if rel.parts[0] in ("console", "tests", "bench", "build", "dist") or rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        assert "textual" not in imported_roots(f), f"{rel} imports textual"
