"""What tiny lmcli models score on downstream tasks made from held-out text: the table of
docs/evaluation.md.

    python -m bench.downstream_scores [--steps 100 800] [--threads N]

The built-in corpus (Python's documentation topics, offline) is split 90/10 by characters. From
the held-out tenth come two task files in lmcli's format: ``doc_mc`` (HellaSwag-shaped: the first
half of a line, its true second half among three second halves of other lines) and ``doc_cloze``
(LAMBADA-shaped: a line and its last word). Each model is a fresh ``lmcli train`` on the 90%
(validated on the 10%) and is scored with ``lmcli eval RUN --task doc_mc.jsonl --task
doc_cloze.jsonl --json``: the default model (4 layers x 128, char tokenizer) for each of
``--steps``, and the same with ``--tokenizer bpe`` for the last. About 8 minutes on two idle
cores. Results: a Markdown table on stdout and bench/results/downstream_scores.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.texts import doc_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "downstream_scores.json"
QUESTIONS = 200


def held_out_tasks(text: str, folder: Path) -> tuple[Path, Path]:
    """The multiple-choice and cloze task files of the held-out text."""
    rng = random.Random(0)
    lines = [" ".join(line.split()) for line in text.splitlines()]
    long = [line for line in lines if len(line.split()) >= 8]
    rng.shuffle(long)
    mc = []
    for line in long[:QUESTIONS]:
        words = line.split()
        half = len(words) // 2
        others = [" ".join(o.split()[len(o.split()) // 2 :]) for o in rng.sample(long, 3)]
        answer = rng.randrange(4)
        choices = others[:answer] + [" ".join(words[half:])] + others[answer:]
        mc.append({"context": " ".join(words[:half]), "choices": choices, "answer": answer})
    cloze = [
        {"context": " ".join(line.split()[:-1]), "target": " " + line.split()[-1]}
        for line in long[QUESTIONS : 2 * QUESTIONS]
    ]
    paths = folder / "doc_mc.jsonl", folder / "doc_cloze.jsonl"
    for path, rows in zip(paths, (mc, cloze), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def lmcli(args: list[str], threads: int | None) -> str:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    done = subprocess.run([sys.executable, "-m", "lmcli", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"lmcli {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 800])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    text = doc_text()
    cut = int(len(text) * 0.9)
    folder = Path(tempfile.mkdtemp(prefix="lmcli-downstream-"))
    (folder / "train.txt").write_text(text[:cut])
    (folder / "val.txt").write_text(text[cut:])
    mc, cloze = held_out_tasks(text[cut:], folder)
    models = [("char", steps) for steps in args.steps] + [("bpe", args.steps[-1])]
    rows: list[dict[str, Any]] = []
    for tokenizer, steps in models:
        run = folder / f"{tokenizer}-{steps}"
        train = ["train", str(folder / "train.txt"), "--val", str(folder / "val.txt"), "-o", str(run)]
        lmcli([*train, "--tokenizer", tokenizer, "--max-steps", str(steps), "-q"], args.threads)
        tasks = ["--task", str(mc), "--task", str(cloze)]
        report = json.loads(lmcli(["eval", str(run), *tasks, "--json"], args.threads))
        val = json.loads(lmcli(["eval", str(run), "--json"], args.threads))
        rows.append({"tokenizer": tokenizer, "steps": steps, "bits_per_byte": val["bits_per_byte"], **report})
        print(f"  {tokenizer} {steps} steps: {json.dumps(report)}", flush=True)
    columns = ["model", "steps", "val bits/byte", "doc_mc acc", "doc_mc acc_norm", "doc_cloze acc", "ppl"]
    print("\n| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|")
    print("| chance | - | - | 0.250 | 0.250 | - | - |")
    for r in rows:
        m, c = r["tasks"]["doc_mc"], r["tasks"]["doc_cloze"]
        print(
            f"| default, {r['tokenizer']} | {r['steps']} | {r['bits_per_byte']:.3f} | {m['acc']:.3f} | "
            f"{m['acc_norm']:.3f} | {c['acc']:.3f} | {c['perplexity']:.1f} |"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"questions": QUESTIONS, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
