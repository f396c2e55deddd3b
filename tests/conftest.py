"""Shared fixtures: tiny models and run folders built in the test, never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmcli.checkpoint import save_checkpoint
from lmcli.config import ModelConfig, TrainConfig
from lmcli.model import Transformer
from lmcli.tokenizer import Tokenizer

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"

TINY_TEXT = (
    "the cat sat on the mat.\nthe dog sat on the log.\n"
    "a bird sang in the tree.\nthe sun rose over the hill.\n"
) * 20


def make_run(
    out: Path,
    text: str = TINY_TEXT,
    kind: str = "char",
    seed: int = 0,
    **model_kw,
) -> Path:
    """Write a run folder (``out/last`` and ``out/best``) with a random tiny model."""
    tok = Tokenizer.train(kind, iter([text]), vocab_size=300)
    cfg = dict(block_size=32, n_layer=2, n_head=2, n_embd=32)
    cfg.update(model_kw)
    mcfg = ModelConfig(vocab_size=tok.vocab_size, **cfg)
    torch.manual_seed(seed)
    model = Transformer(mcfg)
    for name in ("last", "best"):
        save_checkpoint(out / name, model, TrainConfig(), tok, meta={"step": 0})
    return out


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every test's token cache out of ~/.cache."""
    monkeypatch.setenv("LMCLI_CACHE", str(tmp_path_factory.getbasetemp() / "lmcli-cache"))


@pytest.fixture
def tiny_run(tmp_path: Path) -> Path:
    """A run folder holding a random 2-layer char model."""
    return make_run(tmp_path / "run")


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip when it is absent."""
    if not SHARED.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED
