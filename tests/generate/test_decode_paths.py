"""The decoding fast paths: the growing KV cache, the exponential-race draw, decoding thread
count, and the CPU inference scope (weight layout, packed weights, the inference GELU, one-token
layer steps), and min_new_tokens."""

from __future__ import annotations

import copy
import os
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import assert_float32_close, tiny_model, tiny_tokenizer
from torch import nn

import lmcli.model.fastpath.cpu as cpu_module
import lmcli.model.fastpath.packed as packed_module
from lmcli.config.commands import SampleConfig
from lmcli.generate.decoding import prefill, step
from lmcli.generate.rules import draw
from lmcli.generate.sampling import generate
from lmcli.model import fastpath
from lmcli.model.fastpath.packed import PackingLinear, packing_available
from lmcli.model.kv_cache import GROW, KVCache


def test_cache_grows_past_its_first_buffer_and_reorders_every_column() -> None:
    model = tiny_model(block_size=48)
    idx = torch.randint(5, 20, (2, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx[:, :40])
        cache = KVCache.for_model(model, 2)
        assert cache.k.size(3) == GROW and cache.max_len == 48
        parts = [model(idx[:, :3], cache)] + [model(idx[:, t : t + 1], cache) for t in range(3, 40)]
        assert 40 <= cache.k.size(3) <= 48
        assert_float32_close(torch.cat(parts, dim=1), full, model.config)  # cached steps: other sums
        cache.reorder(torch.tensor([1, 1, 0]))
        swapped = model(idx[[1, 1, 0], 40:41], cache)
    assert_float32_close(swapped[:, 0], model(idx[[1, 1, 0], :41])[:, -1], model.config)


def test_padded_decoding_needs_no_mask_rebuild_and_matches_one_row() -> None:
    model = tiny_model()
    cache, logits = prefill(model, [[2, 5, 6, 7], [2, 9]], pad_id=0)
    assert cache.padding.has_padding and cache.padding.max_start == 2
    nxt = torch.tensor([11, 12])
    batched = step(model, cache, nxt)
    single_cache, _ = prefill(model, [[2, 9]], pad_id=0)
    assert_float32_close(batched[1], step(model, single_cache, nxt[1:])[0], model.config)  # other shapes


def test_draw_takes_the_same_tokens_as_multinomial() -> None:
    probs = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)).mul(2).softmax(-1)
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(6)]
        ref = [torch.Generator().manual_seed(seed + i) for i in range(6)]
        expected = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(ref)])
        assert draw(probs, gens).tolist() == expected.tolist()


def test_min_new_tokens_holds_back_eos() -> None:
    model, tok = tiny_model(seed=3), tiny_tokenizer()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_id] += 3.0  # <eos> very likely at every step
    cfg = SampleConfig(temperature=1.0, max_new_tokens=12, seed=0)
    free = generate(model, tok, [[tok.bos_id, 5]], cfg)[0]
    held = generate(model, tok, [[tok.bos_id, 5]], replace(cfg, min_new_tokens=12))[0]
    assert free.finish_reason == "eos" and len(free.ids) < 12
    assert held.finish_reason == "length" and len(held.ids) == 12 and tok.eos_id not in held.ids


def test_step_threads_and_the_inference_scope_change_no_token(monkeypatch) -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    cfg = SampleConfig(temperature=1.0, max_new_tokens=30, seed=4)
    threads = torch.get_num_threads()
    with fastpath.step_threads(model, 1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads
    monkeypatch.setattr(cpu_module, "LAYOUT_MIN_WEIGHT", 1)  # lay out even this tiny model's weights
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with fastpath.inference(model):
        plain = generate(model, tok, [[tok.bos_id, 5, 6]], cfg)[0].ids  # re-entered: the same scope
        assert not model.h[0].mlp.c_fc.weight.is_contiguous()  # wide: transposed in memory
        assert model.h[0].mlp.c_proj.weight.is_contiguous()  # narrow: left alone
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the scope's end gives back the (out, in) layout, the module classes and the plain forward
    assert all(p.is_contiguous() and not p.is_inference() for p in model.parameters())
    assert all(type(m) is not PackingLinear for m in model.modules()) and model.fast_step is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert generate(model, tok, [[tok.bos_id, 5, 6]], cfg)[0].ids == plain


@pytest.mark.parametrize(
    "arch",
    # GQA: a context the beams never fill (rows that slide together see other windows than alone)
    [{}, dict(block_size=40, position="rope", n_head=4, n_kv_head=2, bias=False, qkv_bias=True)],
    ids=["mha", "gqa-qkv-bias"],
)
def test_batched_beams_with_shared_prompt_columns_equal_one_input_at_a_time(arch: dict) -> None:
    from lmcli.config.commands import BeamConfig
    from lmcli.generate.beam import beam_search

    model, tok = tiny_model(**{"block_size": 20, **arch}), tiny_tokenizer()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(12.0)  # confident predictions: no near-ties for batching to flip
    prompts = [[tok.bos_id, 5, 6, 7, 8], [tok.bos_id, 9], [tok.bos_id, 12, 13]]
    cfg = BeamConfig(beam_size=3, max_new_tokens=30)  # past the context: the window slides
    batched = beam_search(model, prompts, cfg, eos_id=tok.eos_id, pad_id=tok.pad_id)
    for prompt, hyps in zip(prompts, batched, strict=True):
        alone = beam_search(model, [prompt], cfg, eos_id=tok.eos_id, pad_id=tok.pad_id)[0]
        assert hyps[0].ids == alone[0].ids
        assert abs(hyps[0].score - alone[0].score) < 1e-4


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN packed linear")
@pytest.mark.parametrize("variant", [{}, {"mlp": "swiglu", "norm": "rmsnorm"}, {"norm_placement": "post"}])
def test_packed_weights_give_the_plain_products_and_follow_weight_changes(monkeypatch, variant) -> None:
    monkeypatch.setattr(packed_module, "PACK_MIN_WEIGHT", 1)  # pack even this tiny model's weights
    model = tiny_model(**variant)
    idx = torch.randint(5, 20, (4, 12), generator=torch.Generator().manual_seed(0))
    plain = model(idx).detach()  # autograd on: always F.linear
    with fastpath.inference(model), torch.no_grad():
        packs = model.h[0].attn.c_attn._packs
        packed = model(idx)
        assert len(packs) > 0  # the products above did use packed weights
        cache = KVCache.for_model(model, 4)
        steps = [model(idx[:, :5], cache)] + [model(idx[:, t : t + 1], cache) for t in range(5, 12)]
        assert_float32_close(packed, plain, model.config)  # oneDNN's kernels sum in their own order
        assert_float32_close(torch.cat(steps, dim=1), plain, model.config)
        model.h[0].mlp.c_fc.weight.mul_(1.5)  # an in-place change: the old pack must not serve
        changed = model(idx)
    assert_float32_close(changed, model(idx).detach(), model.config)
    assert not torch.allclose(changed, plain, atol=1e-3)
    assert len(packs) == 0 and type(model.h[0].attn.c_attn) is nn.Linear  # the scope's end drops them


def test_inference_gelu_equals_the_tanh_gelu() -> None:
    x = torch.cat([torch.linspace(-12, 12, 10001), torch.tensor([-1e20, -60.0, 0.0, 60.0, 1e20])])
    with torch.no_grad():
        fast = cpu_module.gelu_tanh(x)
    torch.testing.assert_close(fast, torch.nn.functional.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6)


def test_a_model_in_an_inference_scope_can_be_copied_and_pickled(monkeypatch) -> None:
    monkeypatch.setattr(packed_module, "PACK_MIN_WEIGHT", 1)
    model, tok = tiny_model(), tiny_tokenizer()
    idx = torch.randint(5, 20, (4, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(idx)
    with fastpath.inference(model), torch.no_grad():
        prefill(model, [[tok.bos_id, 5, 6]] * 4, tok.pad_id)  # packs made, a step plan too
        step(model, prefill(model, [[tok.bos_id, 5]], tok.pad_id)[0], torch.tensor([7]))
        twins = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for twin in twins:  # packed tensors and the scope's step stay behind
        assert twin.fast_step is None and len(twin.h[0].attn.c_attn._packs) == 0
        with torch.no_grad():
            torch.testing.assert_close(twin(idx), expected)


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN packed linear")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_models_are_packed_in_place_and_get_their_weights_back_exactly(monkeypatch, dtype) -> None:
    if dtype is torch.bfloat16 and not packed_module.bf16_packing_available():
        pytest.skip("oneDNN has no native bfloat16 here")
    monkeypatch.setattr(cpu_module, "IN_PLACE_MIN_BYTES", 0)  # treat this tiny model as a large one
    monkeypatch.setattr(cpu_module, "PACK_MIN_WEIGHT", 1)
    monkeypatch.setenv("LMCLI_NATIVE_LAYER", "0")  # (the native step keeps the weights it reads plain)
    arch = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_head=4, n_kv_head=2)
    model = tiny_model(**arch).to(dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(5, 20, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(idx)
    with fastpath.inference(model), torch.no_grad():
        fc = model.h[0].mlp.c_fc.weight
        assert fc.shape == before["h.0.mlp.c_fc.weight"].shape and fc.untyped_storage().nbytes() <= 4
        assert model.lm_head.weight.untyped_storage().nbytes() > 4  # the tied table stays plain
        packed = model(idx)
        cache = KVCache.for_model(model, 2)
        steps = [model(idx[:, :5], cache)] + [model(idx[:, t : t + 1], cache) for t in range(5, 12)]
        with torch.enable_grad():
            graded = model(idx)  # autograd: the plain weight, from the packed copy
    for got in (packed, torch.cat(steps, dim=1), graded.detach()):
        if dtype is torch.float32:
            assert_float32_close(got, plain, model.config)
        else:  # bfloat16: oneDNN and MKL round their sums differently
            torch.testing.assert_close(got, plain, rtol=0.05, atol=0.05)
    assert all(torch.equal(before[k], v) and v.is_contiguous() for k, v in model.state_dict().items())


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not packing_available() or not Path("/proc/self/statm").exists(), reason="oneDNN, Linux")
def test_the_end_of_an_in_place_scope_gives_the_packed_copies_back() -> None:
    """A large model (weights past IN_PLACE_MIN_BYTES) keeps one copy of its weights after its
    inference scope: each packed copy is freed as its plain weight returns (they were all held
    until the last one, and the process stayed at twice the weights: load+sample 1.88x)."""
    model = tiny_model(n_layer=4, n_embd=768, n_head=12, block_size=64, bias=False)  # ~115 MB
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights > cpu_module.IN_PLACE_MIN_BYTES
    idx = torch.randint(5, 20, (1, 8), generator=torch.Generator().manual_seed(0))
    before = _resident()
    with fastpath.inference(model), torch.no_grad():
        assert model.h[0].mlp.c_fc.weight.untyped_storage().nbytes() <= 4  # packed in place
        model(idx)
    assert _resident() - before < 0.25 * weights
