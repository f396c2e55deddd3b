"""What each GGUF preset costs, with and without lmcli's own importance matrix: KL divergence to
the f16 model on held-out text (issue 45's quality goal).

No pretrained model is downloaded: a Llama-shaped model is trained here with ``lmcli train`` on the
first 90% of Tiny Shakespeare (``$LMCLI_DATA/tinyshakespeare/input.txt``, else
``../shared/data``), every width a multiple of 256 so the K-quants apply to every matrix
(``MODEL``, a BPE of 2048 tokens), or ``BENCH_RUN`` names a run folder trained so. Then, with
lmcli's commands only:

    lmcli export RUN f16.gguf --format gguf --dtype f16
    lmcli imatrix f16.gguf calib.txt --out imatrix.gguf        # the next 5% of the text
    lmcli export f16.gguf P.gguf --format gguf --dtype P [--imatrix imatrix.gguf]

and each file is scored against the f16 one on the last 5% (``lmcli.eval.divergence``: windows
of ``CONTEXT`` tokens; per token KL(f16 || file), its mean and 99th percentile, top-1 agreement,
the perplexity ratio). Every model here computes in float32 from its file's values dequantized by
the gguf package (so the types lmcli's kernels do not run yet score as the others, and the rows
measure the blocks alone; ``lmcli eval FILE --kl-divergence f16.gguf`` runs a file as stored).

Rows: for Q4_K_M and IQ4_XS, the mean KL without an importance matrix over the mean KL with one
(goal >= 1/0.75: the matrix cuts it by 25% or more). The whole table goes to
``bench/results/quant_kld.md`` (docs/quantization.md shows it).

    BENCH_RUN=checkpoints/shakespeare python -m bench.bench_quant_kld
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("LMCLI_DATA", ROOT.parent / "shared" / "data"))
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
MARKDOWN = ROOT / "bench" / "results" / "quant_kld.md"
CONTEXT = 256
MODEL = dict(n_layer=6, n_embd=256, n_head=4, n_kv_head=2, d_ff=768, block_size=CONTEXT)
TRAIN = [
    *("--tokenizer", "bpe", "--vocab-size", "2048", "--position", "rope", "--norm", "rmsnorm", "--mlp"),
    *(
        "swiglu",
        "--batch-size",
        "16",
        "--lr",
        "2e-3",
        "--max-time",
        os.environ.get("BENCH_TRAIN_TIME", "25m"),
    ),
    *(a for k, v in MODEL.items() for a in (f"--{k.replace('_', '-')}", str(v))),
]
# (preset, with lmcli's importance matrix)
FILES = [
    ("q8_0", False), ("Q6_K", False), ("Q5_K_M", False), ("Q4_K_M", False), ("Q4_K_M", True),
    ("IQ4_XS", False), ("IQ4_XS", True), ("IQ4_NL", False), ("Q3_K_M", False), ("Q3_K_M", True),
    ("Q2_K", False), ("Q2_K", True),
]  # fmt: skip
GOAL = 1 / 0.75


def lmcli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "lmcli", *args], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"lmcli {' '.join(args)}: {done.stderr.strip()[-1000:]}")


def split(folder: Path) -> tuple[Path, Path, Path]:
    """train (90%), calibration (5%) and held-out (5%) text, cut at blank lines."""
    text = SHAKESPEARE.read_text(encoding="utf-8")
    a = text.index("\n\n", int(len(text) * 0.90)) + 2
    b = text.index("\n\n", int(len(text) * 0.95)) + 2
    parts = {"train.txt": text[:a], "calib.txt": text[a:b], "heldout.txt": text[b:]}
    for name, part in parts.items():
        (folder / name).write_text(part, encoding="utf-8")
    return folder / "train.txt", folder / "calib.txt", folder / "heldout.txt"


def dequantized(path: Path) -> Any:
    """The model of a GGUF file, every tensor dequantized by the gguf package, in float32."""
    import gguf
    import torch

    from lmcli.formats.gguf.load import read_gguf_header
    from lmcli.formats.weights import model_from_state

    f16 = read_gguf_header(path.with_name("f16.gguf"))  # (the header checks; the same model)
    reader = gguf.GGUFReader(str(path))
    state = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF's ne order -> PyTorch's
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32").reshape(shape)
        state[t.name] = torch.from_numpy(values)
    state = f16.family.from_gguf(state, f16.config)
    return model_from_state(f16.config, state, f"in {path}").eval()


def score(folder: Path, heldout: Path) -> dict[str, dict[str, Any]]:
    import torch

    from lmcli.eval.divergence import divergence, text_ids
    from lmcli.formats.sources import load_model

    reference = load_model(folder / "f16.gguf", "cpu", torch.float32)
    ids = list(text_ids(reference.tokenizer, [heldout.read_text(encoding="utf-8")]))
    out = {}
    for preset, weighted in FILES:
        name = f"{preset}{' + imatrix' if weighted else ''}"
        path = folder / f"{preset}{'-imat' if weighted else ''}.gguf"
        report = divergence(dequantized(path), reference.model, ids, CONTEXT, CONTEXT).report()
        out[name] = {**report, "bytes": path.stat().st_size}
    return out


def markdown(results: dict[str, dict[str, Any]], f16_bytes: int, what: str) -> str:
    lines = [
        f"{what}; KL(f16 || file) per token on held-out text, the files' values dequantized, "
        "float32 products.",
        "",
        "| preset | file MiB | mean KLD | p99 KLD | top-1 agreement | PPL ratio |",
        "|---|---|---|---|---|---|",
        f"| f16 (the reference) | {f16_bytes / 2**20:.2f} | 0 | 0 | 100% | 1 |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['bytes'] / 2**20:.2f} | {r['kld_mean']:.5f} | {r['kld_p99']:.5f} | "
            f"{100 * r['top1_agreement']:.2f}% | {r['perplexity_ratio']:.4f} |"
        )
    return "\n".join(lines)


def run() -> list:
    from bench.common import Row, log

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        train, calib, heldout = split(folder)
        run_folder = os.environ.get("BENCH_RUN")
        if run_folder is None:
            run_folder = str(folder / "run")
            lmcli("train", str(train), *TRAIN, "--out", run_folder)
        lmcli("export", run_folder, str(folder / "f16.gguf"), "--format", "gguf", "--dtype", "f16")
        lmcli("imatrix", str(folder / "f16.gguf"), str(calib), "--out", str(folder / "imatrix.gguf"))
        for preset, weighted in FILES:
            out = folder / f"{preset}{'-imat' if weighted else ''}.gguf"
            extra = ["--imatrix", str(folder / "imatrix.gguf")] if weighted else []
            lmcli("export", str(folder / "f16.gguf"), str(out), "--format", "gguf", "--dtype", preset, *extra)
        log("files written; scoring")
        results = score(folder, heldout)
        f16_bytes = (folder / "f16.gguf").stat().st_size
    what = f"A 6-layer Llama-shaped model trained here on Tiny Shakespeare ({run_folder})"
    table = markdown(results, f16_bytes, what)
    MARKDOWN.parent.mkdir(parents=True, exist_ok=True)
    MARKDOWN.write_text(table + "\n")
    print(table)
    rows = []
    for preset in ("Q4_K_M", "IQ4_XS"):
        plain, weighted = results[preset], results[f"{preset} + imatrix"]
        rows.append(
            Row(
                f"mean KLD without / with lmcli's imatrix, {preset}",
                "nats",
                weighted["kld_mean"],
                plain["kld_mean"],
                f"{preset} without an imatrix",
                GOAL,
                lower_is_better=True,
                note=f"p99 {plain['kld_p99']:.5f} -> {weighted['kld_p99']:.5f}, top-1 "
                f"{plain['top1_agreement']:.4f} -> {weighted['top1_agreement']:.4f}",
                extra={"plain": plain, "imatrix": weighted},
            )
        )
    return rows


def main() -> None:
    from bench.common import run_suite

    run_suite("quant_kld", run)


if __name__ == "__main__":
    main()
