"""The agent stays light: no module of agents/ imports torch or transformers, and loading every one of them (the
daemon, the gate's fingerprint probe, pre-flight) leaves both out of the process. The fingerprint's import-torch
probe runs in the probed interpreter, a child process (agents/safety/envs.py LOADED)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

AGENTS = Path(__file__).resolve().parents[2] / "agents"
HEAVY = ("torch", "transformers")


def test_no_module_of_agents_imports_torch_or_transformers() -> None:
    found = []
    for path in sorted(AGENTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.relative_to(AGENTS)}:{node.lineno} {n}" for n in names if n.split(".")[0] in HEAVY]
        # a script the agent hands to another interpreter (a string) names torch through importlib, so that a reader (or
        # a grep) of agents/ finds no import of it either
        found += [
            f"{path.relative_to(AGENTS)}:{i} {line.strip()}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if re.match(r"\s*(import|from)\s+(torch|transformers)\b", line)
        ]
    assert found == []


def test_loading_every_agent_module_loads_neither() -> None:
    mods = sorted(
        "gpudeck.agents." + ".".join(p.relative_to(AGENTS).with_suffix("").parts)
        for p in AGENTS.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint(sorted(h for h in ('torch', 'transformers') if h in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
