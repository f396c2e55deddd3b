"""The package's modules import one another without a cycle, and each imports cleanly in order.

The graph counts every import that runs, at the top of a module or inside a function (a cycle
closed by a function-level import is still a cycle: checkpoint.py <-> hf/ was one); imports under
``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import lmcli

ROOT = Path(lmcli.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.AST) -> list[str]:
    """The ``lmcli`` modules a module's code imports, skipping ``if TYPE_CHECKING:`` blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.extend(f"{node.module}.{a.name}" for a in node.names)  # a submodule, or a name in it
            found.append(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [name for name in found if name == "lmcli" or name.startswith("lmcli.")]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name imported from a module counts as the
    module)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        wanted = runtime_imports(ast.parse(path.read_text(), str(path)))
        graph[name] = {m for m in wanted if m in files and m != name}
    return graph


def test_no_module_imports_itself_through_others() -> None:
    try:
        order = list(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
    assert "lmcli.checkpoint" in order and "lmcli.hf.families" in order


def test_every_module_imports_in_dependency_order_in_a_fresh_interpreter() -> None:
    order = list(graphlib.TopologicalSorter(import_graph()).static_order())
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", script, *order], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
