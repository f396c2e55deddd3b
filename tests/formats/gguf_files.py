"""GGUF files written by the ``gguf`` package alone, and logits computed from a file alone.

``write_gguf_model`` writes a tiny random model of llama.cpp's ``llama``, ``qwen2`` or ``gpt2``
architecture as llama.cpp's own converter lays it out (names, metadata, ggml shapes, F32 norms
and biases), its matrices in one tensor type: F32/F16/BF16 and Q8_0/Q4_0/Q4_1/MXFP4 through
``gguf.quants.quantize``; the types ``gguf`` reads but does not write (the K types, IQ4_NL,
IQ4_XS: ``SCALE_AT``) as random blocks with sane scales. Nothing of lmcli writes these files.

``spm_source`` is a SentencePiece-style vocabulary (tokens, scores, types: control, unknown,
user-defined and ``<0xNN>`` byte tokens) of a BPE trained on text with spaces as ``▁``, as a
SentencePiece BPE model holds it; ``write_gguf_model(..., spm=...)`` writes it as llama.cpp's
converter does (``tokenizer.ggml.model = "llama"``, scores, types, ``add_space_prefix``).

``reference_logits`` is a forward pass written from GGUF's side: it reads nothing but the file
(metadata and tensors, through ``gguf.GGUFReader``, dequantized with ``gguf.quants``) and
computes what llama.cpp's graphs compute in float64: ``gpt2`` (LayerNorm, tanh-GELU, learned
positions), ``llama`` (rotary on adjacent pairs) and ``qwen2`` (rotary on halves, NEOX style).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from families import hf_tokenizer
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

T = gguf.GGMLQuantizationType
KINDS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# the types gguf reads but does not write: the byte offsets of a block's float16 scales (d, then
# the min's scale where it has one), as ggml-common.h lays the blocks out
SCALE_AT = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
# the largest |integer| d multiplies in each (d = scale / REACH spreads the values about +-scale),
# and the min's scale as a multiple of d (it centres them)
REACH = {"Q2_K": 22.5, "Q3_K": 64, "Q4_K": 472.5, "Q5_K": 976.5, "Q6_K": 2000, "IQ4_NL": 64, "IQ4_XS": 2032}
MIN_FACTOR = {"Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}
# the rarer types lmcli reads dequantized: where a block's float16 scale d is (IQ1_M spreads its d
# over the top nibbles of its last 8 bytes; NVFP4's scales are 4 unsigned e4m3 bytes, never NaN)
RARE_SCALE_AT = {
    "IQ1_S": 0,
    "IQ2_XXS": 0,
    "IQ2_XS": 0,
    "IQ2_S": 0,
    "IQ3_XXS": 0,
    "IQ3_S": 0,
    "TQ1_0": 52,
    "TQ2_0": 64,
}
SHAPE = dict(n_embd=256, n_head=4, n_kv=2, n_layer=2, ffn=512, context=64)  # K types: rows of 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TEXTS = [  # pre-tokenization cases: contractions, digits, runs of spaces, newlines, non-ASCII
    "It's the model's 3rd run, isn't it?  Yes:   1234567 tokens.\n\n\tindented\r\n",
    "naïve café — “quotes” and emoji 🙂; ümlaut ß 2024-05-01\n",
    "THE CAT'LL SAY <|im_end|> or <|endoftext|> as text   ",
    "  leading spaces, trailing newline\n",
]


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


SPM_TEXTS = (  # a SentencePiece vocabulary's corpus: prose, code, digits, accents, whitespace runs
    "The quick brown fox jumps over the lazy dog. Naïve cafés serve crème brûlée.\n",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # 123 4567\n",
    "    indented    spaces    and\ttabs\n\nnew paragraphs, 2024-05-01, 3.14159 and 1,000,000.\n",
    "for i in range(10):\n        print(i ** 2, end=' ')\nif x != y: return {'a': [1, 2]}\n",
)
SPM_SPECIALS = {
    "llama": ["<unk>", "<s>", "</s>"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
}
# added tokens that are not special (llama.cpp matches them in text even when it parses no special
# tokens; it makes control tokens of a few names, such as <end_of_turn>, whatever the file says)
USER_DEFINED = ["<start_of_image>", "<end_of_image>"]
SPACE_RUNS = ["  ", "    "]  # Gemma's user-defined runs of spaces, as llama.cpp's converter writes them
SPM_STRESS = [  # Unicode, runs of spaces and newlines, digits, code, turn markers, special-token text
    "The quick brown fox: naïve café, crème brûlée — “quotes” and emoji 🙂; ümlaut ß 日本語\n",
    "  two leading spaces,   three inside, a tab\tand trailing   ",
    "\n\nnew paragraphs\n\n\n    indented 4\n        indented 8\r\n",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-05-01",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # {'a': [1, 2]}\n",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "see <start_of_image>pixels<end_of_image> here and<start_of_image>",
    "text that says <s> </s> <unk> <bos> <eos> is text",
    " ",
    "x",
]


@dataclass
class SpmSource:
    """A SentencePiece-style vocabulary as a GGUF file holds it."""

    tokens: list[str]
    scores: list[float]
    types: list[int]  # gguf.TokenType
    add_space_prefix: bool
    bos: int
    eos: int
    unk: int
    pad: int | None = None


def spm_source(style: str = "llama", vocab_size: int = 400) -> SpmSource:
    """A vocabulary laid out as ``style``'s SentencePiece model: Llama 2's (<unk> <s> </s>, the
    256 byte tokens, then the pieces; a space put in front of a text) or Gemma's (<pad> <eos>
    <bos> <unk> and the turn markers, user-defined image markers, bytes, pieces; no space in
    front). The pieces are a
    BPE trained on ``SPM_TEXTS`` with spaces as ``▁``, scored as SentencePiece scores a BPE model:
    a merge made earlier scores higher."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Sequence(  # words start with ▁; line breaks, tabs, digits alone
        [
            pre_tokenizers.Split(Regex("\u2581*[^\u2581\n\t]+|\u2581+|[\n\t]"), "isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tok.train_from_iterator(SPM_TEXTS * 4, trainer=trainer)
    pieces = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    TT = gguf.TokenType
    specials = SPM_SPECIALS[style]
    tokens = list(specials)
    types = [TT.UNKNOWN if t == "<unk>" else TT.CONTROL for t in specials]
    if style == "gemma":
        tokens += USER_DEFINED + SPACE_RUNS
        types += [TT.USER_DEFINED] * (len(USER_DEFINED) + len(SPACE_RUNS))
    scores = [0.0] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TT.BYTE] * 256
    scores += [0.0] * 256
    for rank, (piece, _) in enumerate(pieces):
        tokens.append(piece)
        types.append(TT.NORMAL)
        scores.append(-float(rank + 1))
    ids = {t: i for i, t in enumerate(tokens)}
    if style == "gemma":
        return SpmSource(
            tokens, scores, [int(t) for t in types], False, ids["<bos>"], ids["<eos>"], ids["<unk>"], 0
        )
    return SpmSource(tokens, scores, [int(t) for t in types], True, ids["<s>"], ids["</s>"], ids["<unk>"])


def write_spm_tokenizer(w: gguf.GGUFWriter, spm: SpmSource, add_bos: bool | None = True) -> None:
    """A SentencePiece-style vocabulary's metadata as llama.cpp's converter writes it."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(spm.tokens)
    w.add_token_scores(spm.scores)
    w.add_token_types(spm.types)
    w.add_bos_token_id(spm.bos)
    w.add_eos_token_id(spm.eos)
    w.add_unk_token_id(spm.unk)
    if spm.pad is not None:
        w.add_pad_token_id(spm.pad)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_add_space_prefix(spm.add_space_prefix)


# ----------------------------------------------------------------------------- writing


def source_tokenizer(pre: str) -> Tokenizer:
    """A byte-level BPE with the pre-tokenizer a model of GGUF's ``pre`` has in its tokenizer.json."""
    llama3 = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("gpt-2", "smollm"))
    split = {"llama-bpe": llama3, "qwen2": llama3.replace(r"\p{N}{1,3}", r"\p{N}")}
    pre_tokenizer = {
        "gpt-2": byte_level,
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
    }.get(pre) or pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split[pre]), "isolated"), byte_level])
    texts = (*TEXTS * 3, "12 123 1234 12345 didn't it's")
    tok = hf_tokenizer(SPECIALS, pre_tokenizer, vocab_size=400, texts=texts)
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    return tok


def random_blocks(
    kind: str, rows: int, cols: int, rng: np.random.Generator, d: np.ndarray | float
) -> np.ndarray:
    """Random ``kind`` blocks (rows, cols / block * bytes) of a type gguf does not write: random
    bits, the float16 scale ``d`` (one, or one a block) and the min's scale d * MIN_FACTOR."""
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    d16 = np.broadcast_to(np.asarray(d, dtype=np.float16).reshape(-1, 1), (len(blocks), 1))
    for i, at in enumerate(SCALE_AT[kind]):
        scale = d16 if i == 0 else (d16 * np.float16(MIN_FACTOR[kind])).astype(np.float16)
        blocks[:, at : at + 2] = np.ascontiguousarray(scale).view(np.uint8)
    return blocks.reshape(rows, -1)


def rare_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, d: float) -> np.ndarray:
    """Random blocks (rows, bytes a row) of a rarer type (``RARE_SCALE_AT``, IQ1_M, NVFP4): random
    bits with the scale d (NVFP4: small e4m3 scales)."""
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    bits = int(np.array([d], dtype=np.float16).view(np.uint16)[0])
    if kind == "IQ1_M":  # d's 16 bits are the top nibbles of the 4 uint16 scales, lowest first
        scales = blocks[:, -8:].copy().view(np.uint16)  # (blocks, 4)
        for i in range(4):
            scales[:, i] = (scales[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        blocks[:, -8:] = scales.view(np.uint8)
    elif kind == "NVFP4":
        blocks[:, :4] &= 0x27  # exponents 0 or 4
    else:
        at = RARE_SCALE_AT[kind]
        blocks[:, at : at + 2] = np.array([bits], dtype=np.uint16).view(np.uint8)
    return blocks.reshape(rows, -1)


def encode(w: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, T | None]:
    """A matrix (rows, cols) as ``kind``: (data, raw type for ``add_tensor``)."""
    if kind == "F32":
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    if kind in SCALE_AT:
        return random_blocks(kind, *w.shape, rng, float(np.abs(w).max()) / 2 / REACH[kind]), T[kind]
    if kind in RARE_SCALE_AT or kind in ("IQ1_M", "NVFP4"):
        return rare_blocks(kind, *w.shape, rng, float(np.abs(w).max()) / 50), T[kind]
    try:
        return gguf.quants.quantize(w.astype(np.float32), T[kind]), T[kind]
    except NotImplementedError:  # a type neither gguf nor lmcli writes (Q1_0): random bytes
        block, size = gguf.GGML_QUANT_SIZES[T[kind]]
        return rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block * size), dtype=np.uint8), T[kind]


def model_tensors(arch: str, vocab: int, rng: np.random.Generator, tied: bool) -> dict[str, np.ndarray]:
    """Random weights under GGUF's names, PyTorch's (out, in) order, unit-variance outputs."""
    C, H, KV, F_ = SHAPE["n_embd"], SHAPE["n_head"], SHAPE["n_kv"], SHAPE["ffn"]
    D = C // H

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)).astype(np.float32) * (1.5 / math.sqrt(cols))

    def vec(n: int, around: float) -> np.ndarray:
        return (around + 0.2 * rng.standard_normal(n)).astype(np.float32)

    out = {"token_embd.weight": mat(vocab, C) * 10, "output_norm.weight": vec(C, 1.0)}
    if arch == "gpt2":
        out |= {"position_embd.weight": mat(SHAPE["context"], C) * 5, "output_norm.bias": vec(C, 0.0)}
    for i in range(SHAPE["n_layer"]):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": vec(C, 1.0), b + "ffn_norm.weight": vec(C, 1.0)}
        out |= {b + "attn_output.weight": mat(C, C), b + "ffn_up.weight": mat(F_, C)}
        out[b + "ffn_down.weight"] = mat(C, F_)
        if arch == "gpt2":
            out[b + "attn_qkv.weight"] = mat(C + 2 * KV * D, C)
            for n, size in (("attn_norm", C), ("ffn_norm", C), ("attn_qkv", C + 2 * KV * D)):
                out[b + n + ".bias"] = vec(size, 0.0)
            for n, size in (("attn_output", C), ("ffn_up", F_), ("ffn_down", C)):
                out[b + n + ".bias"] = vec(size, 0.0)
        else:
            out |= {b + "attn_q.weight": mat(C, C), b + "attn_k.weight": mat(KV * D, C)}
            out |= {b + "attn_v.weight": mat(KV * D, C), b + "ffn_gate.weight": mat(F_, C)}
            if arch == "qwen2":
                for n, size in (("attn_q", C), ("attn_k", KV * D), ("attn_v", KV * D)):
                    out[b + n + ".bias"] = vec(size, 0.0)
    if not tied:
        out["output.weight"] = mat(vocab, C)
    return out


def write_tokenizer(
    w: gguf.GGUFWriter, tok: Tokenizer, vocab: int, pre: str, add_bos: bool | None, model: str = "gpt2"
) -> None:
    """The tokenizer's metadata as llama.cpp's converter writes a byte-level BPE's."""
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab)]
    specials = {by_id[i] for i in tok.get_added_tokens_decoder()}
    TT = gguf.TokenType
    types = [
        TT.CONTROL if t in specials else TT.UNUSED if t.startswith("[PAD") else TT.NORMAL for t in tokens
    ]
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = __import__("json").loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    ids = {t: i for i, t in by_id.items()}
    w.add_bos_token_id(ids["<|endoftext|>"])
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)


def write_gguf_model(
    path: Path,
    arch: str,
    kind: str,
    *,
    seed: int = 0,
    tied: bool = False,
    pre: str = "gpt-2",
    add_bos: bool | None = True,
    name: str = "tiny",
    tok: Tokenizer | None = None,
    tokenizer_model: str = "gpt2",
    spm: SpmSource | None = None,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
    kinds: dict[str, str] | None = None,
) -> Path:
    """A tiny random ``arch`` model, its matrices ``kind``, as llama.cpp's converter lays it out
    (``tok``: its tokenizer, a ``tokenizers`` BPE with ``SPECIALS``; default: one of the tiny text;
    ``spm``: a SentencePiece-style vocabulary instead; ``extra``: called on the writer after the
    tokenizer, to add crafted metadata; ``kinds``: other types for some matrices, by name)."""
    rng = np.random.default_rng(seed)
    tok = tok or hf_tokenizer(SPECIALS)
    # a few unused ids, as padded vocabularies have
    vocab = len(spm.tokens) if spm is not None else tok.get_vocab_size() + 4
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    C, H = SHAPE["n_embd"], SHAPE["n_head"]
    w.add_context_length(SHAPE["context"])
    w.add_embedding_length(C)
    w.add_block_count(SHAPE["n_layer"])
    w.add_feed_forward_length(SHAPE["ffn"])
    w.add_head_count(H)
    w.add_head_count_kv(SHAPE["n_kv"])
    if arch == "gpt2":
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(5000.0)
        w.add_rope_dimension_count(C // H)
    if spm is not None:
        write_spm_tokenizer(w, spm, add_bos)
    else:
        write_tokenizer(w, tok, vocab, pre, add_bos, tokenizer_model)
    if extra is not None:
        extra(w)
    for tname, value in model_tensors(arch, vocab, rng, tied).items():
        if value.ndim == 1:
            w.add_tensor(tname, value)
        else:
            data, raw = encode(value, (kinds or {}).get(tname, kind), rng)
            w.add_tensor(tname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------- the reference


def gguf_weights(reader: gguf.GGUFReader) -> dict[str, torch.Tensor]:
    """Every tensor of the file as float64, dequantized, in numpy's (out, in) order."""
    return {
        t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).double()
        for t in reader.tensors
    }


def rotate_pairs(x: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's rotary positions on (T, H, D): dims (2i, 2i+1) turned by pos * base^(-2i/D)."""
    T_, _, D = x.shape
    angle = torch.arange(T_, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, D, 2) / D)  # (T, D/2)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]  # (T, 1, D/2)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).reshape(x.shape)


def rotate_halves(x: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's NEOX rotary (qwen2) on (T, H, D): dims (i, i + D/2) turned together."""
    D = x.size(-1)
    # (T, H, D) -> (T, H, 2, D/2) -> (T, H, D/2, 2) -> adjacent pairs -> back
    paired = x.reshape(*x.shape[:2], 2, D // 2).transpose(-1, -2).reshape(x.shape)
    turned = rotate_pairs(paired, base)
    return turned.reshape(*x.shape[:2], D // 2, 2).transpose(-1, -2).reshape(x.shape)


def reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Logits (T, V) of ``ids`` computed from the GGUF file alone, as llama.cpp's graphs do."""
    r = gguf.GGUFReader(path)
    arch = field(r, "general.architecture")
    n_layer, H = field(r, f"{arch}.block_count"), field(r, f"{arch}.attention.head_count")
    KV = field(r, f"{arch}.attention.head_count_kv")
    w = gguf_weights(r)
    T_ = len(ids)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ w[f"{name}.weight"].T
        return y + w[f"{name}.bias"] if f"{name}.bias" in w else y

    if arch == "gpt2":
        eps = field(r, "gpt2.attention.layer_norm_epsilon")

        def norm(x: torch.Tensor, name: str) -> torch.Tensor:
            return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)

        x = w["token_embd.weight"][ids] + w["position_embd.weight"][:T_]
    else:
        eps = field(r, f"{arch}.attention.layer_norm_rms_epsilon")
        base = field(r, f"{arch}.rope.freq_base")
        rotate = rotate_pairs if arch == "llama" else rotate_halves

        def norm(x: torch.Tensor, name: str) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[f"{name}.weight"]

        x = w["token_embd.weight"][ids]
    C = x.size(-1)
    D = C // H
    for i in range(n_layer):
        b = f"blk.{i}."
        h = norm(x, b + "attn_norm")
        if arch == "gpt2":
            q, k, v = linear(h, b + "attn_qkv").split([H * D, KV * D, KV * D], dim=-1)
        else:
            q, k, v = (linear(h, b + n) for n in ("attn_q", "attn_k", "attn_v"))
        q, k, v = q.view(T_, H, D), k.view(T_, KV, D), v.view(T_, KV, D)
        if arch != "gpt2":
            q, k = rotate(q, base), rotate(k, base)
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(T_, T_).triu(1).bool(), float("-inf"))
        att = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T_, C)
        x = x + linear(att, b + "attn_output")
        h = norm(x, b + "ffn_norm")
        if arch == "gpt2":
            h = F.gelu(linear(h, b + "ffn_up"), approximate="tanh")
        else:
            h = F.silu(linear(h, b + "ffn_gate")) * linear(h, b + "ffn_up")
        x = x + linear(h, b + "ffn_down")
    head = w.get("output.weight", w["token_embd.weight"])
    return norm(x, "output_norm") @ head.T


# ----------------------------------------------------------------------------- llama.cpp's converter

# Hugging Face's names in a block -> GGUF's, as llama.cpp's converter maps them (gemma3 has four norms)
HF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_BLOCK = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
HF_ARCH = {"Gemma3ForCausalLM": "gemma3", "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3"}


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's ``LlamaModel.permute``: each head's rows from rotary halves to
    adjacent pairs (its ``llama``-style architectures turn pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf(folder: Path, path: Path, tokenizer_writer, kind: str = "F32") -> Path:
    """A Hugging Face folder of Gemma 3, Qwen3 or SmolLM3 as a float32 GGUF file, laid out as
    llama.cpp's ``convert_hf_to_gguf.py`` writes it: names, metadata, Gemma 3's norm weights
    with 1 added and its embedding cut to the tokenizer's rows, SmolLM3's query/key rows in
    adjacent rotary pairs. ``tokenizer_writer(writer, n)`` writes the vocabulary as ``n``
    tokens (the embedding's rows; unused ones after the tokenizer's)."""
    import json

    from safetensors.torch import load_file

    hp = json.loads((folder / "config.json").read_text())
    arch = HF_ARCH[hp["architectures"][0]]
    state = load_file(str(folder / "model.safetensors"))
    n_layer, n_head = hp["num_hidden_layers"], hp["num_attention_heads"]
    n_kv = hp.get("num_key_value_heads", n_head)
    head_dim = hp.get("head_dim") or hp["hidden_size"] // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(folder.name)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(n_layer)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    rope = hp.get("rope_parameters") or {}
    if arch == "gemma3":
        w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
        w.add_sliding_window(hp["sliding_window"])
    else:
        w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
    if arch in ("gemma3", "qwen3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    n_vocab = hp["vocab_size"]
    if arch == "gemma3":  # the rows past the tokenizer's tokens are cut off
        spec = json.loads((folder / "tokenizer.json").read_text())
        n_vocab = len(set(spec["model"]["vocab"]) | {a["content"] for a in spec["added_tokens"]})
    tokenizer_writer(w, n_vocab)
    tensors = {}
    for name, t in state.items():
        t = t.float()
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = t[:n_vocab] if arch == "gemma3" else t
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = t
        elif name == "lm_head.weight":
            if not hp.get("tie_word_embeddings", arch == "gemma3"):
                tensors["output.weight"] = t
        else:
            _, _, i, rest = name.split(".", 3)  # model.layers.{i}.{rest}.weight
            module = rest.removesuffix(".weight")
            norms = GEMMA3_BLOCK if arch == "gemma3" else {"post_attention_layernorm": "ffn_norm"}
            table = HF_BLOCK | norms
            if arch == "smollm3" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                t = llama_permute(t, n_head if module == "self_attn.q_proj" else n_kv)
            tensors[f"blk.{i}.{table[module]}.weight"] = t
    for name, t in tensors.items():  # ``kind`` Q8_0: the matrices whose rows hold whole blocks
        data = t.contiguous().numpy()
        if kind == "Q8_0" and data.ndim == 2 and data.shape[1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(data, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
