"""llama.cpp's own verdict on `lmcli export --format gguf` (run by `make check-gguf`).

It builds small lmcli models of both families, tied and untied, with lmcli's byte-level BPE and
byte tokenizers trained on this project's docs/ (the GPT-2 family: learned positions, LayerNorm,
GELU, biases; the Llama family: rotary positions, RMSNorm, SwiGLU, with and without biases; with
grouped-query attention too when lmcli has ``n_kv_head``). Every parameter is drawn at random,
norm gains and biases included, so a misplaced tensor cannot hide behind a one or a zero. Each
model is exported as f32 GGUF and llama.cpp (through llama-cpp-python) is asked for:

- the prompt's token ids, from llama.cpp's own tokenizer reading the GGUF metadata: they must
  equal lmcli's, as must its ids for a few texts chosen to stress pre-tokenization;
- the logits at every position of prompt + lmcli's continuation: within 1e-3 of lmcli's (for
  the GPT-2 family, of lmcli's with GELU rounded as llama.cpp's CPU backend rounds it, through
  an f16 table; the difference to lmcli's exact GELU is printed beside it);
- its greedy continuation of 32 tokens (llama.cpp's own sampler): equal to lmcli's greedy
  ``generate``, ids and text.

The Gemma 3, Qwen3 and SmolLM3 shapes (``gemma3``, ``qwen3``, ``smollm3``: sandwich (1 + w)
RMSNorms, GeGLU, scaled embeddings, qk-norm, a head size apart from hidden/heads, five local
layers with a sliding window of 8 then a global one, layers without rotary) export to llama.cpp's
own architectures. A GeGLU's GELU is the one product not modelled to 1e-3: llama.cpp's CPU GeGLU
agrees with lmcli's exact tanh-GELU to about 1e-2 and with ggml's f16 GELU table to about 4e-3
on logits of about 20 (its exact arithmetic was not traced), so ``gemma3`` passes within 5e-4 of
its largest logit with the same greedy continuation, and ``gemma3-no-gelu``, the same model with
its gate weights zeroed (no GELU in play), within 1e-3: every other product agrees.

Then GGUF in (``import_cases``): tiny random models written by the ``gguf`` package itself
(``gguf_files.py``: llama.cpp's ``llama``, ``qwen2`` and ``gpt2`` architectures, each tensor type
lmcli reads, the pre-tokenizers lmcli rebuilds), loaded by lmcli: llama.cpp's token ids of the
prompt (``add_bos_token`` followed) and of the stress texts must equal lmcli's rebuilt
tokenizer's, and its logits lmcli's: f32 within 1e-3; the other types within a tolerance stated
for the others, lmcli's logits with each product's input rounded as llama.cpp's CPU kernels
round it (``ggml_rounded``: to 8-bit blocks of 32 values for Q8_0/Q4_0/Q4_1 weights, of 256 for
the K types, to f16 or bf16 for those weights). Those roundings make agreement chaotic: a float
difference of 1e-7 (summation order, rotary tables) that puts one activation on the other side
of a rounding boundary changes its int8 value and every logit it feeds, at that position and,
through keys and values, after it. So such a file passes when at least 3 positions agree to
1e-4 of the largest logit (a weight read otherwise than llama.cpp reads it leaves none; seen:
most positions, often all) and every position to 5% of it. F16 and Q4_1 products are not
modelled to that precision (Q4_1's minimum term uses f16(scale x sum), f16's path was not
traced): they pass on the 5% alone. The count and the difference to lmcli's own float32
products are printed beside it.

Then SentencePiece-style vocabularies (``check_spm``: GGUF's ``llama`` tokenizer model, laid out
as Llama 2's and as Gemma's, written by the ``gguf`` package, and lmcli's export of the model read
from each): llama.cpp's token ids of stress texts (Unicode, byte fallback, runs of spaces and
newlines, digits, code, user-defined turn markers) and of a prompt must equal lmcli's.

llama.cpp runs in this process when ``llama_cpp`` is importable; otherwise ``--llama-python PY``
names a Python that has it (make check-gguf builds one in ~/.cache/lmcli/llama-venv) and this file
runs there as a subprocess with ``--llama-side``, reading a JSON request on stdin, needing
only llama_cpp and numpy.

    python tests/formats/check_gguf.py [--llama-python PY] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The checkpoint folder holds"
N_NEW = 32
TOLERANCE = 1e-3
GEGLU_TOLERANCE = 5e-4  # of the largest logit: a GeGLU model's logits (see the module doc)
TEXTS = [  # pre-tokenization cases: contractions, digits, runs of spaces, newlines, non-ASCII, specials
    "It's the model's 3rd run, isn't it?  Yes:   1234 tokens.\n\n\tindented\r\n",
    "naïve café — “quotes” and emoji 🙂; ümlaut ß\n",
    "text that says <eos> or <bos> is text   ",
    "  leading spaces, trailing newline\n",
]
GGML_TYPE_F32 = 0  # llama.cpp's KV cache in f32 (its default f16 would round every key and value)


# ----------------------------------------------------------------------------- llama.cpp side


def llama_side(request: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp makes of one GGUF file (needs only llama_cpp and numpy); ``vocab_only``:
    its tokenizer alone."""
    import numpy as np
    from llama_cpp import Llama

    if request.get("vocab_only"):
        llm = Llama(model_path=request["gguf"], vocab_only=True, verbose=False)
        return {
            "version": __import__("llama_cpp").__version__,
            "prompt": [int(t) for t in llm.tokenize(request["prompt"].encode(), add_bos=True, special=False)],
            "texts": [
                [int(t) for t in llm.tokenize(t.encode(), add_bos=False, special=False)]
                for t in request["texts"]
            ],
        }
    llm = Llama(
        model_path=request["gguf"],
        n_ctx=request["n_ctx"],
        n_batch=request["n_ctx"],
        logits_all=True,
        n_threads=2,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        verbose=False,
    )
    eos = llm.token_eos()
    prompt = llm.tokenize(request["prompt"].encode(), add_bos=True, special=False)
    continuation: list[int] = []
    if request["n_new"]:
        for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            if token == eos:
                break
            continuation.append(int(token))
            if len(continuation) == request["n_new"]:
                break
    llm.reset()
    llm.eval(request["sequence"])
    logits = np.asarray(llm.scores[: len(request["sequence"])], dtype=np.float64)
    return {
        "version": __import__("llama_cpp").__version__,
        "prompt": [int(t) for t in prompt],
        "continuation": continuation,
        "text": llm.detokenize(continuation).decode("utf-8", errors="replace"),
        "texts": [
            [int(t) for t in llm.tokenize(t.encode(), add_bos=False, special=False)] for t in request["texts"]
        ],
        "logits": logits.tolist(),
    }


def ask_llama(request: dict[str, Any], llama_python: str | None) -> dict[str, Any]:
    """``llama_side`` here, or in ``llama_python`` through a pipe."""
    if llama_python is None:
        return llama_side(request)
    done = subprocess.run(
        [llama_python, __file__, "--llama-side"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


# ----------------------------------------------------------------------------- lmcli side


@dataclass
class Case:
    """One model to check: its name, model options and tokenizer."""

    name: str
    model: dict[str, Any]
    tokenizer: str = "bpe"
    no_gelu: bool = False  # a GeGLU's gate weights zeroed: every product but the GELU to TOLERANCE


def cases() -> list[Case]:
    from lmcli.config.files import field_names
    from lmcli.config.model import ModelConfig

    shape = dict(n_layer=2, n_head=4, n_embd=64, block_size=96)
    llama = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    out = [
        Case("gpt2", {**shape}),
        Case("gpt2-untied", {**shape, "tie_embeddings": False}, tokenizer="byte"),
        Case("llama", {**shape, **llama}),
        Case(
            "llama-biased-untied", {**shape, **llama, "bias": True, "tie_embeddings": False}, tokenizer="byte"
        ),
    ]
    if "n_kv_head" in field_names(ModelConfig):
        out.append(Case("llama-gqa", {**shape, **llama, "n_kv_head": 2}))
    if "layer_pattern" in field_names(ModelConfig):  # llama.cpp's gemma3, qwen3, smollm3
        gemma3 = dict(norm="rmsnorm1p", norm_placement="sandwich", mlp="geglu", qk_norm=True)
        gemma3 |= dict(scale_embeddings=True, head_size=32, n_kv_head=2, sliding_window=8)
        gemma3 |= dict(layer_pattern="LLLLLG", rope_local_base=10000.0, rope_base=1e6, n_layer=7)
        out += [
            Case("gemma3", {**shape, **llama, **gemma3}),
            Case("gemma3-no-gelu", {**shape, **llama, **gemma3}, no_gelu=True),
            Case("qwen3", {**shape, **llama, "qk_norm": True, "head_size": 32, "tie_embeddings": False}),
            Case("smollm3", {**shape, **llama, "rope_pattern": "RRRN", "n_layer": 5, "n_kv_head": 2}),
        ]
    return out


def randomize(model: Any, seed: int = 0) -> None:
    """Draw every parameter, norm gains and biases included, so that no mapping error hides
    behind a one or a zero; matrices scaled for unit-variance outputs, so logits spread widely
    and greedy choices have clear margins."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(1 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            else:
                p.copy_(noise * 2 / p.size(1) ** 0.5)


def make_run(case: Case, workdir: Path, seed: int = 0) -> Path:
    """A checkpoint for ``case``: a tokenizer trained on this project's docs/, random weights."""
    from lmcli.config.model import ModelConfig
    from lmcli.config.train import TrainConfig
    from lmcli.formats.checkpoint import save_checkpoint
    from lmcli.model.transformer import Transformer
    from lmcli.text.tokenizer import Tokenizer

    texts = (p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    tok = Tokenizer.train(case.tokenizer, texts, vocab_size=512)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **case.model)).eval()
    randomize(model, seed)
    if case.no_gelu:
        for block in model.h:
            block.mlp.c_gate.weight.data.zero_()
    out = workdir / f"{case.name}-seed{seed}"
    save_checkpoint(out, model, TrainConfig(), tok, meta={"step": 0})
    return out


def ggml_gelu(x: Any) -> Any:
    """GELU as llama.cpp's CPU backend computes it: a table indexed by the input rounded to f16,
    holding f16 outputs (``GGML_GELU_FP16`` in ggml-cpu/vec.h); exact beyond |x| >= 10."""
    import torch
    import torch.nn.functional as F

    y = F.gelu(x.half().float(), approximate="tanh").half().to(x.dtype)
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


def logits_with_ggml_gelu(model: Any, sequence: list[int]) -> Any:
    """lmcli's logits (T, V) with each GELU MLP's output recomputed through ``ggml_gelu``."""
    import torch

    def hook(mlp: Any, inputs: tuple, output: Any) -> Any:
        x = inputs[0]
        if mlp.c_gate is not None:  # GeGLU: llama.cpp's geglu rounds the gate's GELU so too
            return mlp.c_proj(ggml_gelu(mlp.c_gate(x)) * mlp.c_fc(x))
        return mlp.c_proj(ggml_gelu(mlp.c_fc(x)))

    handles = [block.mlp.register_forward_hook(hook) for block in model.h]
    try:
        with torch.no_grad():
            return model(torch.tensor([sequence]))[0].double()
    finally:
        for h in handles:
            h.remove()


def lmcli_side(checkpoint: Path) -> dict[str, Any]:
    """lmcli's prompt ids, greedy continuation, logits over both, and ids of ``TEXTS``."""
    import torch

    from lmcli.config.commands import SampleConfig
    from lmcli.formats.sources import load_checkpoint
    from lmcli.generate.sampling import generate

    ckpt = load_checkpoint(checkpoint)
    tok, model = ckpt.tokenizer, ckpt.model.eval()
    prompt = [tok.bos_id, *tok.encode(PROMPT)]
    got = generate(model, tok, [prompt], SampleConfig(max_new_tokens=N_NEW, temperature=0.0))[0]
    sequence = prompt + got.ids
    with torch.no_grad():
        logits = model(torch.tensor([sequence]))[0].double()  # (T, V)
    gelu = ckpt.model_config.mlp in ("gelu", "geglu")
    return {
        "prompt": prompt,
        "continuation": got.ids,
        "text": tok.decode(got.ids),
        "texts": [tok.encode(t) for t in TEXTS],
        "sequence": sequence,
        "logits": logits,
        "logits_ggml_gelu": logits_with_ggml_gelu(model, sequence) if gelu else None,
        "n_ctx": ckpt.model_config.block_size,
    }


# ----------------------------------------------------------------------------- the check


@dataclass
class Result:
    name: str
    lines: list[str]
    ok: bool
    version: str  # llama-cpp-python's


def greedy_margin(logits: Any, prompt_len: int) -> float:
    """The smallest gap between the best and second-best logit over the greedy steps."""
    top2 = logits[prompt_len - 1 :].topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).min().item()


def check_case(case: Case, workdir: Path, llama_python: str | None) -> Result:
    """Build, export f32 GGUF, compare llama.cpp with lmcli."""
    import torch

    from lmcli.formats.export.gguf import export_gguf

    for seed in range(20):  # the first seed whose greedy choices are clear at 10x the tolerance
        checkpoint = make_run(case, workdir, seed)
        ours = lmcli_side(checkpoint)
        if greedy_margin(ours["logits"], len(ours["prompt"])) >= 10 * TOLERANCE:
            break
    path = export_gguf(checkpoint, workdir / f"{case.name}-f32.gguf", "f32")
    request = {
        "gguf": str(path),
        "n_ctx": ours["n_ctx"],
        "prompt": PROMPT,
        "n_new": N_NEW,
        "sequence": ours["sequence"],
        "texts": TEXTS,
    }
    theirs = ask_llama(request, llama_python)
    logits = torch.tensor(theirs["logits"], dtype=torch.float64)
    diff = (logits - ours["logits"]).abs().max().item()
    where = f"over {logits.size(0)} positions (logits up to {ours['logits'].abs().max().item():.1f})"
    checks = {
        f"prompt ids ({len(ours['prompt'])})": theirs["prompt"] == ours["prompt"],
        f"ids of {len(TEXTS)} texts": theirs["texts"] == ours["texts"],
    }
    if ours["logits_ggml_gelu"] is None:
        checks[f"max |logit diff| {diff:.1e} {where}"] = diff <= TOLERANCE
    else:  # llama.cpp rounds GELU through an f16 table: compare with lmcli doing the same
        diff_ggml = (logits - ours["logits_ggml_gelu"]).abs().max().item()
        what = f"max |logit diff| {diff_ggml:.1e} {where}, lmcli with ggml's f16 GELU table"
        top = ours["logits"].abs().max().item()
        # GeGLU: llama.cpp's GELU of the gate is not modelled to 1e-3 (see the module doc)
        limit = GEGLU_TOLERANCE * top if case.model.get("mlp") == "geglu" and not case.no_gelu else TOLERANCE
        checks[f"{what} ({diff:.1e} with its exact GELU)"] = diff_ggml <= limit
    margin = greedy_margin(ours["logits"], len(ours["prompt"]))
    what = f"greedy continuation, {len(ours['continuation'])} tokens (smallest top-2 margin {margin:.2f})"
    checks[what] = theirs["continuation"] == ours["continuation"] and theirs["text"] == ours["text"]
    cfg = " ".join(f"{k}={v}" for k, v in case.model.items())
    lines = [f"{case.name} (seed {seed}): {case.tokenizer} tokenizer, {cfg}, {path.stat().st_size} bytes"]
    lines += [f"  {'ok  ' if ok else 'FAIL'} {what}" for what, ok in checks.items()]
    if theirs["continuation"] != ours["continuation"] or theirs["text"] != ours["text"]:
        lines.append(f"    lmcli     {ours['continuation']} {ours['text']!r}")
        lines.append(f"    llama.cpp {theirs['continuation']} {theirs['text']!r}")
    for text, a, b in zip(TEXTS, ours["texts"], theirs["texts"], strict=True):
        if a != b:
            lines.append(f"    {text!r}: lmcli {a} llama.cpp {b}")
    return Result(case.name, lines, all(checks.values()), theirs["version"])


@dataclass
class ImportCase:
    """One GGUF file written by the gguf package, to load with lmcli and llama.cpp."""

    arch: str
    kind: str
    pre: str = "gpt-2"

    @property
    def name(self) -> str:
        return f"import {self.arch} {self.kind} ({self.pre})"


# how llama.cpp's CPU backend rounds the input of a product with weights of each type (its
# ``vec_dot_type``): blocks of 32 (Q8_0, Q8_1) or 256 values (Q8_K) as int8 with a scale, f16, bf16
ROUNDED_AS = {"F16": "F16", "BF16": "BF16", "Q8_0": 32, "Q4_0": 32, "Q4_1": 32}
ROUNDED_AS |= {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q2_K": 256, "Q3_K": 256, "IQ4_XS": 256}
ROUNDED_AS |= {"IQ4_NL": 32, "MXFP4": 32}  # (llama.cpp rounds their inputs as q8_0)


def import_cases() -> list[ImportCase]:
    out = [ImportCase(arch, "F32") for arch in ("llama", "qwen2", "gpt2")]
    out += [ImportCase("llama", "F32", pre) for pre in ("smollm", "llama-bpe", "qwen2")]
    out += [ImportCase(arch, kind) for kind in ROUNDED_AS for arch in ("llama", "qwen2", "gpt2")]
    return out


def ggml_rounded(x: Any, kind: str) -> Any:
    """``x`` (..., C) as llama.cpp's CPU backend rounds a product's input for ``kind`` weights:
    f16/bf16, or int8 blocks: Q8_0/Q8_1 (32 values: q = x * 127/max|x| to nearest even, times the
    scale max|x|/127 stored as f16), Q8_K (256 values: q = x * -127/m, m the value of largest
    magnitude, to nearest even, at most 127, times 1/(-127/m) as float32)."""
    import torch

    how = ROUNDED_AS[kind]
    if how == "F16":
        return x.half().to(x.dtype)
    if how == "BF16":
        return x.bfloat16().to(x.dtype)
    blocks = x.float().reshape(*x.shape[:-1], -1, how)  # (..., C) -> (..., C / block, block)
    if how == 32:
        amax = blocks.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        q = torch.round(blocks * inv)  # torch.round: halves to even, as _mm256_round_ps
        out = q * (amax / 127).half().float()
    else:
        at = blocks.abs().argmax(-1, keepdim=True)
        m = blocks.gather(-1, at)
        inv = torch.where(m != 0, -127 / m, torch.zeros_like(m))
        q = torch.round(blocks * inv).clamp(max=127)
        out = q * torch.where(inv != 0, 1 / inv, torch.zeros_like(inv))
    return out.reshape(x.shape).to(x.dtype)


def logits_rounded_as_ggml(model: Any, sequence: list[int], kind: str, gelu: bool) -> Any:
    """lmcli's logits (T, V) with every linear layer's input rounded by ``ggml_rounded`` (and, for
    a GELU MLP, ggml's f16 GELU table)."""
    import torch

    handles = [
        m.register_forward_pre_hook(lambda mod, args: (ggml_rounded(args[0], kind),))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        if gelu:
            return logits_with_ggml_gelu(model, sequence)
        with torch.no_grad():
            return model(torch.tensor([sequence]))[0].double()
    finally:
        for h in handles:
            h.remove()


def check_import(case: ImportCase, workdir: Path, llama_python: str | None) -> Result:
    """Write ``case`` with the gguf package, load it with lmcli, compare with llama.cpp."""
    import torch
    from gguf_files import TEXTS as STRESS
    from gguf_files import source_tokenizer, write_gguf_model

    from lmcli.formats.sources import load_model

    path = workdir / f"import-{case.arch}-{case.kind}-{case.pre}.gguf"
    path.unlink(missing_ok=True)
    write_gguf_model(path, case.arch, case.kind, tok=source_tokenizer(case.pre), pre=case.pre, add_bos=None)
    ckpt = load_model(path, dtype=torch.float32)
    tok = ckpt.tokenizer
    prompt = tok.with_bos(tok.encode(PROMPT))
    sequence = tok.with_bos(tok.encode(" ".join(STRESS[:2])))[: ckpt.model_config.block_size]
    with torch.no_grad():
        exact = ckpt.model(torch.tensor([sequence]))[0].double()
    gelu = case.arch == "gpt2"  # llama.cpp's GELU goes through an f16 table: lmcli does so here too
    if case.kind == "F32":
        ours = logits_with_ggml_gelu(ckpt.model, sequence) if gelu else exact
    else:
        ours = logits_rounded_as_ggml(ckpt.model, sequence, case.kind, gelu)
    request = {"gguf": str(path), "n_ctx": ckpt.model_config.block_size, "prompt": PROMPT, "n_new": 0}
    theirs = ask_llama({**request, "sequence": sequence, "texts": STRESS}, llama_python)
    logits = torch.tensor(theirs["logits"], dtype=torch.float64)
    per_position = (logits - ours).abs().amax(-1)  # (T,)
    diff, raw, top = per_position.max().item(), (logits - exact).abs().max().item(), ours.abs().max().item()
    checks = {
        f"prompt ids ({len(prompt)}, add_bos {tok.add_bos})": theirs["prompt"] == prompt,
        f"ids of {len(STRESS)} texts": theirs["texts"] == [tok.encode(t) for t in STRESS],
    }
    where = f"over {len(sequence)} positions (logits up to {top:.1f})"
    if case.kind == "F32":
        checks[f"max |logit diff| {diff:.1e} {where}"] = diff <= TOLERANCE
    else:
        agree = int((per_position <= 1e-4 * top).sum())
        what = (
            f"lmcli with ggml's rounding: max {diff:.1e} {where}, {agree} positions within 1e-4 of "
            f"the top; {raw:.1e} with lmcli's exact products"
        )
        checks[what] = (agree >= 3 or case.kind in ("F16", "Q4_1")) and diff <= 0.05 * top
    lines = [f"{case.name}: {path.stat().st_size} bytes"]
    lines += [f"  {'ok  ' if ok else 'FAIL'} {what}" for what, ok in checks.items()]
    for text, a in zip(STRESS, theirs["texts"], strict=True):
        if a != tok.encode(text):
            lines.append(f"    {text!r}: lmcli {tok.encode(text)} llama.cpp {a}")
    return Result(case.name, lines, all(checks.values()), theirs["version"])


SPM_CASES = ["llama", "gemma"]  # SentencePiece-style vocabularies laid out as Llama 2's, Gemma's


def check_spm(style: str, workdir: Path, llama_python: str | None) -> Result:
    """A SentencePiece-style vocabulary (``gguf_files.spm_source``) written by the gguf package,
    and lmcli's GGUF export of the model read from it: llama.cpp's token ids of the stress texts
    and of a prompt (``add_bos_token`` followed) must equal lmcli's rebuilt tokenizer's."""
    import torch
    from gguf_files import SPM_STRESS, spm_source, write_gguf_model

    from lmcli.formats.export.gguf import write_gguf
    from lmcli.formats.sources import load_model

    source = workdir / f"spm-{style}.gguf"
    exported = workdir / f"spm-{style}-exported.gguf"
    for path in (source, exported):
        path.unlink(missing_ok=True)
    write_gguf_model(source, "llama", "F32", spm=spm_source(style), add_bos=style == "llama")
    ckpt = load_model(source, dtype=torch.float32)
    write_gguf(ckpt.model, ckpt.tokenizer, exported, "f32")
    tok = ckpt.tokenizer
    ours = {"prompt": tok.with_bos(tok.encode(PROMPT)), "texts": [tok.encode(t) for t in SPM_STRESS]}
    lines, ok, version = [f"sentencepiece vocabulary, {style} layout"], True, ""
    for path in (source, exported):
        request = {"gguf": str(path), "vocab_only": True, "prompt": PROMPT, "texts": SPM_STRESS}
        theirs = ask_llama(request, llama_python)
        version = theirs["version"]
        checks = {
            f"{path.name}: prompt ids ({len(ours['prompt'])}, add_bos {tok.add_bos})": theirs["prompt"]
            == ours["prompt"],
            f"{path.name}: ids of {len(SPM_STRESS)} texts": theirs["texts"] == ours["texts"],
        }
        lines += [f"  {'ok  ' if good else 'FAIL'} {what}" for what, good in checks.items()]
        ok = ok and all(checks.values())
        for text, a, b in zip(SPM_STRESS, ours["texts"], theirs["texts"], strict=True):
            if a != b:
                lines.append(f"    {text!r}: lmcli {a} llama.cpp {b}")
    return Result(f"spm {style}", lines, ok, version)


def run_checks(workdir: Path, llama_python: str | None = None, only: str | None = None) -> list[Result]:
    """Every case, export and import; llama.cpp in-process unless ``llama_python`` is given."""

    def chosen(name: str) -> bool:
        return only is None or only in name

    exported = [check_case(case, workdir, llama_python) for case in cases() if chosen(case.name)]
    imported = [check_import(case, workdir, llama_python) for case in import_cases() if chosen(case.name)]
    spm = [check_spm(style, workdir, llama_python) for style in SPM_CASES if chosen(f"spm {style}")]
    return exported + imported + spm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", help="a Python with llama_cpp installed (default: this one)")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoints and GGUF files here")
    parser.add_argument("--only", help="run the checks whose name holds this text (gemma3, spm, import)")
    parser.add_argument("--llama-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llama_side:
        json.dump(llama_side(json.load(sys.stdin)), sys.stdout)
        return 0
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "hf")]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_checks(workdir, args.llama_python, args.only)
    for r in results:
        print("\n".join(r.lines))
    failed = [r.name for r in results if not r.ok]
    verdict = "FAIL: " + ", ".join(failed) if failed else "PASS"
    print(f"check-gguf: {verdict} ({len(results)} models, llama-cpp-python {results[0].version})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
