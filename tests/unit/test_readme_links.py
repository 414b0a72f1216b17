"""The README and docs/ are true for a new user on a fresh clone: every relative link points inside the repository at a
file that exists, and nothing tells them to install gpudeck from a package index it is not published on."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_stays_in_the_repository_and_exists() -> None:
    bad = []
    for page in PAGES:
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}")
        bad += [f"{page.relative_to(ROOT)}: {m}" for m in re.findall(r"`\.\./[^`]*`", text)]
    assert not bad, bad


def test_no_install_from_an_index_and_one_line_per_install() -> None:
    text = (ROOT / "README.md").read_text()
    assert not re.search(r"pip install (-U )?gpudeck\b", text)
    assert "pip install ./gpudeck" in text  # the agent alone, from a checkout
    assert "--extra-index-url https://download.pytorch.org/whl/cpu './gpudeck[train]'" in text  # a CPU box
    assert "| `pip install './gpudeck[train]'` |" in text  # a CUDA host
    assert "gpudeck-*.whl" in text  # or a built wheel
