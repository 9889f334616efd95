"""The benchmarks/ tools stay runnable and outside the product: each module with a
main() builds its parser from its own flags, none imports a private pdd name,
and the wheel's packages leave benchmarks/ out."""
from __future__ import annotations

import ast
import configparser
import importlib
from pathlib import Path

import pytest
from setuptools import find_packages

import benchmarks
from benchmarks.cli import parser

ROOT = Path(benchmarks.__file__).resolve().parent
TOOLS = sorted(p.stem for p in ROOT.glob("*.py") if "\ndef main(" in p.read_text())


@pytest.mark.parametrize("name", TOOLS)
def test_each_tool_parses_its_own_flags(name):
    module = importlib.import_module(f"benchmarks.{name}")
    p = parser(module)
    assert p.prog == f"python -m benchmarks.{name}"
    assert p.description == module.__doc__
    p.parse_args([])   # every flag has a default: the tool runs as documented without any


def _private_pdd_names(path: Path) -> list[str]:
    """`from pdd.x import _y`, `import pdd._x` and `pdd_module._attr` where the module came from pdd."""
    tree = ast.parse(path.read_text())
    pdd_names, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pdd":
            parts = node.module.split(".")
            found += [f"{node.module}" for p in parts if p.startswith("_")]
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"{node.module}.{a.name}")
                pdd_names.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "pdd":
                    found += [a.name for p in a.name.split(".") if p.startswith("_")]
                    pdd_names.add((a.asname or a.name).split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in pdd_names):
            found.append(f"{node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", sorted(ROOT.glob("*.py")), ids=lambda p: p.name)
def test_tools_import_only_public_pdd_names(path):
    assert _private_pdd_names(path) == []


def test_the_wheel_leaves_benchmarks_out():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT.parent / "setup.cfg")
    include = [s.strip() for s in cfg["options.packages.find"]["include"].split(",")]
    shipped = find_packages(str(ROOT.parent), include=include)
    assert "pdd.bench" in shipped and not [p for p in shipped if p.split(".")[0] == "benchmarks"]
