"""The cost of a quantized KV cache (``--kv-dtype q8_0|q4_0``): the KL divergence of each position's
next-token distribution against a float16 cache's over a long text, and the memory it saves.

A model (``BENCH_MODEL``: a GGUF file, a Hugging Face folder or an lmcli run, loaded as ``lmcli
sample`` loads it; by default a SmolLM2-135M-shaped model with random weights, nothing
downloaded, whose figures say little of a trained model's: attention over random keys is near
uniform, so rounding them costs less than it would) reads ``BENCH_CONTEXT`` tokens (4096;
``BENCH_TEXT``: a text file through the model's tokenizer, else a fixed pattern of ids) in chunks
of ``CHUNK`` (llama.cpp's micro-batch), each chunk attending over the cache as it was written:
float16, q8_0 and q4_0 in lockstep. Each position's KL(p_f16 || p_q) (``llama-perplexity
--kl-divergence``'s measure), its mean and 99th percentile, and how often the most likely token
is the same; the cache's bytes at that context.

    python -m bench.bench_kv_quant
    BENCH_MODEL=model.gguf BENCH_TEXT=book.txt python -m bench.bench_kv_quant
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from lmcli.config.model import ModelConfig
from lmcli.device import set_threads
from lmcli.model.fastpath import inference
from lmcli.model.kv_cache import KVCache
from lmcli.model.transformer import Transformer

CHUNK = 512
DTYPES = (torch.float16, "q8_0", "q4_0")
SMOLLM2 = dict(
    n_layer=30, n_embd=576, n_head=9, n_kv_head=3, d_ff=1536, vocab_size=49152, tie_embeddings=True
)


def load(context: int) -> tuple[Transformer, list[int]]:
    """The model and ``context`` token ids to read."""
    source, text = os.environ.get("BENCH_MODEL"), os.environ.get("BENCH_TEXT")
    if source:
        from lmcli.formats.sources import load_model

        ckpt = load_model(source, "cpu", as_stored=True)
        model, tok = ckpt.model, ckpt.tokenizer
        ids = tok.encode(Path(text).read_text()) if text else []
    else:
        torch.manual_seed(0)
        cfg = ModelConfig(
            block_size=context, position="rope", norm="rmsnorm", mlp="swiglu", bias=False, **SMOLLM2
        )
        model, ids = Transformer(cfg).eval(), []
    vocab = model.config.vocab_size
    ids = ids or [5 + (i * 7919 + (i // 97) * 31) % (vocab - 5) for i in range(context)]
    if len(ids) < context or model.config.block_size < context:
        raise SystemExit(
            f"need {context} tokens and a context of as many ({len(ids)}, {model.config.block_size})"
        )
    return model, ids[:context]


def main() -> None:
    context = int(os.environ.get("BENCH_CONTEXT", "4096"))
    set_threads(int(os.environ.get("BENCH_THREADS", "1")))
    model, ids = load(context)
    idx = torch.tensor([ids])
    kl: dict[str, list[torch.Tensor]] = {str(d): [] for d in DTYPES[1:]}
    same: dict[str, int] = {str(d): 0 for d in DTYPES[1:]}
    size: dict[str, int] = {}
    start = time.perf_counter()
    with torch.no_grad(), inference(model):
        caches = {}
        for dtype in DTYPES:
            model.kv_dtype = dtype
            caches[str(dtype)] = KVCache.for_model(model, 1, max_len=context)
        for at in range(0, context, CHUNK):
            chunk = idx[:, at : at + CHUNK]
            ref = model(chunk, caches[str(DTYPES[0])])[0].float().log_softmax(-1)  # (T, V)
            for name in kl:
                got = model(chunk, caches[name])[0].float().log_softmax(-1)
                kl[name].append((ref.exp() * (ref - got)).sum(-1))  # (T,)
                same[name] += int((got.argmax(-1) == ref.argmax(-1)).sum())
        size = {name: cache.nbytes() for name, cache in caches.items()}
    elapsed = time.perf_counter() - start
    print(f"{context} tokens through float16, q8_0 and q4_0 caches ({elapsed:.0f} s), against float16:")
    for name, parts in kl.items():
        d = torch.cat(parts)
        print(
            f"  {name}: KL mean {d.mean():.2e}, 99th percentile {d.quantile(0.99):.2e}, max {d.max():.2e}; "
            f"same top token {same[name] / context:.4f}; cache {size[name] / 2**20:.1f} MiB "
            f"({size[name] / size[str(DTYPES[0])]:.3f} of float16's {size[str(DTYPES[0])] / 2**20:.1f})"
        )


if __name__ == "__main__":
    main()
