"""Evaluation memory: ``lmcli eval`` (``lmcli.eval.perplexity.evaluate_run``) streams its text, so its peak
memory does not grow with the text's size.

Texts of ``SMALL_MB`` and ``BIG_MB`` MB are generated in a temporary folder (documentation lines,
reshuffled and varied, as the tokenize suite does) with a run folder holding a tiny model (one
layer, 16 wide) and a byte-level BPE tokenizer of ``VOCAB`` tokens; the model is tiny because
memory, not speed, is measured. Each evaluation runs in a fresh subprocess that reports its own
peak RSS (VmHWM). Before streaming, 10 MB took 3.9 GB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_tokenize import peak_rss_mb, prefix_copy, write_corpus
from bench.common import Row, log, run_suite

BIG_MB, SMALL_MB = 100, 10
VOCAB = 2000
SHAPE = dict(n_layer=1, n_head=2, n_embd=16, block_size=256)
BATCH = 64  # windows per forward
GOAL_FLAT = 0.9


def make_run(run_dir: Path, sample: str) -> None:
    """A run folder: a random tiny model and a BPE tokenizer trained on ``sample``."""
    import torch

    from lmcli.config.files import from_dict
    from lmcli.config.model import ModelConfig
    from lmcli.config.train import TrainConfig
    from lmcli.formats.checkpoint import save_checkpoint
    from lmcli.model.transformer import Transformer
    from lmcli.text.tokenizer import Tokenizer

    tok = Tokenizer.train("bpe", iter([sample]), vocab_size=VOCAB)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **SHAPE)).eval()
    cfg = from_dict(TrainConfig, {"tokenizer": "bpe", "vocab_size": VOCAB})
    save_checkpoint(run_dir / "last", model, cfg, tok, meta={"step": 0})


def child(run_dir: str, text: str) -> None:
    """Evaluate ``text`` with the run, as ``lmcli eval RUN TEXT --batch-size BATCH`` does."""
    import torch

    from lmcli.config.commands import EvalConfig
    from lmcli.eval.perplexity import evaluate_run
    from lmcli.formats.sources import load_model

    ckpt = load_model(Path(run_dir) / "last", torch.device("cpu"))
    t0 = time.perf_counter()
    score, _ = evaluate_run(ckpt, EvalConfig(batch_size=BATCH), (text,), progress=False)
    result = {"seconds": time.perf_counter() - t0, "tokens": score.tokens, "perplexity": score.perplexity}
    print(json.dumps({**result, "rss_mb": peak_rss_mb()}))


def measure(run_dir: Path, text: Path) -> dict[str, float]:
    """One evaluation in a fresh interpreter: its time, tokens, and peak RSS (MB)."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "bench.bench_eval_memory", "--child", str(run_dir), str(text)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["mb"] = text.stat().st_size / 1e6
    log(
        f"eval of {result['mb']:.0f} MB: {result['tokens']} tokens in {result['seconds']:.0f} s, "
        f"peak RSS {result['rss_mb']:.0f} MB"
    )
    return result


def run() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-eval-mem-") as tmp:
        tmp_dir = Path(tmp)
        big, small = tmp_dir / f"text-{BIG_MB}mb.txt", tmp_dir / f"text-{SMALL_MB}mb.txt"
        write_corpus(big, BIG_MB)
        prefix_copy(big, small, SMALL_MB)
        with open(big, encoding="utf-8") as f:
            make_run(tmp_dir / "run", f.read(10**6))
        ours_small = measure(tmp_dir / "run", small)
        ours_big = measure(tmp_dir / "run", big)
    return [
        Row(
            f"eval peak RSS, {BIG_MB} MB vs {SMALL_MB} MB text",
            "MB",
            ours_big["rss_mb"],
            ours_small["rss_mb"],
            f"lmcli eval of {SMALL_MB} MB",
            GOAL_FLAT,
            lower_is_better=True,
            note=f"{ours_big['tokens']:,} tokens in {ours_big['seconds']:.0f} s; memory flat if ratio ~ 1",
            extra={"lmcli_big": ours_big, "lmcli_small": ours_small},
        )
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:4])
    else:
        run_suite("eval_memory", run)


if __name__ == "__main__":
    main()
