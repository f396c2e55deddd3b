"""Structured output: the per-token cost of a grammar's mask. ``lmcli.sampling.generate`` of the
same rows with a JSON schema (each row its own llguidance matcher, masks computed every step)
and without, on a 6x384 model with a 32,000-token byte-level vocabulary.

Tokens/s counts the tokens each side generated (a constrained row ends when its JSON is
complete; the schema's open array keeps most rows going to ``NEW``); the ratio is the share of
the unconstrained speed that remains under the mask, and the note gives the mask's cost per
token and row in microseconds.
"""

from __future__ import annotations

import torch

from bench.common import Row, interleaved, log, run_suite
from bench.models import SMALL, lmcli_model
from bench.texts import wide_tokenizer
from lmcli.config.commands import SampleConfig
from lmcli.generate.constrain import Constraint, Grammars
from lmcli.generate.sampling import generate
from lmcli.model import fastpath

VOCAB, ROWS, NEW, PROMPT = 32000, 8, 64, 16
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "n", "ok"],
        "additionalProperties": False,
    },
}


def run() -> list[Row]:
    tok = wide_tokenizer(VOCAB)
    model = lmcli_model(VOCAB, 256, **SMALL).eval()
    prompt = [
        tok.bos_id,
        *torch.randint(5, VOCAB, (PROMPT - 1,), generator=torch.Generator().manual_seed(1)).tolist(),
    ]
    cfg = SampleConfig(max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.8, num_samples=ROWS)
    grammars = Grammars(tok)
    constraint = Constraint.json_schema(SCHEMA)
    grammars.compile(constraint)
    counts: dict[str, int] = {}

    def constrained() -> None:
        out = generate(model, tok, [prompt], cfg, processors=lambda: (grammars.processor(constraint),))
        counts["schema"] = sum(len(g.ids) + (g.finish_reason == "eos") for g in out)

    def free() -> None:
        counts["free"] = sum(len(g.ids) for g in generate(model, tok, [prompt], cfg))

    log(f"{model.num_parameters() / 1e6:.1f}M parameters, vocab {VOCAB}, {ROWS} rows x {NEW} tokens")
    with torch.inference_mode(), fastpath.inference(model):
        times = interleaved({"schema": constrained, "free": free}, repeats=3, warmup=1)
    speed = {k: counts[k] / times[k] for k in times}
    mask_us = 1e6 * (times["schema"] / counts["schema"] - times["free"] / counts["free"])
    return [
        Row(
            f"structured output tokens/s ({ROWS} rows, vocab {VOCAB // 1000}k)",
            "tokens/s",
            speed["schema"],
            speed["free"],
            "no schema",
            0.7,
            note=f"the mask costs {mask_us:.0f} us per token and row ({counts['schema']} tokens with it)",
            extra={"seconds": times, "tokens": counts, "mask_us_per_token": mask_us},
        )
    ]


def main() -> None:
    run_suite("structured", run)


if __name__ == "__main__":
    main()
