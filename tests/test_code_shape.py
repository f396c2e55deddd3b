"""The code keeps its shape: no function longer than a screen and a half, no file in ``lmcli/``
longer than ~600 lines, the C++ sources of the native kernels included (ruff holds complexity,
branches and statements: pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

import lmcli

ROOT = Path(lmcli.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 620
MAX_CXX_FILE_LINES = 650  # the native kernels' .cpp, .inc and .h files (denser lines of intrinsics)
CXX_SUFFIXES = (".cpp", ".inc", ".h")


def test_no_function_over_80_lines() -> None:
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these functions:\n" + "\n".join(long)


def test_no_file_over_600_lines() -> None:
    big = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in sorted(ROOT.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not big, "give these a room of their own:\n" + "\n".join(big)


def test_no_cxx_source_over_650_lines() -> None:
    big = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in sorted(ROOT.rglob("*"))
        if p.suffix in CXX_SUFFIXES and (n := len(p.read_text().splitlines())) > MAX_CXX_FILE_LINES
    ]
    assert not big, "split these by job:\n" + "\n".join(big)


def test_test_modules_have_unique_names() -> None:
    """pytest imports test modules by their base name (the test folders are no packages): two
    files of one name stop the whole suite at collection, so every name is taken once."""
    seen: dict[str, list[str]] = {}
    tests = ROOT.parent / "tests"
    for path in sorted(tests.rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"rename one of each: {twice}"
