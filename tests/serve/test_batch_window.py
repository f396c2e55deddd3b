"""Serve's batch cache keeps only the last window (plus a prefix-cache block) of a model's
sliding-window layers (``BatchCache`` with a ``WindowRing``): rows joining and leaving, padding
shifting left and right, replies many windows long and a prefix cache give the texts and
log-probs ``generate`` gives each request alone, in memory that stops growing with the context."""

from __future__ import annotations

import pytest
import torch
from helpers import GEMMA3_BLOCK, tiny_model, tiny_tokenizer

from lmcli.config.commands import SampleConfig
from lmcli.generate.decoding import make_prompt
from lmcli.generate.prefix_cache import PrefixCache
from lmcli.generate.sampling import generate
from lmcli.model import fastpath
from lmcli.model.kv_cache import kv_bytes
from lmcli.serve.batch_cache import RING_SLACK
from lmcli.serve.scheduler import Done, Job, Scheduler, Update

pytest.importorskip("starlette")

W = 5
GEMMA_LIKE = dict(
    **GEMMA3_BLOCK,
    n_head=4,
    n_kv_head=2,
    sliding_window=W,
    layer_pattern="LLG",
    n_layer=3,
    rope_local_base=100.0,
)


def _run(sched: Scheduler, plan: list, top: bool = False, limit: int = 600) -> tuple[list[dict], list]:
    """Submit ``plan`` ((iteration, prompt ids, settings)) and step until every request ended:
    each request's texts (by choice) and end, the per-step cache sizes (bytes, ring columns)."""
    results: list[dict] = [{} for _ in plan]
    sizes = []

    def deliver(k: int):
        def f(events: list) -> None:
            for e in events:
                if isinstance(e, Update):
                    results[k].setdefault(e.index, "")
                    results[k][e.index] += e.text
                    results[k].setdefault("logprobs", []).extend(t.logprob for t in e.logprobs)
                else:
                    results[k]["end"] = e

        return f

    for it in range(limit):
        for k, (at, ids, cfg) in enumerate(plan):
            if at == it:
                sched.submit(Job([ids], cfg, top_logprobs=0 if top else None), deliver(k))
        with torch.inference_mode():  # as the server's decoding thread runs it
            sched._iteration()
        cache = sched.engine.cache
        if cache is not None and cache.ring is not None and cache.batch_size:
            sizes.append((cache.length, cache.batch_size, cache.nbytes(), cache.ring.k.size(3)))
        if all("end" in r for r in results):
            break
    return results, sizes


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16], ids=["float32", "bf16"])
def test_long_replies_in_a_changing_batch_keep_only_the_window(kv_dtype) -> None:
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, block_size=256, **GEMMA_LIKE)
    model.kv_dtype = kv_dtype
    cfg = model.config
    prompts = [
        make_prompt(p, tok, 256).ids for p in ("the cat", "a", "the sun rose over the hill and the", "dog")
    ]
    plan = [  # a long reply beside rows that join late (shifting it right) and leave (shifting it left)
        (0, prompts[0], SampleConfig(max_new_tokens=120, min_new_tokens=120, temperature=0.9, seed=1)),
        (3, prompts[1], SampleConfig(max_new_tokens=8, temperature=0.0)),
        (5, prompts[2], SampleConfig(max_new_tokens=40, temperature=1.0, seed=7, top_k=10)),
        (60, prompts[3], SampleConfig(max_new_tokens=30, temperature=0.8, seed=2)),
    ]
    with fastpath.inference(model):
        expected = [generate(model, tok, [ids], c)[0] for _, ids, c in plan]
        sched = Scheduler(model, tok, max_batch=4, max_queue=8)
        results, sizes = _run(sched, plan, top=True)
    for r, exp in zip(results, expected, strict=True):
        assert isinstance(r["end"], Done) and r[0] == exp.text
        torch.testing.assert_close(torch.tensor(r["logprobs"]), torch.tensor(exp.logprobs), atol=1e-4, rtol=0)
    # the ring: W + RING_SLACK columns of the two local layers, whatever the batch's length
    assert {ring for *_, ring in sizes} == {W + RING_SLACK}
    longest = max(sizes)
    assert longest[0] > 120  # the batch went many windows past the ring
    itemsize = 2 if kv_dtype else 4
    rows = longest[1]
    plain = rows * kv_bytes(cfg, longest[0], itemsize, None)  # every column of every layer
    kept = rows * kv_bytes(cfg, longest[0], itemsize, RING_SLACK)  # the global layer, and the ring
    assert longest[2] <= kept + rows * kv_bytes(cfg, 16, itemsize, None)  # (the buffers grow 16 at a time)
    assert longest[2] < 0.5 * plain


def test_a_prefix_cache_keeps_the_blocks_of_a_windowed_batch() -> None:
    """The ring drops a row's old columns, so its blocks go to the prefix cache as they are
    completed: a follow-up request that starts with an earlier prompt and reply reuses them
    and gets the text ``generate`` gives it alone."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, block_size=256, **GEMMA_LIKE)
    first = make_prompt("the cat sat on the", tok, 256).ids
    cfg = SampleConfig(max_new_tokens=70, min_new_tokens=70, temperature=0.9, seed=1)
    with fastpath.inference(model):
        reply = generate(model, tok, [first], cfg)[0]
        follow = first + reply.ids + tok.encode(" and the dog")
        follow_cfg = SampleConfig(max_new_tokens=10, min_new_tokens=10, temperature=0.0)
        expected = generate(model, tok, [follow], follow_cfg)[0]
        sched = Scheduler(model, tok, max_batch=4, max_queue=8, prefixes=PrefixCache(1 << 26))
        plan = [
            (0, make_prompt("a", tok, 256).ids, SampleConfig(max_new_tokens=90, temperature=1.0, seed=4)),
            (2, first, cfg),
            (100, follow, follow_cfg),
        ]
        results, sizes = _run(sched, plan)
    assert results[1][0] == reply.text and results[2][0] == expected.text
    assert results[2]["end"].cached_tokens >= len(first) + 69 - 15  # the reply's whole blocks too
    assert {ring for *_, ring in sizes} == {W + RING_SLACK}
