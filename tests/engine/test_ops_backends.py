"""Every op the dispatcher (`pdd.ops`) forwards to a backend exists in both
backends. The Triton backend is only chosen on a GPU, so a name missing there
(a warm-up added to the reference and the dispatcher but not re-exported by
`triton_ops`) would otherwise first show as an AttributeError in a GPU
worker's start. Read from the sources: nothing here needs Triton or a GPU."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pdd.ops

OPS = Path(pdd.ops.__file__).parent


def _forwarded() -> set[str]:
    source = (OPS / "__init__.py").read_text()
    return set(re.findall(r"\bbackend(?:_for\([^)]*\))?\.(\w+)\(", source))


def _exported(module: str) -> set[str]:
    tree = ast.parse((OPS / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_the_dispatcher_forwards_something():
    assert {"paged_attention", "warm_up_merges", "warm_up_split_prefill", "argmax"} <= _forwarded()


def test_the_triton_backend_has_every_forwarded_op():
    assert _forwarded() - _exported("triton_ops") == set()


def test_the_reference_backend_has_every_op_it_is_asked_for():
    warm_ups = {name for name in _forwarded() if name.startswith("warm_up_")}   # GPU only: never asked of it
    assert _forwarded() - warm_ups - _exported("reference") == set()
