"""The KV cache's dtype (``--kv-dtype``): a float32 cache gives the full forward's logits (float32
tolerance); a bfloat16 or float16 cache gives them within its rounding (stated below) and the
same greedy tokens, in half the memory; every decoding command's cache takes the option.

Why float32 (the compute dtype) stays the default on the CPU: a bf16 cache moves the tiny
models' logits by 1.7e-4 to 2.4e-2 (0.03%-0.5% of their largest logit, measured in
docs/quantization.md), far past the float32 tolerance that the exactness tests of every cached
path (cached step == full forward, prefix cache == full prefill) rely on."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import assert_float32_close, make_run, run_cli, tiny_model, tiny_tokenizer
from test_sliding_window import windowed

from lmcli.cli.common import load_source
from lmcli.config.commands import BeamConfig, SampleConfig
from lmcli.errors import LmcliError
from lmcli.eval.downstream.scoring import Group, score_groups
from lmcli.generate.beam import beam_search
from lmcli.generate.sampling import generate
from lmcli.generate.speculative import Draft
from lmcli.model.fastpath import inference
from lmcli.model.kv_cache import KVCache, check_fits, kv_bytes
from lmcli.model.native import ops

# the largest logit difference a 16-bit cache may make, relative to the largest logit
# (bfloat16 keeps 8 significant bits: 2^-8 = 0.4% per value; float16 11: 0.05%)
RELATIVE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}

MODELS = {
    "learned": lambda: tiny_model(seed=0),
    "rope-gqa": lambda: tiny_model(seed=1, position="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1),
    "windowed": windowed,  # sliding-window layers in a ring, soft-capped attention
}


def stepwise(model: torch.nn.Module, idx: torch.Tensor, cache: KVCache, prompt: int) -> torch.Tensor:
    """Logits (B, T, V) of ``idx``: ``prompt`` columns at once, then one at a time."""
    outs = [model(idx[:, :prompt], cache)]
    outs += [model(idx[:, t : t + 1], cache) for t in range(prompt, idx.size(1))]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("fast", [False, True], ids=["forward", "cpu-step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_cache_gives_the_full_forward_within_its_rounding(name: str, fast: bool, dtype) -> None:
    model = MODELS[name]()
    idx = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(idx)
        with inference(model) if fast else contextlib.nullcontext():
            model.kv_dtype = dtype  # what --kv-dtype sets
            cache = KVCache.for_model(model, 2, window_slack=0)
            got = stepwise(model, idx, cache, prompt=9)
    assert got.dtype == torch.float32  # attention computed in the model's dtype
    assert cache.k.dtype == dtype and (cache.ring is None or cache.ring.k.dtype == dtype)
    if dtype == torch.float32:
        assert_float32_close(got, full, model.config)
        return
    diff = (got - full).abs().max().item()
    assert 0 < diff <= RELATIVE[dtype] * full.abs().max().item()
    assert torch.equal(got.argmax(-1), full.argmax(-1))  # the same greedy tokens


@pytest.mark.parametrize("slack", [None, 0, 4], ids=["no-ring", "ring", "ring-slack"])
def test_a_16_bit_cache_takes_half_the_memory_and_the_estimate_counts_it(slack: int | None) -> None:
    model = windowed()
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.kv_dtype = dtype
        cache = KVCache.for_model(model, 3, window_slack=slack)
        cache.reserve(model.config.block_size)  # a full context
        held = [cache.k, cache.v] + ([cache.ring.k, cache.ring.v] if cache.ring is not None else [])
        sizes[dtype] = sum(t.numel() * t.element_size() for t in held)
        # the pre-flight's count: n_kv_head x head_dim a column, the ring's columns for local layers
        itemsize = torch.empty((), dtype=dtype).element_size()
        assert kv_bytes(model.config, model.config.block_size, itemsize, slack) * 3 == sizes[dtype]
    assert sizes[torch.bfloat16] * 2 == sizes[torch.float32]


def test_check_fits_counts_the_cache_in_its_dtype(monkeypatch) -> None:
    model = tiny_model(seed=0, position="rope", n_kv_head=1, n_head=2)
    cfg = model.config
    per_row32 = kv_bytes(cfg, cfg.block_size, 4) + 16 * cfg.padded_vocab_size
    per_row16 = kv_bytes(cfg, cfg.block_size, 2) + 16 * cfg.padded_vocab_size
    assert (
        kv_bytes(cfg, cfg.block_size, 4) == 2 * cfg.n_layer * cfg.block_size * cfg.head_dim * 4
    )  # one kv head
    monkeypatch.setattr("lmcli.model.kv_cache.memory_of", lambda device: 10 * per_row16)
    model.kv_dtype = torch.bfloat16
    check_fits(model, 10, "ten rows")  # fits in bf16 ...
    model.kv_dtype = torch.float32
    with pytest.raises(LmcliError, match="ten rows needs 10 rows"):
        check_fits(model, 10, "ten rows")  # ... not in float32
    assert 10 * per_row32 > 10 * per_row16


def test_the_option_reaches_the_model_and_the_commands(tmp_path, capsys) -> None:
    run = make_run(tmp_path / "run")
    assert load_source(run, {}).model.kv_dtype is None  # auto: the compute dtype
    if ops.available():  # auto for GGUF blocks on the kernels: float16, as llama.cpp's cache
        assert load_source(run, {"quantize": "int8"}).model.kv_dtype == torch.float16
        assert load_source(run, {"quantize": "int8", "kv_dtype": "float32"}).model.kv_dtype == torch.float32
    model = load_source(run, {"kv_dtype": "bfloat16"}).model
    assert model.kv_dtype == torch.bfloat16 and KVCache.for_model(model, 1).k.dtype == torch.bfloat16
    outs = {}
    for kv in ("float32", "bfloat16"):
        code, out, err = run_cli(
            [
                "sample",
                str(run),
                "-p",
                "the",
                "--max-new-tokens",
                "12",
                "--temperature",
                "0",
                "--kv-dtype",
                kv,
            ],
            capsys,
        )
        assert code == 0, err
        outs[kv] = out
    assert outs["float32"] == outs["bfloat16"]  # greedy: the same text
    code, _, err = run_cli(["sample", str(run), "-p", "the", "--kv-dtype", "int8"], capsys)
    assert code == 2 and err.startswith("error:")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_speculative_decoding_and_beams_take_the_16_bit_cache(dtype) -> None:
    """The draft's cache and the model's in ``dtype``: the draft's greedy text is the model's
    alone (a windowed model: the ring with its roll-back slack); beam search decodes in it too."""
    tok = tiny_tokenizer()
    model = windowed(block_size=64)
    draft = windowed(seed=2, n_layer=2, rope_pattern="RN", block_size=64)
    model.kv_dtype = draft.kv_dtype = dtype
    prompts = [tok.with_bos(tok.encode(t)) for t in ("the cat", "a bird sang in")]
    cfg = SampleConfig(max_new_tokens=25, temperature=0.0)
    with torch.no_grad():
        plain = generate(model, tok, prompts, cfg)
        drafted = generate(model, tok, prompts, cfg, draft=Draft(draft, tok, 3))
        beams = beam_search(
            model, prompts, BeamConfig(beam_size=3, max_new_tokens=10), eos_id=tok.eos_id, pad_id=tok.pad_id
        )
    assert [g.ids for g in drafted] == [g.ids for g in plain]
    model.kv_dtype = torch.float32
    with torch.no_grad():
        wide = beam_search(
            model, prompts, BeamConfig(beam_size=3, max_new_tokens=10), eos_id=tok.eos_id, pad_id=tok.pad_id
        )
    assert [b[0].ids for b in beams] == [b[0].ids for b in wide]  # the same best beam


def test_eval_scoring_reads_a_16_bit_cache_within_its_rounding() -> None:
    """``eval``'s cached scoring (contexts in a cache, continuations on it): the log-likelihoods
    of a bfloat16 cache are the float32 cache's within its rounding, the greedy flags the same."""
    model = tiny_model(seed=1, position="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1, block_size=64)
    g = torch.Generator().manual_seed(4)

    def ids(n: int) -> list[int]:
        return torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist()

    groups = [Group(ids(20 + 3 * i), [ids(1 + i), ids(5), ids(2)]) for i in range(4)]
    scores = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            model.kv_dtype = dtype
            scores[dtype] = score_groups(model, groups, batch_size=2)
    wide = torch.tensor([s for group in scores[torch.float32] for s, _ in group])
    narrow = torch.tensor([s for group in scores[torch.bfloat16] for s, _ in group])
    assert 0 < (wide - narrow).abs().max() <= RELATIVE[torch.bfloat16] * wide.abs().max()
    flags = {d: [f for group in s for _, f in group] for d, s in scores.items()}
    assert flags[torch.float32] == flags[torch.bfloat16]
