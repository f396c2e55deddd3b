"""Decode tokens/s with a float32 against a bfloat16 KV cache (``--kv-dtype``), at a long context;
``BENCH_KV`` names the caches (default float32,bfloat16; also float16, q8_0, q4_0).

A Qwen2.5-0.5B-shaped model (24 x 896, 14 heads, 2 key/value heads, MLP 4864, vocabulary
151936, tied; random float32 weights, nothing downloaded) decodes ``NEW`` tokens one at a time
through lmcli's CPU one-token step after ``CONTEXT`` cached columns. The columns are filled with
random keys and values instead of a prefill (a step's cost depends on how many columns it reads,
not on what they hold), so the bench takes seconds, not the minutes of a 1k-token prefill on one
thread. Each dtype runs in turn (A, B, A, B; the best of each); the figures are indicative on a
shared machine.

    python -m bench.bench_kv_dtype                    # 1 thread, a 1024-column context
    BENCH_CONTEXT=4096 BENCH_THREADS=2 python -m bench.bench_kv_dtype
    BENCH_CONTEXT=4096 BENCH_KV=float16,q8_0,q4_0 python -m bench.bench_kv_dtype
"""

from __future__ import annotations

import os
import time

import torch

from lmcli.config.model import ModelConfig
from lmcli.device import set_threads
from lmcli.model.fastpath import inference
from lmcli.model.kv_cache import KVCache, KVDtype, kv_dtype
from lmcli.model.transformer import Transformer

NEW = 16
QWEN = dict(n_layer=24, n_embd=896, n_head=14, n_kv_head=2, d_ff=4864, vocab_size=151936, qkv_bias=True)


def decode_speed(model: Transformer, dtype: KVDtype, context: int) -> tuple[float, int]:
    """Tokens/s of ``NEW`` one-token steps after ``context`` filled columns, and the cache's bytes."""
    model.kv_dtype = dtype
    cache = KVCache.for_model(model, 1)
    cache.reserve(context + NEW)
    g = torch.Generator().manual_seed(0)
    shape = (*cache.k.shape[:4], model.config.head_dim)  # (layers, 1, KV, columns, D)
    cache.k.copy_(cache.rows.stored(torch.randn(shape, generator=g)))  # (as the cache holds them)
    cache.v.copy_(cache.rows.stored(torch.randn(shape, generator=g)))
    cache.length = context
    token = torch.tensor([[5]])
    model(token, cache)  # a first step: buffers and tables made outside the timing
    start = time.perf_counter()
    for _ in range(NEW):
        model(token, cache)
    return NEW / (time.perf_counter() - start), 2 * cache.k.numel() * cache.k.element_size()


def main() -> None:
    context = int(os.environ.get("BENCH_CONTEXT", "1024"))
    threads = int(os.environ.get("BENCH_THREADS", "1"))
    set_threads(threads)
    torch.manual_seed(0)
    cfg = ModelConfig(
        block_size=max(2048, context + NEW + 1),
        position="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        **QWEN,
    )
    model = Transformer(cfg).eval()
    names = os.environ.get("BENCH_KV", "float32,bfloat16").split(",")
    best: dict[str, float] = {}
    size: dict[str, int] = {}
    with torch.no_grad(), inference(model):
        for _ in range(2):
            for name in names:
                speed, size[name] = decode_speed(model, kv_dtype(name), context)
                best[name] = max(best.get(name, 0.0), speed)
    print(f"Qwen2.5-0.5B shape, float32 weights, {context}-column context, {threads} thread(s), best of 2:")
    for name, speed in best.items():
        print(f"  KV cache {name:>8}: {speed:6.2f} tokens/s, cache {size[name] / 2**20:6.1f} MiB")
    for name in names[1:]:
        print(f"  {name} / {names[0]}: {best[name] / best[names[0]]:.3f}x")


if __name__ == "__main__":
    main()
