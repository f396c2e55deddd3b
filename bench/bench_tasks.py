"""Multiple-choice throughput: lmcli's built-in scorer (``lmcli eval --task``) against
lm-evaluation-harness's ``hf`` backend on the same weights and the same task file.

The model is the SMALL shape (6 x 384, context 256; 13.3M parameters with a byte-level BPE of
8000 tokens trained on the bench text), saved as an lmcli run and exported as a Hugging Face
GPT-2 folder for the harness. The task is HellaSwag-shaped: a context of ~60 tokens and four
endings of ~20, taken from the bench text, 96 questions, in one JSONL file that both sides read
(the harness through a task YAML). Each side's time runs from the file to the scores: lmcli ``load_tasks`` and
``evaluate_tasks`` (8 questions per forward), the harness ``simple_evaluate`` with
``batch_size=32`` requests (the same 32 rows per forward, ``add_bos_token=True``: lmcli reads
``<bos> context`` too). The row is valid when both give the same acc and acc_norm on every
question.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.common import Row, interleaved, log, run_suite
from bench.models import SMALL, lmcli_model
from bench.texts import doc_text
from lmcli.config.train import TrainConfig
from lmcli.eval.downstream.evaluate import load_tasks
from lmcli.eval.downstream.kinds import KIND_OF, Scorer
from lmcli.eval.harness import task_config
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.export.hf import export_hf
from lmcli.model import fastpath
from lmcli.text.tokenizer import Tokenizer

VOCAB, BLOCK = 8000, 256
QUESTIONS, CONTEXT_CHARS, ENDING_CHARS = 96, 240, 80
GOAL = 2.0


def span(text: str, rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of ``text`` starting at a word, on one line."""
    start = text.index(" ", rng.randrange(len(text) - 2 * chars)) + 1
    return " ".join(text[start : start + chars].split()[:-1])


def write_task(folder: Path, text: str) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(QUESTIONS):
        choices = [span(text, rng, ENDING_CHARS) for _ in range(4)]
        context = span(text, rng, CONTEXT_CHARS)
        rows.append({"context": context, "choices": choices, "answer": rng.randrange(4)})
    data = folder / "bench_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "bench_mc.yaml").write_text(yaml.safe_dump(task_config("bench_mc", data, "multiple_choice")))
    return data


def run() -> list[Row]:
    import logging

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    text = doc_text()
    tok = Tokenizer.train("bpe", iter([text]), vocab_size=VOCAB)
    model = lmcli_model(tok.vocab_size, BLOCK, **SMALL).eval()
    folder = Path(tempfile.mkdtemp(prefix="lmcli-bench-tasks-"))
    save_checkpoint(folder / "run" / "last", model, TrainConfig(), tok, meta={"step": 0})
    hf_folder = export_hf(folder / "run", folder / "hf")
    data = write_task(folder, text)
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    hf = HFLM(pretrained=str(hf_folder), add_bos_token=True, batch_size=32, device="cpu")
    size = model.num_parameters() / 1e6
    log(f"model: {size:.1f}M parameters, vocab {tok.vocab_size}, {QUESTIONS} questions")
    results: dict[str, Any] = {}

    def ours() -> None:
        [task] = load_tasks((str(data),))
        scorer = Scorer(model, tok, batch_size=8)
        results["lmcli"] = KIND_OF["multiple_choice"].score(scorer, task.items, [])

    def theirs() -> None:
        results["hf"] = simple_evaluate(
            model=hf, tasks=["bench_mc"], task_manager=manager, log_samples=True, bootstrap_iters=0
        )

    with fastpath.inference(model):  # as `lmcli eval` holds it for the whole command
        times = interleaved({"lmcli": ours, "hf": theirs}, repeats=2, warmup=1)
    samples = sorted(results["hf"]["samples"]["bench_mc"], key=lambda s: s["doc_id"])
    pairs = zip(results["lmcli"], samples, strict=True)
    same = all((r["acc"], r["acc_norm"]) == (s["acc"], s["acc_norm"]) for r, s in pairs)
    acc_norm = sum(r["acc_norm"] for r in results["lmcli"]) / QUESTIONS
    log(f"acc_norm {acc_norm:.4f}; every question's acc and acc_norm equal: {same}")
    return [
        Row(
            f"multiple-choice questions/s, {model.num_parameters() / 1e6:.1f}M, 4 choices",
            "questions/s",
            QUESTIONS / times["lmcli"],
            QUESTIONS / times["hf"],
            "lm-eval hf backend",
            GOAL,
            valid=same,
            note=f"acc and acc_norm equal on all {QUESTIONS} questions" if same else "scores DIFFER",
            extra={"acc_norm": acc_norm},
        )
    ]


def main() -> None:
    run_suite("tasks", run)


if __name__ == "__main__":
    main()
