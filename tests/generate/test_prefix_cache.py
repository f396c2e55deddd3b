"""The prefix cache: a prompt prefilled on top of cached keys and values gives the logits of a
full prefill, seeded replies are the same with and without it, and it stays within its bound."""

from __future__ import annotations

import contextlib
import gc
import os

import pytest
import torch
from helpers import assert_float32_close, rss_mb, tiny_model, tiny_tokenizer

from lmcli.config.commands import SampleConfig
from lmcli.generate.decoding import prefill
from lmcli.generate.prefix_cache import BLOCK, PrefixCache
from lmcli.generate.sampling import generate
from lmcli.model import fastpath
from lmcli.model.kv_cache import KVCache
from lmcli.serve.scheduler import malloc_trim

ARCHITECTURES = [
    dict(position="learned"),
    dict(position="sinusoidal", norm_placement="post"),
    dict(position="alibi"),
    dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_head=4, n_kv_head=2),
    dict(position="rope", qk_norm=True, logit_softcap=0.5),
]


def ids_of(n: int, seed: int, vocab: int = 20) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: "-".join(map(str, a.values())))
def test_prefill_on_cached_prefix_equals_full_prefill(arch: dict) -> None:
    model = tiny_model(block_size=96, **arch)
    prefixes = PrefixCache(1 << 30)
    first = ids_of(50, 0)
    second = first[:40] + ids_of(30, 1)  # shares 40 tokens: two whole blocks are reused
    with torch.no_grad():
        prefixes.prefill(model, first)
        cache, logits, reused = prefixes.prefill(model, second)
        full_cache, full_logits = prefill(model, [second], pad_id=0)
    assert reused == 2 * BLOCK
    assert cache.length == full_cache.length == len(second)
    assert_float32_close(logits, full_logits, model.config)
    n = len(second)
    assert_float32_close(cache.k[..., :n, :], full_cache.k[..., :n, :], model.config)
    assert_float32_close(cache.v[..., :n, :], full_cache.v[..., :n, :], model.config)


@pytest.mark.parametrize("fast", [False, True])
def test_a_prompt_keeps_one_token_to_prefill(fast: bool) -> None:
    """A prompt cached whole still prefills its last token (its logits start the reply): its
    last block again when it ends a block, or the one token alone (the fast path's step)."""
    model = tiny_model(block_size=96)
    prefixes = PrefixCache(1 << 30)
    whole, one_more = ids_of(2 * BLOCK, 2), ids_of(2 * BLOCK + 1, 2)
    with torch.no_grad(), fastpath.inference(model) if fast else contextlib.nullcontext():
        prefixes.prefill(model, whole)
        for ids, expected in ((whole, BLOCK), (one_more, 2 * BLOCK)):
            _, logits, reused = prefixes.prefill(model, ids)
            _, full = prefill(model, [ids], pad_id=0)
            assert reused == expected
            assert_float32_close(logits, full, model.config)


def converse(
    model, tok, cfg: SampleConfig, prefixes: PrefixCache | None
) -> tuple[list, list[int], list[int]]:
    """Five turns: each prompt is the prompt before, its reply and a new message. The replies
    (their tokens and log-probs), each turn's tokens from the cache, and each prompt's length."""
    prompt, replies, reused, lengths = tok.encode("the cat sat"), [], [], []
    for turn in range(5):
        before = prefixes.cached_tokens if prefixes is not None else 0
        g = generate(model, tok, [prompt], cfg, prefixes=prefixes)[0]
        replies.append((g.ids, g.logprobs))
        reused.append(prefixes.cached_tokens - before if prefixes is not None else 0)
        lengths.append(len(prompt))
        prompt = prompt + g.ids + tok.encode(f" and turn {turn} of the dog.")
    return replies, reused, lengths


# sliding-window layers (W = 5 on two of three layers): the decoding cache keeps their window and
# a block in a ring, and the reply's blocks go to the prefix cache as they are completed
WINDOWED = dict(
    position="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    n_layer=3,
    sliding_window=5,
    layer_pattern="LLG",
)


@pytest.mark.parametrize("arch", [{}, WINDOWED], ids=["full", "windowed"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_conversation_replies_equal_with_and_without_the_cache(
    temperature: float, arch: dict, monkeypatch
) -> None:
    """With the cache, each turn reuses the prompt and the reply before it; the replies are
    the same as without."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, block_size=256, **arch)
    cfg = SampleConfig(max_new_tokens=20, temperature=temperature, seed=3, min_new_tokens=20)
    rings = []
    ringed = KVCache.ringed

    def spy(cache: KVCache, *args) -> KVCache:
        out = ringed(cache, *args)
        rings.append(None if out.ring is None else out.ring.size)
        return out

    monkeypatch.setattr(KVCache, "ringed", spy)
    with fastpath.inference(model):
        plain, _, _ = converse(model, tok, cfg, None)
        cached, reused, lengths = converse(model, tok, cfg, PrefixCache(1 << 30))
    assert rings == [5 + BLOCK] * 5 if arch else rings == [None] * 5
    assert [ids for ids, _ in cached] == [ids for ids, _ in plain]
    for (_, got), (_, want) in zip(cached, plain, strict=True):  # the logits too, not only the draws
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)
    # each later turn reused the prompt before it and part of its reply (20 tokens, 19 of them
    # fed to the model; whole blocks only)
    assert all(reused[t] > lengths[t - 1] for t in range(1, 5))


def test_the_cache_stays_within_its_bound_least_recently_used_first() -> None:
    model = tiny_model(block_size=96)
    cfg = model.config
    block_bytes = 2 * cfg.n_layer * cfg.n_kv_head * BLOCK * cfg.head_dim * 4
    prefixes = PrefixCache(4 * block_bytes)  # four blocks
    a, b, c = ids_of(33, 10), ids_of(33, 11), ids_of(33, 12)  # two whole blocks each
    with torch.no_grad():
        prefixes.prefill(model, a)
        prefixes.prefill(model, b)
        assert prefixes.stats()["prefix_cache_blocks"] == 4
        prefixes.prefill(model, a)  # a is used again: b is now the least recently used
        prefixes.prefill(model, c)  # needs two blocks: b's leaf goes, then b's first block
        assert prefixes.bytes <= prefixes.max_bytes
        assert prefixes.stats()["prefix_cache_blocks"] == 4
        assert prefixes.prefill(model, a)[2] == 2 * BLOCK
        assert prefixes.prefill(model, c)[2] == 2 * BLOCK
        assert prefixes.prefill(model, b)[2] == 0
        stats = prefixes.stats()
    assert stats["prefix_cache_hits"] == 3 and stats["prefix_cache_misses"] == 4
    assert stats["prefix_cache_cached_tokens"] == 4 * BLOCK + 2 * BLOCK


def test_a_cache_too_small_for_a_block_caches_nothing_and_fails_nothing() -> None:
    model = tiny_model(block_size=96)
    prefixes = PrefixCache(100)
    ids = ids_of(40, 4)
    with torch.no_grad():
        _, logits, reused = prefixes.prefill(model, ids)
        _, again, reused_again = prefixes.prefill(model, ids)
        _, full = prefill(model, [ids], pad_id=0)
    assert reused == reused_again == 0 and prefixes.bytes == 0
    assert torch.equal(logits, again)
    assert_float32_close(logits, full, model.config)


@pytest.mark.slow
def test_memory_returns_after_clear() -> None:
    """Filling the cache with ~200 MiB of blocks and clearing it gives the memory back."""
    model = tiny_model(block_size=512, n_layer=4, n_embd=256, n_head=4)
    trim = malloc_trim()
    prefixes = PrefixCache(1 << 30)
    gc.collect()
    trim()
    baseline = rss_mb(os.getpid())
    with torch.no_grad():
        for seed in range(64):  # 64 different prompts of 496 tokens: 4 * 496 * 256 * 8 bytes each
            prefixes.prefill(model, ids_of(497, 100 + seed))
    full = rss_mb(os.getpid())
    assert prefixes.bytes >= 200 << 20
    assert full - baseline >= 180
    prefixes.clear()
    gc.collect()
    trim()
    assert prefixes.bytes == 0
    assert rss_mb(os.getpid()) - baseline < 0.1 * (full - baseline)
