"""`make llama-venv`'s smoke test of the peer build and the flags of its portable rebuild."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_peer import portable_flags, smoke  # noqa: E402

# a CPU that advertises AMX (as a virtual machine may without allowing it) and AVX512-VNNI
AMX_CPU = (
    "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512dq "
    "avx512cd avx512_vnni amx_tile amx_int8 amx_bf16\n"
)


def test_the_portable_rebuild_turns_amx_off_and_keeps_what_the_cpu_lists() -> None:
    flags = portable_flags(AMX_CPU)
    assert "-DGGML_NATIVE=OFF" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_FMA=ON"} <= set(flags)
    assert {"-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF"} <= set(flags)  # not listed: off


def test_a_build_that_dies_on_its_first_token_fails_the_smoke_test(tmp_path: Path) -> None:
    crashing = tmp_path / "python"  # a "llama.cpp venv" whose product dies as ldtilecfg does
    crashing.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crashing.chmod(crashing.stat().st_mode | stat.S_IEXEC)
    ok, why = smoke(str(crashing))
    assert not ok and "exit -11" in why
