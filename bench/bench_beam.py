"""Beam-search throughput: ``lmcli.beam.beam_search`` against Hugging Face
``generate(num_beams=5, early_stopping=True, length_penalty=1.0)`` on the same weights and inputs.

Several inputs of 12-30 tokens (the length of translation sources) are decoded as one
left-padded batch on both sides, at most ``MAX_NEW`` new tokens each. The
random weights are drawn wide (as in tests/generate/test_beam.py's parity test) so that predictions are
confident and the two implementations, whose arithmetic differs in the last bits, choose the same
beams; the suite checks that the best hypothesis of every input is the same token ids on both
sides. Tokens/s counts the tokens of the best hypotheses (``<eos>`` included when it ended one).
"""

from __future__ import annotations

from typing import Any

import torch

from bench.common import Row, interleaved, log, run_suite
from bench.models import SMALL, hf_twin, lmcli_model
from lmcli.config.commands import BeamConfig
from lmcli.generate.beam import Hypothesis, beam_search
from lmcli.model import fastpath
from lmcli.model.transformer import Transformer

VOCAB, BLOCK = 8000, 256
BOS, EOS, PAD = 2, 3, 0
BEAMS, MAX_NEW = 5, 24
PROMPT_LENGTHS = (14, 22, 18, 30, 12, 26, 20, 16)  # source sentences, as in translation
WEIGHT_STD = 0.1  # wide random weights: confident predictions, no near-ties between beams
GOAL = 2.0


def peaky_model(seed: int = 0) -> Transformer:
    model = lmcli_model(VOCAB, BLOCK, seed=seed, **SMALL).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * WEIGHT_STD)
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [[BOS, *torch.randint(5, VOCAB, (n - 1,), generator=g).tolist()] for n in PROMPT_LENGTHS]


def lmcli_beam(model: Transformer, inputs: list[list[int]]) -> list[Hypothesis]:
    cfg = BeamConfig(beam_size=BEAMS, length_penalty=1.0, max_new_tokens=MAX_NEW, early_stopping=True)
    return [h[0] for h in beam_search(model, inputs, cfg, eos_id=EOS, pad_id=PAD)]


def hf_beam(hf: Any, inputs: list[list[int]]) -> list[list[int]]:
    """Best continuation of each input (ids after the prompt, up to and without <eos>)."""
    width = max(len(p) for p in inputs)
    idx = torch.tensor([[PAD] * (width - len(p)) + p for p in inputs])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in inputs])
    out = hf.generate(
        idx,
        attention_mask=attention,
        num_beams=BEAMS,
        early_stopping=True,
        length_penalty=1.0,
        max_new_tokens=MAX_NEW,
        do_sample=False,
        use_cache=True,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    best = []
    for row in out[:, width:].tolist():
        best.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return best


def run() -> list[Row]:
    model = peaky_model()
    hf = hf_twin(model, bos_id=BOS, eos_id=EOS, pad_id=PAD).eval()
    inputs = prompts()
    n_params = model.num_parameters()
    log(f"model: {n_params / 1e6:.1f}M parameters, vocab {VOCAB}, {len(inputs)} inputs, beam {BEAMS}")
    results: dict[str, Any] = {}

    def ours() -> None:
        results["lmcli"] = lmcli_beam(model, inputs)

    def theirs() -> None:
        results["hf"] = hf_beam(hf, inputs)

    with torch.inference_mode(), fastpath.inference(model):  # as `lmcli beam` holds it for all inputs
        times = interleaved({"lmcli": ours, "hf": theirs}, repeats=4, warmup=1)
    ours_ids = [h.ids + ([EOS] if h.ended else []) for h in results["lmcli"]]
    theirs_ids = results["hf"]
    same = ours_ids == theirs_ids
    n_tokens = sum(len(ids) for ids in ours_ids)
    differ = [i for i, (a, b) in enumerate(zip(ours_ids, theirs_ids, strict=True)) if a != b]
    log(f"best hypotheses identical: {same}" + (f" (inputs {differ} differ)" if differ else ""))
    return [
        Row(
            f"beam-{BEAMS} tokens/s, {n_params / 1e6:.1f}M, vocab {VOCAB}, {len(inputs)} inputs",
            "tokens/s",
            sum(len(ids) for ids in ours_ids) / times["lmcli"],
            sum(len(ids) for ids in theirs_ids) / times["hf"],
            "HF generate(num_beams)",
            GOAL,
            valid=same,
            note=f"best hypotheses of all {len(inputs)} inputs identical ({n_tokens} tokens)"
            if same
            else f"best hypotheses DIFFER for inputs {differ}",
            extra={"params": n_params, "tokens": n_tokens, "seconds": times},
        )
    ]


def main() -> None:
    run_suite("beam", run)


if __name__ == "__main__":
    main()
