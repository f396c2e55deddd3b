"""Is the llama.cpp peer build usable here? One token from a tiny GGUF file, and the build flags
that avoid what this CPU advertises but may not allow.

    python tests/formats/llama_peer.py --llama-python PY     # exit 0: the build answers
    python tests/formats/llama_peer.py --portable-flags      # CMake flags for a rebuild

A build with ``GGML_NATIVE=ON`` compiles for every instruction set the CPU advertises. A virtual
machine may advertise AMX and forbid it (ggml's AMX product then dies in ``ldtilecfg`` with a
general-protection fault): the smoke test catches that, and ``make llama-venv`` rebuilds with
``GGML_NATIVE=OFF`` and the explicit flags of the instruction sets that do run (AMX off).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# ggml's CMake switches by the /proc/cpuinfo flags they need (AMX never: see the docstring)
CPU_SWITCHES = (
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
AMX_SWITCHES = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")

# run in the llama.cpp venv: load the file, evaluate two tokens, print the first logit
SMOKE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=32, n_threads=1, verbose=False)
llm.eval([1, 2])
print(float(llm.scores[1][0]))
"""


def portable_flags(cpuinfo: str) -> list[str]:
    """``-D`` switches for a build without ``-march=native``: each instruction set whose flags
    the CPU lists (first ``flags`` line of ``cpuinfo``), AMX always off."""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    out = ["-DGGML_NATIVE=OFF"]
    out += [f"-D{name}={'ON' if all(f in have for f in need) else 'OFF'}" for name, need in CPU_SWITCHES]
    out += [f"-D{name}=OFF" for name in AMX_SWITCHES]
    return out


def smoke(llama_python: str, timeout: float = 300) -> tuple[bool, str]:
    """(whether the build in ``llama_python`` ran a tiny model, what went wrong)."""
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # gguf_files and the helpers it imports
    from gguf_files import write_gguf_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf_model(Path(tmp) / "tiny.gguf", "llama", "F32")
        try:
            done = subprocess.run(
                [llama_python, "-c", SMOKE, str(path)], capture_output=True, text=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, str(e)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        return False, f"exit {done.returncode} {tail}".strip()
    return True, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", help="the python of the llama.cpp venv")
    parser.add_argument("--portable-flags", action="store_true", help="print the rebuild's CMake flags")
    args = parser.parse_args(argv)
    if args.portable_flags:
        print(" ".join(portable_flags(Path("/proc/cpuinfo").read_text())))
        return 0
    if not args.llama_python:
        parser.error("--llama-python or --portable-flags")
    ok, why = smoke(args.llama_python)
    print("llama.cpp peer: answers" if ok else f"llama.cpp peer: fails its smoke test ({why})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
