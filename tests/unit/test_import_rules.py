"""The import rules of ARCHITECTURE.md, enforced on the source (not on what happens to be installed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RULES = {
    "agents": {"textual", "rich", "torch", "transformers", "console", "trainers"},
    "trainers": {"console", "agents", "textual", "rich"},
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args and isinstance(node.args[0], ast.Constant):
            roots.add(str(node.args[0].value).split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_only_what_it_may(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    bad = {str(f.relative_to(ROOT)): sorted(imported_roots(f) & RULES[package]) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"forbidden imports: {bad}"


def test_only_console_imports_textual() -> None:
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT)
        # the console may; tests and benches drive it; build outputs and environments are not source
        if rel.parts[0] in ("console", "tests", "bench", "build", "dist") or rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        assert "textual" not in imported_roots(f), f"{rel} imports textual"
