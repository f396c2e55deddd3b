"""Small builders shared by tests (imported as a plain module from the tests folder)."""

from __future__ import annotations

import io

import pytest
import torch

from lmcli.cli import main
from lmcli.config import ModelConfig
from lmcli.model import Transformer
from lmcli.tokenizer import Tokenizer

TEXT = "the cat sat on the mat. a bird sang in the tree. the sun rose over the hill.\n"


def tiny_model_and_tokenizer(seed: int = 0, **kw) -> tuple[Transformer, Tokenizer]:
    tok = Tokenizer.train("char", iter([TEXT]))
    cfg = dict(vocab_size=tok.vocab_size, block_size=48, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**cfg)).eval(), tok


# a one-layer model trained for a few steps: CLI runs that finish in about a second
FAST_TRAIN_ARGS = [
    *("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16"),
    *("--batch-size", "4", "--eval-interval", "2", "--eval-batches", "1", "--warmup-steps", "1", "-q"),
]


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
