"""Speculative decoding: ``generate`` with a draft model against ``generate`` without one, on the
same model, prompt and settings (``lmcli sample --draft``).

The pair: a 6x384 character-level model (~10.8M parameters) and a 2x128 draft (~0.4M), each
trained briefly by ``lmcli.train`` on the same text (CPython's documentation, ``bench/texts.py``)
with the same tokenizer, ``STEPS`` steps each (seeded: the same pair on every machine, about
two minutes of training on two cores), so that the draft agrees with the model often, as a
small model of a family agrees with a large one. Two random models would agree on almost nothing (no speed-up
to measure), and a draft made of the model's own first layers agrees only once both are trained.

Both sides decode exactly ``NEW`` tokens (``min_new_tokens = max_new_tokens``) from the same
prompt, greedily (the texts must be equal: the row is invalid otherwise) and sampled at
temperature 0.8. The ratio is the speed-up; the acceptance rate (proposals taken / proposed) is
in the note.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.common import Row, interleaved, log, run_suite
from bench.texts import doc_text
from lmcli.config.commands import SampleConfig
from lmcli.config.files import from_dict
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.formats.sources import load_checkpoint
from lmcli.generate.sampling import generate
from lmcli.generate.speculative import Draft
from lmcli.model import fastpath
from lmcli.train import Reporter, train

NEW = 96
PROMPT = 32
CONTEXT = 128  # prompt + NEW: speculation needs both in the context
K = 4  # --draft-tokens
STEPS = 150
TARGET = dict(n_layer=6, n_head=6, n_embd=384)
DRAFT = dict(n_layer=2, n_head=2, n_embd=128)


def trained(folder: Path, corpus: Path, shape: dict[str, int], tokenizer: str) -> Path:
    """A char model of ``shape`` trained ``STEPS`` steps on ``corpus``; its run folder."""
    options = dict(
        corpus=(str(corpus),),
        out=str(folder),
        tokenizer=tokenizer,
        max_steps=STEPS,
        batch_size=8,
        eval_interval=STEPS,
        eval_batches=2,
        warmup_steps=20,
        cache_dir=str(folder.parent / "cache"),
        seed=0,
    )
    cfg = from_dict(TrainConfig, options, source="bench_speculative")  # flat names, as flags
    model = ModelConfig(block_size=CONTEXT, **shape)
    result = train(model, cfg, reporter=Reporter(info=lambda m: None), progress=False)
    log(f"{shape}: {result.step} steps, validation loss {result.val_loss}")
    return folder


def case(model, draft: Draft, tok, prompt: list[int], temperature: float) -> Row:
    cfg = SampleConfig(max_new_tokens=NEW, min_new_tokens=NEW, temperature=temperature, seed=0)
    out: dict[str, list] = {}

    def plain() -> None:
        out["plain"] = generate(model, tok, [prompt], cfg)

    def drafted() -> None:
        out["draft"] = generate(model, tok, [prompt], cfg, draft=draft)

    with torch.inference_mode(), fastpath.inference(model), fastpath.inference(draft.model):
        times = interleaved({"draft": drafted, "plain": plain}, repeats=3, warmup=1)
    g = out["draft"][0]
    acceptance = g.accepted / g.drafted if g.drafted else 0.0
    same = temperature > 0 or g.ids == out["plain"][0].ids
    what = "greedy" if temperature == 0 else f"temperature {temperature}"
    note = f"acceptance {acceptance:.2f} ({g.accepted}/{g.drafted} proposals, k={K})"
    if not same:
        note += "; the greedy texts differ"
    return Row(
        f"speculative sample tokens/s ({what})",
        "tokens/s",
        NEW / times["draft"],
        NEW / times["plain"],
        "lmcli without --draft",
        1.0,
        valid=same,
        note=note,
        extra={"acceptance": acceptance, "k": K, "new_tokens": NEW, "seconds": times},
    )


def run() -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "docs.txt"
        corpus.write_text(doc_text())
        log(f"training the model {TARGET} and the draft {DRAFT}")
        big = trained(root / "model", corpus, TARGET, "char")
        small = trained(root / "draft", corpus, DRAFT, str(big / "last" / "tokenizer.json"))
        target, helper = load_checkpoint(big / "last"), load_checkpoint(small / "last")
        tok = target.tokenizer
        prompt = tok.with_bos(tok.encode(doc_text()[10000:20000]))[:PROMPT]
        draft = Draft(helper.model, helper.tokenizer, K)
        big_m, small_m = target.model.num_parameters() / 1e6, helper.model.num_parameters() / 1e6
        log(f"{big_m:.1f}M model, {small_m:.2f}M draft")
        return [case(target.model, draft, tok, prompt, t) for t in (0.0, 0.8)]


def main() -> None:
    run_suite("speculative", run)


if __name__ == "__main__":
    main()
