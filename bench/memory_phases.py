"""Where the memory of a GGUF file run as stored goes, phase by phase: RSS above the imported
runtime after each step of loading (``read_gguf_header``'s and ``load_gguf_as_stored``'s, done
here one at a time) and of ``bench_cpu_decode``'s generation (a warm-up, then a 256-token prompt
and 128 greedy tokens), and the peak within each phase (``/proc/self/status``' VmHWM, reset
between phases by ``/proc/self/clear_refs``). Linux only.

    python -m bench.memory_phases FILE.gguf
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path


def status() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found["VmRSS"], found["VmHWM"]


def phases(path: str, threads: int = 1) -> list[tuple[str, int, int]]:
    """(phase, resident above the runtime, peak above the runtime within the phase), in order."""
    import torch

    from bench.bench_cpu_decode import NEW, prompt_ids
    from lmcli.config.commands import SampleConfig
    from lmcli.device import release_freed_memory, set_threads
    from lmcli.formats.families.gguf_schema import GgufSchema
    from lmcli.formats.families.hf_config import HFConfig
    from lmcli.formats.gguf import as_stored, load
    from lmcli.generate.sampling import generate
    from lmcli.model import fastpath
    from lmcli.model.quant import default_kv_dtype

    set_threads(threads)
    gc.collect()
    release_freed_memory()
    base = status()[0]
    out: list[tuple[str, int, int]] = []

    def phase(name: str) -> None:
        now, peak = status()
        out.append((name, now - base, peak - base))
        Path("/proc/self/clear_refs").write_text("5")

    phase("imported runtime")
    scanned, family, cfg, notices = load.check_gguf(path)
    phase("header scanned, config checked")
    arrays = load._metadata(scanned)
    phase("tokenizer arrays decoded")
    tok = load.tokenizer_from_gguf(arrays)
    phase("tokenizer built")
    del arrays
    meta = HFConfig(dict(scanned.metadata), path, GgufSchema())
    scanned.raw = b""
    release_freed_memory()
    phase("its arrays freed, heap trimmed")
    tensors = load._tensors(scanned)
    phase("tensors read")
    header = load.GgufHeader(Path(path), meta, tensors, family, cfg, tok, scanned.tensors, notices)
    model = as_stored.load_as_stored(header, load.default_dtype(header))
    phase("model assembled")
    del header, tensors, scanned
    release_freed_memory()
    model.kv_dtype = default_kv_dtype(model)
    phase("loaded (header freed)")
    prompt = prompt_ids(model.config.vocab_size)
    run: Callable[[list[int], int], object] = lambda ids, n: generate(  # noqa: E731
        model, tok, [ids], SampleConfig(temperature=0, max_new_tokens=n, min_new_tokens=n)
    )
    with torch.inference_mode(), fastpath.inference(model):
        run(prompt[:8], 4)
        phase("warm-up generation")
        run(prompt, NEW)
        phase(f"{len(prompt)}-token prompt + {NEW} tokens")
    return out


def main() -> None:
    path = sys.argv[1]
    rows = phases(path)
    size = os.path.getsize(path)
    print(f"{'phase':34} {'now MB':>8} {'peak MB':>8}")
    for name, now, peak in rows:
        print(f"{name:34} {now / 1e6:8.1f} {peak / 1e6:8.1f}")
    top = max(peak for _, _, peak in rows)
    print(f"peak above the runtime {top / 1e6:.0f} MB = {top / size:.2f}x the file ({size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
