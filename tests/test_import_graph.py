"""pdd's import graph, read from the source with `ast` (module-level and
function-level imports alike, since a lazy import is still a dependency):
no circles between pdd's modules, and no shared library module importing a
role's package."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pdd"

SHARED = ("pdd.tracing", "pdd.kv", "pdd.ops", "pdd.protocol", "pdd.config", "pdd.api")
ROLES = ("pdd.router", "pdd.worker", "pdd.http", "pdd.admin")


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lives in: `pdd.ops.store_kv` is `pdd.ops`."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    # `from pdd.ops import reference` names a module; `from pdd.ops import store_kv` names a function.
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = _imported_names(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom) and len(names) > 1:
                # A `from X import name` depends on X.name when that is a module, else on X.
                names = [n for n in names[1:] if n in modules] or names[:1]
            for name in names:
                if name == "pdd" or name.startswith("pdd."):
                    target = _nearest_module(name, modules)
                    if target and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(module, target) for module, targets in graph.items() if _within(module, SHARED)
            for target in targets if _within(target, ROLES)}


def test_the_graph_reads_lazy_imports():
    graph = import_graph()
    # pdd.ops loads its Triton kernels inside a function: that is an edge too.
    assert "pdd.ops.triton_ops" in graph["pdd.ops"]
    assert "pdd.protocol.messages" in graph["pdd.protocol.codec"]


def test_no_circles_between_pdd_modules():
    assert circles(import_graph()) == set()


def test_no_shared_library_imports_a_role_package():
    assert upward_imports(import_graph()) == set()


def test_the_checks_see_a_circle_and_an_upward_import():
    graph = {"pdd.kv.a": {"pdd.kv.b"}, "pdd.kv.b": {"pdd.kv.a", "pdd.worker.x"}, "pdd.worker.x": set()}
    assert circles(graph) == {frozenset({"pdd.kv.a", "pdd.kv.b"})}
    assert upward_imports(graph) == {("pdd.kv.b", "pdd.worker.x")}
