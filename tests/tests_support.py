"""Small builders shared by tests (imported as a plain module from the tests folder)."""

from __future__ import annotations

import torch

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
