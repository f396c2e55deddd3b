"""``--verbose``: after loading, one line on stderr naming the path the model's products take
(lmcli's native kernels and their instruction set, torch's int8/int4 kernels, or float weights),
for each command that loads a model to run it. Runs with the kernels built and without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from lmcli.model.native import ops

CHAT = json.dumps({"messages": [{"role": "user", "content": "the cat"}]})


def argv_of(command: str, run: Path, text: Path) -> list[str]:
    return {
        "sample": ["sample", str(run), "-p", "the", "--max-new-tokens", "2", "--json"],
        "beam": ["beam", str(run), "-p", "the", "--beam-size", "2", "--max-new-tokens", "2", "--json"],
        "eval": ["eval", str(run), str(text), "--json"],
        "chat": ["chat", str(run), "--json", "--max-new-tokens", "2"],
        "serve": ["serve", str(run), "--port", "0"],
    }[command] + ["--device", "cpu"]


@pytest.mark.parametrize("command", ["sample", "beam", "eval", "chat", "serve"])
def test_verbose_prints_one_line_naming_the_products_path(
    command: str, tiny_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    served = []
    monkeypatch.setattr("lmcli.serve.server.serve", lambda ckpt, cfg, **kw: served.append(ckpt))
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat.\n" * 4)
    argv = argv_of(command, tiny_run, text)
    lib = ops.library()
    # --quantize int8 of a 32-wide model: q8_0 blocks on the native kernels, else torch's int8
    int8 = (
        f"quantized products: native kernels, {lib.best} ({', '.join(lib.isas)} on this CPU); blocks q8_0"
        if lib is not None
        else "quantized products: torch (int8 kernels on cpu)"
    )
    cases = [
        ([], None),  # no --verbose: no line
        (["--verbose"], "products: torch (float weights on cpu; no quantized layer)"),
        (["--verbose", "--quantize", "int8"], int8),
    ]
    for extra, expected in cases:
        stdin = CHAT if command == "chat" else None
        code, _, err = run_cli(argv + extra, capsys, stdin=stdin, monkeypatch=monkeypatch)
        assert code == 0, err
        lines = [line for line in err.splitlines() if line.startswith(("products:", "quantized products:"))]
        assert lines == ([expected] if expected else []), err
        # the native step's own line comes with it (this GPT-2-shaped model's blocks: none native)
        steps = [line for line in err.splitlines() if line.startswith("native step:")]
        assert len(steps) == (expected is not None), err
    assert len(served) == len(cases) * (command == "serve")


def test_the_line_without_the_kernels(tiny_run: Path, capsys, monkeypatch) -> None:
    """LMCLI_NATIVE=0: --quantize int8 takes torch's int8 layers, and the line says so."""
    try:
        monkeypatch.setenv("LMCLI_NATIVE", "0")
        ops._load.cache_clear()
        argv = ["sample", str(tiny_run), "-p", "the", "--max-new-tokens", "2", "--json", "--device", "cpu"]
        code, _, err = run_cli([*argv, "--verbose", "--quantize", "int8"], capsys)
        assert code == 0, err
        assert [line for line in err.splitlines() if "products" in line] == [
            "quantized products: torch (int8 kernels on cpu)"
        ]
    finally:
        ops._load.cache_clear()
