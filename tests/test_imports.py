"""The package's layers: every import points down or sideways, never up, and never in a circle.

The graph counts every import of an ``lmcli`` module, wherever it stands: at the top of a module,
inside a function, and under ``if TYPE_CHECKING:`` too (a circle of type hints is still a circle a
reader has to untangle). The layer order is written once, here, as docs/architecture.md draws it.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import lmcli

ROOT = Path(lmcli.__file__).parent

# Lowest first: a module may import its own layer and the layers below it, nothing above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("lmcli", "lmcli.errors"),  # the version, the error types
    ("lmcli.safe_io", "lmcli.device", "lmcli.tasks"),  # what everything uses
    ("lmcli.config",),  # every option, declared once
    ("lmcli.text",),  # tokenizers, chat templates
    ("lmcli.model",),  # the Transformer and its layers, KV cache, fast paths
    ("lmcli.data",),  # corpora, token shards, training windows
    ("lmcli.formats",),  # run folders, weights, HF/GGUF in and out
    ("lmcli.generate",),  # decoding: sampling, beam, speculative, the row engine
    ("lmcli.eval",),  # perplexity, BLEU, downstream tasks, the harness
    ("lmcli.serve",),  # the OpenAI-compatible server
    ("lmcli.train",),  # the training loop and what a run needs
    ("lmcli.cli", "lmcli.__main__"),  # the commands
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_imports(tree: ast.AST) -> list[str]:
    """Every ``lmcli`` module a module names in an import, ``TYPE_CHECKING`` blocks included."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.extend(f"{node.module}.{a.name}" for a in node.names)  # a submodule, or a name in it
            found.append(node.module)
    return [name for name in found if name == "lmcli" or name.startswith("lmcli.")]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name imported from a module counts as the
    module; a package's ``__init__`` counts as the package)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        wanted = all_imports(ast.parse(path.read_text(), str(path)))
        graph[name] = {m for m in wanted if m in files and m != name and not name.startswith(m + ".")}
    return graph


def layer_of(module: str) -> int:
    best, level = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level >= 0, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return level


def test_no_import_circle() -> None:
    try:
        order = list(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None
    assert "lmcli.formats.checkpoint" in order and "lmcli.formats.families" in order


def test_no_import_back_up_the_layers() -> None:
    up = [
        f"{mod} (layer {layer_of(mod)}) imports {dep} (layer {layer_of(dep)})"
        for mod, deps in sorted(import_graph().items())
        for dep in sorted(deps)
        if layer_of(dep) > layer_of(mod)
    ]
    assert not up, "imports back up:\n" + "\n".join(up)


def test_the_checks_see_what_they_claim() -> None:
    """The graph reads function-level and TYPE_CHECKING imports, and the layer rule fires."""
    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmcli.train.run import Run\n"
    code += "def f():\n    from lmcli.cli import app\n"
    assert set(all_imports(ast.parse(code))) >= {"lmcli.train.run", "lmcli.cli.app"}
    assert layer_of("lmcli.model.transformer") > layer_of("lmcli.config.model")
    assert layer_of("lmcli.cli.app") == len(LAYERS) - 1


def test_only_a_handful_of_modules_at_the_root() -> None:
    loose = sorted(p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert loose == ["device", "errors", "safe_io", "tasks"], loose


def test_every_module_imports_in_dependency_order_in_a_fresh_interpreter() -> None:
    order = list(graphlib.TopologicalSorter(import_graph()).static_order())
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", script, *order], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
