"""llama.cpp's quantizer against lmcli's, tensor by tensor (run by `make check-gguf`).

Each model (random weights: Llama-family shapes whose rows are whole K-quant blocks, tied and
untied, grouped-query attention of 2 and 4 query heads a key/value head; GPT-2's fused
projection; Qwen3 and Gemma 3; and a bench shape, SmolLM2-135M's, whose 576-wide rows take the
fallbacks) is written once as an f16 GGUF file by `lmcli export`. From that one file:

- every preset: lmcli's `export --dtype PRESET` against `llama_cpp.llama_model_quantize` (the
  library llama-quantize is): each tensor's type and bytes must be equal;
- with an importance matrix (`lmcli imatrix` on a calibration text, written in llama.cpp's GGUF
  layout): lmcli's `export --imatrix` against `llama_model_quantize` given the same file's
  entries, normalised as llama-quantize's `load_imatrix` does (sums / count); and each quantized
  tensor of lmcli's file against ggml's C `ggml_quantize_chunk` (libggml-base) given the f16
  values and those importance weights.

The per-preset counts of identical tensors are printed; any difference fails the check.

    python tests/formats/check_quant.py [--llama-python PY] [--workdir DIR] [--only NAME]
        [--presets Q4_K_M,...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# llama_ftype of each preset lmcli writes
FTYPES = {
    "q8_0": 7, "q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12,
    "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25,
    "IQ4_XS": 30,
}  # fmt: skip
IMATRIX_PRESETS = ("Q4_K_M", "IQ4_XS", "Q2_K", "Q3_K_M", "q4_0", "Q5_K_S", "Q6_K", "IQ4_NL")
GGML_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q2_K": 10, "q3_K": 11, "q4_K": 12,
              "q5_K": 13, "q6_K": 14, "iq4_nl": 20, "iq4_xs": 23}  # fmt: skip


# ----------------------------------------------------------------------------- llama.cpp side


def llama_side(request: dict[str, Any]) -> dict[str, Any]:
    """llama_model_quantize of ``src`` into each ``jobs`` file, then ggml_quantize_chunk of the
    ``chunks`` arrays (needs only llama_cpp and numpy)."""
    import ctypes
    import os

    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    out: dict[str, Any] = {"version": llama_cpp.__version__, "seconds": {}}
    keep = []
    for job in request["jobs"]:  # (no gguf package on this side: the entries come as .npz)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = job["ftype"], request.get("threads", 2)
        if job.get("imatrix"):
            entries = np.load(job["imatrix"])
            data = (llama_cpp.llama_model_imatrix_data * (len(entries.files) + 1))()
            for i, name in enumerate(entries.files):
                sums = np.ascontiguousarray(entries[name], dtype=np.float32)
                keep.append(sums)
                data[i].name = name.encode()
                data[i].data = sums.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                data[i].size = sums.size
            params.imatrix = data
        start = time.perf_counter()
        if llama_cpp.llama_model_quantize(request["src"].encode(), job["dst"].encode(), ctypes.byref(params)):
            raise RuntimeError(f"llama_model_quantize failed for {job['dst']}")
        out["seconds"][job["dst"]] = time.perf_counter() - start
    if request.get("chunks"):
        lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
        fn = lib.ggml_quantize_chunk
        fn.restype = ctypes.c_size_t
        fn.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            *(ctypes.c_int64,) * 3,
            ctypes.c_void_p,
        ]
        weights = np.load(request["chunks"])
        digests = {}
        for key, name, kind, block, block_bytes, offset, rows, cols in request["chunk_jobs"]:
            values = np.memmap(request["src"], np.float16, "r", offset, (rows, cols))
            x = np.ascontiguousarray(values, dtype=np.float32)
            qw = np.ascontiguousarray(weights[name], dtype=np.float32)
            dst = np.zeros(rows * (cols // block) * block_bytes, dtype=np.uint8)
            fn(GGML_TYPES[kind], x.ctypes.data, dst.ctypes.data, 0, rows, cols, qw.ctypes.data)
            digests[key] = hashlib.sha256(dst.tobytes()).hexdigest()
        out["chunks"] = digests
    return out


def ask_llama(request: dict[str, Any], llama_python: str | None) -> dict[str, Any]:
    """``llama_side`` here, or in ``llama_python`` through a pipe."""
    if llama_python is None:
        return llama_side(request)
    done = subprocess.run(
        [llama_python, __file__, "--llama-side"], input=json.dumps(request), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


# ----------------------------------------------------------------------------- lmcli side


@dataclass
class Case:
    name: str
    model: dict[str, Any]
    presets: tuple[str, ...] = tuple(FTYPES)


LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_embd=256, n_head=4, d_ff=512)
CASES = (
    Case("llama-gqa4-untied", {**LLAMA, "n_layer": 8, "n_kv_head": 1, "tie_embeddings": False}),
    Case("llama-gqa2-tied", {**LLAMA, "n_layer": 17, "n_kv_head": 2, "d_ff": 768}),
    Case("gpt2", dict(n_layer=8, n_head=4, n_embd=256, position="learned", tie_embeddings=True)),
    Case(
        "qwen3",
        {**LLAMA, "n_layer": 4, "n_kv_head": 2, "qk_norm": True, "head_size": 64, "tie_embeddings": False},
    ),
    Case("smollm3", {**LLAMA, "n_layer": 5, "n_kv_head": 2, "rope_pattern": "RRRN"}),
    Case(
        "gemma3",
        dict(
            LLAMA,
            n_layer=7,
            n_kv_head=2,
            norm="rmsnorm1p",
            norm_placement="sandwich",
            mlp="geglu",
            qk_norm=True,
            head_size=64,
            scale_embeddings=True,
            sliding_window=8,
            layer_pattern="LLLLLG",
            rope_local_base=10000.0,
            rope_base=1e6,
        ),
    ),  # fmt: skip
    Case(
        "smollm2-135m-shape",
        dict(LLAMA, n_layer=30, n_embd=576, n_head=9, n_kv_head=3, d_ff=1536, tie_embeddings=True),
        ("Q4_K_M", "Q3_K_M", "Q2_K", "Q5_K_M", "Q6_K", "IQ4_XS", "q8_0"),
    ),
)


def lmcli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "lmcli", *args], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"lmcli {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")


def make_f16(case: Case, workdir: Path) -> Path:
    """The case's random model as an lmcli run, exported as f16 GGUF by lmcli."""
    import torch
    from helpers import tiny_tokenizer, train_config

    from lmcli.config.model import ModelConfig
    from lmcli.formats.checkpoint import save_checkpoint
    from lmcli.model.transformer import Transformer

    text = (ROOT / "README.md").read_text()
    vocab = 2048 if "135m" in case.name else 512
    tok = tiny_tokenizer(text, "bpe", vocab_size=vocab)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, block_size=128, **case.model)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms and biases away from 1 and 0, too
            if p.dim() == 1:
                p.normal_(1.0 if "ln" in name or "norm" in name else 0.0, 0.1)
    save_checkpoint(workdir / case.name, model, train_config(), tok, meta={"step": 0})
    f16 = workdir / f"{case.name}-f16.gguf"
    lmcli("export", str(workdir / case.name), str(f16), "--format", "gguf", "--dtype", "f16")
    return f16


def tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    import gguf
    import numpy as np

    return {
        t.name: (t.tensor_type.name, np.asarray(t.data).view(np.uint8).tobytes())
        for t in gguf.GGUFReader(str(path)).tensors
    }


def compare(ours: Path, theirs: Path) -> tuple[int, int, list[str]]:
    """(identical tensors, tensors, the first differences) of two GGUF files."""
    a, b = tensors(ours), tensors(theirs)
    diffs = [n for n in a if a[n] != b.get(n)] + [n for n in b if n not in a]
    notes = [f"{n}: {a.get(n, ('-',))[0]} vs {b.get(n, ('-',))[0]}" for n in diffs[:3]]
    return len(a) - len([n for n in diffs if n in a]), len(b), notes


def imatrix_entries(path: Path, out: Path) -> Path:
    """The imatrix file's entries normalised as llama-quantize's load_imatrix does, read with the
    gguf package (not lmcli's reader), as an .npz for the llama side."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    found = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1) for t in reader.tensors}
    entries = {}
    for name in {n.removesuffix(".in_sum2") for n in found if n.endswith(".in_sum2")}:
        count = float(found[name + ".counts"][0])
        rows = int(count + 0.5)
        entries[name] = (
            found[name + ".in_sum2"] / np.float32(rows)
            if rows > 0
            else np.ones_like(found[name + ".in_sum2"])
        )
    np.savez(out, **entries)
    return out


def chunk_request(f16: Path, quantized: list[Path], npz: Path) -> tuple[list[list[Any]], dict[str, str]]:
    """The quantized tensors of lmcli's files that have importance weights, as ggml_quantize_chunk
    jobs over the f16 file's values (where they lie in it), and lmcli's digests of them."""
    import gguf
    import numpy as np

    weights = np.load(npz)
    src = {t.name: t for t in gguf.GGUFReader(str(f16)).tensors}
    jobs, digests = [], {}
    for path in quantized:
        for t in gguf.GGUFReader(str(path)).tensors:
            kind = t.tensor_type.name.lower().replace("_k", "_K")
            if kind not in GGML_TYPES or t.name not in weights.files:
                continue
            x = src[t.name]
            block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
            key = f"{path.name}:{t.name}"
            jobs.append([key, t.name, kind, block, block_bytes, int(x.data_offset), *map(int, x.data.shape)])
            digests[key] = hashlib.sha256(np.asarray(t.data).view(np.uint8).tobytes()).hexdigest()
    return jobs, digests


def compared(case: Case, workdir: Path, presets: list[str], tag: str) -> list[str]:
    """One report line per preset: lmcli's file against llama.cpp's."""
    lines = []
    for p in presets:
        ours, theirs = (workdir / f"{case.name}-{side}-{p}{tag}.gguf" for side in ("lmcli", "llama"))
        same, total, notes = compare(ours, theirs)
        verdict = "ok  " if same == total and not notes else "FAIL"
        what = f"{case.name} {p}{' + imatrix' if tag else ''}"
        lines.append(f"{verdict} {what}: {same}/{total} tensors identical {'; '.join(notes)}".rstrip())
    return lines


def check_case(case: Case, workdir: Path, llama_python: str | None, presets: set[str] | None) -> list[str]:
    """Every preset of one model, then the importance-matrix runs; the report's lines (a line
    starting with FAIL for a difference)."""
    f16 = make_f16(case, workdir)
    chosen = [p for p in case.presets if presets is None or p in presets]
    jobs = [{"dst": str(workdir / f"{case.name}-llama-{p}.gguf"), "ftype": FTYPES[p]} for p in chosen]
    for p in chosen:
        lmcli(
            "export", str(f16), str(workdir / f"{case.name}-lmcli-{p}.gguf"), "--format", "gguf", "--dtype", p
        )
    ask_llama({"src": str(f16), "jobs": jobs}, llama_python)
    lines = compared(case, workdir, chosen, "")
    calib = workdir / "calibration.txt"
    calib.write_text((ROOT / "docs" / "training.md").read_text())
    imatrix = workdir / f"{case.name}-imatrix.gguf"
    lmcli("imatrix", str(f16), str(calib), "--out", str(imatrix), "--context", "64")
    npz = imatrix_entries(imatrix, workdir / f"{case.name}-imatrix.npz")
    chosen = [p for p in IMATRIX_PRESETS if p in case.presets and (presets is None or p in presets)]
    jobs = [{"dst": str(workdir / f"{case.name}-llama-{p}-imat.gguf"), "ftype": FTYPES[p]} for p in chosen]
    for job in jobs:
        job["imatrix"] = str(npz)
    ours = [workdir / f"{case.name}-lmcli-{p}-imat.gguf" for p in chosen]
    for p, out in zip(chosen, ours, strict=True):
        lmcli("export", str(f16), str(out), "--format", "gguf", "--dtype", p, "--imatrix", str(imatrix))
    chunk_jobs, digests = chunk_request(f16, ours, npz)
    request = {"src": str(f16), "jobs": jobs, "chunks": str(npz), "chunk_jobs": chunk_jobs}
    reply = ask_llama(request, llama_python)
    lines += compared(case, workdir, chosen, "-imat")
    agree = sum(reply["chunks"][key] == digest for key, digest in digests.items())
    verdict = "ok  " if agree == len(digests) else "FAIL"
    what = f"{case.name} {', '.join(chosen)} + imatrix, tensor by tensor vs ggml_quantize_chunk"
    lines.append(f"{verdict} {what}: {agree}/{len(digests)} identical")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", help="a Python with llama_cpp installed (default: this one)")
    parser.add_argument("--workdir", type=Path, help="keep the files here")
    parser.add_argument("--only", help="the cases whose name holds this text")
    parser.add_argument("--presets", help="only these presets, comma-separated")
    parser.add_argument("--llama-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llama_side:
        json.dump(llama_side(json.load(sys.stdin)), sys.stdout)
        return 0
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    presets = set(args.presets.split(",")) if args.presets else None
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for case in CASES:
            if args.only is None or args.only in case.name:
                found = check_case(case, workdir, args.llama_python, presets)
                print("\n".join(found), flush=True)
                lines += found
    failed = [line for line in lines if line.startswith("FAIL")]
    print(f"check-quant: {'FAIL' if failed else 'PASS'} ({len(lines)} comparisons, {len(failed)} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
