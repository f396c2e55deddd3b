"""llama-quantize's per-tensor types (formats/export/presets.py) against tables written by hand
from llama.cpp's rules (src/llama-quant.cpp, llama_tensor_get_type): for an 8-layer model,
use_more_bits picks layers 0, 3, 6 and 7 (i < n/8, i >= 7n/8, (i - n/8) % 3 == 2); n/8 = 1,
n/16 = 0. ``make check-gguf`` compares whole files with llama.cpp's own quantizer."""

from __future__ import annotations

import pytest

from lmcli.config.commands import parse_gguf_type
from lmcli.errors import LmcliError
from lmcli.formats.export.presets import ModelShape, check_quantizes, more_bits, preset, tensor_types

N = 8
MORE_BITS = {0, 3, 6, 7}


def llama_tensors(n_embd: int = 256, d_ff: int = 512, kv: int = 64, tied: bool = False) -> dict:
    """GGUF name -> PyTorch shape of a Llama model's tensors."""
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (300, n_embd), "output_norm.weight": (n_embd,)}
    if not tied:
        out["output.weight"] = (300, n_embd)
    for i in range(N):
        b = f"blk.{i}."
        out |= {
            b + "attn_q.weight": (n_embd, n_embd),
            b + "attn_k.weight": (kv, n_embd),
            b + "attn_v.weight": (kv, n_embd),
            b + "attn_output.weight": (n_embd, n_embd),
            b + "attn_norm.weight": (n_embd,),
            b + "ffn_gate.weight": (d_ff, n_embd),
            b + "ffn_up.weight": (d_ff, n_embd),
            b + "ffn_down.weight": (n_embd, d_ff),
            b + "ffn_norm.weight": (n_embd,),
        }
    return out


def types_of(name: str, gqa: int = 2, imatrix: bool = False, **shape) -> dict:
    tensors = llama_tensors(**shape)
    return tensor_types(preset(name), tensors, ModelShape("llama", N, 4 * gqa, 4), imatrix=imatrix)


def by_layer(types: dict, role: str) -> list[str | None]:
    return [types[f"blk.{i}.{role}.weight"] for i in range(N)]


def test_use_more_bits_layers() -> None:
    assert {i for i in range(N) if more_bits(i, N)} == MORE_BITS
    assert {i for i in range(24) if more_bits(i, 24)} == {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}


# (preset, gqa) -> the types of attn_v, ffn_down, attn_output by layer, of attn_q, and of output
# and token_embd (untied); the norms are never quantized
TABLE = {
    ("Q4_K_M", 2): (
        ["q6_K" if i in MORE_BITS else "q4_K" for i in range(N)],
        ["q6_K" if i in MORE_BITS else "q4_K" for i in range(N)],
        ["q4_K"] * N, "q4_K", "q6_K", "q4_K",
    ),
    ("Q5_K_M", 2): (
        ["q6_K" if i in MORE_BITS else "q5_K" for i in range(N)],
        ["q6_K" if i in MORE_BITS else "q5_K" for i in range(N)],
        ["q5_K"] * N, "q5_K", "q6_K", "q5_K",
    ),
    ("Q4_K_S", 2): (
        ["q5_K"] * 4 + ["q4_K"] * 4, ["q5_K"] + ["q4_K"] * 7, ["q4_K"] * N, "q4_K", "q6_K", "q4_K"
    ),
    ("Q5_K_S", 2): (["q5_K"] * N, ["q5_K"] * N, ["q5_K"] * N, "q5_K", "q6_K", "q5_K"),
    ("Q3_K_S", 2): (["q3_K"] * N, ["q3_K"] * N, ["q3_K"] * N, "q3_K", "q6_K", "q3_K"),
    ("Q3_K_M", 2): (["q5_K"] * 2 + ["q4_K"] * 6, ["q4_K"] * N, ["q4_K"] * N, "q3_K", "q6_K", "q3_K"),
    ("Q3_K_L", 2): (["q5_K"] * N, ["q5_K"] * N, ["q5_K"] * N, "q3_K", "q6_K", "q3_K"),
    ("Q2_K", 2): (["q3_K"] * N, ["q3_K"] * N, ["q3_K"] * N, "q2_K", "q6_K", "q2_K"),
    ("Q2_K", 4): (["q4_K"] * N, ["q3_K"] * N, ["q3_K"] * N, "q2_K", "q6_K", "q2_K"),
    ("Q6_K", 2): (["q6_K"] * N, ["q6_K"] * N, ["q6_K"] * N, "q6_K", "q6_K", "q6_K"),
    ("IQ4_XS", 2): (["iq4_xs"] * N, ["q5_K"] + ["iq4_xs"] * 7, ["iq4_xs"] * N, "iq4_xs", "q6_K", "iq4_xs"),
    ("IQ4_XS", 4): (["q5_K"] * N, ["q5_K"] + ["iq4_xs"] * 7, ["iq4_xs"] * N, "iq4_xs", "q6_K", "iq4_xs"),
    ("IQ4_NL", 2): (["iq4_nl"] * N, ["q5_K"] + ["iq4_nl"] * 7, ["iq4_nl"] * N, "iq4_nl", "q6_K", "iq4_nl"),
    ("q8_0", 2): (["q8_0"] * N, ["q8_0"] * N, ["q8_0"] * N, "q8_0", "q8_0", "q8_0"),
    ("q4_0", 2): (["q4_0"] * N, ["q4_0"] * N, ["q4_0"] * N, "q4_0", "q6_K", "q4_0"),
    ("Q5_1", 2): (["q5_1"] * N, ["q5_1"] * N, ["q5_1"] * N, "q5_1", "q6_K", "q5_1"),
}  # fmt: skip


@pytest.mark.parametrize(("name", "gqa"), list(TABLE))
def test_types_follow_llama_cpp_rules(name: str, gqa: int) -> None:
    attn_v, ffn_down, attn_output, attn_q, output, token_embd = TABLE[name, gqa]
    types = types_of(name, gqa)
    assert by_layer(types, "attn_v") == attn_v
    assert by_layer(types, "ffn_down") == ffn_down
    assert by_layer(types, "attn_output") == attn_output
    assert set(by_layer(types, "attn_q")) == set(by_layer(types, "ffn_up")) == {attn_q}
    assert (types["output.weight"], types["token_embd.weight"]) == (output, token_embd)
    assert types["output_norm.weight"] is None and types["blk.0.ffn_norm.weight"] is None


def test_tied_embeddings_take_the_output_rule_and_fallbacks_apply() -> None:
    tied = types_of("Q4_K_M", tied=True)
    assert tied["token_embd.weight"] == "q6_K" and "output.weight" not in tied
    # rows of 576 values (SmolLM2's width): no K-quant block fits
    wide = types_of("Q4_K_M", n_embd=576, d_ff=1536, kv=192)
    assert wide["blk.1.attn_q.weight"] == "q5_0"  # q4_K -> q5_0
    assert wide["blk.0.attn_v.weight"] == "q8_0"  # q6_K -> q8_0
    assert wide["blk.1.ffn_down.weight"] == "q4_K"  # its rows are 1536 = 6 x 256
    assert wide["output.weight"] == "q8_0"  # rows not whole q4_K blocks: q8_0 at once
    assert types_of("Q5_K_S", n_embd=576, d_ff=1536, kv=192)["blk.1.attn_q.weight"] == "q5_1"
    assert types_of("IQ4_XS", n_embd=576, d_ff=1536, kv=192)["blk.1.attn_q.weight"] == "iq4_nl"
    assert types_of("Q2_K", n_embd=576, d_ff=1536, kv=192)["blk.1.attn_q.weight"] == "q4_0"
    # rows of 40: no block of 32 fits either -> f16
    narrow = types_of("q8_0", n_embd=40, d_ff=64, kv=40)
    assert narrow["blk.0.attn_q.weight"] == "f16" and narrow["blk.0.ffn_down.weight"] == "q8_0"


def test_an_importance_matrix_changes_the_ffn_down_rules() -> None:
    assert by_layer(types_of("IQ4_XS", imatrix=True), "ffn_down") == ["iq4_xs"] * N
    assert by_layer(types_of("q4_0", imatrix=True), "ffn_down") == ["q4_1"] + ["q4_0"] * 7
    assert by_layer(types_of("Q5_0", imatrix=True), "ffn_down") == ["q5_1"] + ["q5_0"] * 7


def test_gpt2_fused_projection_counts_as_attn_v_and_positions_stay() -> None:
    tensors = {"token_embd.weight": (300, 256), "position_embd.weight": (64, 256)}
    for i in range(N):
        tensors |= {f"blk.{i}.attn_qkv.weight": (768, 256), f"blk.{i}.attn_qkv.bias": (768,)}
    types = tensor_types(preset("Q4_K_M"), tensors, ModelShape("gpt2", N, 4, 4))
    assert [types[f"blk.{i}.attn_qkv.weight"] for i in range(N)] == [
        "q6_K" if i in MORE_BITS else "q4_K" for i in range(N)
    ]
    assert types["position_embd.weight"] is None and types["blk.0.attn_qkv.bias"] is None


def test_a_70b_llama_raises_attn_v() -> None:
    tensors = {f"blk.{i}.attn_v.weight": (1024, 8192) for i in range(80)}
    types = tensor_types(preset("Q3_K_S"), tensors, ModelShape("llama", 80, 64, 8))
    assert set(types.values()) == {"q5_K"}  # q3_K -> q5_K for the 70B size


def test_names_in_any_case_and_refusals() -> None:
    assert parse_gguf_type("q4_k_m") == parse_gguf_type("Q4_K_M") == "Q4_K_M"
    assert parse_gguf_type("Q8_0") == "q8_0" and parse_gguf_type("F16") == "f16"
    assert preset("iq4_xs").file_type == 30 and preset("q4_k_m").file_type == 15
    with pytest.raises(LmcliError, match="invalid dtype 'Q4_K_X': choose one of f32, f16, q8_0"):
        preset("Q4_K_X")
    narrow = llama_tensors(n_embd=40, d_ff=40, kv=40)
    types = tensor_types(preset("Q4_K_M"), narrow, ModelShape("llama", N, 4, 4))
    with pytest.raises(
        LmcliError, match="Q4_K_M: no matrix of this model has rows that q4_K or its fallback"
    ):
        check_quantizes(preset("Q4_K_M"), types, narrow)
    check_quantizes(preset("f16"), tensor_types(preset("f16"), narrow, ModelShape("llama", N, 4, 4)), narrow)
