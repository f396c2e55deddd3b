"""The scheduler without HTTP, step by step: requests that join a running batch (shorter and
longer prompts than its width, into holes and appended), leave it early, and time out, each
still give exactly the text ``generate`` gives them alone."""

from __future__ import annotations

import pytest
import torch
from helpers import GEMMA3_BLOCK, tiny_model, tiny_tokenizer

from lmcli.config.commands import SampleConfig
from lmcli.generate.decoding import make_prompt
from lmcli.generate.prefix_cache import PrefixCache
from lmcli.generate.rules import PENDING_TOKENS
from lmcli.generate.sampling import generate
from lmcli.model import fastpath
from lmcli.model.quant import quantize
from lmcli.serve.scheduler import Done, Failed, Job, Scheduler, Update

pytest.importorskip("starlette")


def _collect(store: dict) -> callable:
    def deliver(events: list) -> None:
        for e in events:
            if isinstance(e, Update):
                store.setdefault(e.index, "")
                store[e.index] += e.text
            else:
                store["end"] = e

    return deliver


ARCHITECTURES = {
    "learned": {},
    "rope-gqa-qkv-bias": dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_head=4, n_kv_head=2, qkv_bias=True
    ),
    # Gemma-3-like, a window of 6 on every other layer: the batch keeps the window and a block in its
    # ring (turned as rows move), generate's cache the window alone; the texts must agree
    "gemma-window": dict(
        **GEMMA3_BLOCK,
        scale_embeddings=True,
        n_head=4,
        n_kv_head=2,
        sliding_window=6,
        layer_pattern="LG",
        rope_local_base=100.0,
    ),
}


@pytest.mark.parametrize(
    ("arch", "quant", "kv_dtype"),
    # quantized models (lmcli.model.quant) decode in the batch too: their products are row by row;
    # a 16-bit KV cache (--kv-dtype) in the batch as in generate's cache
    [(arch, "none", None) for arch in ARCHITECTURES]
    + [("rope-gqa-qkv-bias", "int8", None), ("rope-gqa-qkv-bias", "int4", None)]
    + [("gemma-window", "none", torch.bfloat16), ("rope-gqa-qkv-bias", "none", torch.float16)]
    # a cache of q8_0 blocks (--kv-dtype q8_0: heads of 32 values), the window's ring in blocks too
    + [("gemma-window", "none", "q8_0")],
)
def test_joining_and_leaving_rows_keep_every_request_exact(arch: str, quant: str, kv_dtype) -> None:
    tok = tiny_tokenizer()
    heads = {"head_size": 32} if kv_dtype == "q8_0" else {}
    model = quantize(tiny_model(tok.vocab_size, block_size=64, **ARCHITECTURES[arch], **heads), quant, 32)
    model.kv_dtype = kv_dtype
    sched = Scheduler(model, tok, max_batch=6, max_queue=8)
    plan = [  # (iteration at which it arrives, prompt, settings)
        (0, "the cat sat on the", SampleConfig(max_new_tokens=30, temperature=0.9, seed=1, stop=("\x00",))),
        (0, "a", SampleConfig(max_new_tokens=3, temperature=0.0, seed=0)),  # leaves early: a hole
        (2, "the", SampleConfig(max_new_tokens=20, temperature=1.1, seed=5, num_samples=2, top_k=8)),
        (4, "dog", SampleConfig(max_new_tokens=10, temperature=1.0, seed=3, top_p=0.8)),  # into the hole
        # longer than the batch's width: every row shifts right
        (8, "the sun rose over the hill and the", SampleConfig(max_new_tokens=12, temperature=0.7, seed=9)),
    ]
    with fastpath.inference(model):
        expected = [
            [g.text for g in generate(model, tok, [make_prompt(p, tok, 64).ids], cfg)] for _, p, cfg in plan
        ]
    results: list[dict] = [{} for _ in plan]
    it = 0
    with fastpath.inference(model):
        while it < 200 and not all("end" in r for r in results):
            for k, (at, prompt, cfg) in enumerate(plan):
                if at == it:
                    sched.submit(Job([make_prompt(prompt, tok, 64).ids], cfg), _collect(results[k]))
            sched._iteration()
            it += 1
    for r, exp, (_, _, cfg) in zip(results, expected, plan, strict=True):
        assert isinstance(r["end"], Done)
        assert [r.get(j, "") for j in range(cfg.num_samples)] == exp
    assert sched.stats()["active_rows"] == 0 and sched.stats()["kv_cache_bytes"] == 0
    assert sched.engine.cache.dtype == (kv_dtype or torch.float32)


def test_a_request_past_its_time_fails_and_frees_its_rows() -> None:
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, block_size=64)
    sched = Scheduler(model, tok, max_batch=2, max_queue=2)
    result: dict = {}
    cfg = SampleConfig(max_new_tokens=40, stop=("\x00",))
    sched.submit(Job([[tok.bos_id]], cfg, timeout=0.0), _collect(result))
    sched._iteration()
    sched._iteration()
    assert isinstance(result["end"], Failed) and result["end"].kind == "timeout"
    assert sched.stats()["active_rows"] == 0


def test_a_2000_token_reply_decodes_a_few_tokens_per_step(monkeypatch) -> None:
    """The server decoded the whole reply at every token (quadratic in its length: 2,000 tokens
    were 2 million decoded); each step now decodes a few tokens, and the reply once at its end."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, block_size=2048, n_layer=1, n_head=2, n_embd=16)
    decoded: list[int] = []
    original = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or original(ids, **kw))
    sched = Scheduler(model, tok, max_batch=2, max_queue=2)
    n = 2000
    cfg = SampleConfig(max_new_tokens=n, min_new_tokens=n, temperature=1.0, seed=3, stop=("zz",))
    updates: list[Update] = []
    sched.submit(Job([[tok.bos_id]], cfg, top_logprobs=0), updates.extend)
    with fastpath.inference(model):
        while not updates or not isinstance(updates[-1], Done):
            sched._iteration()
    *steps, whole = decoded
    assert whole == n  # the reply, decoded once when it ended
    assert max(steps) <= PENDING_TOKENS + 1 and sum(steps) <= 3 * n  # a few tokens per step
    tokens = [e.token for u in updates[:-1] for e in u.logprobs]
    assert len(tokens) == n == updates[-1].completion_tokens
    assert "".join(u.text for u in updates[:-1]) == original(tokens)  # streamed whole


@pytest.mark.parametrize(
    ("arch", "kv_dtype"), [("learned", None), ("gemma-window", None), ("gemma-window", torch.bfloat16)]
)
def test_a_reply_that_ended_in_a_running_batch_is_reused_exactly(arch: str, kv_dtype) -> None:
    """With a prefix cache: a request whose prompt is an earlier request's prompt and reply
    (that row ended in a batch with padding and holes) starts from its cached keys and values
    and gives the text ``generate`` gives it alone; out of memory, the cache is given up."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, block_size=96, **ARCHITECTURES[arch])
    model.kv_dtype = kv_dtype  # the prefix cache's blocks in the cache's dtype
    sched = Scheduler(model, tok, max_batch=4, max_queue=8, prefixes=PrefixCache(1 << 26))
    first = make_prompt("the cat sat on the", tok, 96).ids
    cfg = SampleConfig(max_new_tokens=30, min_new_tokens=30, temperature=0.9, seed=1)
    with fastpath.inference(model):
        reply = generate(model, tok, [first], cfg)[0]
        follow = first + reply.ids + tok.encode(" and the dog")
        follow_cfg = SampleConfig(max_new_tokens=10, min_new_tokens=10, temperature=0.0)
        expected = generate(model, tok, [follow], follow_cfg)[0]
    plan = [  # (iteration, prompt, settings): the first row ends beside longer and shorter rows
        (0, make_prompt("a", tok, 96).ids, SampleConfig(max_new_tokens=40, temperature=1.0, seed=4)),
        (1, first, cfg),
        (3, make_prompt("the sun rose over the hill and the", tok, 96).ids, SampleConfig(max_new_tokens=50)),
        (40, follow, follow_cfg),
    ]
    results: list[dict] = [{} for _ in plan]
    logprobs: list[float] = []  # of the last request's tokens

    def follow_deliver(events: list) -> None:
        logprobs.extend(t.logprob for e in events if isinstance(e, Update) for t in e.logprobs)
        _collect(results[3])(events)

    with fastpath.inference(model):
        for it in range(300):
            for k, (at, ids, c) in enumerate(plan):
                if at == it:
                    top = 0 if k == 3 else None
                    sched.submit(
                        Job([ids], c, top_logprobs=top), follow_deliver if k == 3 else _collect(results[k])
                    )
            sched._iteration()
            if all("end" in r for r in results):
                break
    assert results[1][0] == reply.text
    assert results[3][0] == expected.text
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected.logprobs), atol=1e-4)
    assert results[3]["end"].cached_tokens >= len(first) + 29 - 15  # the reply's whole blocks too
    assert sched.stats()["prefix_cache_hits"] >= 1

    def out_of_memory(prompts):
        raise torch.OutOfMemoryError("no room")

    original = sched.engine.prefill
    calls = iter([out_of_memory, original])
    sched.engine.prefill = lambda prompts: next(calls)(prompts)
    result: dict = {}
    sched.submit(Job([follow], follow_cfg), _collect(result))
    with fastpath.inference(model):
        while "end" not in result:
            sched._iteration()
    assert result[0] == expected.text and result["end"].cached_tokens == 0
    assert sched.stats()["prefix_cache_bytes"] > 0  # emptied, then this request's blocks
