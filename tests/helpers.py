"""What tests share: the tiny corpus, one tiny-model builder, one train-config builder, run folders,
the CLI in-process.

Imported as a plain module (``from helpers import ...``) from any test folder: pytest puts tests/ on
sys.path when it loads tests/conftest.py. Models and run folders are built in the test, never
downloaded.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lmcli.checkpoint import save_checkpoint
from lmcli.cli import main
from lmcli.config import ModelConfig, TrainConfig, from_dict
from lmcli.model import Transformer
from lmcli.tokenizer import Tokenizer

# The tiny corpus: 2020 characters; a char tokenizer of it has 25 tokens (5 of them special).
TINY_TEXT = (
    "the cat sat on the mat.\nthe dog sat on the log.\n"
    "a bird sang in the tree.\nthe sun rose over the hill.\n"
) * 20

# The shape tiny_model gives unless told otherwise.
TINY_SHAPE = dict(block_size=48, n_layer=2, n_head=2, n_embd=32)

# A one-layer model trained for a few steps: CLI runs that finish in about a second.
FAST_TRAIN_ARGS = [
    *("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16"),
    *("--batch-size", "4", "--eval-interval", "2", "--eval-batches", "1", "--warmup-steps", "1", "-q"),
]


def tiny_tokenizer(text: str = TINY_TEXT, kind: str = "char", vocab_size: int = 300) -> Tokenizer:
    """A ``kind`` tokenizer trained on ``text`` (``vocab_size`` only matters for bpe)."""
    return Tokenizer.train(kind, iter([text]), vocab_size=vocab_size)


def tiny_model(vocab_size: int | None = None, seed: int | None = 0, **config) -> Transformer:
    """A random Transformer in eval mode: TINY_SHAPE with ``config`` overriding any field.

    ``vocab_size`` defaults to that of ``tiny_tokenizer()``; ``seed`` seeds torch before the
    weights are drawn (None: draw them from torch's global generator as it stands).
    """
    if vocab_size is None:
        vocab_size = tiny_tokenizer().vocab_size
    if seed is not None:
        torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=vocab_size, **{**TINY_SHAPE, **config})).eval()


def train_config(**options: Any) -> TrainConfig:
    """A TrainConfig from flat option names, spelled as flags, TOML keys and ``config.json``
    spell them (``train_config(lr=3e-3, max_steps=40)``): each option goes to its section
    (``cfg.optim.lr``, ``cfg.schedule.max_steps``), so a test never builds the sections itself.
    Checked as any config: a bad value raises the one-line ``LmcliError`` the CLI would print.
    (To change some options of a config: ``lmcli.config.replace_options(cfg, max_steps=8)``.)"""
    return from_dict(TrainConfig, options, source="train_config")


def make_run(out: Path, text: str = TINY_TEXT, kind: str = "char", seed: int = 0, **config) -> Path:
    """A run folder (``out/last`` and ``out/best``): a tiny model, context 32 unless told otherwise,
    with a ``kind`` tokenizer of ``text``."""
    tok = tiny_tokenizer(text, kind)
    model = tiny_model(tok.vocab_size, seed, **{"block_size": 32, **config})
    for name in ("last", "best"):
        save_checkpoint(out / name, model, train_config(), tok, meta={"step": 0})
    return out


FLOAT32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7: float32's relative rounding step
FLOAT32_MARGIN = 8.0  # how far above the typical rounding error two computations may drift apart


def float32_tolerance(expected: torch.Tensor, cfg: ModelConfig) -> float:
    """The absolute difference two float32 computations of ``cfg``'s forward pass may show
    through rounding alone: ``FLOAT32_MARGIN * sqrt(K) * eps * max|expected|``, with
    ``K = n_layer * max(n_embd, ffn_dim)``.

    A sum of K float32 terms is off by about sqrt(K) * eps * (the size of its terms) when its
    rounding errors have random signs (Higham and Mary, "A new approach to probabilistic
    rounding error analysis", 2019; K * eps in the worst case). A forward pass puts one such
    error per block into the residual stream, each from a sum over at most max(n_embd, ffn_dim)
    terms, and the logits are of the size of ``max|expected|``. The largest difference seen
    (Qwen2 with YaRN against transformers) is about 1.5 * sqrt(K) * eps * max|expected|;
    the margin of 8 leaves room for CPUs that sum in yet another order. On the tiny test models
    this is ~1e-4 on logits of size 7, while a wrong weight, bias, mask or position moves them by
    1e-3 and more (``tests/hf/test_families.py`` keeps a weight 0.1% off failing).
    """
    finite = expected[torch.isfinite(expected)]
    width = max(cfg.n_embd, cfg.ffn_dim)
    scale = finite.abs().max().item() if finite.numel() else 0.0
    return FLOAT32_MARGIN * math.sqrt(cfg.n_layer * width) * FLOAT32_EPS * scale


def assert_float32_close(actual: torch.Tensor, expected: torch.Tensor, cfg: ModelConfig) -> None:
    """``actual`` equals ``expected`` up to ``float32_tolerance``: two float32 computations of
    the same outputs of ``cfg``'s model by different routes (lmcli against transformers or
    llama.cpp's arithmetic, a cached step against the full forward, packed weights against plain
    ones, adapters against merged weights).

    A fixed tolerance does not hold on every CPU: each route adds its numbers in an order of its
    own, and the order depends on the CPU and the BLAS build (AVX2 and AVX-512 kernels split a
    dot product differently); ``atol=1e-5`` failed on an AMD EPYC at 1.2e-5. Comparing in
    float64 instead is no cure here: transformers' RMSNorm and rotary tables compute in float32
    even in a float64 model, and lmcli's CPU decoding paths (packed weights, the one-token step)
    exist in float32 only."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=float32_tolerance(expected, cfg))


def run_cli(argv: list[str], capsys, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """``lmcli ARGV`` in this process, reading ``stdin`` if given: (exit code, stdout, stderr)."""
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def assert_one_line_error(code: int, err: str, message: str) -> None:
    """Exit code 2 and one ``error: ...`` line holding ``message`` (warnings aside), no traceback."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert "Traceback" not in err


def weights(run: Path, which: str = "last") -> dict[str, torch.Tensor]:
    """The weights of a run folder's ``which`` checkpoint."""
    return load_file(str(run / which / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def read_metrics(run: Path) -> list[dict]:
    """A run folder's metrics.jsonl, one dict a line."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
