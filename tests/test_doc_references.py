"""The module paths the docs and docstrings name exist: a file path of the project's (``lmcli/...py``,
``formats/sources.py``, ``tests/...py``) names a file that is there, and a dotted name
(``lmcli.formats.sources.load_model``, ``from lmcli.x import y``) imports. A module moved or
renamed without its mentions fails here, naming the file and the stale reference.

A path whose first folder is none of the project's (``lm_eval/api/task.py``, ``path/to/file.py``)
is another project's or a placeholder, and is not checked.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import lmcli

REPO = Path(lmcli.__file__).parent.parent
# a module's path: ``formats/sources.py``, or with a name in it: ``train/run_folder.resolve_configs``
# (not another kind of file: ``docs/serve.md``, ``bench/results/all.json``)
OTHER_FILES = r"(?:md|json|jsonl|inc|cpp|h|txt|png|toml|sh|gguf|safetensors|yaml|csv|html|pt|bin|gz|zst)\b"
PATH = re.compile(rf"(?<![\w./-])((?:[\w-]+/)+[\w-]+)(?:\.py\b|\.(?!{OTHER_FILES})(?=[A-Za-z_]))")
DOTTED = re.compile(r"(?<![\w./])(lmcli(?:\.\w+)+)")
FROM = re.compile(r"\bfrom (lmcli(?:\.\w+)*) import ([\w, ]+)")


def described() -> list[Path]:
    """The files that describe the code: the docs, the README and every module's docstrings."""
    return [
        *sorted((REPO / "docs").glob("*.md")),
        REPO / "README.md",
        *sorted((REPO / "lmcli").rglob("*.py")),
    ]


def project_files() -> list[str]:
    """Every file of the project, relative to the repository, and its folders' names."""
    kept = ("lmcli", "tests", "bench", "docs")
    return [p.relative_to(REPO).as_posix() for top in kept for p in (REPO / top).rglob("*") if p.is_file()]


def names(file: str, path: str) -> bool:
    """Whether ``path`` (a module's path without ``.py``, from some folder down) names ``file``, or
    a folder that holds it."""
    return any(f"/{file}".endswith(f"/{path}{end}") for end in (".py", "/__init__.py"))


def modules() -> set[str]:
    return {"lmcli", *(m.name for m in pkgutil.walk_packages(lmcli.__path__, "lmcli."))}


def resolves(name: str, known: set[str]) -> bool:
    """Whether ``name`` is a module, or a module and the attributes it holds."""
    parts = name.split(".")
    depth = max(k for k in range(1, len(parts) + 1) if ".".join(parts[:k]) in known)
    found: object = importlib.import_module(".".join(parts[:depth]))
    for attr in parts[depth:]:
        if not hasattr(found, attr):
            return False
        found = getattr(found, attr)
    return True


def test_every_module_path_named_in_the_docs_exists() -> None:
    files = project_files()
    folders = {part for f in files for part in f.split("/")[:-1]}
    stale = []
    for doc in described():
        for match in PATH.finditer(doc.read_text(encoding="utf-8")):
            path = match.group(1)
            if path.split("/")[0] in folders and not any(names(f, path) for f in files):
                stale.append(f"{doc.relative_to(REPO)}: {path}")
    assert not stale, "paths that name no file:\n" + "\n".join(stale)


def test_every_dotted_lmcli_name_in_the_docs_imports() -> None:
    known = modules()
    stale = []
    for doc in described():
        text = doc.read_text(encoding="utf-8")
        names = {m.group(1).rstrip(".") for m in DOTTED.finditer(text)}
        for module, imported in FROM.findall(text):
            names |= {f"{module}.{n.split()[0]}" for n in imported.split(",") if n.strip()}  # (x as y: x)
        stale += [f"{doc.relative_to(REPO)}: {name}" for name in sorted(names) if not resolves(name, known)]
    assert not stale, "names that do not import:\n" + "\n".join(stale)


def test_a_stale_reference_is_found(tmp_path: Path) -> None:
    """The checks above see the references they are for (the regrouping's old paths)."""
    text = "see ``hf.gguf_check`` in `hf/families/hf_config.py` and lmcli.hf.gguf_load.load_gguf"
    assert [m.group(1) for m in PATH.finditer(text)] == ["hf/families/hf_config"]
    assert [m.group(1) for m in DOTTED.finditer(text)] == ["lmcli.hf.gguf_load.load_gguf"]
    assert not resolves("lmcli.hf.gguf_load.load_gguf", modules())
    assert resolves("lmcli.formats.gguf.load.load_gguf", modules())
