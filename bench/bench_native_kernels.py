"""The native kernels alone: weight bytes streamed per second for one activation row (decode)
and for a prompt's rows (16, 64, 256: weight bytes per row-product), per block format, at the MLP
shapes of SmolLM2-135M (576 x 1536) and Qwen2.5-0.5B (896 x 4864 down, 4864 x 896 up), against
torch's products on the same shapes (float32 ``F.linear``; ``_weight_int8pack_mm`` with bfloat16
activations, lmcli's int8).

A prompt's rows are timed three ways a format: ``native`` (the kernels' integer rows, four
activation rows a weight block), ``deq+gemm`` (the kernels dequantize the weight to bfloat16 a
slice at a time, one torch GEMM a slice: ``BoundProduct.gemm``, what ``BlockLinear`` runs from
``BLOCK_GEMM_ROWS`` rows) and ``torch deq`` (the weight dequantized by torch/gguf ops, cast to
bfloat16, one GEMM: the path before the kernels dequantized).

The weight is (n, k): every format's block that divides k. Indicative only on a shared machine
(best of ``REPS`` timings a case); on one thread the time is the thread's CPU time (everything
runs on it: the load matters less), on more the wall clock.

    OMP_NUM_THREADS=1 python -m bench.bench_native_kernels          # 1 thread
    BENCH_THREADS=2 python -m bench.bench_native_kernels
    BENCH_ROWS=1,64 BENCH_FORMATS=q8_0,q4_0 python -m bench.bench_native_kernels
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from lmcli.model.native import ops
from lmcli.model.native.blocks import dequantize_blocks

SHAPES = {
    "smollm2": (576, 1536),
    "qwen2.5": (896, 4864),
    "qwen2.5 up": (4864, 896),
    "from memory": (24576, 4864),
}
FROM_MEMORY = "from memory"  # weights of 64-170 MB, far past the caches: the DRAM-bound figure
REPS = 7
QT = gguf.GGMLQuantizationType


def best_time(
    fn: Callable[[], object], min_s: float = 0.2, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The best over REPS of the mean time of a call, each rep at least ``min_s`` long by ``clock``."""
    fn()
    calls, t0 = 0, clock()
    while clock() - t0 < 0.05:
        fn()
        calls += 1
    per = max(1, int(calls * min_s / 0.05))
    best = float("inf")
    for _ in range(REPS):
        t0 = clock()
        for _ in range(per):
            fn()
        best = min(best, (clock() - t0) / per)
    return best


def blocks_for(fmt: str, n: int, k: int) -> torch.Tensor:
    """Blocks of a random weight: gguf's quantizer where it has one (32 rows, repeated to n: the
    speed does not depend on the values), else random bytes (fp16 scales never make a float32
    subnormal; mxfp4's random e8m0 scales would: it has gguf's quantizer)."""
    f, rng = ops.FORMATS[fmt], np.random.default_rng(0)
    try:
        rows = gguf.quants.quantize(rng.standard_normal((32, k)).astype(np.float32), QT[fmt.upper()])
        return torch.from_numpy(np.ascontiguousarray(np.resize(rows, (n, rows.shape[1]))))
    except NotImplementedError:
        return torch.from_numpy(rng.integers(0, 256, (n, f.row_bytes(k)), dtype=np.uint8))


def report(case: str, kind: str, bytes_streamed: int, t: float) -> None:
    print(f"{case} {kind:15} {bytes_streamed / t / 1e9:6.1f} GB/s  {t * 1e6:8.1f} us", flush=True)


def main() -> None:
    threads = int(os.environ.get("BENCH_THREADS", "1"))
    all_rows = tuple(int(r) for r in os.environ.get("BENCH_ROWS", "1,16,64,256").split(","))
    formats = os.environ.get("BENCH_FORMATS", ",".join(ops.FORMATS)).split(",")
    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    print(ops.backend_line(), f"| threads {threads} | {clock.__name__}")

    def timed(fn: Callable[[], object]) -> float:
        return best_time(fn, clock=clock)

    for shape, (n, k) in SHAPES.items():
        for rows in (1,) if shape == FROM_MEMORY else all_rows:
            x = torch.randn(rows, k)
            case = f"{shape} {n}x{k} {'decode' if rows == 1 else f'{rows} rows':8}"
            for fmt in formats:
                if k % ops.FORMATS[fmt].block:
                    continue
                b = blocks_for(fmt, n, k)
                bound = ops.BoundProduct(b, fmt, k)
                t = timed(lambda: bound(x, threads))  # noqa: B023
                report(case, f"native {fmt}", b.numel() * rows, t)
                if rows > 1:
                    t = timed(lambda: bound.gemm(x, threads))  # noqa: B023
                    report(case, f"deq+gemm {fmt}", b.numel() * rows, t)
                    xb = x.bfloat16()
                    t = timed(lambda: F.linear(xb, dequantize_blocks(b, fmt, k).bfloat16()))  # noqa: B023
                    report(case, f"torch deq {fmt}", b.numel() * rows, t)
            if shape != FROM_MEMORY:  # (a float32 table of that shape is 0.5 GB)
                w = torch.randn(n, k)
                t = timed(lambda: F.linear(x, w))  # noqa: B023
                report(case, "torch f32", w.numel() * 4 * rows, t)
                if rows > 1:
                    wb, xb = w.bfloat16(), x.bfloat16()
                    t = timed(lambda: F.linear(xb, wb))  # noqa: B023
                    report(case, "torch bf16", wb.numel() * 2 * rows, t)
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            s, xb = torch.rand(n, dtype=torch.bfloat16), x.bfloat16()
            t = timed(lambda: torch.ops.aten._weight_int8pack_mm(xb, q, s))  # noqa: B023
            report(case, "torch int8", q.numel() * rows, t)


if __name__ == "__main__":
    main()
