"""llama-quantize's presets (Q4_K_M, IQ4_XS, ...) and the type each tensor takes in them.

A preset is a file type (``general.file_type``, llama.cpp's ``llama_ftype``) with a default block
type; llama.cpp then picks each tensor's type by its role, its layer and the model's shape
(``llama_tensor_get_type`` in llama.cpp's ``src/llama-quant.cpp``). ``tensor_types`` follows those
rules for the architectures lmcli writes (``llama``, ``qwen3``, ``gemma3``, ``smollm3``, ``gpt2``;
no experts, no Falcon), so that lmcli's file and llama-quantize's, from the same weights, hold
every tensor in the same type (``make check-gguf`` compares them byte for byte). The rules, in
llama.cpp's order (``i``: the layer, ``n``: the layers; ``more_bits(i)``: i < n/8, i >= 7n/8 or
(i - n/8) % 3 == 2; ``gqa``: query heads per key/value head):

- only matrices named ``*weight`` are quantized, never a norm or ``position_embd`` (they keep the
  type lmcli writes them in: f32 vectors, f16 matrices);
- ``output.weight`` (and ``token_embd.weight`` when the head is tied to it): q8_0 when its rows are
  not a whole number of the default type's blocks, else q6_K (q8_0 stays q8_0); an untied
  ``token_embd`` keeps the default;
- ``attn_v`` (and GPT-2's fused ``attn_qkv``): Q2_K -> q4_K if gqa >= 4 else q3_K; Q3_K_M -> q5_K
  for layers 0-1 else q4_K; Q3_K_L -> q5_K; IQ4_NL/IQ4_XS with gqa >= 4 -> q5_K; Q4_K_M, Q5_K_M
  -> q6_K where more_bits; Q4_K_S -> q5_K for layers 0-3; a 70B Llama (80 layers, gqa > 1): a
  q3_K/q4_K choice becomes q5_K;
- ``ffn_down``: Q2_K -> q3_K; Q3_K_M -> q5_K for i < n/16 else q4_K; Q3_K_L -> q5_K; Q4_K_M ->
  q6_K where more_bits; IQ4_NL/IQ4_XS without an importance matrix -> q5_K for i < n/8; Q5_K_M ->
  q6_K where more_bits; Q4_K_S -> q5_K for i < n/8; Q4_0/Q5_0 with an importance matrix ->
  q4_1/q5_1 for i < n/8;
- ``attn_output``: Q2_K -> q3_K, Q3_K_M -> q4_K, Q3_K_L -> q5_K;
- then the fallback when a row is not a whole number of the type's blocks: iq4_xs -> iq4_nl,
  q2_K/q3_K -> q4_0, q4_K -> q5_0, q5_K -> q5_1, q6_K -> q8_0; a 32-value type whose blocks still
  do not fit -> f16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lmcli.config.commands import GGUF_PRESETS, parse_gguf_type
from lmcli.errors import LmcliError

# values a block of each type lmcli writes (GGML's names); f16/f32 are blocks of one
BLOCK = {
    **dict.fromkeys(("f32", "f16"), 1),
    **dict.fromkeys(("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"), 32),
    **dict.fromkeys(("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs"), 256),
}
FALLBACK = {
    "iq4_xs": "iq4_nl",
    "q2_K": "q4_0",
    "q3_K": "q4_0",
    "q4_K": "q5_0",
    "q5_K": "q5_1",
    "q6_K": "q8_0",
}


@dataclass(frozen=True)
class Preset:
    """A llama-quantize preset: its name (as llama-quantize spells it), ``general.file_type``,
    default tensor type."""

    name: str
    file_type: int  # llama.cpp's llama_ftype
    default: str  # GGML's name of the type most matrices take

    @property
    def quantized(self) -> bool:
        return self.default not in ("f32", "f16")


_TABLE = {
    p.name: p
    for p in (
        Preset("F32", 0, "f32"),
        Preset("F16", 1, "f16"),
        Preset("Q4_0", 2, "q4_0"),
        Preset("Q4_1", 3, "q4_1"),
        Preset("Q8_0", 7, "q8_0"),
        Preset("Q5_0", 8, "q5_0"),
        Preset("Q5_1", 9, "q5_1"),
        Preset("Q2_K", 10, "q2_K"),
        Preset("Q3_K_S", 11, "q3_K"),
        Preset("Q3_K_M", 12, "q3_K"),
        Preset("Q3_K_L", 13, "q3_K"),
        Preset("Q4_K_S", 14, "q4_K"),
        Preset("Q4_K_M", 15, "q4_K"),
        Preset("Q5_K_S", 16, "q5_K"),
        Preset("Q5_K_M", 17, "q5_K"),
        Preset("Q6_K", 18, "q6_K"),
        Preset("IQ4_NL", 25, "iq4_nl"),
        Preset("IQ4_XS", 30, "iq4_xs"),
    )
}
# by the names lmcli's options take (config.commands.GGUF_PRESETS: lmcli's four in lower case)
PRESETS = {name: _TABLE[name.upper()] for name in GGUF_PRESETS}


def preset(name: str) -> Preset:
    """The preset ``name`` names, in any case (``q4_k_m``, ``Q4_K_M``); one line listing them."""
    return PRESETS[parse_gguf_type(name)]


@dataclass(frozen=True)
class ModelShape:
    """What of a model the type choice reads."""

    arch: str  # GGUF's general.architecture
    n_layer: int
    n_head: int
    n_kv_head: int

    @property
    def gqa(self) -> int:
        return self.n_head // self.n_kv_head

    @property
    def llama_70b(self) -> bool:  # (llama.cpp's LLM_TYPE_70B, the one size its rules name)
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_kv_head


def category(name: str) -> str:
    """A tensor's role, as llama.cpp's ``tensor_get_category`` reads its name."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for part, role in (
        ("attn_qkv.weight", "attn_v"),  # a fused projection counts as attn_v
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return role
    return "other"


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize changes the type of this tensor (a matrix named ``*weight`` that is no
    norm and no learned position table)."""
    return (
        len(shape) >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and name != "position_embd.weight"
    )


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int:
    found = re.match(r"blk\.(\d+)\.", name)
    return int(found.group(1)) if found else 0


def _attn_v(p: str, t: str, i: int, shape: ModelShape) -> str:
    if p == "Q2_K":
        t = "q4_K" if shape.gqa >= 4 else "q3_K"
    elif p == "Q3_K_M":
        t = "q5_K" if i < 2 else "q4_K"
    elif p == "Q3_K_L":
        t = "q5_K"
    elif p in ("IQ4_NL", "IQ4_XS") and shape.gqa >= 4:
        t = "q5_K"
    elif p in ("Q4_K_M", "Q5_K_M") and more_bits(i, shape.n_layer):
        t = "q6_K"
    elif p == "Q4_K_S" and i < 4:
        t = "q5_K"
    if shape.llama_70b and t in ("q3_K", "q4_K"):
        t = "q5_K"
    return t


def _ffn_down(p: str, t: str, i: int, n: int, imatrix: bool) -> str:
    if p == "Q2_K":
        return "q3_K"
    if p == "Q3_K_M":
        return "q5_K" if i < n // 16 else "q4_K"
    if p == "Q3_K_L":
        return "q5_K"
    if p == "Q4_K_M":
        return "q6_K" if more_bits(i, n) else t
    if p in ("IQ4_NL", "IQ4_XS"):
        return "q5_K" if i < n // 8 and not imatrix else t
    if p == "Q5_K_M":
        return "q6_K" if more_bits(i, n) else t
    if p == "Q4_K_S":
        return "q5_K" if i < n // 8 else t
    if p in ("Q4_0", "Q5_0") and imatrix and i < n // 8:
        return "q4_1" if p == "Q4_0" else "q5_1"
    return t


def tensor_type(
    p: Preset, name: str, shape: tuple[int, ...], model: ModelShape, *, tied: bool, imatrix: bool
) -> str:
    """The type of one quantizable tensor in preset ``p`` (``shape``: PyTorch's order, rows last;
    ``tied``: the model has no ``output.weight``; ``imatrix``: importance weights are given)."""
    t, role, cols = p.default, category(name), shape[-1]
    if p.quantized:
        i = _layer(name)
        if role == "output" or (tied and role == "token_embd"):
            t = "q8_0" if cols % BLOCK[p.default] else ("q8_0" if t == "q8_0" else "q6_K")
        elif role == "attn_v":
            t = _attn_v(p.name, t, i, model)
        elif role == "ffn_down":
            t = _ffn_down(p.name, t, i, model.n_layer, imatrix)
        elif role == "attn_output":
            t = {"Q2_K": "q3_K", "Q3_K_M": "q4_K", "Q3_K_L": "q5_K"}.get(p.name, t)
        if cols % BLOCK[t]:
            t = FALLBACK.get(t, t)
            if cols % BLOCK[t]:
                t = "f16"
    return t


def tensor_types(
    p: Preset, tensors: dict[str, tuple[int, ...]], model: ModelShape, *, imatrix: bool = False
) -> dict[str, str | None]:
    """Each tensor's type in preset ``p`` (None: not quantized, written as lmcli writes it)."""
    tied = "output.weight" not in tensors
    return {
        name: tensor_type(p, name, shape, model, tied=tied, imatrix=imatrix)
        if quantizable(name, shape)
        else None
        for name, shape in tensors.items()
    }


def check_quantizes(p: Preset, types: dict[str, str | None], shapes: dict[str, tuple[int, ...]]) -> None:
    """One line when preset ``p`` would quantize no matrix at all: every row a length that neither
    its types nor their fallbacks hold (llama.cpp would write the whole file f16)."""
    chosen = [t for t in types.values() if t is not None]
    if p.quantized and chosen and all(t == "f16" for t in chosen):
        cols = sorted({shapes[name][-1] for name, t in types.items() if t is not None})
        listed = ", ".join(map(str, cols[:4]))
        raise LmcliError(
            f"{p.name}: no matrix of this model has rows that {p.default} or its fallback can hold "
            f"(rows of {listed} values; blocks of {BLOCK[p.default]} or 32): nothing would be quantized"
        )
