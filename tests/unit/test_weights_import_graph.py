"""The weight sync's modules import one way: the pusher (``pipeline.weights.push``) imports the
transports, the transports the interface (``pipeline.weights.interface``), never back.

Every module-level import counts, those under ``if TYPE_CHECKING:`` too (a circle there still
ties the modules together); imports inside functions are ``test_import_rules``'s business.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_level_imports(tree: ast.Module) -> list[str]:
    """Every module imported by a statement at module level, also inside ``if`` / ``try``
    blocks; ``from a import b`` as ``a`` and ``a.b``."""
    found: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.append(node.module)
                found.extend(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return found


def _graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports at module level."""
    paths = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in paths.items():
        deps = set()
        for module in _module_level_imports(ast.parse(path.read_text(), filename=str(path))):
            while module and module not in paths:  # a name inside a module: the module
                module = module.rpartition(".")[0]
            if module and module != name:
                deps.add(module)
        graph[name] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of two or more modules, sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for dep in graph[module]:
            if dep not in order:
                visit(dep)
                low[module] = min(low[module], low[dep])
            elif dep in stack:
                low[module] = min(low[module], order[dep])
        if low[module] == order[module]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for module in graph:
        if module not in order:
            visit(module)
    return found


def test_no_import_circle_through_the_weight_sync():
    circles = [c for c in _circles(_graph("pipeline"))
               if any(m.startswith("pipeline.weights") for m in c)]
    assert circles == []


def test_the_checker_sees_a_circle_under_type_checking():
    """The checker itself: a back edge under ``if TYPE_CHECKING:`` is a circle."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from pipeline.weights.push import WeightPusher\n")
    assert "pipeline.weights.push" in _module_level_imports(tree)
    graph = {"pipeline.weights.push": {"pipeline.weights.disk"},
             "pipeline.weights.disk": {"pipeline.weights.push"}, "pipeline.other": set()}
    assert _circles(graph) == [["pipeline.weights.disk", "pipeline.weights.push"]]
