"""No function in trainers/ is longer than 100 lines (issue 31: a step, a checkpoint or an export is a method you can read and test)."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINERS = Path(__file__).resolve().parents[2] / "trainers"
LIMIT = 100


def function_lengths(root: Path) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function and method under ``root``, decorators included, longest first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                assert node.end_lineno is not None
                found.append((node.end_lineno - first + 1, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def test_no_trainer_function_over_100_lines() -> None:
    lengths = function_lengths(TRAINERS)
    assert len(lengths) > 100  # the walk found the trainers' code
    too_long = [f"{where} ({n} lines)" for n, where in lengths if n > LIMIT]
    assert not too_long, "split these: " + "; ".join(too_long)


def test_the_walk_measures_a_long_function(tmp_path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "long.py").write_text(f"@staticmethod\ndef long():\n{body}\n")
    assert function_lengths(tmp_path) == [(LIMIT + 2, "long.py:2 long")]
