"""NaN and infinity are never turned into zeros (issue 48, finding 5): an activation block holding
one makes every product it enters non-finite on every instruction set, a NaN or infinite block
scale in a GGUF file makes `eval` and `sample` fail with their one line instead of a uniform
perplexity and an echoed prompt, and the one-call decoding step gives non-finite logits (a row
whose squares overflow too) where it gave uniform ones."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # gguf_files
from gguf_files import write_gguf_model  # noqa: E402
from test_native import random_blocks  # noqa: E402

from lmcli.formats.gguf.as_stored import load_as_stored  # noqa: E402
from lmcli.formats.gguf.load import read_gguf_header  # noqa: E402
from lmcli.model import fastpath  # noqa: E402
from lmcli.model.kv_cache import KVCache  # noqa: E402
from lmcli.model.native import ops  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.available(), reason="native kernels not built here")
TEXT = "the cat sat on the mat. 12 birds sang, didn't they?\n"


@pytest.mark.parametrize("fmt", list(ops.FORMATS))
def test_a_non_finite_activation_gives_non_finite_outputs(fmt: str) -> None:
    f = ops.FORMATS[fmt]
    n, k = 7, 4 * f.block
    blocks = torch.from_numpy(random_blocks(fmt, n, k, seed=21))
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(22))
    x[0, 3] = float("nan")  # a NaN in the first block
    x[1, k - 1] = float("inf")  # an infinity in the last value
    x[2, f.block + 1] = float("-inf")
    x[3, 0], x[3, 1] = float("inf"), float("nan")
    for isa in ops.library().isas:
        bound = ops.BoundProduct(blocks, fmt, k, isa)
        for rows in (x, x[:1], x[1:2]):  # four rows a call, and one
            y = bound(rows)
            assert not torch.isfinite(y[: min(4, len(rows))]).any(), (isa, len(rows))
        y = bound(x)
        assert torch.isfinite(y[4:]).all() and torch.equal(y[4:], bound(x[4:])), isa  # the others untouched


def damaged(tmp: Path, kind: str, at: int, value: float, tensor: str | None) -> Path:
    """A tiny GGUF file of ``kind`` with the float16 at byte ``at`` of every block of ``tensor``
    (None: of every matrix) set to ``value``."""
    path = write_gguf_model(tmp / f"{kind}.gguf", "llama", kind)
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    data = np.frombuffer(bytearray(path.read_bytes()), dtype=np.uint8)
    for name, info in read_gguf_header(path).table.items():
        if (tensor is None and info.type_name == kind) or name == tensor:
            blocks = data[info.offset : info.offset + info.n_bytes].reshape(-1, size)
            blocks[:, at : at + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    path.write_bytes(data.tobytes())
    return path


FILES = {  # every block scale of one ffn_down NaN; a q4_K dmin infinite; every scale the largest half
    "q4_0 ffn_down d = nan": ("Q4_0", 0, float("nan"), "blk.0.ffn_down.weight"),
    "q4_K ffn_down dmin = inf": ("Q4_K", 2, float("inf"), "blk.0.ffn_down.weight"),
    "q4_0 every d = 65504": ("Q4_0", 0, 65504.0, None),
}


@pytest.mark.parametrize("case", [c for c in FILES if "65504" not in c])
def test_eval_of_a_file_with_non_finite_scales_is_one_line(tmp_path: Path, capsys, case: str) -> None:
    """16-token windows one at a time: every product on the kernels' integer rows (it reported
    perplexity 304.000, the vocabulary size, and exit 0)."""
    from helpers import assert_one_line_error, run_cli

    path = damaged(tmp_path, *FILES[case])
    (tmp_path / "t.txt").write_text(TEXT * 4)
    argv = ["eval", str(path), str(tmp_path / "t.txt"), "--context", "16", "--batch-size", "1"]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "gives a loss of nan")


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_sample_of_a_file_with_a_nan_scale_is_one_line(tmp_path: Path, capsys, temperature: str) -> None:
    """`sample` stops with one line where it printed the prompt alone (token 0, an empty text,
    picked from NaN logits), exit 0."""
    from helpers import assert_one_line_error, run_cli

    path = damaged(tmp_path, *FILES["q4_0 ffn_down d = nan"])
    argv = ["sample", str(path), "-p", "the cat", "--max-new-tokens", "4", "--temperature", temperature]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "the model computes NaN or infinite logits")


@pytest.mark.parametrize("case", list(FILES))
def test_the_one_call_step_gives_non_finite_logits_not_uniform_ones(
    tmp_path: Path, case: str, monkeypatch
) -> None:
    """Each decoding step of such a file natively: non-finite logits (they were all equal: every
    row of the int8 activations zero, or a norm whose sum of squares overflowed giving zeros)."""
    monkeypatch.setenv("LMCLI_NATIVE_LAYER", "1")
    model = load_as_stored(read_gguf_header(damaged(tmp_path, *FILES[case])), torch.float32)
    idx = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(23))
    with torch.inference_mode(), fastpath.inference(model):
        assert all(n is not None for n in model.fast_step.natives)
        kv = KVCache.for_model(model, 1)
        logits = torch.cat([model.fast_step(idx[:, t : t + 1], kv) for t in range(idx.size(1))], 1)
    assert not torch.isfinite(logits).all(), logits.amax(-1) - logits.amin(-1)
