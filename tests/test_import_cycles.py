"""No import cycle among marsi's modules, and dependencies that point one way: `orchestrator -> agent_trainer ->
protocols`, `orchestrator -> protocols`. Every import counts, at any depth: module level, inside functions, and
under `if TYPE_CHECKING:`. One exception: inside `protocols.config`, one model split into a file per section,
a section's checks may name `RunConfig` under `if TYPE_CHECKING:` (annotations only; `run.py` composes the
sections). Pure AST, no module is imported.

    python tests/test_import_cycles.py      # prints the cycles, if any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocols", "agent_trainer", "orchestrator")
LAYER = {"protocols": 0, "agent_trainer": 1, "orchestrator": 2}
"""A package imports only packages of a lower layer than its own, and its own modules."""
TYPE_ONLY_INSIDE = "protocols.config"
"""The package whose modules may refer to each other's types under `if TYPE_CHECKING:` without that counting."""


def type_only(tree: ast.AST) -> set[ast.AST]:
    """The import nodes under an `if TYPE_CHECKING:` block."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for stmt in block.body for node in ast.walk(stmt) if isinstance(node, (ast.Import, ast.ImportFrom))}


def library_modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the library's packages (a package's __init__ under
    the package's name)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules that `module` imports, anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    exempt = type_only(tree) if module.startswith(TYPE_ONLY_INSIDE + ".") else set()
    for node in ast.walk(tree):
        if node in exempt:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` of a name below a module: the module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {module: imported(module, path, modules) for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the layers: `importer -> imported`."""
    layer = lambda module: LAYER[module.split(".")[0]]  # noqa: E731
    return [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets) if layer(b) > layer(a)]


def test_the_import_graph_is_built_from_every_kind_of_import():
    graph = import_graph()
    assert "orchestrator.coordinator" in graph["orchestrator.cli"]  # inside a function
    assert "orchestrator.rollout" in graph["orchestrator.pipeline"]  # `from orchestrator import rollout`
    assert "agent_trainer.actor" in graph["orchestrator.session"]  # inside a function, below `if`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "orchestrator.coordinator" not in graph["orchestrator.pipeline"]  # no type-only way back either
    assert "protocols.config.run" not in graph["protocols.config.critic"]  # annotations only: the one exception
    assert "protocols.config.critic" in graph["protocols.config.run"]


def test_no_import_cycle_among_the_library_modules():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_point_from_orchestrator_to_agent_trainer_to_protocols():
    assert not upward(import_graph())


if __name__ == "__main__":
    graph = import_graph()
    for cycle in cycles(graph):
        print("cycle:", " <-> ".join(cycle))
    for edge in upward(graph):
        print("against the layers:", edge)
