"""Float weights through the native kernels (f32, f16, bf16: ``ops.FLOATS``): each product equals
torch's float32 product of the weight widened to float32 (its one rounding is float32's, in
another order of sums), on every instruction set this CPU runs, a batch's rows exactly as each
row alone; a float model's blocks step in one native call (``native_step``), float32 between them
whatever the model's dtype, within float32 rounding of the per-operation step of a float32 model
and closer to it than a bfloat16 or float16 model's own per-operation step; its weights stay plain
in the scope (never packed in place), and a float32 model's greedy text is the per-operation
step's."""

from __future__ import annotations

import pytest
import torch
from helpers import GEMMA3_BLOCK, tiny_model, tiny_tokenizer
from test_native_layer import LLAMA, spread, steps

import lmcli.model.fastpath.cpu as cpu_module
from lmcli.errors import LmcliError
from lmcli.model import fastpath
from lmcli.model.native import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="native kernels not built here")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WINDOWED = dict(
    **GEMMA3_BLOCK,
    head_size=16,
    n_layer=3,
    n_head=4,
    n_kv_head=2,
    sliding_window=4,
    layer_pattern="LG",
    rope_local_base=100.0,
    scale_embeddings=True,
    attn_scalar=7.0,
    attn_softcap=3.0,
    logit_softcap=5.0,
)
MODELS = {"llama": dict(n_layer=2, **LLAMA), "windowed": WINDOWED}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k"), [(7, 5), (64, 576), (33, 1000)])
def test_a_float_product_is_torch_float32_product_of_the_widened_weight(dtype, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(6, k, generator=g)
    exact = x.double() @ w.double().T  # (every product of float32 and a widened weight is exact in doubles)
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T)
    blocks, fmt = ops.float_blocks(w)
    assert fmt == {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    assert blocks.data_ptr() == w.data_ptr()  # a view: no copy
    for isa in ops.library().isas:
        product = ops.BoundProduct(blocks, fmt, k, isa)
        y = product(x)
        assert ((y.double() - exact).abs() <= bound).all(), isa
        for threads in (1, 3):  # a batch's rows (four at a time) as each row alone, bit for bit
            assert all(torch.equal(product(x[i : i + 1], threads), y[i : i + 1]) for i in range(6))
            assert torch.equal(product(x, threads), y)


def test_float_weights_the_kernels_cannot_read_as_they_are_are_refused() -> None:
    for w in (torch.randn(8, 6).t(), torch.randn(4, 4, dtype=torch.float64), torch.randn(8)):
        with pytest.raises(LmcliError, match="a float product needs a contiguous"):
            ops.float_blocks(w)
    blocks, fmt = ops.float_blocks(torch.randn(8, 6))
    with pytest.raises(LmcliError, match="rows of 5 values take 20 bytes"):
        ops.BoundProduct(blocks, fmt, 5)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(
    "cache", [{}, {"window_slack": 2}, {"start": torch.tensor([0, 3])}], ids=["plain", "ring", "padded"]
)
def test_a_float32_model_steps_natively_within_float32_rounding(name: str, cache, monkeypatch) -> None:
    model = spread(tiny_model(vocab_size=80, **MODELS[name]))
    idx = torch.randint(0, 80, (2, 14), generator=torch.Generator().manual_seed(1))
    got, per_op = (
        steps(model, idx, True, monkeypatch, **cache),
        steps(model, idx, False, monkeypatch, **cache),
    )
    assert (got - per_op).abs().max() <= 1e-5 * per_op.abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_16_bit_model_steps_in_float32_closer_to_its_float32_twin(dtype, name: str, monkeypatch) -> None:
    """The native blocks keep float32 between them (llama.cpp's residual stream): the logits of a
    bfloat16 (float16) model are nearer those of its float32 twin (the same rounded weights) than
    its per-operation step's, which rounds every operation to 16 bits."""
    model = spread(tiny_model(vocab_size=80, **MODELS[name])).to(dtype)
    twin = tiny_model(vocab_size=80, **MODELS[name])
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    idx = torch.randint(0, 80, (2, 14), generator=torch.Generator().manual_seed(2))
    native, per_op = steps(model, idx, True, monkeypatch), steps(model, idx, False, monkeypatch)
    assert native.dtype == per_op.dtype == dtype  # (the logits in the model's dtype, as a forward's)
    reference = steps(twin, idx, False, monkeypatch, dtype=dtype)  # (the cache in 16 bits as theirs)
    assert (native.float() - reference).abs().max() < (per_op.float() - reference).abs().max()


def test_the_scope_keeps_the_weights_the_step_reads_plain(monkeypatch) -> None:
    """A model whose blocks step natively packs none of their weights in place (the kernels read
    them as they are); oneDNN multiplies the float32 ones as they are for prompts."""
    monkeypatch.setattr(cpu_module, "IN_PLACE_MIN_BYTES", 0)  # treat this tiny model as a large one
    monkeypatch.setattr(cpu_module, "PACK_MIN_WEIGHT", 1)
    monkeypatch.setenv("LMCLI_NATIVE_LAYER", "1")
    model = tiny_model(vocab_size=80, **{**LLAMA, "n_layer": 2})
    idx = torch.randint(0, 80, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(idx)
    with fastpath.inference(model), torch.no_grad():
        assert all(n is not None for n in model.fast_step.natives) and model.fast_step.head is not None
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(w.is_contiguous() and w.untyped_storage().nbytes() == w.numel() * 4 for w in weights)
        torch.testing.assert_close(model(idx), plain)  # a prompt: torch's products


def test_greedy_text_is_the_per_operation_step_s(monkeypatch) -> None:
    from lmcli.config.commands import SampleConfig
    from lmcli.generate.sampling import generate

    tok = tiny_tokenizer()
    model = spread(tiny_model(tok.vocab_size, **{**WINDOWED, "block_size": 64}))
    cfg = SampleConfig(temperature=0, max_new_tokens=24, min_new_tokens=24)
    texts = []
    for flag in ("1", "0"):
        monkeypatch.setenv("LMCLI_NATIVE_LAYER", flag)
        texts.append(generate(model, tok, [tok.encode("To be")], cfg)[0].ids)
    assert texts[0] == texts[1]
