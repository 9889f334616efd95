"""One map: README's layout section and docs/design.md's package layout each
name every package of pdd, and docs/design.md every top-level module."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _section(path: Path, heading: str) -> str:
    text = path.read_text()
    start = text.index(f"## {heading}\n")
    return text[start:text.find("\n## ", start + 1)]


def _packages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "pdd").glob("*/__init__.py"))


def test_readme_layout_names_every_package():
    layout = _section(ROOT / "README.md", "Layout")
    assert [p for p in _packages() if f"pdd/{p}/" not in layout] == []


def test_design_layout_names_every_package_and_module():
    layout = _section(ROOT / "docs" / "design.md", "Package layout")
    named = set(re.findall(r"^  (\S+)", layout, flags=re.M))
    modules = [p.name for p in (ROOT / "pdd").glob("*.py") if p.name != "__init__.py"]
    assert [p for p in _packages() if f"{p}/" not in named] == []
    assert sorted(m for m in modules if m not in named) == []
