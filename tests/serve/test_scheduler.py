"""The scheduler without HTTP, step by step: requests that join a running batch (shorter and
longer prompts than its width, into holes and appended), leave it early, and time out, each
still give exactly the text ``generate`` gives them alone."""

from __future__ import annotations

import pytest
from helpers import tiny_model, tiny_tokenizer

from lmcli import fastpath
from lmcli.config import SampleConfig
from lmcli.generate.decoding import make_prompt
from lmcli.generate.sampling import generate
from lmcli.quant import quantize
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
}


@pytest.mark.parametrize(
    ("arch", "quant"),
    # quantized models (lmcli.quant) decode in the batch too: their products are row by row
    [(arch, "none") for arch in ARCHITECTURES]
    + [("rope-gqa-qkv-bias", "int8"), ("rope-gqa-qkv-bias", "int4")],
)
def test_joining_and_leaving_rows_keep_every_request_exact(arch: str, quant: str) -> None:
    tok = tiny_tokenizer()
    model = quantize(tiny_model(tok.vocab_size, block_size=64, **ARCHITECTURES[arch]), quant, 32)
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
