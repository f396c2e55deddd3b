"""The quantized products of one decoding step, as a model's weights stream from memory: every
matrix of every layer and the head, each its own bytes (past the caches), one activation row,
timed as a whole step; against the machine's copy bandwidth, and against another build
of the kernels (``BENCH_AGAINST``: a library another tree built, e.g. the tree before a change)
in alternation, step by step, so that a shared machine's load falls on both alike.

Shapes: ``gemma3`` (Gemma 3 270M's Q4_K_M mix, as llama.cpp's quantizer makes it: q/k q5_0, v
q8_0, output q4_K, gate/up q5_0, down q6_K on 18 layers, the tied 262k x 640 head q8_0),
``smollm2-q8_0``/``-q4_0`` (30 x 576, head 49152), ``qwen2.5-q8_0``/``-q4_0`` (24 x 896, head
151936). One thread: this thread's CPU time; more: the wall clock.

    python -m bench.bench_decode_step
    BENCH_STEP=gemma3,smollm2-q8_0 BENCH_THREADS=2 python -m bench.bench_decode_step
    BENCH_AGAINST=~/.cache/lmcli/native/liblmcli_native-OLD.so python -m bench.bench_decode_step
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from pathlib import Path

import torch

from bench.bench_native_kernels import blocks_for
from lmcli.model.native import ops


def llama_layer(f: str, c: int, qkv: int, mlp: int) -> list[tuple[str, int, int]]:
    """A Llama block's matrices (format, out, in) in one format: q/k/v fused, o, gate, up, down."""
    return [(f, qkv, c), (f, c, c), (f, mlp, c), (f, mlp, c), (f, c, mlp)]


GEMMA3_LAYER = [("q5_0", 1280, 640), ("q8_0", 256, 640), ("q4_K", 640, 1024)]
GEMMA3_LAYER += [("q5_0", 2048, 640), ("q5_0", 2048, 640), ("q6_K", 640, 2048)]
# name -> (layers, a layer's matrices, the head)
STEPS = {
    "gemma3": (18, GEMMA3_LAYER, ("q8_0", 262144, 640)),
    **{f"smollm2-{f}": (30, llama_layer(f, 576, 960, 1536), (f, 49152, 576)) for f in ("q8_0", "q4_0")},
    **{f"qwen2.5-{f}": (24, llama_layer(f, 896, 1152, 4864), (f, 151936, 896)) for f in ("q8_0", "q4_0")},
}
REPS = 12


class Bandwidth:
    """The machine's copy bandwidth (bytes read + written per second copying a 256 MiB tensor,
    bench_cpu_decode's measure), sampled between the steps (a shared machine's load changes by
    the second): their median."""

    def __init__(self) -> None:
        self.a = torch.ones(64 << 20)
        self.b = torch.empty_like(self.a)
        self.rates: list[float] = []

    def sample(self) -> None:
        t0 = time.perf_counter()
        self.b.copy_(self.a)
        self.rates.append(2 * self.a.nbytes / (time.perf_counter() - t0))

    def median(self) -> float:
        return statistics.median(self.rates)


def bind(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.lmcli_native_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.lmcli_native_matmul.argtypes += [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return lib


def main() -> None:
    threads = int(os.environ.get("BENCH_THREADS", "1"))
    names = os.environ.get("BENCH_STEP", ",".join(STEPS)).split(",")
    this = ops.library()
    assert this is not None, "the native kernels did not build"
    libs = {"this": bind(str(this.path))}
    if os.environ.get("BENCH_AGAINST"):
        libs["against"] = bind(str(Path(os.environ["BENCH_AGAINST"]).expanduser()))
    isa = this.report.best_isa
    clock = time.thread_time if threads == 1 else time.perf_counter
    print(ops.backend_line(), f"| threads {threads}")
    for name in names:
        layers, layer, head = STEPS[name]
        made: dict[tuple[str, int, int], torch.Tensor] = {}
        mats = []
        for fmt, n, k in [m for _ in range(layers) for m in layer] + [head]:
            blocks = made.setdefault((fmt, n, k), blocks_for(fmt, n, k)).clone()  # its own bytes
            mats.append((ops.FORMATS[fmt].ggml_type, blocks, n, k))
        total = sum(b.numel() for _, b, _, _ in mats)
        xs = {k: torch.randn(1, k) for *_, k in mats}
        ys = {n: torch.empty(1, n) for _, _, n, _ in mats}

        def step(lib: ctypes.CDLL, mats: list = mats, xs: dict = xs, ys: dict = ys) -> float:
            t0 = clock()
            for t, b, n, k in mats:
                lib.lmcli_native_matmul(
                    t, b.data_ptr(), n, k, xs[k].data_ptr(), 1, ys[n].data_ptr(), threads, isa
                )
            return clock() - t0

        times: dict[str, list[float]] = {key: [] for key in libs}
        bandwidth = Bandwidth()
        for rep in range(REPS + 1):
            bandwidth.sample()
            for key in libs if rep % 2 else reversed(libs):
                t = step(libs[key])
                if rep:  # (the first: a warm-up)
                    times[key].append(t)
        copy = bandwidth.median()
        line = f"{name:14} {total / 1e6:5.0f} MB/step, copy {copy / 1e9:.1f} GB/s"
        for key, ts in times.items():
            rate = total / statistics.median(ts)
            line += f" | {key} {rate / 1e9:5.1f} GB/s ({rate / copy:.2f} of copy)"
        if "against" in times:
            ratio = statistics.median(a / b for a, b in zip(times["against"], times["this"], strict=True))
            line += f" | this / against {ratio:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
