"""LoRA against full fine-tuning: peak memory and step time of ``lmcli train --init-from BASE``.

The base is a GPT-2-small-shaped model (12 layers, 12 heads, 768 wide, a 50257-token vocabulary,
random weights; a 256-token context), saved as an lmcli run folder with a byte tokenizer (the
model's vocabulary is padded beyond the tokenizer's, as an imported model's is). Each side
fine-tunes it for ``STEPS`` steps of one 256-token window in a fresh interpreter, through
``lmcli.train.train`` exactly as the command line does: full fine-tuning (every weight, AdamW
state for every weight) against LoRA rank ``RANK`` on the four projections of every block (the
base frozen, AdamW state for the adapters alone). Each child reports its peak RSS (VmHWM) and
the median step time from its metrics.jsonl (steps after the first).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_tokenize import peak_rss_mb
from bench.common import Row, log, run_suite
from bench.models import GPT2_SMALL

VOCAB, BLOCK, BATCH, STEPS, RANK = 50257, 256, 1, 5, 8
GOAL_RSS = 1 / 0.6  # LoRA's peak RSS at most 0.6x full fine-tuning's
TEXT = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree.\n" * 400


def make_base(run_dir: Path) -> None:
    """The base run folder: random GPT-2-small weights and a byte tokenizer."""
    import torch

    from lmcli.config.files import from_dict
    from lmcli.config.model import ModelConfig
    from lmcli.config.train import TrainConfig
    from lmcli.formats.checkpoint import save_checkpoint
    from lmcli.model.transformer import Transformer
    from lmcli.text.tokenizer import Tokenizer

    byte = Tokenizer.train("byte", iter([TEXT]))
    tok = Tokenizer(byte.hf, {"eos": byte.token(byte.eos_id)})  # named specials: a padded vocabulary
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=VOCAB, block_size=BLOCK, **GPT2_SMALL))
    cfg = from_dict(TrainConfig, {"tokenizer": "byte"})
    save_checkpoint(run_dir / "last", model, cfg, tok, meta={"step": 0})


def child(tmp: str, rank: str) -> None:
    """Fine-tune the base (``rank`` 0: every weight) and print peak RSS and step time as JSON."""
    from lmcli.config.files import from_dict
    from lmcli.config.model import ModelConfig
    from lmcli.config.train import TrainConfig
    from lmcli.train import Reporter, train

    tmp_dir = Path(tmp)
    options = dict(
        corpus=(str(tmp_dir / "text.txt"),),
        out=str(tmp_dir / f"ft-{rank}"),
        init_from=str(tmp_dir / "base"),
        cache_dir=str(tmp_dir / "cache"),
        lora_rank=int(rank),
        max_steps=STEPS,
        batch_size=BATCH,
        log_interval=1,
        eval_interval=10 * STEPS,
        eval_batches=1,
        warmup_steps=1,
    )
    cfg = from_dict(TrainConfig, options)
    train(ModelConfig(), cfg, reporter=Reporter(info=lambda msg: None), progress=False)
    rss = peak_rss_mb()
    records = [
        json.loads(line) for line in (tmp_dir / f"ft-{rank}" / "metrics.jsonl").read_text().splitlines()
    ]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > 1]
    step_s = BATCH * BLOCK / statistics.median(rates)
    print(json.dumps({"rss_mb": rss, "step_s": step_s}))


def measure(tmp: Path, rank: int) -> dict[str, float]:
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "bench.bench_lora", "--child", str(tmp), str(rank)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    what = f"LoRA rank {rank}" if rank else "full fine-tuning"
    log(f"{what}: peak RSS {result['rss_mb']:.0f} MB, {result['step_s']:.2f} s/step")
    return result


def run() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-lora-") as tmp:
        tmp_dir = Path(tmp)
        (tmp_dir / "text.txt").write_text(TEXT)
        make_base(tmp_dir / "base")
        full = measure(tmp_dir, 0)
        lora = measure(tmp_dir, RANK)
        adapters = (tmp_dir / f"ft-{RANK}" / "last" / "adapters.safetensors").stat().st_size
        base = (tmp_dir / "base" / "last" / "model.safetensors").stat().st_size
    shape = f"GPT-2 small shape, vocabulary {VOCAB}, {BATCH}x{BLOCK} tokens a step, {STEPS} steps"
    return [
        Row(
            f"LoRA r{RANK} fine-tune peak RSS, GPT-2 small",
            "MB",
            lora["rss_mb"],
            full["rss_mb"],
            "full fine-tuning",
            GOAL_RSS,
            lower_is_better=True,
            note=f"{shape}; adapters file {adapters / 1e6:.1f} MB ({100 * adapters / base:.2f}% of the base)",
            extra={"lora": lora, "full": full},
        ),
        Row(
            f"LoRA r{RANK} fine-tune step time, GPT-2 small",
            "s/step",
            lora["step_s"],
            full["step_s"],
            "full fine-tuning",
            lower_is_better=True,
            note=shape,
        ),
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:4])
    else:
        run_suite("lora", run)


if __name__ == "__main__":
    main()
