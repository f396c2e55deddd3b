"""Sliding-window layers (Gemma 3, Qwen3, SmolLM3, Mistral) in every cached path: a local layer
sees the last W positions, and the decoders' caches keep only those (``WindowRing``).

Each cached route (a prompt then steps, short chunks, left padding, the CPU one-token step, a
speculative cut back, a beam reorder) gives the logits of one full forward over the sequence;
the full forward's window itself is checked against transformers in tests/formats."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import GEMMA3_BLOCK, assert_float32_close, tiny_model, tiny_tokenizer

from lmcli.config.commands import BeamConfig, SampleConfig
from lmcli.generate.beam import beam_search
from lmcli.generate.decoding import prefill
from lmcli.generate.sampling import generate
from lmcli.generate.speculative import Draft
from lmcli.model.fastpath import inference
from lmcli.model.kv_cache import KVCache

W = 5
# every variant at once: a Gemma-3-like block with a SmolLM3-like layer without rotary
VARIANTS = dict(
    **GEMMA3_BLOCK,
    head_size=12,
    n_layer=3,
    n_head=4,
    n_kv_head=2,
    sliding_window=W,
    layer_pattern="LG",
    rope_local_base=100.0,
    rope_pattern="RRN",
    scale_embeddings=True,
    attn_scalar=7.0,
    attn_softcap=3.0,
    logit_softcap=5.0,
)


def windowed(seed: int = 0, **changes) -> torch.nn.Module:
    """A tiny model of VARIANTS with wide weights (clear greedy margins)."""
    model = tiny_model(seed=seed, **{**VARIANTS, **changes})
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.4)
    return model


def stepwise(model: torch.nn.Module, idx: torch.Tensor, cache: KVCache, prompt: int, chunk: int = 1):
    """Logits (B, T, V) of ``idx`` through ``cache``: ``prompt`` columns at once, then ``chunk``
    at a time."""
    outs = [model(idx[:, :prompt], cache)]
    for t in range(prompt, idx.size(1), chunk):
        outs.append(model(idx[:, t : t + chunk], cache))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("slack", [None, 0, 3], ids=["full-cache", "ring", "ring-slack"])
@pytest.mark.parametrize("fast", [False, True], ids=["forward", "cpu-step"])
def test_cached_steps_equal_one_forward_past_the_window(slack: int | None, fast: bool) -> None:
    model = windowed()
    idx = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(idx)
        with inference(model) if fast else contextlib.nullcontext():
            cache = KVCache.for_model(model, 2, window_slack=slack)
            got = stepwise(model, idx, cache, prompt=9)
            assert (model.fast_step is not None) == fast
    assert_float32_close(got, full, model.config)
    if slack is not None:  # the local layers' keys: a ring of W + slack columns; the global ones grow
        assert cache.ring is not None and cache.ring.k.shape[:4] == (2, 2, 2, W + slack)
        assert cache.k.size(0) == 1 and cache.k.size(3) >= 30


def test_left_padded_rows_see_only_their_own_window() -> None:
    model = windowed()
    a = torch.randint(0, model.config.vocab_size, (1, 26), generator=torch.Generator().manual_seed(1))
    b = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache, first = prefill(model, [a[0, :8].tolist(), b[0, :2].tolist()], pad_id=0, window_slack=0)
        rows = [first]
        for t in range(18):  # a step each, row b six columns behind row a
            step = torch.tensor([[a[0, 8 + t]], [b[0, 2 + t]]])
            rows.append(model(step, cache)[:, -1])
        alone_a, alone_b = model(a[:, :26])[0], model(b[:, :20])[0]
    got = torch.stack(rows, dim=1)  # (2, 19, V)
    assert_float32_close(got[0], alone_a[7:26], model.config)
    assert_float32_close(got[1], alone_b[1:20], model.config)


def test_a_cut_back_within_the_slack_is_exact_and_beyond_it_refused() -> None:
    model = windowed()
    idx = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model, 1, window_slack=3)
        stepwise(model, idx[:, :16], cache, prompt=7, chunk=3)  # columns 0..15, the last 3 at once
        cache.truncate(13)  # the 3 just written: the ring still holds the window before them
        assert_float32_close(stepwise(model, idx[:, 13:], cache, prompt=1), full[:, 13:], model.config)
        with pytest.raises(ValueError, match="cannot truncate a sliding-window cache"):
            cache.truncate(cache.length - 5)


def test_greedy_beam_of_one_and_speculative_decoding_agree_past_the_window() -> None:
    tok = tiny_tokenizer()
    model = windowed(seed=1, block_size=64)
    prompts = [tok.with_bos(tok.encode(t)) for t in ("the cat", "a bird sang in")]
    plain = generate(model, tok, prompts, SampleConfig(max_new_tokens=30, temperature=0))
    for prompt, g in zip(prompts, plain, strict=True):  # greedy by full forwards, no cache at all
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(len(g.ids)):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert g.ids == ids[len(prompt) :] and len(ids) > 3 * W
    beams = beam_search(
        model, prompts, BeamConfig(beam_size=1, max_new_tokens=30), eos_id=tok.eos_id, pad_id=tok.pad_id
    )
    assert [h[0].ids for h in beams] == [g.ids[: len(h[0].ids)] for g, h in zip(plain, beams, strict=True)]
    draft = Draft(windowed(seed=2, n_layer=2, rope_pattern="RN", block_size=64), tok, 4)
    fast = generate(model, tok, prompts, SampleConfig(max_new_tokens=30, temperature=0), draft=draft)
    assert [g.ids for g in fast] == [g.ids for g in plain]
    assert sum(g.drafted for g in fast) > sum(g.accepted for g in fast) > 0  # some drafts were cut back


def test_decoding_keeps_only_the_window_of_local_layers() -> None:
    model = windowed(block_size=64)
    with torch.no_grad():
        cache, _ = prefill(model, [list(range(1, 12))], pad_id=0, window_slack=0)
        for t in range(40):
            model(torch.tensor([[t % 20 + 1]]), cache)
    assert cache.length == 51
    assert cache.ring is not None and cache.ring.k.size(3) == cache.ring.v.size(3) == W  # stays at W


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--sliding-window", "4", "--layer-pattern", "LLX"],
            "invalid layer-pattern 'LLX': use the letters L and G",
        ),
        (["--layer-pattern", "LG"], "layer-pattern needs --sliding-window"),
        (["--rope-pattern", "RN"], "rope-local-base and rope-pattern need --position rope"),
        (["--position", "rope", "--rope-pattern", "RRN"], "at most one per layer (2)"),
        (["--sliding-window", "-1"], "sliding-window must be >= 0, got -1"),
        (["--n-embd", "30", "--n-head", "4"], "n-embd (30) must be divisible by n-head (4)"),
    ],
)
def test_bad_variant_options_are_one_line_errors(tmp_path, capsys, flags: list[str], message: str) -> None:
    from helpers import TINY_TEXT, assert_one_line_error, run_cli

    (tmp_path / "c.txt").write_text(TINY_TEXT)
    argv = ["train", str(tmp_path / "c.txt"), "-o", str(tmp_path / "run"), "--n-layer", "2", *flags]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "run").exists()
