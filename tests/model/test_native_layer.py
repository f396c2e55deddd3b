"""A block's decoding step in one native call (lmcli.model.native.layer, fastpath.native_step)
against the per-operation step it replaces, for each block variant it serves (sliding windows
and their rings, soft-capped scores, padded rows among them); the blocks it leaves to that step;
and the checks in front of the call."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.model import fastpath
from lmcli.model.kv_cache import KVCache
from lmcli.model.native import layer as native_layer
from lmcli.model.native import ops
from lmcli.model.quant import quantize
from lmcli.model.transformer import Transformer

pytestmark = pytest.mark.skipif(not ops.available(), reason="native kernels not built here")

LLAMA = dict(
    position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_head=4, n_kv_head=2, n_embd=64, d_ff=96
)
VARIANTS = {
    "llama": {},
    "qwen2 (q/k/v bias)": dict(qkv_bias=True),
    "qwen3 (q/k norm)": dict(qk_norm=True),
    "gemma3 norms, GeGLU, head size, scalar": dict(
        norm="rmsnorm1p", mlp="geglu", head_size=32, attn_scalar=24.0, scale_embeddings=True
    ),
    "sandwich": dict(norm_placement="sandwich"),
    "smollm3 (layers without rotary)": dict(rope_pattern="RN"),
    "gemma2 (soft-capped scores and logits)": dict(
        norm="rmsnorm1p", mlp="geglu", norm_placement="sandwich", attn_softcap=5.0, logit_softcap=3.0
    ),
}
STEPS = 12


def spread(model: Transformer, seed: int = 0) -> Transformer:
    """Weights far from their initial values (norm gains 0.5-1.5), so that every part shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model


def steps(model: Transformer, idx: torch.Tensor, native: bool, monkeypatch, **cache) -> torch.Tensor:
    """Logits (B, T, V) of the one-token steps over idx (B, T), the native call on or off (on:
    every layer of every step took it)."""
    monkeypatch.setenv("LMCLI_NATIVE_LAYER", "1" if native else "0")
    calls = []
    with monkeypatch.context() as mp:
        call = native_layer.NativeLayer.call
        mp.setattr(native_layer.NativeLayer, "call", lambda *a: calls.append(1) or call(*a))
        with torch.inference_mode(), fastpath.inference(model):
            kv = KVCache.for_model(model, idx.size(0), **cache)
            out = torch.cat([model.fast_step(idx[:, t : t + 1], kv) for t in range(idx.size(1))], 1)
            natives = model.fast_step.natives
    assert all(n is not None for n in natives) == native  # (each block took the path asked for)
    assert len(calls) == native * len(natives) * idx.size(1)
    return out


def assert_close_steps(a: torch.Tensor, b: torch.Tensor, bound: float = 1e-4) -> None:
    """Each step's logits (B, T, V) within ``bound`` of the largest, but for the rare step where
    an activation lands within float rounding of an int8 rounding boundary and rounds the other way
    in the two orders of additions (one quantum of one value: within 3% of the largest logit)."""
    scale = b.abs().max()
    per_step = (a - b).abs().amax(-1).flatten()  # (B * T,)
    assert per_step.max() <= 3e-2 * scale, per_step
    assert per_step.median() <= bound * scale, per_step


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_native_step_equals_the_per_operation_step(variant: str, mode: str, monkeypatch) -> None:
    model = quantize(spread(tiny_model(vocab_size=80, n_layer=2, **{**LLAMA, **VARIANTS[variant]})), mode, 32)
    idx = torch.randint(0, 80, (1, STEPS), generator=torch.Generator().manual_seed(1))
    assert_close_steps(steps(model, idx, True, monkeypatch), steps(model, idx, False, monkeypatch))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_is_written_and_read_as_the_per_operation_step_does(dtype, monkeypatch) -> None:
    model = quantize(spread(tiny_model(vocab_size=80, n_layer=1, **LLAMA)), "int8")
    idx = torch.randint(0, 80, (1, 8), generator=torch.Generator().manual_seed(2))
    native = steps(model, idx, True, monkeypatch, dtype=dtype)
    # bfloat16 keeps 8 bits: a key that rounds the other way moves a score by up to 2^-8
    bound = 1e-4 if dtype == torch.float16 else 2e-2
    assert_close_steps(native, steps(model, idx, False, monkeypatch, dtype=dtype), bound)


def test_rows_of_a_batch_and_padded_rows(monkeypatch) -> None:
    """Two rows step natively together, left-padded ones too (serve's batch, prompts of two lengths):
    each row attends from its first column and turns by its own position."""
    model = quantize(spread(tiny_model(vocab_size=80, n_layer=2, **LLAMA)), "int8")
    idx = torch.randint(0, 80, (2, 10), generator=torch.Generator().manual_seed(3))
    assert_close_steps(steps(model, idx, True, monkeypatch), steps(model, idx, False, monkeypatch))
    start = torch.tensor([0, 3])
    calls = []
    call = native_layer.NativeLayer.call
    monkeypatch.setattr(native_layer.NativeLayer, "call", lambda *a: calls.append(1) or call(*a))
    native = steps(model, idx, True, monkeypatch, start=start)
    # every layer of every step, those where row 1 is still all padding (columns 0-2) included:
    # such a row sees its new column alone, as the model's mask lets it
    assert len(calls) == 2 * 10
    assert_close_steps(native, steps(model, idx, False, monkeypatch, start=start))


@pytest.mark.parametrize(
    "cache",
    [{}, {"window_slack": 0}, {"window_slack": 2}, {"start": torch.tensor([0, 3])}],
    ids=["whole-cache", "ring", "ring-slack", "padded"],
)
@pytest.mark.parametrize("pattern", ["LG", ""], ids=["gemma3", "mistral"])
def test_sliding_window_layers_step_natively_past_the_window(pattern: str, cache, monkeypatch) -> None:
    """Gemma 3's block (QK-norm, its local rotary base, soft-capped scores for good measure) with a
    window of 4 on every other layer, or on every layer (Mistral's: the ring holds them all), 12
    steps: each local layer attends to its last 4 columns, read from the whole cache or from the
    ring (a slot each column modulo its size), a padded row's window never reaching before its
    text."""
    window = dict(sliding_window=4, layer_pattern=pattern, rope_local_base=100.0, attn_softcap=5.0)
    gemma3 = dict(norm="rmsnorm1p", mlp="geglu", norm_placement="sandwich", qk_norm=True, head_size=32)
    if not pattern:  # Mistral's block otherwise
        gemma3, window = {}, dict(sliding_window=4)
    model = quantize(spread(tiny_model(vocab_size=80, n_layer=3, **{**LLAMA, **gemma3, **window})), "int8")
    idx = torch.randint(0, 80, (2, STEPS), generator=torch.Generator().manual_seed(4))
    native = steps(model, idx, True, monkeypatch, **cache)
    assert_close_steps(native, steps(model, idx, False, monkeypatch, **cache))


def test_blocks_the_call_does_not_serve_keep_the_per_operation_step(monkeypatch) -> None:
    monkeypatch.setenv("LMCLI_NATIVE_LAYER", "1")
    for model in (
        quantize(tiny_model(vocab_size=80, n_layer=1, n_head=4, n_embd=64), "int8"),  # GPT-2: LayerNorm, GELU
        tiny_model(vocab_size=80, n_layer=1, n_head=4, n_embd=64),  # GPT-2 in floats
        tiny_model(vocab_size=80, n_layer=1, **{**LLAMA, "norm_placement": "post"}),  # post-norm
        tiny_model(vocab_size=80, n_layer=1, **{**LLAMA, "mlp": "relu2"}),  # an MLP not gated
    ):
        with torch.inference_mode(), fastpath.inference(model):
            assert model.fast_step.natives == [None]


def test_greedy_text_is_the_same_with_the_native_step(monkeypatch) -> None:
    from helpers import tiny_tokenizer

    from lmcli.config.commands import SampleConfig
    from lmcli.generate.sampling import generate

    tok = tiny_tokenizer()
    model = quantize(spread(tiny_model(tok.vocab_size, n_layer=2, **LLAMA)), "int4", 32)
    cfg = SampleConfig(temperature=0, max_new_tokens=24, min_new_tokens=24)
    texts = []
    for flag in ("1", "0"):
        monkeypatch.setenv("LMCLI_NATIVE_LAYER", flag)
        texts.append(generate(model, tok, [tok.encode("To be")], cfg)[0].ids)
    assert texts[0] == texts[1]


def layer_of(model: Transformer) -> native_layer.NativeLayer:
    from lmcli.model.fastpath.native_step import native_block

    block = native_block(model.h[0])
    assert block is not None
    return block


def test_sizes_are_checked_before_the_call() -> None:
    """What a step's calls share is checked once (``StepArgs.checked``, which the decoding step
    builds its arguments with), each layer's rows at its call (``StepArgs.run``)."""
    model = quantize(spread(tiny_model(vocab_size=80, n_layer=1, **LLAMA)), "int8")
    native = layer_of(model)
    C, KV, D = 64, 2, 16
    k = torch.zeros(1, 1, KV, 8, D)  # (layers, rows, KV, columns, D)
    table = torch.ones(16, D // 2), torch.zeros(16, D // 2)

    def rotary(at: list[int], cos: Tensor = table[0], sin: Tensor = table[1]) -> native_layer.RotaryRows:
        return native_layer.RotaryRows(cos, sin, torch.tensor(at))

    def checked(rows: int = 1, keys: Tensor = k, column: int = 0, **kw) -> native_layer.StepArgs:
        return native_layer.StepArgs.checked(native, rows, keys, keys.clone(), column, **kw)

    cases = {
        "outside the cache": lambda: checked(column=8),
        "does not fit": [
            lambda: checked(keys=torch.zeros(1, 1, KV, 8, D + 2)),
            lambda: checked(rows=2),  # a cache of 1 row for 2 rows
            lambda: checked(keys=k.to(torch.int32)),
            lambda: checked(keys=k[0]),  # one layer's cache, not the model's
            lambda: checked(fmt="q8_0"),  # float rows where blocks are said
            lambda: checked(fmt="int8"),
            lambda: checked(ring=(k[:, :, :1], k[:, :, :1])),  # a ring of other heads
        ],
        "rotary table": [
            lambda: checked(rotary=(rotary([0], table[0][:, :-1], table[1][:, :-1]), None)),
            lambda: checked(rotary=(rotary([0], table[0].double(), table[1].double()), None)),
        ],
        "positions": [
            lambda: checked(rotary=(rotary([16]), None)),
            lambda: checked(rotary=(rotary([0, 1]), None)),
        ],
        "start must be int64": lambda: checked(column=3, start=torch.tensor([1], dtype=torch.int32)),
        "a row starts before column 0": lambda: checked(column=3, start=torch.tensor([-1])),
        "threads": lambda: checked(threads=0),
    }
    for says, calls in cases.items():
        for call in calls if isinstance(calls, list) else [calls]:
            with pytest.raises(LmcliError, match=says):
                call()
    args = checked(column=3, start=torch.tensor([2]), rotary=(rotary([1]), rotary([1])))
    for x, row in ((torch.zeros(1, C + 1), 0), (torch.zeros(2, C), 0), (torch.zeros(1, C), 1)):
        with pytest.raises(LmcliError, match="do not fit"):
            args.run(native, x, row, 0, True)
    x = torch.randn(1, C)
    assert args.run(native, x, 0, 0, True) is x and torch.isfinite(x).all()  # (the call itself runs)
    ringed = checked(column=3, ring=(torch.zeros(1, 1, KV, 4, D), torch.zeros(1, 1, KV, 4, D)))
    with pytest.raises(LmcliError, match="window 0 does not fit a ring of 4"):  # (a layer without one)
        ringed.run(native, x, 0, 0, True, ringed=True)
    with pytest.raises(LmcliError, match="do not fit"):
        checked(column=3).run(native, x, 0, 0, True, ringed=True)  # no ring at all
    x64 = torch.randn(1, C, dtype=torch.float64)  # other rows are converted
    assert args.run(native, x64, 0, 0, True).dtype == torch.float32


def test_weights_that_do_not_fit_each_other_are_refused() -> None:
    import dataclasses

    model = quantize(spread(tiny_model(vocab_size=80, n_layer=1, **LLAMA)), "int8")
    w = layer_of(model).weights
    with pytest.raises(LmcliError, match="norm 1 must be float32"):
        native_layer.NativeLayer(dataclasses.replace(w, norm_1=w.norm_1[:-1]))
    with pytest.raises(LmcliError, match="query/key/value products give"):
        native_layer.NativeLayer(dataclasses.replace(w, heads=w.heads + 2))
    with pytest.raises(LmcliError, match="MLP's down projection"):
        native_layer.NativeLayer(dataclasses.replace(w, down=w.up))
    with pytest.raises(LmcliError, match="unsupported"):
        native_layer.NativeLayer(dataclasses.replace(w, act="relu"))


@pytest.mark.parametrize("arch,kind", [("llama", "Q4_K"), ("qwen2", "Q5_0")])
def test_a_gguf_file_run_as_stored_steps_natively(tmp_path, arch: str, kind: str, monkeypatch) -> None:
    """A file's q, k and v in their own formats (a stacked product), Qwen2's biases cut into them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
    from gguf_files import write_gguf_model

    from lmcli.formats.gguf.as_stored import load_as_stored
    from lmcli.formats.gguf.load import read_gguf_header

    model = load_as_stored(read_gguf_header(write_gguf_model(tmp_path / "m.gguf", arch, kind)), torch.float32)
    idx = torch.randint(0, model.config.vocab_size, (1, STEPS), generator=torch.Generator().manual_seed(5))
    assert_close_steps(steps(model, idx, True, monkeypatch), steps(model, idx, False, monkeypatch))


def test_query_key_value_parts_in_their_own_formats_with_the_stack_bias(monkeypatch) -> None:
    """A GGUF file's q, k, v as one stacked product of three formats (as Q4_K_M files hold them),
    the bias on the stack: the call cuts it into the parts."""
    from lmcli.model.native.blocks import quantize_blocks
    from lmcli.model.quant import BlockLinear, StackedBlockLinear

    model = spread(tiny_model(vocab_size=80, n_layer=2, **{**LLAMA, "qkv_bias": True}))
    floats = [(b.attn.c_attn.weight.detach().clone(), b.attn.c_attn.bias.detach().clone()) for b in model.h]
    model = quantize(model, "int8")
    for block, (w, b) in zip(model.h, floats, strict=True):
        cuts = (64, 32, 32)  # H * D, KV * D, KV * D
        parts = [
            BlockLinear(quantize_blocks(part, fmt), fmt, 64)
            for part, fmt in zip(w.split(cuts), ("q8_0", "q4_0", "q8_0"), strict=True)
        ]
        block.attn.c_attn = StackedBlockLinear(parts, b)
    idx = torch.randint(0, 80, (1, STEPS), generator=torch.Generator().manual_seed(6))
    assert_close_steps(steps(model, idx, True, monkeypatch), steps(model, idx, False, monkeypatch))


def test_one_row_decodes_on_the_kernels_threads_and_torch_on_one(monkeypatch) -> None:
    monkeypatch.setenv("LMCLI_NATIVE_LAYER", "1")
    model = quantize(tiny_model(vocab_size=80, n_layer=1, **LLAMA), "int8")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode(), fastpath.inference(model):
            runner = model.fast_step
            with fastpath.step_threads(model, 1):
                assert (torch.get_num_threads(), runner.kernel_threads) == (1, 2)
            assert (torch.get_num_threads(), runner.kernel_threads) == (2, None)
            with fastpath.step_threads(model, 1, native=False):  # (a scope that runs prompts too)
                assert runner.kernel_threads is None
    finally:
        torch.set_num_threads(before)
