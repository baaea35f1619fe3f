"""Sizes that keep marsi readable, measured on the source (pure AST): the `Coordinator` facade at most 250 lines,
the step loop's `run` at most 40 (it reads top to bottom on one screen), no library file over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocols", "agent_trainer", "orchestrator")


def definition(path: Path, *names: str) -> ast.AST:
    """The class or function `names` leads to in `path` (a class, then a method of it)."""
    node: ast.AST = ast.parse(path.read_text(), str(path))
    for name in names:
        node = next(n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)
    return node


def lines(node: ast.AST) -> int:
    """Lines from the definition's first (its decorators included) to its last."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return node.end_lineno - first + 1


def test_the_coordinator_class_is_at_most_250_lines():
    assert lines(definition(ROOT / "orchestrator" / "coordinator.py", "Coordinator")) <= 250


def test_run_is_at_most_40_lines():
    assert lines(definition(ROOT / "orchestrator" / "coordinator.py", "Coordinator", "run")) <= 40
    assert lines(definition(ROOT / "orchestrator" / "step_loop.py", "StepLoop", "run")) <= 40


def test_no_library_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"over 600 lines: {long}"


def test_no_library_module_rebinds_module_state_with_global():
    """Process-wide settings hide who owns them: state lives in objects that are handed on (`global` nowhere)."""
    found = [f"{p.relative_to(ROOT)}:{node.lineno}" for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Global)]
    assert not found, f"global statements: {found}"
