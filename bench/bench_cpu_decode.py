"""CPU decoding against llama.cpp at each precision, and the memory of load + generation.

Three model shapes with random weights (nothing is downloaded): SmolLM2-135M's (30 layers, 576
wide, 9 heads, 3 key/value heads, MLP 1536, vocabulary 49152, tied), Qwen2.5-0.5B's (24 x 896,
14 heads, 2 key/value heads, MLP 4864, vocabulary 151936, query/key/value biases, tied) and
Gemma 3 270M's (18 x 640, 4 heads, 1 key/value head of 256, GeGLU MLP 2048, sandwich norms,
five sliding-window layers of 512 tokens then a global one, a 32k context, a 262,144-token
SentencePiece-style vocabulary: ``bench.texts.spm_pieces``, tied). A child process writes each
as an lmcli checkpoint and, through lmcli's GGUF exporter (the ``gguf`` package's own writer and
quantizers), as f32, f16, q8_0 and q4_0 GGUF files of the same weights (Gemma 3's: its f32,
q8_0 and q4_0 files alone, and its rows are the GGUF pairs: the file as stored on both sides).
Then, for each precision pair (lmcli fp32 / llama.cpp f32, bf16 / f16, int8 / q8_0, int4 /
q4_0) and thread count, lmcli and llama.cpp run in turn, each in a fresh process (A, B, A, B;
the best of each): one prompt of ``PROMPT`` tokens (prefill tokens/s), then ``NEW``
greedy tokens one at a time (decode tokens/s). lmcli's figures are the ones ``lmcli sample
--json`` reports (``Generated.speed``); llama.cpp's are timed around ``Llama.eval`` in
llama-cpp-python (``make check-gguf`` builds it in ~/.cache/lmcli/llama-venv; ``LLAMA_PYTHON``
names another Python that has it; without one the rows say "skipped: llama_cpp absent").

On a CPU where lmcli's native kernels build (``lmcli.model.native``), lmcli's int8/int4 are
GGUF's q8_0/q4_0 blocks multiplied by them; the "gguf q8_0"/"gguf q4_0" rows have lmcli run
llama.cpp's own file, its matrices as stored (each row's JSON says which products ran). The
"gguf q4_K_M" rows run a Q4_K_M file that llama.cpp's own quantizer (``llama_model_quantize``,
in a llama.cpp child) makes from the f32 file, as a user's download is made: q4_K and q6_K
matrices where the widths are multiples of 256, q5_0/q8_0 (llama.cpp's fallbacks) where not;
lmcli and llama.cpp both run that one file (no llama.cpp: no file, no rows).

Each decode figure is also given as a fraction of the bandwidth limit, for both sides
(``bandwidth_fraction`` in a row's JSON): the bytes of weights a token reads (every matrix once,
the tied vocabulary table as the head: lmcli's weights as held, llama.cpp's file's tensors) over
the machine's memory-copy bandwidth, measured here (bytes read + written per second by a 256 MiB
copy, on the same threads).

The memory rows (lmcli alone): a fresh process loads the Qwen2.5-shaped model (the lmcli
checkpoint, float32, for fp32; a Hugging Face folder of it in bfloat16, as the hub's are, for
bf16 and int8; the q4_0 and Q4_K_M GGUF files as stored for gguf q4_0 and gguf q4_K_M) and
generates ``NEW`` tokens; peak RSS minus the RSS before loading, over the bytes of the weights
as held, and for a GGUF file over the file's size (issue 38's measure; goal <= 1.3x). The
Gemma-3-shaped model has memory rows too: its q8_0 and Q4_K_M files as stored (issue 46's
measure: a large vocabulary, a long context).

    python -m bench.bench_cpu_decode              # 1 thread
    BENCH_THREADS=1,2 python -m bench.bench_cpu_decode
    BENCH_SHAPES=smollm2 python -m bench.bench_cpu_decode
    BENCH_SHAPES=gemma3 BENCH_THREADS=1,2 python -m bench.bench_cpu_decode
    BENCH_PAIRS=gguf-q4_K_M,int8 python -m bench.bench_cpu_decode   # some pairs (and memory rows)

``BENCH_PAIRS`` names lmcli's side of each pair, spaces as dashes (fp32, bf16, int8, int4,
gguf-q8_0, gguf-q4_0, gguf-q4_K_M); the memory rows of the modes named run too. The other
presets users download run only when named: gguf-q2_K, gguf-q3_K_M, gguf-iq4_xs, gguf-iq4_nl
(files llama.cpp's quantizer makes, as the Q4_K_M one; each row's log names its blocks' mix).
The three shapes' widths are not whole 256-value blocks, so most of their matrices take
llama.cpp's fallbacks (q4_0, q5_0, iq4_nl, ...); ``BENCH_SHAPES=llama-256`` adds a Llama shape
whose widths are (12 x 768, 12 heads, 4 key/value heads, MLP 2048, vocabulary 32000: 100M
parameters), where those files' own q2_K/q3_K/q4_K/iq4_xs blocks run:

    BENCH_PAIRS=gguf-q2_K,gguf-q3_K_M,gguf-iq4_xs,gguf-iq4_nl python -m bench.bench_cpu_decode
    BENCH_SHAPES=llama-256 BENCH_PAIRS=gguf-q2_K,gguf-q3_K_M,gguf-iq4_xs python -m bench.bench_cpu_decode
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NEW = 128
PROMPT = 256
MEMORY_GOAL = 1.3
MEMORY_SHAPE = "qwen2.5"  # the memory rows' model (1 GB in bf16, as bench_load's)
PAIRS = (("fp32", "f32"), ("bf16", "f16"), ("int8", "q8_0"), ("int4", "q4_0"))
# lmcli running llama.cpp's own file: its q8_0/q4_0 matrices as stored, by the native kernels
# llama.cpp's quantizer makes these files from the f32 one: (file type, llama_ftype name)
LLAMA_QUANTIZED = {"q4_K_M": "Q4_K_M", "q2_K": "Q2_K", "q3_K_M": "Q3_K_M"}
LLAMA_QUANTIZED |= {"iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL"}
GGUF_PAIRS = (("gguf q8_0", "q8_0"), ("gguf q4_0", "q4_0"), ("gguf q4_K_M", "q4_K_M"))
# the other presets users download, run only when BENCH_PAIRS names them (gguf-q2_K, ...)
MORE_PAIRS = (("gguf q2_K", "q2_K"), ("gguf q3_K_M", "q3_K_M"))
MORE_PAIRS += (("gguf iq4_xs", "iq4_xs"), ("gguf iq4_nl", "iq4_nl"))
MEMORY_MODES = ("fp32", "bf16", "int8", "gguf q4_0", "gguf q4_K_M")
# the shapes with memory rows, and their modes (Gemma 3's: its GGUF files as stored, the goal's measure)
MEMORY = {MEMORY_SHAPE: MEMORY_MODES, "gemma3": ("gguf q8_0", "gguf q4_K_M")}
# the memory rows' sources (else bfloat16)
STORED = {"fp32": "float32", "gguf q8_0": "GGUF q8_0", "gguf q4_0": "GGUF q4_0", "gguf q4_K_M": "GGUF Q4_K_M"}
GROUP_SIZE = 64
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(
        label="SmolLM2-135M shape",
        n_layer=30,
        n_embd=576,
        n_head=9,
        n_kv_head=3,
        d_ff=1536,
        vocab_size=49152,
    ),
    "qwen2.5": dict(
        label="Qwen2.5-0.5B shape",
        n_layer=24,
        n_embd=896,
        n_head=14,
        n_kv_head=2,
        d_ff=4864,
        vocab_size=151936,
        qkv_bias=True,
    ),
    "gemma3": dict(
        label="Gemma-3-270M shape",
        n_layer=18,
        n_embd=640,
        n_head=4,
        n_kv_head=1,
        head_size=256,
        d_ff=2048,
        vocab_size=262144,
    ),
}
# a Llama shape whose widths are whole 256-value blocks: where a K-quant or IQ4_XS file's own
# blocks run (the shapes above fall back to 32-value blocks on most matrices); run when named
SHAPES["llama-256"] = dict(
    label="Llama-100M shape, 256-multiple widths",
    n_layer=12,
    n_embd=768,
    n_head=12,
    n_kv_head=4,
    d_ff=2048,
    vocab_size=32000,
)
DEFAULT_SHAPES = ("smollm2", "qwen2.5", "gemma3")
# Gemma 3 270M's block, context and layer pattern: five sliding-window layers (512 tokens) then a
# global one, its own rotary base on each; a SentencePiece-style vocabulary (bench.texts.spm_pieces)
GEMMA3 = dict(
    block_size=32768,
    position="rope",
    norm="rmsnorm1p",
    norm_placement="sandwich",
    mlp="geglu",
    bias=False,
    qk_norm=True,
    norm_eps=1e-6,
    rope_base=1e6,
    rope_local_base=1e4,
    sliding_window=512,
    layer_pattern="LLLLLG",
    scale_embeddings=True,
    attn_scalar=256.0,
)
GGUF_ONLY = ("gemma3",)  # shapes written as GGUF files alone: their rows are the GGUF pairs'
GGUF_ONLY_TYPES = ("f32", "q8_0", "q4_0")  # (f32: what llama.cpp's quantizer makes Q4_K_M from)


def llama_python() -> str | None:
    """A Python that can import llama_cpp: $LLAMA_PYTHON, else make check-gguf's venv."""
    path = os.environ.get("LLAMA_PYTHON") or str(Path.home() / ".cache/lmcli/llama-venv/bin/python")
    if not Path(path).exists():
        return None
    ok = subprocess.run([path, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    return path if ok else None


def selected(mode: str) -> bool:
    """Whether ``BENCH_PAIRS`` (lmcli's side of each pair, spaces as dashes) includes ``mode``
    (without it: every pair but ``MORE_PAIRS``)."""
    names = os.environ.get("BENCH_PAIRS")
    if names is None:
        return mode not in dict(MORE_PAIRS)
    return mode.replace(" ", "-") in names.split(",")


def prompt_ids(vocab: int) -> list[int]:
    """The same ``PROMPT`` ids for both sides: ids 5.. (no specials), from a fixed pattern."""
    return [2] + [5 + (i * 7919) % (vocab - 5) for i in range(PROMPT - 1)]


# ----------------------------------------------------------------------------- children


def write(folder: Path, shape: str) -> dict[str, Any]:
    """The lmcli checkpoint (float32), a Hugging Face folder of it in bfloat16 and the GGUF
    files of one shape (a ``GGUF_ONLY`` shape: its GGUF files alone)."""
    import torch
    from safetensors.torch import load_file, save_file

    from bench.texts import spm_tokenizer, wide_tokenizer
    from lmcli.config.model import ModelConfig
    from lmcli.config.train import TrainConfig
    from lmcli.formats.checkpoint import save_checkpoint
    from lmcli.formats.export.gguf import write_gguf
    from lmcli.formats.export.hf import export_hf
    from lmcli.model.transformer import Transformer

    spec = {k: v for k, v in SHAPES[shape].items() if k != "label"}
    if shape == "gemma3":
        cfg, tok = ModelConfig(**GEMMA3, **spec), spm_tokenizer(spec["vocab_size"])
    else:
        base = dict(block_size=2048, position="rope", norm="rmsnorm", mlp="swiglu", bias=False, rope_base=1e5)
        cfg, tok = ModelConfig(**base, **spec), wide_tokenizer(spec["vocab_size"])
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    if shape in GGUF_ONLY:
        return {"gguf": {t: str(write_gguf(model, tok, folder / f"{t}.gguf", t)) for t in GGUF_ONLY_TYPES}}
    save_checkpoint(folder / "fp32", model, TrainConfig(), tok, meta={"step": 0})
    files = {t: str(write_gguf(model, tok, folder / f"{t}.gguf", t)) for _, t in PAIRS}
    hf = export_hf(folder / "fp32", folder / "bf16")  # then in bfloat16, as the hub's folders are
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(hf / "model.safetensors")).items()}
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return {"gguf": files}


def llama_quantize(source: str, out: str, ftype: str) -> dict[str, Any]:
    """In this fresh process (a Python with llama_cpp): llama.cpp's own quantizer makes ``out``
    (``ftype``: a ``LLAMA_FTYPE_MOSTLY_*`` name, e.g. Q4_K_M) from the GGUF file ``source``."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    if llama_cpp.llama_model_quantize(source.encode(), out.encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype}")
    return {"file": out, "file_bytes": os.path.getsize(out)}


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def lmcli_side(run: str, mode: str, threads: int) -> dict[str, Any]:
    """In this fresh process: load, quantize, prefill ``PROMPT`` tokens and decode ``NEW``."""
    import torch

    from lmcli.config.commands import SampleConfig
    from lmcli.device import set_threads
    from lmcli.formats.sources import load_model
    from lmcli.generate.sampling import generate
    from lmcli.model import fastpath
    from lmcli.model.quant import default_kv_dtype, products_line, weight_bytes

    set_threads(threads)
    before = resident()
    t0 = time.perf_counter()
    # as `lmcli sample` loads: in the dtype stored (float32, or the bf16 folder's bfloat16), a GGUF
    # file's blocks as stored, a Hugging Face folder quantized as it is read, --kv-dtype auto
    quantize = mode if mode in ("int8", "int4") else "none"
    ckpt = load_model(run, "cpu", as_stored=mode.startswith("gguf"), quantize=quantize, group_size=GROUP_SIZE)
    ckpt.model.kv_dtype = default_kv_dtype(ckpt.model)
    loaded = time.perf_counter() - t0
    model, tok = ckpt.model, ckpt.tokenizer
    prompt = prompt_ids(model.config.vocab_size)
    greedy = SampleConfig(temperature=0, max_new_tokens=NEW, min_new_tokens=NEW)
    with torch.inference_mode(), fastpath.inference(model):
        generate(model, tok, [prompt[:8]], SampleConfig(temperature=0, max_new_tokens=4, min_new_tokens=4))
        out = generate(model, tok, [prompt], greedy)[0]
    speed = out.speed.report()
    held = weight_bytes(model)
    return {
        "products": products_line(model),  # the kernels' line and the block formats held
        "format_bytes": format_bytes(model),
        "prefill": speed["prefill_tokens_per_s"],
        "decode": speed["decode_tokens_per_s"],
        "new_tokens": len(out.ids),
        "weight_bytes": held,
        "bytes_per_token": held - untied_embedding_bytes(model),
        "load_s": loaded,
        "rss_before_load": before,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def format_bytes(model: Any) -> dict[str, int]:
    """Bytes of the block matrices in each GGUF format (a Q4_K_M file's mix), once each."""
    from lmcli.model.quant import BlockLinear

    out: dict[str, int] = {}
    for m in {id(m): m for m in model.modules() if isinstance(m, BlockLinear)}.values():
        out[m.fmt] = out.get(m.fmt, 0) + m.blocks.numel()
    return out


def untied_embedding_bytes(model: Any) -> int:
    """Bytes of a token embedding that no product reads (an untied table: one row a token)."""
    from lmcli.model.quant import BlockEmbedding, Int8Embedding

    wte = model.wte
    if model.config.tie_embeddings:
        return 0
    if isinstance(wte, BlockEmbedding):
        return wte.table.blocks.numel()
    if isinstance(wte, Int8Embedding):
        return wte.qweight.numel() + wte.scales.numel() * wte.scales.element_size()
    return wte.weight.numel() * wte.weight.element_size()


def llama_side(gguf: str, threads: int, prompt: list[int]) -> dict[str, Any]:
    """In this fresh process (a Python with llama_cpp and numpy): the same prompt and steps."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(
        model_path=gguf,
        n_ctx=PROMPT + NEW + 16,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def last_logits() -> Any:
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    llm.eval(prompt[:8])  # warm-up, as lmcli's
    for _ in range(4):
        llm.eval([int(np.argmax(last_logits()))])
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(NEW - 1):
        llm.eval([int(np.argmax(last_logits()))])
    decode = time.perf_counter() - t0
    return {
        "prefill": len(prompt) / prefill,
        "decode": (NEW - 1) / decode,
        "file_bytes": os.path.getsize(gguf),
    }


def copy_bandwidth(threads: int) -> float:
    """Bytes read + written per second by copying a 256 MiB float32 tensor (best of 5)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(64 << 20)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * a.element_size() / best


def tensor_bytes(gguf: str) -> int:
    """Bytes of a GGUF file's tensors (the file less its header: a 262k vocabulary's is 6 MB)."""
    from lmcli.formats.gguf.check import scan

    return sum(t.n_bytes for t in scan(gguf).tensors.values())


def child(python: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [python, "-m", "bench.bench_cpu_decode", *args], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the rows


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's best over the runs (throughputs: highest)."""
    out = dict(runs[0])
    for key in ("prefill", "decode"):
        out[key] = max(r[key] for r in runs)
    return out


def pair_rows(
    shape: str, mode: str, gguf_type: str, threads: int, ours: dict, theirs: dict | None, bandwidth: float
) -> list[Any]:
    """The decode and prefill rows of one precision pair."""
    from bench.common import Row

    label = f"{SHAPES[shape]['label']}, {mode} vs {gguf_type}, {threads} thread{'s' * (threads > 1)}"
    limit_ours = bandwidth / ours["bytes_per_token"]
    fractions = {"lmcli": ours["decode"] / limit_ours}
    if theirs is not None:
        fractions["llama.cpp"] = theirs["decode"] * theirs["tensor_bytes"] / bandwidth
    extra = {"lmcli": ours, "llama.cpp": theirs, "copy_bandwidth": bandwidth, "threads": threads}
    extra["bandwidth_fraction"] = fractions
    if theirs is None:
        note = f"skipped: llama_cpp absent; lmcli at {ours['decode'] / limit_ours:.2f} of its bandwidth limit"
        return [
            Row(
                f"decode tok/s, {label}",
                "tokens/s",
                ours["decode"],
                float("nan"),
                "llama.cpp",
                None,
                note=note,
            ),
            Row(f"prefill tok/s, {label}", "tokens/s", ours["prefill"], float("nan"), "llama.cpp", None),
        ]
    limit_theirs = bandwidth / theirs["tensor_bytes"]
    note = (
        f"bandwidth limit {bandwidth / 1e9:.1f} GB/s copy: lmcli {fractions['lmcli']:.2f} of "
        f"{limit_ours:.0f} tok/s ({ours['bytes_per_token'] / 1e6:.0f} MB/token), llama.cpp "
        f"{fractions['llama.cpp']:.2f} of {limit_theirs:.0f} ({theirs['tensor_bytes'] / 1e6:.0f} MB tensors)"
    )
    return [
        Row(
            f"decode tok/s, {label}",
            "tokens/s",
            ours["decode"],
            theirs["decode"],
            "llama.cpp",
            1.0,
            valid=ours["new_tokens"] == NEW,
            note=note,
            extra=extra,
        ),
        Row(
            f"prefill tok/s, {label}",
            "tokens/s",
            ours["prefill"],
            theirs["prefill"],
            "llama.cpp",
            None,
            extra=extra,
        ),
    ]


def decode_rows(folder: Path, shape: str, files: dict[str, str], threads: int, llama: str | None) -> list:
    from bench.common import log

    bandwidth = child(sys.executable, "bandwidth", str(threads))["bytes_per_s"]
    log(f"{shape}, {threads} thread(s): copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = []
    prompt = json.dumps(prompt_ids(SHAPES[shape]["vocab_size"]))
    for mode, gguf_type in PAIRS + GGUF_PAIRS + MORE_PAIRS:
        stored = mode.startswith("gguf")
        if not selected(mode) or gguf_type not in files or (shape in GGUF_ONLY and not stored):
            continue
        run = (
            files[gguf_type]
            if mode.startswith("gguf")
            else str(folder / ("bf16" if mode == "bf16" else "fp32"))
        )
        ours_runs, theirs_runs = [], []
        for _ in range(2):  # A, B, A, B
            ours_runs.append(child(sys.executable, "lmcli", run, mode, str(threads)))
            if llama is not None:
                theirs_runs.append(child(llama, "llama", files[gguf_type], str(threads), prompt))
        ours, theirs = best_of(ours_runs), best_of(theirs_runs) if theirs_runs else None
        if theirs is not None:  # the bytes a token reads: the file's tensors (the tied table as the head)
            theirs["tensor_bytes"] = tensor_bytes(files[gguf_type])
        if ours["format_bytes"]:
            mix = ", ".join(f"{f} {b / 1e6:.0f} MB" for f, b in sorted(ours["format_bytes"].items()))
            log(f"{mode}: blocks {mix}")
        made = pair_rows(shape, mode, gguf_type, threads, ours, theirs, bandwidth)
        fractions = ", ".join(f"{k} {v:.2f}" for k, v in made[0].extra.get("bandwidth_fraction", {}).items())
        log(
            f"{mode}/{gguf_type}: lmcli {ours['decode']:.1f} tok/s decode, {ours['prefill']:.0f} prefill; "
            + (f"llama.cpp {theirs['decode']:.1f}, {theirs['prefill']:.0f}" if theirs else "llama.cpp absent")
            + (f"; bandwidth fraction {fractions}" if fractions else "")
        )
        rows += made
    return rows


def memory_rows(folder: Path, shape: str, files: dict[str, str]) -> list:
    """Peak RSS of load + ``NEW`` tokens over the weights as held, fp32, bf16 and int8, and of
    the q4_0 and Q4_K_M GGUF files run as stored over the file's size."""
    from bench.common import Row, log

    rows = []
    for mode in MEMORY.get(shape, MEMORY_MODES):
        gguf_type = mode.split()[-1]
        if not selected(mode) or (mode.startswith("gguf") and gguf_type not in files):
            continue
        run = (
            files[gguf_type]
            if mode.startswith("gguf")
            else str(folder / ("fp32" if mode == "fp32" else "bf16"))
        )
        m = child(sys.executable, "lmcli", run, mode, "1")
        if mode.startswith("gguf"):
            m["file_bytes"] = os.path.getsize(run)
        size = m.get("file_bytes", m["weight_bytes"])
        x = (m["peak_rss"] - m["rss_before_load"]) / size
        what = "the file's" if "file_bytes" in m else "weights as held"
        log(f"memory {mode}: {x:.2f}x of {size / 1e6:.0f} MB ({what})")
        rows.append(
            Row(
                f"load+generate memory / weights, {SHAPES[shape]['label']}, {mode}",
                "x weights",
                x,
                MEMORY_GOAL,
                f"goal {MEMORY_GOAL}x",
                1.0,
                lower_is_better=True,
                valid=x <= MEMORY_GOAL,
                note=f"peak RSS minus RSS before loading over {size / 1e6:.0f} MB ({what}; weights held "
                f"{m['weight_bytes'] / 1e6:.0f} MB, stored {STORED.get(mode, 'bfloat16')}, {m['products']}): "
                f"{'met' if x <= MEMORY_GOAL else 'MISSED'}",
                extra=m,
            )
        )
    return rows


def run() -> list:
    from bench.common import log

    threads = [int(t) for t in os.environ.get("BENCH_THREADS", "1").split(",")]
    shapes = os.environ.get("BENCH_SHAPES", ",".join(DEFAULT_SHAPES)).split(",")
    llama = llama_python()
    log(f"llama.cpp: {llama or 'absent'}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            folder = Path(tmp) / shape
            files = child(sys.executable, "write", str(folder), shape)["gguf"]
            for gguf_type, ftype in LLAMA_QUANTIZED.items():
                if llama is not None and (selected(f"gguf {gguf_type}")):
                    out = str(folder / f"{gguf_type}.gguf")
                    files[gguf_type] = child(llama, "quantize", files["f32"], out, ftype)["file"]
            log(f"wrote {shape}: {', '.join(Path(f).name for f in files.values())}")
            if shape in MEMORY or len(shapes) == 1:
                rows += memory_rows(folder, shape, files)
            for n in threads:
                rows += decode_rows(folder, shape, files, n, llama)
            for f in folder.rglob("*"):
                if f.is_file():
                    f.unlink()
    return rows


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["write"]:
        print(json.dumps(write(Path(args[1]), args[2])))
    elif args[:1] == ["lmcli"]:
        print(json.dumps(lmcli_side(args[1], args[2], int(args[3]))))
    elif args[:1] == ["llama"]:
        print(json.dumps(llama_side(args[1], int(args[2]), json.loads(args[3]))))
    elif args[:1] == ["quantize"]:
        print(json.dumps(llama_quantize(args[1], args[2], args[3])))
    elif args[:1] == ["bandwidth"]:
        print(json.dumps({"bytes_per_s": copy_bandwidth(int(args[1]))}))
    else:
        from bench.common import run_suite

        run_suite("cpu_decode", run)


if __name__ == "__main__":
    main()
