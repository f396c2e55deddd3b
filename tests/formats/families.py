"""Tiny random Hugging Face models of every family lmcli imports, saved as local folders.

Each folder holds what a hub model holds: config.json, generation_config.json, model.safetensors
(or shards), tokenizer.json and tokenizer_config.json naming the special tokens. The tokenizers
use their family's token names, so the roles must come from the files, not from lmcli's names.
Every family registered in ``lmcli.formats.families`` needs a variant here (``test_family_adapters.py``
checks): adding a family is its adapter module and a variant.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from helpers import TINY_TEXT
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SHAPE = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64)
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
WINDOW = 8  # the sliding window of the families that have one: the tests run well past it

# name -> (config class, config fields, special tokens, tokenizer_config roles, extra vocab rows)
VARIANTS: dict[str, tuple] = {
    "gpt2": (
        transformers.GPT2Config,
        dict(n_embd=32, n_head=4, n_layer=2, n_positions=64),
        ["<|endoftext|>"],
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
        0,
    ),
    "llama-tied": (
        transformers.LlamaConfig,
        dict(**SHAPE, max_position_embeddings=64, tie_word_embeddings=True, rope_theta=500.0),
        ["<unk>", "<s>", "</s>"],
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        0,
    ),
    "llama-gqa-untied-llama3": (
        transformers.LlamaConfig,
        dict(
            **SHAPE,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        0,
    ),
    "qwen2-gqa-bias-yarn": (
        transformers.Qwen2Config,
        dict(
            **SHAPE,
            num_key_value_heads=1,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
        ),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": CHAT_TEMPLATE,
        },
        7,  # the model's vocabulary is padded beyond the tokenizer's, as Qwen2.5's is
    ),
    "mistral-gqa-window": (
        transformers.MistralConfig,
        dict(**SHAPE, num_key_value_heads=2, max_position_embeddings=96, sliding_window=48),
        ["<unk>", "<s>", "</s>"],
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        0,
    ),
    "gemma3-window-scaled": (
        transformers.Gemma3TextConfig,
        dict(
            **SHAPE | dict(num_hidden_layers=3),
            num_key_value_heads=2,
            head_dim=16,  # not hidden_size / heads
            max_position_embeddings=64,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        {
            "bos_token": "<bos>",
            "eos_token": "<end_of_turn>",
            "pad_token": "<pad>",
            "chat_template": GEMMA_TEMPLATE,
        },
        0,
    ),
    "qwen3-window-untied": (
        transformers.Qwen3Config,
        dict(
            **SHAPE,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": CHAT_TEMPLATE,
        },
        0,
    ),
    "smollm3-nope-window": (
        transformers.SmolLM3Config,
        dict(
            **SHAPE | dict(num_hidden_layers=4),
            num_key_value_heads=2,
            max_position_embeddings=64,
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=WINDOW,
        ),
        ["<|begin_of_text|>", "<|end_of_text|>", "<|im_end|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"},
        0,
    ),
}


def hf_tokenizer(
    specials: list[str], pre_tokenizer=None, vocab_size: int = 300, texts: tuple[str, ...] = ()
) -> Tokenizer:
    """A byte-level BPE of the tiny corpus (and ``texts``) with the given special tokens first;
    GPT-2's pre-tokenizer unless another is given."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TINY_TEXT, *texts], trainer=trainer)
    return tok


def hf_folder(tmp: Path, name: str, *, shards: int = 1, dtype: torch.dtype = torch.float32) -> Path:
    """The variant ``name`` as a saved folder under ``tmp`` (weights scaled up so that greedy
    decoding has no near-ties; ``shards`` > 1 writes a sharded safetensors index)."""
    cls, fields, specials, roles, extra_vocab = VARIANTS[name]
    tok = hf_tokenizer(specials)
    vocab = tok.get_vocab()
    ids = {r.removesuffix("_token"): vocab[t] for r, t in roles.items() if r.endswith("_token") and t}
    first = vocab[specials[0]]
    config = cls(
        vocab_size=tok.get_vocab_size() + extra_vocab,
        bos_token_id=ids.get("bos", first),
        eos_token_id=ids["eos"],
        pad_token_id=ids.get("pad"),
        **fields,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # norm weights around 1, everything else around 0
            p.normal_(1.0 if p.dim() == 1 and bool((p == 1).all()) else 0.0, 0.3)
    folder = tmp / name
    size = sum(p.numel() * 4 for p in model.parameters())
    model.to(dtype).save_pretrained(folder, max_shard_size=f"{size // shards // 1000 + 1}KB")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **roles}, indent=2)
    )
    return folder
