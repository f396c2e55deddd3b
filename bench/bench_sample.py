"""Sampling throughput: ``lmcli.sampling.generate`` against Hugging Face ``generate(do_sample=True)``
on the same weights, prompt and settings, for three model sizes.

Both sides use their KV cache, temperature 0.8 without top-k/top-p, one prompt of ``PROMPT``
tokens, and exactly ``new`` new tokens (``min_new_tokens = max_new_tokens``: neither may stop
early at ``<eos>``). Tokens/s counts the new tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.common import Row, interleaved, log, run_suite
from bench.models import GPT2_SMALL, SMALL, TINY, hf_twin, lmcli_model
from bench.texts import char_tokenizer, wide_tokenizer
from lmcli.config.commands import SampleConfig
from lmcli.generate.sampling import generate
from lmcli.model import fastpath
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer

PROMPT = 16
TEMPERATURE = 0.8
# (label, shape, vocab, context, new tokens, repeats, goal)
CASES: list[tuple[str, dict[str, int], int, int, int, int, float]] = [
    ("4x128, vocab 65", TINY, 65, 256, 200, 5, 3.0),
    ("6x384, vocab 65", SMALL, 65, 256, 100, 3, 1.5),
    ("GPT-2 small", GPT2_SMALL, 50257, 1024, 32, 2, 1.1),
]


def lmcli_sample(model: Transformer, tok: Tokenizer, prompt: list[int], new: int, seed: int) -> list[int]:
    cfg = SampleConfig(
        max_new_tokens=new, min_new_tokens=new, temperature=TEMPERATURE, top_k=0, top_p=1.0, seed=seed
    )
    out = generate(model, tok, [prompt], cfg)[0]
    return out.ids


def hf_sample(hf: Any, prompt: list[int], new: int, pad_id: int) -> list[int]:
    idx = torch.tensor([prompt])
    out = hf.generate(
        idx,
        attention_mask=torch.ones_like(idx),
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new,
        min_new_tokens=new,
        use_cache=True,
        pad_token_id=pad_id,
    )
    return out[0, len(prompt) :].tolist()


def case(
    label: str, shape: dict[str, int], vocab: int, block: int, new: int, repeats: int, goal: float
) -> Row:
    tok = char_tokenizer(vocab) if vocab <= 100 else wide_tokenizer(vocab)
    model = lmcli_model(vocab, block, **shape).eval()
    hf = hf_twin(model, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id).eval()
    g = torch.Generator().manual_seed(1)
    prompt = [tok.bos_id, *torch.randint(5, vocab, (PROMPT - 1,), generator=g).tolist()]
    n_params = model.num_parameters()
    log(f"{label}: {n_params / 1e6:.1f}M parameters, prompt {PROMPT}, {new} new tokens")
    lengths: dict[str, int] = {}

    def ours() -> None:
        lengths["lmcli"] = len(lmcli_sample(model, tok, prompt, new, seed=0))

    def theirs() -> None:
        lengths["hf"] = len(hf_sample(hf, prompt, new, tok.pad_id))

    with torch.inference_mode(), fastpath.inference(model):  # one scope, as a long-lived caller holds
        times = interleaved({"lmcli": ours, "hf": theirs}, repeats=repeats, warmup=1)
    same = lengths["lmcli"] == lengths["hf"] == new
    return Row(
        f"sample tokens/s, {n_params / 1e6:.1f}M ({label})",
        "tokens/s",
        new / times["lmcli"],
        new / times["hf"],
        "HF generate(do_sample)",
        goal,
        valid=same,
        note="" if same else f"new tokens differ: {lengths}",
        extra={"params": n_params, "new_tokens": new, "prompt": PROMPT, "seconds": times},
    )


def run() -> list[Row]:
    return [case(*c) for c in CASES]


def main() -> None:
    run_suite("sample", run)


if __name__ == "__main__":
    main()
