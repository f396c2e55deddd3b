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

llama.cpp runs in this process when ``llama_cpp`` is importable; otherwise ``--llama-python PY``
names a Python that has it (make check-gguf builds one in ~/.cache/lmcli/llama-venv) and this file
runs there as a subprocess with ``--llama-side``, reading a JSON request on stdin, needing
only llama_cpp and numpy.

    python tests/hf/check_gguf.py [--llama-python PY] [--workdir DIR]
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
TEXTS = [  # pre-tokenization cases: contractions, digits, runs of spaces, newlines, non-ASCII, specials
    "It's the model's 3rd run, isn't it?  Yes:   1234 tokens.\n\n\tindented\r\n",
    "naïve café — “quotes” and emoji 🙂; ümlaut ß\n",
    "text that says <eos> or <bos> is text   ",
    "  leading spaces, trailing newline\n",
]
GGML_TYPE_F32 = 0  # llama.cpp's KV cache in f32 (its default f16 would round every key and value)


# ----------------------------------------------------------------------------- llama.cpp side


def llama_side(request: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp makes of one GGUF file (needs only llama_cpp and numpy)."""
    import numpy as np
    from llama_cpp import Llama

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


def cases() -> list[Case]:
    from lmcli.config import ModelConfig, field_names

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
    from lmcli.checkpoint import save_checkpoint
    from lmcli.config import ModelConfig, TrainConfig
    from lmcli.model import Transformer
    from lmcli.tokenizer import Tokenizer

    texts = (p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    tok = Tokenizer.train(case.tokenizer, texts, vocab_size=512)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **case.model)).eval()
    randomize(model, seed)
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
        return mlp.c_proj(ggml_gelu(mlp.c_fc(inputs[0])))

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

    from lmcli.config import SampleConfig
    from lmcli.generate.sampling import generate
    from lmcli.sources import load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    tok, model = ckpt.tokenizer, ckpt.model.eval()
    prompt = [tok.bos_id, *tok.encode(PROMPT)]
    got = generate(model, tok, [prompt], SampleConfig(max_new_tokens=N_NEW, temperature=0.0))[0]
    sequence = prompt + got.ids
    with torch.no_grad():
        logits = model(torch.tensor([sequence]))[0].double()  # (T, V)
    gelu = ckpt.model_config.mlp == "gelu"
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

    from lmcli.hf.gguf import export_gguf

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
        checks[f"{what} ({diff:.1e} with its exact GELU)"] = diff_ggml <= TOLERANCE
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


def run_checks(workdir: Path, llama_python: str | None = None) -> list[Result]:
    """Every case; llama.cpp in-process unless ``llama_python`` is given."""
    return [check_case(case, workdir, llama_python) for case in cases()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", help="a Python with llama_cpp installed (default: this one)")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoints and GGUF files here")
    parser.add_argument("--llama-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llama_side:
        json.dump(llama_side(json.load(sys.stdin)), sys.stdout)
        return 0
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_checks(workdir, args.llama_python)
    for r in results:
        print("\n".join(r.lines))
    failed = [r.name for r in results if not r.ok]
    verdict = "FAIL: " + ", ".join(failed) if failed else "PASS"
    print(f"check-gguf: {verdict} ({len(results)} models, llama-cpp-python {results[0].version})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
