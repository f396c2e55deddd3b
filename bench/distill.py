"""Distillation on a CPU: a small student trained on a corpus alone, against the same student taught
by a bigger teacher (run beside it; from its offline top-64 logits; from 64 tokens drawn from it
at each position), and a student cut from half the teacher's blocks against a random student of
its shape, all on the same tokens.

    python -m bench.distill [--teacher RUN] [--work DIR] [--threads N] [--epochs E] [--teacher-time 45m]

No pretrained model is downloaded: the teacher is trained here by ``lmcli train`` (``TEACHER``: a
Llama-shaped model, 6 blocks 384 wide, a BPE vocabulary of 4,096 tokens) on Tiny Shakespeare cut
in three at paragraph breaks: the first 85% (what the teacher and every student train on), 5%
(validation: ``best/`` and the curves) and the last 10% (held out: seen by no run, scored once at
the end). ``--teacher RUN`` takes a teacher trained before (the same command).

Then, each a fresh ``lmcli`` process on the same tokens (``--epochs`` passes over the 85%):

- ``tokenize --teacher --top-k 64``: the corpus in the teacher's tokenizer and its top-64 logits
  (timed: the offline students' wall time counts it); the same with ``--logits sampled`` (64
  tokens drawn from the teacher at each position) into ``tokens-sampled``;
- ``scratch``: the student (``STUDENT``: 4 blocks 192 wide, 2.6M parameters) with ``--task lm``;
- ``online``: ``--task distill`` with the teacher run beside the student;
- ``offline``: ``--task distill`` reading the logits (no teacher in memory); ``offline-mix``:
  the same with ``--distill-alpha 0.5`` (half the loss the text's cross-entropy);
  ``offline-sampled``: reading the sampled logits (the forward KL estimated from the draws);
- ``cut``: ``--student-layers 3`` (blocks 0, 3, 5 of the teacher, its embedding and head), from
  the logits, against ``cut-random``: the same shape from random weights, the same training.

Reported: each student's held-out perplexity at equal tokens (``lmcli eval RUN/last``), its wall
time, the starting held-out perplexity of the cut and random students, the bytes a token of
the logits, the teacher's mean mass outside its top 64, and the cost of one offline distillation
step over one plain step of the student, measured in this process, the two alternated on the
same batches. Results:
bench/results/distill.json and bench/results/distill.png (validation loss against tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("LMCLI_DATA", ROOT.parent / "shared" / "data"))
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
RESULTS = ROOT / "bench" / "results"
LLAMA = ["--position", "rope", "--norm", "rmsnorm", "--mlp", "swiglu", "--no-bias"]
TEACHER = [
    *("--tokenizer", "bpe", "--vocab-size", "4096", *LLAMA, "--n-layer", "6", "--n-head", "6"),
    *("--n-embd", "384", "--block-size", "256", "--batch-size", "8", "--warmup-steps", "30"),
    *("--lr", "2e-3", "--log-interval", "10", "--eval-interval", "50", "--eval-batches", "10", "--seed", "1"),
]
STUDENT = [*LLAMA, "--n-layer", "4", "--n-head", "4", "--n-embd", "192", "--block-size", "256"]
BATCH, BLOCK, TOP_K, CUT = 8, 256, 64, 3
# a random student of the cut's shape, trained as the cut is (AdamW, cosine: a student from weights)
CUT_SHAPE = [
    *LLAMA,
    "--n-layer",
    str(CUT),
    "--n-head",
    "6",
    "--n-embd",
    "384",
    "--optimizer",
    "adamw",
    "--schedule",
    "cosine",
]
GOAL_PPL, GOAL_STEP = 0.85, 1.3  # distilled ppl <= 0.85x scratch's; an offline step <= 1.3x a plain one


def split(work: Path) -> dict[str, Path]:
    """Tiny Shakespeare cut at paragraph breaks: 85% train, 5% validation, 10% held out."""
    text = SHAKESPEARE.read_text(encoding="utf-8")
    cuts = [text.index("\n\n", int(len(text) * f)) + 2 for f in (0.85, 0.90)]
    parts = {"train": text[: cuts[0]], "val": text[cuts[0] : cuts[1]], "test": text[cuts[1] :]}
    out = {}
    for name, part in parts.items():
        out[name] = work / f"{name}.txt"
        if not out[name].exists():
            out[name].write_text(part, encoding="utf-8")
    return out


def lmcli(args: list[str], threads: int | None) -> float:
    """One ``lmcli`` command in a fresh process (niced); its wall time. A failure ends the script."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = ["nice", "-n", "10", sys.executable, "-m", "lmcli", *args]
    print("  lmcli " + " ".join(args), flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def teacher_logits(
    teacher: Path, train: Path, out: Path, seconds: Path, threads: int | None, *more: str
) -> float:
    """The corpus's token folder ``out`` with the teacher's logits (kept when finished before);
    the seconds it took (recorded in ``seconds``)."""
    if not (out / "teacher.json").exists():
        spent = lmcli(["tokenize", str(train), "--teacher", str(teacher), "--top-k", str(TOP_K), *more,
                       "--block-size", str(BLOCK), "-o", str(out), "-q"], threads)  # fmt: skip
        seconds.write_text(json.dumps(spent))
    return json.loads(seconds.read_text())


def train_run(name: str, args: list[str], work: Path, threads: int | None) -> dict[str, Any]:
    """One training run (kept when it finished before: ``work/NAME``); its wall time and curve."""
    out = work / name
    if not (out / "last" / "meta.json").exists():
        more = ["--threads", str(threads)] if threads else []
        lmcli(["train", *args, "--out", str(out), "-q", *more], threads)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = BATCH * BLOCK
    return {
        "command": "lmcli train " + " ".join(args),
        "train_s": max(r["elapsed"] for r in records if "elapsed" in r),
        "curve": [(r["step"] * tokens, r["val_loss"]) for r in records if "val_loss" in r],
        "kl": [(r["step"] * tokens, r["kl"]) for r in records if "kl" in r],
    }


def held_out(run: Path, test: Path, threads: int | None) -> float:
    """The perplexity of ``run/last`` on the held-out text."""
    out = run / "held-out.json"
    if not out.exists():
        env = dict(os.environ, PYTHONPATH=str(ROOT), **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        cmd = [sys.executable, "-m", "lmcli", "eval", str(run / "last"), str(test), "--json"]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        out.write_text(done.stdout)
    return json.loads(out.read_text())["perplexity"]


def starting_perplexity(teacher: Path, tokens: Path, test: Path) -> dict[str, float]:
    """Held-out perplexity before any step: the cut student, a random one of its shape, the
    random small student (as ``lmcli train`` seeds them)."""
    import torch

    from lmcli.config.model import ModelConfig
    from lmcli.eval.perplexity import evaluate_text
    from lmcli.formats.model_source import model_source
    from lmcli.model.transformer import Transformer
    from lmcli.train.init_from import open_cut

    text = test.read_text(encoding="utf-8")
    source = model_source(teacher)
    tok = source.tokenizer()
    cut = open_cut(source, (), CUT, lambda m: None, BLOCK).load(False)[0].eval()
    torch.manual_seed(1337)
    twin = Transformer(cut.config).eval()
    small = ModelConfig(vocab_size=tok.vocab_size, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                        n_layer=4, n_head=4, n_embd=192, block_size=BLOCK, vocab_multiple=1)  # fmt: skip
    torch.manual_seed(1337)
    student = Transformer(small).eval()
    return {name: evaluate_text(m, tok, text).perplexity for name, m in
            (("cut", cut), ("cut-random", twin), ("student-random", student))}  # fmt: skip


def step_cost(tokens: Path, threads: int | None, repeats: int = 12) -> dict[str, float]:
    """Seconds of one plain training step of the student and of one offline distillation step
    (the logits gathered, the loss over the top-64 and the rest), alternated on the same windows
    in this process (fastest of ``repeats`` each; AdamW for both)."""
    import torch

    from bench.common import interleaved
    from lmcli.config.model import ModelConfig
    from lmcli.data.logit_shards import gather, open_logit_folder
    from lmcli.data.token_shards import open_token_folder
    from lmcli.data.windows import WindowSampler
    from lmcli.eval.perplexity import forward_scored
    from lmcli.model.transformer import Transformer
    from lmcli.train.post.divergence import Targets, distill_loss

    if threads:
        torch.set_num_threads(threads)
    folder = open_token_folder(tokens)
    logits = open_logit_folder(folder)
    assert logits is not None
    pieces, stream = logits.pieces(), folder.stream()
    vocab = folder.tokenizer().vocab_size
    cfg = ModelConfig(vocab_size=vocab, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                      n_layer=4, n_head=4, n_embd=192, block_size=BLOCK, vocab_multiple=1)  # fmt: skip
    model = Transformer(cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sampler = WindowSampler(stream, BLOCK, seed=0, grid=logits.context)
    at = [0]

    def plain() -> None:
        batch = sampler.batch(at[0], BATCH)
        out, targets = forward_scored(model, batch)
        torch.nn.functional.cross_entropy(out.float(), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def distill() -> None:
        starts = sampler.window_starts(at[0], BATCH)
        batch = sampler.batch(at[0], BATCH)
        ids, logp, rest = gather(pieces, stream, starts, BLOCK)
        k = ids.shape[-1]
        flat = [torch.from_numpy(a).view(-1, k) for a in (logp, ids)]  # (B, T, K) -> (N, K)
        teacher = Targets(flat[0], flat[1], torch.from_numpy(rest).view(-1))
        out, targets = forward_scored(model, batch)
        distill_loss(out, targets, teacher).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        at[0] += BATCH

    times = interleaved({"plain": plain, "distill": distill}, repeats=repeats, warmup=2)
    return {**times, "ratio": times["distill"] / times["plain"]}


def rest_mass(tokens: Path) -> float:
    """The teacher's mean probability outside its top K over the corpus (what the offline loss
    cannot see token by token)."""
    import numpy as np

    files = sorted(tokens.glob("shard-*.top-rest"))
    logs = np.concatenate([np.fromfile(p, dtype=np.float16).astype(np.float64) for p in files])
    return float(np.exp(logs).mean())


def plot(results: dict[str, Any], out: Path) -> None:
    """Validation loss against tokens seen, one line a student."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name, run in results["runs"].items():
        tokens, losses = zip(*run["curve"], strict=True)
        ax.plot([t / 1e3 for t in tokens], losses, marker="o", markersize=3, label=name)
    ax.set_xlabel("tokens seen (thousands)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def table(results: dict[str, Any]) -> str:
    """The results as a markdown table and the goals' lines."""
    runs, scratch = results["runs"], results["runs"]["scratch"]["held_out_ppl"]
    lines = ["| student | held-out ppl | vs scratch | wall time (train + logits) |", "|---|---|---|---|"]
    for name, run in runs.items():
        spent = results["sampled_logits_s"] if name == "offline-sampled" else results["logits_s"]
        logits = f" + {spent / 60:.1f} min" if run.get("offline") else ""
        wall = f"{run['train_s'] / 60:.1f} min{logits}"
        lines.append(f"| {name} | {run['held_out_ppl']:.1f} | {run['held_out_ppl'] / scratch:.3f} | {wall} |")
    start = results["start_ppl"]
    lines += [
        "",
        f"starting held-out ppl: cut {start['cut']:.1f}, random of its shape {start['cut-random']:.1f}, "
        f"random small student {start['student-random']:.1f}",
        f"offline step / plain step: {results['step']['ratio']:.2f} (goal <= {GOAL_STEP}); logits "
        f"{results['bytes_per_token']} bytes a token ({results['logit_bytes'] / 1e6:.1f} MB for "
        f"{results['tokens']:,} tokens); the teacher's mass outside its top {TOP_K}: "
        f"{results['rest_mass']:.3f} on average; sampled logits {TOP_K} draws, "
        f"{results['sampled_logit_bytes'] / 1e6:.1f} MB",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", type=Path, help="a teacher trained before with TEACHER's options")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "lmcli" / "bench-distill")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--epochs", type=float, default=1.0, help="passes of every student over the corpus")
    parser.add_argument("--teacher-time", default="45m", help="the teacher's --max-time when trained here")
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    data = split(work)
    t_all = time.perf_counter()
    teacher = args.teacher or work / "teacher"
    if not (teacher / "last" / "meta.json").exists():
        cache = ["--cache-dir", str(work / "cache")]
        split_args = [str(data["train"]), "--val", str(data["val"])]
        what = [*TEACHER, "--max-time", args.teacher_time, *cache, "--out", str(teacher), "-q"]
        lmcli(["train", *split_args, *what], args.threads)
    tokens, sampled = work / "tokens", work / "tokens-sampled"
    logits_s = teacher_logits(teacher, data["train"], tokens, work / "logits_s.json", args.threads)
    sampled_s = teacher_logits(
        teacher, data["train"], sampled, work / "sampled_logits_s.json", args.threads, "--logits", "sampled"
    )
    n_tokens = json.loads((tokens / "index.json").read_text())["n_tokens"]
    steps = max(1, round(args.epochs * n_tokens / (BATCH * BLOCK)))
    common = [*STUDENT, "--val", str(data["val"]), "--batch-size", str(BATCH), "--max-steps", str(steps),
              "--warmup-steps", str(max(steps // 10, 1)), "--eval-interval", str(max(steps // 7, 1)),
              "--eval-batches", "10", "--cache-dir", str(work / "cache")]  # fmt: skip
    distill = ["--task", "distill", "--teacher", str(teacher)]
    plans = {
        "scratch": [str(tokens), *common],
        "online": [str(data["train"]), *common, *distill],
        "offline": [str(tokens), *common, *distill],
        "offline-mix": [str(tokens), *common, *distill, "--distill-alpha", "0.5"],
        "offline-sampled": [str(sampled), *common, *distill],
        "cut": [str(tokens), *common, *distill, "--student-layers", str(CUT)],
        "cut-random": [str(tokens), *common, *distill, *CUT_SHAPE],
    }
    results: dict[str, Any] = {"teacher": str(teacher), "tokens": n_tokens, "steps": steps, "runs": {}}
    for name, plan in plans.items():
        run = train_run(name, plan, work, args.threads)
        run["held_out_ppl"] = held_out(work / name, data["test"], args.threads)
        run["offline"] = name in ("offline", "offline-mix", "offline-sampled", "cut", "cut-random")
        results["runs"][name] = run
        print(f"  {name}: held-out ppl {run['held_out_ppl']:.2f} in {run['train_s']:.0f} s", flush=True)
    results["teacher_held_out_ppl"] = held_out(teacher, data["test"], args.threads)
    results["logits_s"], results["sampled_logits_s"] = logits_s, sampled_s
    results["start_ppl"] = starting_perplexity(teacher, tokens, data["test"])
    results["step"] = step_cost(tokens, args.threads)
    record = json.loads((tokens / "teacher.json").read_text())
    results["bytes_per_token"] = TOP_K * 2 * 2 + 2 if record["dtype"] == "uint16" else TOP_K * 6 + 2
    results["logit_bytes"] = sum(p.stat().st_size for p in tokens.glob("shard-*.top-*"))
    results["sampled_logit_bytes"] = sum(p.stat().st_size for p in sampled.glob("shard-*.drawn-*"))
    results["rest_mass"] = rest_mass(tokens)
    results["elapsed_s"] = time.perf_counter() - t_all
    results["load"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distill.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "distill.png")
    scratch = results["runs"]["scratch"]["held_out_ppl"]
    best = min(
        results["runs"][n]["held_out_ppl"] for n in ("online", "offline", "offline-mix", "offline-sampled")
    )
    print(table(results))
    teacher_ppl, minutes = results["teacher_held_out_ppl"], results["elapsed_s"] / 60
    ratio = f"distilled/scratch {best / scratch:.3f} (goal <= {GOAL_PPL})"
    online = results["runs"]["online"]["held_out_ppl"]
    ratio += f"; offline/online {results['runs']['offline']['held_out_ppl'] / online:.3f}, "
    ratio += f"offline-sampled/online {results['runs']['offline-sampled']['held_out_ppl'] / online:.3f}"
    print(f"teacher held-out ppl {teacher_ppl:.1f}; {ratio}; {minutes:.0f} min in all")


if __name__ == "__main__":
    main()
