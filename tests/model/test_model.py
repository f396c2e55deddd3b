"""The Transformer: causal masking for every variant, tying, parameter counts."""

from __future__ import annotations

import contextlib
import itertools
import re

import pytest
import torch
from helpers import assert_float32_close, tiny_model

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError

VARIANTS = list(
    itertools.product(("learned", "sinusoidal", "rope", "alibi"), ("layernorm", "rmsnorm"), ("pre", "post"))
)

SHAPE = dict(vocab_size=13, block_size=16, n_embd=16)  # 2 layers, 2 heads, seed 0: tiny_model's


def assert_causal(model: torch.nn.Module) -> None:
    """Changing the token at t changes the logits at t, and none before it (the same shapes, the
    same kernels: the earlier logits are computed as before, whatever the CPU)."""
    idx = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(1))
    base = model(idx)
    for t in range(16):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 13
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t]), "the changed token must matter"


@pytest.mark.parametrize("position,norm,placement", VARIANTS)
def test_future_tokens_never_change_earlier_logits(position: str, norm: str, placement: str) -> None:
    assert_causal(tiny_model(**SHAPE, position=position, norm=norm, norm_placement=placement))


NEW_OPTIONS = [
    dict(qk_norm=True),
    dict(mlp="relu2"),
    dict(logit_softcap=0.5),
    dict(qk_norm=True, position="rope"),
]


@pytest.mark.parametrize("options", NEW_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_future_tokens_never_change_earlier_logits_with_the_new_options(options: dict) -> None:
    model = tiny_model(**SHAPE, **options)
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norm gains, so QK-norm's weights count too
            p.add_(0.1 * torch.randn_like(p))
    assert_causal(model)


def test_logit_softcap_bounds_the_logits_and_qk_norm_normalizes_queries() -> None:
    capped = tiny_model(**SHAPE, logit_softcap=0.05)
    plain = tiny_model(**SHAPE)
    idx = torch.randint(0, 13, (1, 8), generator=torch.Generator().manual_seed(3))
    out = capped(idx)
    assert out.abs().max() < 0.05
    torch.testing.assert_close(out, 0.05 * torch.tanh(plain(idx) / 0.05))  # same seed, same weights
    attn = tiny_model(**SHAPE, qk_norm=True).h[0].attn
    q, k = attn.normalize_qk(3 * torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(1, 2, 5), rtol=1e-4, atol=1e-4)


def test_zero_init_starts_residual_projections_at_zero_and_they_learn() -> None:
    model = tiny_model(**SHAPE, zero_init=True).train()
    projections = [p for n, p in model.named_parameters() if n.endswith("c_proj.weight")]
    assert len(projections) == 4 and all((p == 0).all() for p in projections)
    idx = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    assert all(p.grad.abs().sum() > 0 for p in projections)  # the gradient reaches them


MLP_FORMULAS = {  # each variant's definition, written out from its paper
    "gelu": lambda x, m: m.c_proj(
        0.5 * m.c_fc(x) * (1 + torch.tanh(0.7978845608 * (m.c_fc(x) + 0.044715 * m.c_fc(x) ** 3)))
    ),
    "relu": lambda x, m: m.c_proj(torch.clamp(m.c_fc(x), min=0)),
    "relu2": lambda x, m: m.c_proj(torch.clamp(m.c_fc(x), min=0) ** 2),
    "swiglu": lambda x, m: m.c_proj(m.c_gate(x) * torch.sigmoid(m.c_gate(x)) * m.c_fc(x)),
}


@pytest.mark.parametrize("mlp", sorted(MLP_FORMULAS))
def test_each_mlp_variant_computes_its_formula_and_changes_the_model(mlp: str) -> None:
    """Every block's MLP equals its variant's formula, and the variants give different models
    from the same seed (an MLP name that fell back to another variant would fail)."""
    model = tiny_model(**SHAPE, mlp=mlp).eval()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    for block in model.h:
        torch.testing.assert_close(block.mlp(x), MLP_FORMULAS[mlp](x, block.mlp), rtol=1e-5, atol=1e-6)
    idx = torch.randint(0, 13, (1, 6), generator=torch.Generator().manual_seed(1))
    others = [tiny_model(**SHAPE, mlp=other).eval() for other in MLP_FORMULAS if other != mlp]
    assert all(not torch.allclose(model(idx), other(idx)) for other in others)


def test_tied_head_shares_the_embedding_and_untied_does_not() -> None:
    tied, untied = tiny_model(**SHAPE), tiny_model(**SHAPE, tie_embeddings=False)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() - tied.num_parameters() == 13 * 16


def test_prefix_positions_attend_bidirectionally_only_within_the_prefix() -> None:
    model = tiny_model(**SHAPE)
    idx = torch.randint(0, 13, (1, 10), generator=torch.Generator().manual_seed(2))
    prefix = torch.tensor([4])
    base = model(idx, prefix_len=prefix)
    changed = idx.clone()
    changed[0, 3] = (changed[0, 3] + 1) % 13  # inside the prefix: earlier prefix positions see it
    assert not torch.allclose(model(changed, prefix_len=prefix)[0, 0], base[0, 0])
    changed = idx.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 13  # after the prefix: still causal
    torch.testing.assert_close(model(changed, prefix_len=prefix)[0, :6], base[0, :6])


def test_sequence_longer_than_context_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the context"):
        tiny_model(**SHAPE)(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(n_embd=30, n_head=4), "divisible by n-head"),
        (dict(position="absolute"), "invalid position"),
        (dict(norm="batchnorm"), "invalid norm"),
        (dict(dropout=1.5), "dropout"),
        (dict(n_layer=0), "n-layer must be positive"),
    ],
)
def test_bad_model_configs_are_refused_with_a_clear_message(kw: dict, message: str) -> None:
    with pytest.raises(LmcliError, match=message):
        ModelConfig(**kw)


def test_output_index_computes_the_same_logits_at_fewer_positions() -> None:
    """The flat indices of the scored positions give what boolean-mask selection gave."""
    model = tiny_model(**SHAPE)
    idx = torch.randint(0, 13, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.rand(3, 9, generator=torch.Generator().manual_seed(4)) > 0.5
    index = mask.view(-1).nonzero().squeeze(1)  # what collate computes on the host
    torch.testing.assert_close(model(idx, output_index=index), model(idx)[mask], rtol=0, atol=0)


# ----------------------------------------------------------------------------- vocabulary padding

PADDED = dict(vocab_size=65, vocab_multiple=64, block_size=16, n_embd=16)  # 65 tokens, 128 rows


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_padded_vocabulary_has_128_rows_and_65_logits_in_every_path(tie: bool) -> None:
    """Vocabulary 65 padded to a multiple of 64: the tables hold 128 rows, yet the full forward,
    the cached forward, ``output_index``, ``last_only`` and the CPU fast one-token step all give
    logits over the 65 tokens, and cached decoding (plain and fast) equals the full forward."""
    from lmcli.model import fastpath
    from lmcli.model.kv_cache import KVCache

    model = tiny_model(**PADDED, tie_embeddings=tie)
    assert model.config.padded_vocab_size == 128
    assert model.wte.weight.shape == (128, 16) and model.lm_head.weight.shape == (128, 16)
    idx = torch.randint(0, 65, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(idx)
        assert full.shape == (2, 12, 65)
        assert model(idx, last_only=True).shape == (2, 1, 65)
        assert model(idx, output_index=torch.tensor([0, 5, 23])).shape == (3, 65)
        for fast in (False, True):
            with fastpath.inference(model) if fast else contextlib.nullcontext():
                assert (model.fast_step is not None) == fast
                cache = KVCache.for_model(model, 2)
                parts = [model(idx[:, :4], cache)] + [model(idx[:, t : t + 1], cache) for t in range(4, 12)]
            assert all(p.size(-1) == 65 for p in parts)
            assert_float32_close(torch.cat(parts, dim=1), full, model.config)  # other kernels: rounding


def test_padding_changes_no_logit_and_the_padded_rows_get_no_gradient() -> None:
    """The padded model computes what the unpadded one with the same 65 rows computes, and a
    training loss leaves the padded rows of the (untied) head and the embedding untouched."""
    padded = tiny_model(**PADDED, tie_embeddings=False)
    plain = tiny_model(**{**PADDED, "vocab_multiple": 1}, tie_embeddings=False)
    assert plain.wte.weight.shape == (65, 16)
    state = {
        k: v[:65] if k in ("wte.weight", "lm_head.weight") else v for k, v in padded.state_dict().items()
    }
    plain.load_state_dict(state)
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(padded(idx), plain(idx), rtol=0, atol=0)
    padded.train()
    loss = torch.nn.functional.cross_entropy(padded(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
    loss.backward()
    for table in (padded.wte.weight, padded.lm_head.weight):
        assert table.grad[:65].abs().sum() > 0 and torch.all(table.grad[65:] == 0)


@pytest.mark.parametrize("value,message", [(-64, "vocab-multiple must be in [0, 1024]"), (4096, "[0, 1024]")])
def test_an_absurd_vocab_multiple_is_refused(value: int, message: str) -> None:
    with pytest.raises(LmcliError, match=re.escape(message)):
        ModelConfig(vocab_size=65, vocab_multiple=value)
    assert ModelConfig(vocab_size=65, vocab_multiple="auto").vocab_multiple == 0


# ----------------------------------------------------------------------------- packed documents

DOCUMENT_VARIANTS = [
    dict(position="learned"),
    dict(position="sinusoidal", norm="rmsnorm"),
    dict(position="rope", n_kv_head=1),
    dict(position="alibi", norm_placement="post"),
]


def packed_window() -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Two rows of documents packed end to end: ids (2, 16), document numbers (2, 16), and each
    document's (row, start, end)."""
    idx = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(5))
    document = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])  # a row of one document too
    return idx, document, [(0, 0, 5), (0, 5, 12), (0, 12, 16), (1, 0, 16)]


@pytest.mark.parametrize("options", DOCUMENT_VARIANTS, ids=lambda o: o["position"])
def test_packed_documents_compute_what_each_document_computes_alone(options: dict) -> None:
    """With document numbers, no token attends across a document boundary and positions restart:
    each document's logits are those of the document run alone."""
    model = tiny_model(**{**SHAPE, **options})
    idx, document, spans = packed_window()
    packed = model(idx, document=document)
    for row, start, end in spans:
        alone = model(idx[row : row + 1, start:end])[0]
        assert_float32_close(packed[row, start:end], alone, model.config)
    unmasked = model(idx)
    assert not torch.allclose(unmasked[0, 5:12], packed[0, 5:12], atol=1e-4)  # the mask did something


def test_the_flex_attention_block_mask_equals_the_boolean_mask(monkeypatch) -> None:
    """The mask a GPU uses (a FlexAttention BlockMask, run here in eager mode) gives the same
    logits as the boolean mask of the CPU."""
    import warnings

    from lmcli.model import documents

    model = tiny_model(**SHAPE, position="rope")
    idx, document, _ = packed_window()
    expected = model(idx, document=document)
    monkeypatch.setattr("lmcli.model.transformer.document_mask", lambda doc, plain: documents.block_mask(doc))
    with warnings.catch_warnings(), torch.no_grad():  # FlexAttention has no backward on a CPU
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        flex = model(idx, document=document)
    assert_float32_close(flex, expected, model.config)


def test_document_numbers_are_for_training_windows_only() -> None:
    model = tiny_model(**SHAPE)
    with pytest.raises(ValueError, match="no cache, no prefix"):
        model(torch.zeros(1, 4, dtype=torch.long), prefix_len=torch.tensor([2]), document=torch.zeros(1, 4))


def test_rotary_tables_hold_one_angle_a_pair_and_turn_each_pair_by_it() -> None:
    """Rotary positions: the tables hold cos and sin of one angle per pair of dimensions (half the
    bytes of two equal halves, which cost Gemma 3 270M 128 MiB), and turning a head by them is
    multiplying each pair (x_i, x_{i+D/2}) as a complex number by e^{i * pos * freq_i}."""
    from lmcli.model.positions import Rotary

    model = tiny_model(vocab_size=13, position="rope", rope_local_base=10_000.0, sliding_window=4)
    rotary, cfg = model.positions, model.config
    assert isinstance(rotary, Rotary)
    D = cfg.head_dim
    tables = dict(rotary.named_buffers())
    assert sorted(tables) == ["cos", "cos_local", "sin", "sin_local"]
    assert all(t.shape == (cfg.block_size, D // 2) for t in tables.values())
    q, k = torch.randn(2, 1, 2, 5, D, generator=torch.Generator().manual_seed(0)).unbind(0)
    pos = torch.tensor([[0, 3, 7, 9, 15]])
    for local, base in ((False, cfg.rope_base), (True, 10_000.0)):
        turned, _ = rotary.rotate(q, k, pos, local=local)
        freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
        turn = torch.polar(torch.ones(5, D // 2, dtype=torch.float64), pos[0, :, None] * freq)
        pairs = torch.complex(q[..., : D // 2].double(), q[..., D // 2 :].double()) * turn
        expected = torch.cat([pairs.real, pairs.imag], dim=-1)
        torch.testing.assert_close(turned.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("position", ["rope", "sinusoidal"])
def test_position_tables_grow_as_far_as_a_forward_reaches_with_the_values_of_whole_ones(
    position: str, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's position tables cover the first ``TABLE_START`` positions (a 32k context's
    rotary tables are not held whole for a short generation) and grow, doubling, as a forward
    reaches past them: cached decoding gives the logits, bit for bit, of a model whose tables
    cover its whole context (the per-operation forward and the fast path's step alike)."""
    import copy

    from lmcli.generate.decoding import prefill, step
    from lmcli.model import fastpath, positions

    monkeypatch.setattr(positions, "TABLE_START", 4)
    extra = dict(rope_local_base=10_000.0, sliding_window=6, layer_pattern="LG") if position == "rope" else {}
    model = tiny_model(vocab_size=13, block_size=48, position=position, **extra)
    tables = dict(model.positions.named_buffers())
    assert tables and all(t.size(0) == 4 for t in tables.values())
    whole = copy.deepcopy(model)
    whole.positions.make_tables(whole.config, 48)
    ids = torch.randint(13, (2, 30), generator=torch.Generator().manual_seed(0))
    got = []
    for m in (model, whole):
        scope = fastpath.inference(m) if fast else contextlib.nullcontext()
        with torch.inference_mode(), scope:
            cache, logits = prefill(m, [ids[0, :5].tolist(), ids[1, :3].tolist()], 0)
            out = [logits] + [step(m, cache, ids[:, t]) for t in range(5, 30)]
        got.append(torch.stack(out))
    assert torch.equal(got[0], got[1])
    assert model.positions.n_pos == 32  # 4 -> 8 (the prompt) -> 16 -> 32
    for name, table in model.positions.named_buffers():
        assert torch.equal(table, dict(whole.positions.named_buffers())[name][:32])
    model.positions.reach(40)
    assert model.positions.n_pos == 48  # doubled, at most the context
