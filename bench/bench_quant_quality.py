"""Quality of the quantized paths: perplexity of a small trained model, lmcli against llama.cpp.

Random weights give meaningless perplexity, so this suite trains a model for real first: ``lmcli
train`` on the first 90% of Tiny Shakespeare (``$LMCLI_DATA/tinyshakespeare/input.txt``, else
``../shared/data``; without it, CPython's documentation topics, ``bench.texts.doc_text``), a
Llama-shaped model whose widths are multiples of 256 so llama.cpp's K-quants apply to every
matrix (``MODEL``, a BPE of ``VOCAB`` tokens, ``TRAIN_STEPS`` steps: ~2.5 minutes on one idle
core; steps, not a time limit, so a busy machine trains the same model). Then:

- lmcli writes it as f32, q8_0 and q4_0 GGUF files (``write_gguf``, as ``export --format gguf``);
- llama.cpp's own quantizer (``llama_model_quantize``, in a llama.cpp child) makes Q8_0, Q4_0,
  Q4_1, Q5_0, Q5_1, Q4_K_M, Q5_K_M and Q6_K files from the f32 one (``LLAMA_FILES``: every block
  format lmcli's kernels run; Q4_K_M's q4_K and q6_K matrices as in a user's download);
- every path scores the same token ids of the held-out last 10%: ``WINDOWS`` windows of
  ``WINDOW`` tokens, each token after a window's first predicted from the ones before it in the
  window; perplexity = exp(mean NLL), the NLL computed in float64 from each side's logits.

lmcli's paths: the trained model in float32 (the reference), ``quantize`` int8/int4 (q8_0/q4_0
blocks by the native kernels where they build), and each GGUF file run as stored
(``load_model(..., as_stored=True)``) and dequantized to float32 (``as_stored=False``: the
dequantized reference of that file). lmcli scores each window twice: one token at a time with
the KV cache (the decoding step, ``fastpath``; quantized products by the kernels, activations
rounded to int8) and whole windows in one forward (``WINDOWS x WINDOW`` rows a product: a
quantized layer's prompt path, its weight dequantized to bfloat16 for one GEMM). llama.cpp
scores each file's windows with ``logits_all=True`` in a child process.

Rows (goals of issue 38): each quantized path's perplexity within 1% of its file's dequantized
reference, and within 1% of llama.cpp's on the same file; the fp32 reference and the change
against it are in each row's note and the Markdown table (``bench/results/quant_quality.md``).

    BENCH_THREADS=1 python -m bench.bench_quant_quality
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("LMCLI_DATA", ROOT.parent / "shared" / "data"))
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
MARKDOWN = ROOT / "bench" / "results" / "quant_quality.md"
HELD_OUT = 0.1  # the last fraction of the text: never trained on, scored
WINDOW, WINDOWS = 128, 64  # the scored windows: 64 x 127 predicted tokens
VOCAB = 2048
TRAIN_STEPS = os.environ.get("BENCH_TRAIN_STEPS", "160")  # fewer only to try the suite out
# Llama-shaped (llama.cpp's ``llama`` architecture), every width a multiple of 256 (K-quant rows)
MODEL = dict(n_layer=4, n_embd=256, n_head=4, n_kv_head=2, d_ff=768, block_size=WINDOW)
TRAIN_ARGS = [
    *("--tokenizer", "bpe", "--vocab-size", str(VOCAB), "--position", "rope", "--norm", "rmsnorm"),
    *("--mlp", "swiglu", "--no-bias", "--batch-size", "16", "--max-steps", TRAIN_STEPS),
    *("--eval-interval", "100000", "--seed", "1337"),
    *(a for k, v in MODEL.items() for a in (f"--{k.replace('_', '-')}", str(v))),
]
LMCLI_FILES = ("f32", "q8_0", "q4_0")  # lmcli's writer
# every block format lmcli's kernels run (q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K), from
# llama.cpp's own quantizer; Q4_K_M is the usual download (q4_K with some q6_K), Q5_K_M q5_K's
LLAMA_FILES = {
    f"llama.cpp {t}": t for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K")
}
GOAL = 0.01  # within 1%
# quantize()'s int8/int4 hold the blocks of lmcli's q8_0/q4_0 files (with the native kernels)
SAME_BLOCKS = {"int8": ("lmcli q8_0", "blocks q8_0"), "int4": ("lmcli q4_0", "blocks q4_0")}


def corpus() -> tuple[str, str]:
    """(the text, its name): Tiny Shakespeare if present, else CPython's documentation."""
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text(encoding="utf-8"), str(SHAKESPEARE)
    from bench.texts import doc_text

    return doc_text(), "CPython's documentation topics (no Tiny Shakespeare)"


def train(folder: Path, text: str, threads: int) -> dict[str, Any]:
    """``lmcli train`` (a fresh process, ``threads`` threads) on all but the held-out end of ``text``."""
    split = int(len(text) * (1 - HELD_OUT))
    (folder / "train.txt").write_text(text[:split], encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "lmcli", "train", str(folder / "train.txt"), *TRAIN_ARGS]
    t0 = time.perf_counter()
    done = subprocess.run(
        [*cmd, "--out", str(folder / "run"), "-q"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"lmcli train failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "command": "lmcli train TEXT " + " ".join(TRAIN_ARGS),
        "train_s": time.perf_counter() - t0,
        "steps": max(r.get("step", 0) for r in records),
        "val_loss": losses[-1] if losses else None,
        "held_out": text[split:],
    }


def windows(tok: Any, text: str) -> list[list[int]]:
    """``WINDOWS`` windows of ``WINDOW`` token ids from the start of ``text`` (no specials)."""
    ids = tok.encode(text)
    if len(ids) < WINDOW * WINDOWS:
        raise RuntimeError(f"held-out text of {len(ids)} tokens: {WINDOW * WINDOWS} needed")
    return [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(WINDOWS)]


# ----------------------------------------------------------------------------- lmcli's side


def lmcli_nll(model: Any, ids: list[list[int]]) -> dict[str, float]:
    """Mean NLL (nats a token) of every window's tokens after its first: one token at a time
    with the KV cache (``step``), and whole windows in one forward (``window``)."""
    import torch
    import torch.nn.functional as F

    from lmcli.model import fastpath
    from lmcli.model.kv_cache import KVCache

    idx = torch.tensor(ids)  # (WINDOWS, WINDOW)
    targets = idx[:, 1:]  # (WINDOWS, WINDOW - 1)

    def nll(logits: Any) -> float:  # (WINDOWS, WINDOW - 1, V) -> mean NLL in float64
        return F.cross_entropy(logits.double().flatten(0, 1), targets.flatten()).item()

    with torch.inference_mode(), fastpath.inference(model):
        window = nll(model(idx)[:, :-1])
        cache = KVCache.for_model(model, idx.size(0), max_len=idx.size(1))
        steps = [model(idx[:, t : t + 1], cache) for t in range(idx.size(1) - 1)]  # each (WINDOWS, 1, V)
        step = nll(torch.cat(steps, 1))
    return {"step": step, "window": window}


def lmcli_rows(folder: Path, files: dict[str, str], ids: list[list[int]], threads: int) -> dict[str, dict]:
    """lmcli's perplexities: the trained model (fp32, int8, int4) and every file as stored and
    dequantized, with the products each path ran."""
    from lmcli.device import set_threads
    from lmcli.formats.sources import load_model
    from lmcli.model.quant import products_line, quantize

    set_threads(threads)
    out: dict[str, dict] = {}
    for mode in ("fp32", "int8", "int4"):
        model = quantize(load_model(folder / "run" / "last", "cpu").model, mode if mode != "fp32" else "none")
        out[mode] = {**lmcli_nll(model, ids), "products": products_line(model)}
    for name, path in files.items():
        stored = load_model(path, "cpu", as_stored=True).model
        out[name] = {**lmcli_nll(stored, ids), "products": products_line(stored)}
        out[name]["dequantized"] = lmcli_nll(load_model(path, "cpu").model, ids)["window"]
    return out


def write_files(folder: Path) -> dict[str, str]:
    """lmcli's GGUF files of the trained model (f32, q8_0, q4_0)."""
    from lmcli.formats.export.gguf import write_gguf
    from lmcli.formats.sources import load_model

    ckpt = load_model(folder / "run" / "last", "cpu")
    return {
        f"lmcli {t}": str(
            write_gguf(ckpt.model, ckpt.tokenizer, folder / f"lmcli-{t}.gguf", t, name="quality")
        )
        for t in LMCLI_FILES
    }


# ----------------------------------------------------------------------------- llama.cpp's side


def llama_nll(gguf: str, threads: int, ids_file: str) -> dict[str, Any]:
    """In this fresh process (a Python with llama_cpp and numpy): the mean NLL of the same
    windows' tokens from llama.cpp's logits of ``gguf``."""
    import numpy as np
    from llama_cpp import Llama

    ids = json.loads(Path(ids_file).read_text())
    llm = Llama(
        model_path=gguf,
        n_ctx=WINDOW,
        n_batch=WINDOW,
        n_ubatch=WINDOW,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
    )
    total, count = 0.0, 0
    for window in ids:
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)  # (WINDOW - 1, V)
        top = logits.max(-1)
        lse = top + np.log(np.exp(logits - top[:, None]).sum(-1))
        total += float((lse - logits[np.arange(len(window) - 1), window[1:]]).sum())
        count += len(window) - 1
    return {"nll": total / count, "tokens": count, "file_bytes": os.path.getsize(gguf)}


# ----------------------------------------------------------------------------- the rows


def source(name: str, results: dict[str, dict]) -> str | None:
    """The file whose dequantized weights are path ``name``'s: its own, lmcli's q8_0/q4_0 file
    for ``quantize`` int8/int4 when they hold its blocks (else None: torch's int8/int4), lmcli's
    f32 file for the fp32 model."""
    if name == "fp32":
        return "lmcli f32"
    if name in SAME_BLOCKS:
        file, blocks = SAME_BLOCKS[name]
        return file if blocks in results[name]["products"] else None
    return name


def ppl(nll: float) -> float:
    return math.exp(nll)


def within(a: float, b: float) -> bool:
    return abs(a / b - 1) <= GOAL


def quality_rows(results: dict[str, dict], llama: dict[str, dict], reference: float) -> list:
    """Two rows a quantized path: lmcli's perplexity against its file's dequantized reference,
    and against llama.cpp's of the same file (both goals: within 1%)."""
    from bench.common import Row

    rows = []
    for name, r in results.items():
        file = source(name, results)
        if name in ("fp32", "lmcli f32") or file is None:  # the fp32 row (the export) comes first
            continue
        ours = ppl(r["step"])
        extra = {"lmcli": r, "llama.cpp": llama.get(file), "file": file, "fp32_reference": reference}
        change = f"{ours / reference - 1:+.2%} against the fp32 model's {reference:.3f}"
        dequantized = results[file]["dequantized"]
        if dequantized is not None:
            rows.append(
                Row(
                    f"perplexity vs dequantized, {name}",
                    "perplexity",
                    ours,
                    ppl(dequantized),
                    f"{file} dequantized",
                    1 - GOAL,
                    lower_is_better=True,
                    valid=within(ours, ppl(dequantized)),
                    note=f"decoding steps ({r['products']}); whole windows {ppl(r['window']):.3f}; {change}",
                    extra=extra,
                )
            )
        theirs = llama.get(file)
        if theirs is not None:
            rows.append(
                Row(
                    f"perplexity vs llama.cpp, {name}",
                    "perplexity",
                    ours,
                    ppl(theirs["nll"]),
                    f"llama.cpp, {file}",
                    1 - GOAL,
                    lower_is_better=True,
                    valid=within(ours, ppl(theirs["nll"])),
                    note=f"the same {theirs['tokens']} tokens; within 1% both ways: "
                    f"{'met' if within(ours, ppl(theirs['nll'])) else 'MISSED'}",
                    extra=extra,
                )
            )
    return rows


def markdown(results: dict[str, dict], llama: dict[str, dict], trained: dict[str, Any]) -> str:
    """One line a path: lmcli's perplexities, the dequantized reference, llama.cpp's, the ratios."""
    reference = ppl(results["fp32"]["window"])
    lines = [
        f"Perplexity on {WINDOWS} held-out windows of {WINDOW} tokens ({trained['text']}; "
        f"{trained['steps']} training steps in {trained['train_s']:.0f} s); "
        f"fp32 reference {reference:.3f}.",
        "",
        "| path (file) | lmcli, decoding steps | lmcli, whole windows | dequantized | lmcli / dequantized "
        "| llama.cpp | lmcli / llama.cpp | vs fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        file = source(name, results)
        deq = r["window"] if name == "fp32" else results[file]["dequantized"] if file else None
        theirs = llama.get(file) if file else None
        step, window = ppl(r["step"]), ppl(r["window"])
        cells = [
            name if file == name else f"{name} ({file or 'torch kernels: no file'})",
            f"{step:.3f}",
            f"{window:.3f}",
            f"{ppl(deq):.3f}" if deq is not None else "-",
            f"{step / ppl(deq):.4f}" if deq is not None else "-",
            f"{ppl(theirs['nll']):.3f}" if theirs else "absent",
            f"{step / ppl(theirs['nll']):.4f}" if theirs else "-",
            f"{step / reference - 1:+.2%}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    kernels = {r["products"].split("; blocks ")[0] for r in results.values() if "; blocks " in r["products"]}
    held = [
        f"{n}: {r['products'].split('; blocks ')[1]}"
        for n, r in results.items()
        if "; blocks " in r["products"]
    ]
    lines += ["", "; ".join(sorted(kernels)) + "; blocks held: " + "; ".join(held)]
    return "\n".join(lines)


def child(python: str, *args: str) -> dict[str, Any]:
    from bench.bench_cpu_decode import child as run_child

    if args[0] == "quantize":  # bench_cpu_decode's llama.cpp child makes the file
        return run_child(python, *args)
    done = subprocess.run(
        [python, "-m", "bench.bench_quant_quality", *args], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run() -> list:
    from bench.bench_cpu_decode import llama_python
    from bench.common import log
    from lmcli.formats.sources import load_model

    threads = int(os.environ.get("BENCH_THREADS", "1").split(",")[0])
    llama = llama_python()
    text, text_name = corpus()
    log(f"llama.cpp: {llama or 'absent'}; text: {text_name}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        trained = {**train(folder, text, threads), "text": text_name}
        log(f"trained {trained['steps']} steps in {trained['train_s']:.0f} s, val loss {trained['val_loss']}")
        ids = windows(load_model(folder / "run" / "last", "cpu").tokenizer, trained.pop("held_out"))
        (folder / "ids.json").write_text(json.dumps(ids))
        files = write_files(folder)
        if llama is not None:
            for name, ftype in LLAMA_FILES.items():
                out = str(folder / f"{ftype}.gguf")
                files[name] = child(llama, "quantize", files["lmcli f32"], out, ftype)["file"]
        log(f"files: {', '.join(files)}")
        results = lmcli_rows(folder, files, ids, threads)
        results["fp32"]["dequantized"] = None
        theirs = {}
        if llama is not None:
            theirs = {
                name: child(llama, "llama", path, str(threads), str(folder / "ids.json"))
                for name, path in files.items()
            }
        for name, r in results.items():
            them = theirs.get(source(name, results) or "")
            log(
                f"{name}: lmcli {ppl(r['step']):.4f} (steps), {ppl(r['window']):.4f} (windows)"
                + (f", dequantized {ppl(r['dequantized']):.4f}" if r.get("dequantized") else "")
                + (f"; llama.cpp {ppl(them['nll']):.4f}" if them else "")
            )
    table = markdown(results, theirs, trained)
    MARKDOWN.parent.mkdir(parents=True, exist_ok=True)
    MARKDOWN.write_text(table + "\n")
    print(table)
    reference = ppl(results["fp32"]["window"])
    rows = quality_rows(results, theirs, reference)
    if "lmcli f32" in theirs:  # the export itself: llama.cpp's f32 perplexity equals lmcli's
        from bench.common import Row

        ours, peer = ppl(results["fp32"]["window"]), ppl(theirs["lmcli f32"]["nll"])
        rows.insert(
            0,
            Row(
                "perplexity vs llama.cpp, fp32",
                "perplexity",
                ours,
                peer,
                "llama.cpp, lmcli f32",
                1 - GOAL,
                lower_is_better=True,
                valid=within(ours, peer),
                note=f"the trained model (whole windows) against llama.cpp on its f32 export; "
                f"{trained['command']}",
                extra={"lmcli": results["fp32"], "llama.cpp": theirs["lmcli f32"], "training": trained},
            ),
        )
    return rows


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["llama"]:
        print(json.dumps(llama_nll(args[1], int(args[2]), args[3])))
    else:
        from bench.common import run_suite

        run_suite("quant_quality", run)


if __name__ == "__main__":
    main()
