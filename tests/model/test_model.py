"""The Transformer: causal masking for every variant, tying, parameter counts."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import tiny_model

from lmcli.config import ModelConfig
from lmcli.errors import LmcliError

VARIANTS = list(
    itertools.product(("learned", "sinusoidal", "rope", "alibi"), ("layernorm", "rmsnorm"), ("pre", "post"))
)

SHAPE = dict(vocab_size=13, block_size=16, n_embd=16)  # 2 layers, 2 heads, seed 0: tiny_model's


@pytest.mark.parametrize("position,norm,placement", VARIANTS)
def test_future_tokens_never_change_earlier_logits(position: str, norm: str, placement: str) -> None:
    model = tiny_model(**SHAPE, position=position, norm=norm, norm_placement=placement)
    idx = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(1))
    base = model(idx)
    for t in range(16):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 13
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t]), "the changed token must matter"


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
    idx = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(1))
    base = model(idx)
    for t in range(16):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 13
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t]), "the changed token must matter"


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


@pytest.mark.parametrize("mlp", ["gelu", "relu", "relu2", "swiglu"])
def test_mlp_variants_run_and_differ(mlp: str) -> None:
    model = tiny_model(**SHAPE, mlp=mlp)
    out = model(torch.zeros(1, 4, dtype=torch.long))
    assert out.shape == (1, 4, 13) and torch.isfinite(out).all()


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
