"""KV-cache decoding: cached equals uncached, batching and padding change nothing, sliding window."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from helpers import assert_float32_close, tiny_model, tiny_tokenizer

from lmcli.config.commands import SampleConfig
from lmcli.generate.decoding import prefill, step
from lmcli.generate.sampling import generate
from lmcli.model import fastpath
from lmcli.model.kv_cache import KVCache
from lmcli.model.transformer import Transformer

VARIANTS = list(itertools.product(("learned", "sinusoidal", "rope", "alibi"), ("pre", "post")))

VOCAB, BLOCK = 23, 24  # 2 layers, 2 heads, width 32, seed 0: tiny_model's
ALPHABET = "abcdefghijklmnopqr"  # a char tokenizer of it has 23 tokens


def greedy_uncached(model: Transformer, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids


ARCHITECTURES = [dict(position=pos, norm_placement=placement) for pos, placement in VARIANTS] + [
    dict(norm=norm, mlp=mlp, norm_placement=placement, position="rope", bias=False)
    for norm, mlp, placement in [
        ("rmsnorm", "swiglu", "pre"),
        ("rmsnorm", "relu", "post"),
        ("layernorm", "swiglu", "post"),
    ]
]
ARCHITECTURES += [  # grouped-query attention (Llama, Mistral), with query/key/value biases only (Qwen2)
    dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_head=4, n_kv_head=2),
    dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True, n_head=4, n_kv_head=1),
    dict(position="alibi", n_head=4, n_kv_head=2, tie_embeddings=False),
    dict(position="rope", rope_scaling="llama3", rope_factor=8.0, rope_original_context=8, n_kv_head=1),
    dict(position="rope", rope_scaling="yarn", rope_factor=4.0, rope_original_context=8, n_kv_head=1),
]
ARCHITECTURES += [  # issue 18's options: QK-norm, ReLU^2, soft-capped logits (a small cap: tanh bends)
    dict(qk_norm=True),
    dict(position="rope", norm="rmsnorm", mlp="relu2", bias=False, qk_norm=True, n_head=4, n_kv_head=2),
    dict(position="alibi", norm_placement="post", qk_norm=True, logit_softcap=0.5),
    dict(position="rope", mlp="relu2", logit_softcap=0.5, zero_init=True),
]
ARCHITECTURES += [  # issue 19: the vocabulary's 23 rows padded to 64 (tied, untied and soft-capped)
    dict(vocab_multiple=64),
    dict(
        position="rope",
        norm="rmsnorm",
        mlp="swiglu",
        tie_embeddings=False,
        logit_softcap=0.5,
        vocab_multiple=64,
    ),
]


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fastpath"])
@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: "-".join(str(v) for v in a.values()))
def test_cached_step_logits_equal_full_forward(arch: dict, fast: bool) -> None:
    """A prompt, then one token at a time through the cache (plain: the model's forward; fastpath:
    the one-token LayerSteps of an inference scope): the logits must be those of one full
    forward, at every position."""
    model = tiny_model(VOCAB, block_size=BLOCK, **arch)
    idx = torch.randint(0, 23, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
    with fastpath.inference(model) if fast else contextlib.nullcontext(), torch.no_grad():
        assert (model.fast_step is not None) == fast
        cache = KVCache.for_model(model, 3)
        parts = [model(idx[:, :7], cache)] + [model(idx[:, t : t + 1], cache) for t in range(7, 20)]
    assert_float32_close(torch.cat(parts, dim=1), full, model.config)  # one-token steps: other sums


@pytest.mark.parametrize("position", ["learned", "rope", "alibi"])
def test_greedy_tokens_with_and_without_cache_are_identical(position: str) -> None:
    model = tiny_model(VOCAB, block_size=BLOCK, position=position)
    tok = tiny_tokenizer(ALPHABET)
    prompt = [tok.bos_id, 7, 8, 9]
    out = generate(model, tok, [prompt], SampleConfig(temperature=0, max_new_tokens=15))[0]
    expected = greedy_uncached(model, prompt, 15)[len(prompt) :]
    if tok.eos_id in expected:
        expected = expected[: expected.index(tok.eos_id)]
    assert out.ids == expected


def test_left_padded_batch_equals_one_prompt_at_a_time() -> None:
    model = tiny_model(VOCAB, block_size=BLOCK)
    prompts = [[2, 5, 6, 7, 8, 9], [2, 11], [2, 12, 13, 14]]
    cache, logits = prefill(model, prompts, pad_id=0)
    batched = [logits]
    nxt = logits.argmax(-1)
    for _ in range(4):
        logits = step(model, cache, nxt)
        batched.append(logits)
        nxt = logits.argmax(-1)
    for row, p in enumerate(prompts):
        c1, l1 = prefill(model, [p], pad_id=0)
        single = [l1]
        n1 = l1.argmax(-1)
        for _ in range(4):
            l1 = step(model, c1, n1)
            single.append(l1)
            n1 = l1.argmax(-1)
        for a, b in zip(batched, single, strict=True):
            assert_float32_close(a[row], b[0], model.config)  # a batch of other shapes: other sums


def test_reorder_and_expand_move_cache_rows() -> None:
    cache = KVCache(1, 2, 1, 4, 2)
    keys = torch.tensor([1.0, 2.0]).view(2, 1, 1, 1).expand(2, 1, 1, 2)  # (B, H, T, D)
    cache.update(0, keys, -keys)
    cache.advance(1)
    cache.expand(3)
    assert cache.batch_size == 6 and cache.k[0, :, 0, 0, 0].tolist() == [1, 1, 1, 2, 2, 2]
    assert cache.v[0, :, 0, 0, 0].tolist() == [-1, -1, -1, -2, -2, -2]
    cache.reorder(torch.tensor([5, 0]))
    assert cache.k[0, :, 0, 0, 0].tolist() == [2, 1] and cache.v[0, :, 0, 0, 1].tolist() == [-2, -1]


def test_generation_continues_past_the_context_with_a_sliding_window() -> None:
    model = tiny_model(VOCAB, block_size=12)
    tok = tiny_tokenizer(ALPHABET)
    out = generate(model, tok, [[tok.bos_id, 7]], SampleConfig(temperature=1.0, max_new_tokens=40, seed=0))[0]
    assert out.finish_reason in ("length", "eos")
    long = generate(model, tok, [[tok.bos_id, 7]], SampleConfig(temperature=0, max_new_tokens=40))[0]
    assert len(long.ids) == 40 or long.finish_reason == "eos"
