"""Model builders shared by the suites: an lmcli Transformer and a Hugging Face GPT-2 with the
same weights (random, built from configs: nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch

from lmcli.config.model import ModelConfig
from lmcli.formats.families import FAMILIES
from lmcli.formats.weights import logical_state
from lmcli.model.transformer import Transformer

# the shapes the suites name
TINY = dict(n_layer=4, n_head=4, n_embd=128)  # ~0.9M parameters with a 65-token vocabulary
SMALL = dict(n_layer=6, n_head=6, n_embd=384)  # ~10.9M with 65 tokens, ~13.8M with 8000
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768)  # GPT-2 small: 124M with 50257 tokens


def lmcli_model(vocab_size: int, block_size: int, seed: int = 0, **shape: Any) -> Transformer:
    """A randomly initialised lmcli Transformer (GPT-2 architecture, dropout 0)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab_size, block_size=block_size, dropout=0.0, **shape)
    return Transformer(cfg)


def hf_twin(
    model: Transformer, *, bos_id: int = 2, eos_id: int = 3, pad_id: int = 0, attn: str = "sdpa"
) -> Any:
    """A ``transformers.GPT2LMHeadModel`` holding exactly ``model``'s weights (dropouts 0)."""
    import transformers

    cfg = model.config
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.ffn_dim,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=True,
    )
    hf_cfg._attn_implementation = attn
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    missing, unexpected = hf.load_state_dict(FAMILIES["gpt2"].to_hf(logical_state(model), cfg), strict=False)
    missing = [k for k in missing if not k.endswith(("attn.bias", "attn.masked_bias", "lm_head.weight"))]
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit GPT-2: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    hf.train(model.training)
    return hf


def check_same_logits(model: Transformer, hf: Any, vocab_size: int, length: int = 16) -> float:
    """Largest absolute difference of the two models' logits on one random sequence."""
    idx = torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(idx) - hf(idx).logits).abs().max().item()
    if diff > 1e-3:
        raise RuntimeError(f"lmcli and Hugging Face logits differ by {diff}")
    return diff


def count_params(model: Transformer) -> int:
    return model.num_parameters()
