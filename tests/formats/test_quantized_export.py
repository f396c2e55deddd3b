"""Quantized GGUF export (``export --dtype PRESET [--imatrix]``), importance matrices
(``lmcli imatrix``, llama.cpp's file layouts) and ``--quantize PRESET``: the file holds each
tensor in the preset's type with the quantizer's bytes, every source exports the same file, the
export streams its sources a group at a time, the importance matrix is the sums of squares a
hand computation gives and survives its files, and bad input is one line with nothing written.
(``make check-gguf`` compares the files with llama.cpp's own quantizer, byte for byte.)"""

from __future__ import annotations

import gc
import struct
import weakref
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_one_line_error, run_cli, tiny_model, tiny_tokenizer, train_config

from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.export import gguf as export
from lmcli.formats.export.calibrate import calibration_ids, collect_imatrix
from lmcli.formats.export.in_memory import quantized_as_preset
from lmcli.formats.export.presets import ModelShape, preset, tensor_types
from lmcli.formats.export.stream import open_source
from lmcli.formats.families import for_export
from lmcli.formats.gguf.as_stored import load_gguf_as_stored
from lmcli.formats.gguf.imatrix import ImportanceMatrix, read_imatrix, write_imatrix
from lmcli.model.native import ops
from lmcli.model.native.blocks import quantize_blocks

native = pytest.mark.skipif(not ops.available(), reason="native library not built here")
TEXT = "the cat sat on the mat. the dog sat on the log! 12 birds sang, didn't they?\n" * 12
LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_embd=256, n_head=4, n_kv_head=2)


def run(tmp: Path, **config) -> Path:
    """A run folder of a random Llama-shaped model whose rows are whole K-quant blocks."""
    tok = tiny_tokenizer(TEXT, "bpe", vocab_size=300)
    model = tiny_model(tok.vocab_size, **{**LLAMA, "n_layer": 2, "d_ff": 512, "block_size": 32, **config})
    for name in ("last", "best"):
        save_checkpoint(tmp / "run" / name, model, train_config(), tok, meta={"step": 0})
    return tmp / "run"


def read(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in gguf.GGUFReader(str(path)).tensors}


@native
def test_q4_k_m_file_holds_the_presets_types_and_the_quantizers_bytes(tmp_path: Path) -> None:
    src = run(tmp_path)
    out = export.export_gguf(src, tmp_path / "m.gguf", "q4_k_m")
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == 15
    assert reader.fields["general.quantization_version"].contents() == 2
    source = open_source(src)
    family = for_export(source.config, "gguf")
    weights = {n: t for group in source.groups() for n, t in family.to_gguf(group, source.config).items()}
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    types = tensor_types(preset("Q4_K_M"), shapes, ModelShape("llama", 2, 4, 2))
    for name, (kind, data) in read(out).items():
        want = types[name] or "f32"
        assert kind.lower() == want.lower(), name
        if types[name]:
            assert np.array_equal(data.view(np.uint8), quantize_blocks(weights[name], types[name]).numpy())
    # two layers: use_more_bits takes layer 1 (i >= 7n/8), not layer 0 (n/8 = 0)
    assert (types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]) == ("q4_K", "q6_K")


@native
def test_every_source_exports_the_same_file(tmp_path: Path, capsys) -> None:
    src = run(tmp_path, tie_embeddings=False)
    f16 = export.export_gguf(src, tmp_path / "f16.gguf", "f16")
    code, _, _ = run_cli(["export", str(src), str(tmp_path / "hf"), "--format", "hf"], capsys)
    assert code == 0
    from_run = read(export.export_gguf(src, tmp_path / "run.gguf", "Q5_K_M"))
    from_hf = read(export.export_gguf(tmp_path / "hf", tmp_path / "hf.gguf", "Q5_K_M"))
    assert from_hf.keys() == from_run.keys()
    for name, (kind, data) in from_run.items():
        assert from_hf[name][0] == kind and np.array_equal(from_hf[name][1], data), name
    # from the f16 file: the run's weights rounded to f16 first, then the same quantizer
    from lmcli.formats.sources import load_model

    model = load_model(src).model
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(p.half().float())
    from_model = read(export.write_gguf(model, open_source(src).tokenizer, tmp_path / "m.gguf", "Q5_K_M"))
    from_f16 = read(export.export_gguf(f16, tmp_path / "from-f16.gguf", "Q5_K_M"))
    for name, (kind, data) in from_model.items():
        if kind != "F32":
            assert from_f16[name][0] == kind and np.array_equal(from_f16[name][1], data), name


@native
def test_export_streams_one_group_at_a_time(tmp_path: Path, monkeypatch) -> None:
    src = run(tmp_path, n_layer=4)
    source = open_source(src)
    seen: list[list[weakref.ref]] = []
    alive_at_next: list[int] = []
    groups = source.groups

    def watched():  # noqa: ANN202 - records which earlier tensors are still alive at each group
        for group in groups():
            gc.collect()
            alive_at_next.append(sum(r() is not None for refs in seen for r in refs))
            seen.append([weakref.ref(t) for t in group.values()])
            yield group

    monkeypatch.setattr(source, "groups", watched)
    export.write_source(source, tmp_path / "m.gguf", "Q4_K_M")
    assert len(seen) == 5 and alive_at_next == [0] * 5  # the globals, then 4 blocks, none kept


def hand_squares(model: torch.nn.Module, ids: list[list[int]]) -> torch.Tensor:
    """Per-column sums of squares of block 0's query/key/value input, computed by hand."""
    x = torch.tensor(ids)
    h = model.wte(x)
    ln = model.h[0].ln_1
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ln.eps) * ln.weight  # RMSNorm
    return normed.detach().double().pow(2).sum((0, 1))


def test_imatrix_is_the_sums_of_squares_of_each_matrixs_inputs(tmp_path: Path) -> None:
    tok = tiny_tokenizer(TEXT, "bpe", vocab_size=300)
    model = tiny_model(tok.vocab_size, **{**LLAMA, "n_layer": 2, "d_ff": 512, "block_size": 32})
    family = for_export(model.config, "gguf")
    windows = calibration_ids(tok, TEXT, 16)
    matrix = collect_imatrix(model, family, windows, batch_size=3, dataset="calib.txt")
    rows = len(windows) * 16
    expected = hand_squares(model, windows).float().numpy()
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"):
        np.testing.assert_allclose(matrix.sums[name], expected, rtol=1e-4)
        assert matrix.counts[name] == rows
    assert set(matrix.sums) == {
        f"blk.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    }
    assert matrix.sums["blk.1.ffn_down.weight"].shape == (512,)
    assert (matrix.chunk_count, matrix.chunk_size, matrix.datasets) == (len(windows), 16, ["calib.txt"])
    np.testing.assert_allclose(matrix.weights("blk.0.attn_q.weight"), expected / rows, rtol=1e-4)


def test_imatrix_files_round_trip_in_llama_cpps_layouts(tmp_path: Path) -> None:
    matrix = ImportanceMatrix(datasets=["calib.txt"], chunk_count=3, chunk_size=64)
    matrix.add("blk.0.attn_q.weight", np.arange(1, 9, dtype=np.float32), 192)
    matrix.add("blk.0.ffn_down.weight", np.full(16, 2.5, np.float32), 192)
    path = write_imatrix(matrix, tmp_path / "imatrix.gguf")
    reader = gguf.GGUFReader(str(path))  # the layout, read by the gguf package
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.datasets"].contents() == ["calib.txt"]
    assert reader.fields["imatrix.chunk_count"].contents() == 3
    assert reader.fields["imatrix.chunk_size"].contents() == 64
    assert "general.architecture" not in reader.fields
    shapes = {t.name: list(map(int, t.shape)) for t in reader.tensors}
    assert shapes["blk.0.attn_q.weight.in_sum2"] == [8, 1] and shapes["blk.0.attn_q.weight.counts"] == [1, 1]
    back = read_imatrix(path)
    assert back.datasets == ["calib.txt"] and (back.chunk_count, back.chunk_size) == (3, 64)
    np.testing.assert_array_equal(back.sums["blk.0.attn_q.weight"], np.arange(1, 9, dtype=np.float32))
    assert back.counts["blk.0.attn_q.weight"] == 192
    np.testing.assert_array_equal(
        back.weights("blk.0.attn_q.weight"), np.arange(1, 9, dtype=np.float32) / np.float32(192)
    )
    # the older .dat layout: mean squares x ncall, divided by ncall on reading
    dat = tmp_path / "imatrix.dat"
    values = np.array([3.0, 6.0, 9.0], dtype=np.float32)
    name = b"blk.0.attn_q.weight"
    tail = struct.pack("<ii", 7, 9) + b"calib.txt"
    dat.write_bytes(
        struct.pack("<ii", 1, len(name)) + name + struct.pack("<ii", 3, 3) + values.tobytes() + tail
    )
    old = read_imatrix(dat)
    np.testing.assert_array_equal(old.weights("blk.0.attn_q.weight"), values / np.float32(3))
    assert old.datasets == ["calib.txt"] and old.chunk_count == 7


@native
@pytest.mark.slow
def test_export_with_imatrix_uses_each_tensors_weights(tmp_path: Path, capsys) -> None:
    src = run(tmp_path)
    (tmp_path / "calib.txt").write_text(TEXT)
    code, out, _ = run_cli(
        [
            "imatrix",
            str(src),
            str(tmp_path / "calib.txt"),
            "--out",
            str(tmp_path / "i.gguf"),
            "--context",
            "16",
        ],
        capsys,
    )
    assert code == 0 and "wrote" in out and "14 matrices" in out
    matrix = read_imatrix(tmp_path / "i.gguf")
    to_gguf = ["--format", "gguf", "--dtype"]
    code, _, _ = run_cli(
        [
            "export",
            str(src),
            str(tmp_path / "a.gguf"),
            *to_gguf,
            "IQ4_XS",
            "--imatrix",
            str(tmp_path / "i.gguf"),
        ],
        capsys,
    )
    assert code == 0
    source = open_source(src)
    family = for_export(source.config, "gguf")
    weights = {n: t for group in source.groups() for n, t in family.to_gguf(group, source.config).items()}
    found = read(tmp_path / "a.gguf")
    kind, data = found["blk.1.ffn_up.weight"]
    qw = torch.from_numpy(matrix.weights("blk.1.ffn_up.weight"))
    assert kind == "IQ4_XS"
    assert np.array_equal(
        data.view(np.uint8), quantize_blocks(weights["blk.1.ffn_up.weight"], "iq4_xs", qw).numpy()
    )
    assert not np.array_equal(
        data.view(np.uint8), quantize_blocks(weights["blk.1.ffn_up.weight"], "iq4_xs").numpy()
    )
    assert found["blk.0.ffn_down.weight"][0] == "IQ4_XS"  # (without an imatrix: q5_K)
    reader = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    assert reader.fields["quantize.imatrix.entries_count"].contents() == 14
    # a calibration text instead of a file: computed on the way, the same matrix, the same file
    code, _, _ = run_cli(
        [
            "export",
            str(src),
            str(tmp_path / "b.gguf"),
            *to_gguf,
            "iq4_xs",
            "--imatrix",
            str(tmp_path / "calib.txt"),
        ],
        capsys,
    )
    assert code == 0 and read(tmp_path / "b.gguf")["blk.1.ffn_up.weight"][0] == "IQ4_XS"


@native
def test_quantize_preset_is_the_exported_file_as_stored(tmp_path: Path) -> None:
    src = run(tmp_path, tie_embeddings=False)
    from lmcli.formats.sources import load_model

    ckpt = load_model(src)
    in_memory = quantized_as_preset(ckpt.model, ckpt.tokenizer, "Q4_K_M")
    path = export.write_gguf(load_model(src).model, ckpt.tokenizer, tmp_path / "m.gguf", "Q4_K_M")
    from_file = load_gguf_as_stored(path, torch.float32)[0]
    x = torch.randint(0, ckpt.model.config.vocab_size, (1, 12))
    with torch.inference_mode():
        assert torch.equal(in_memory(x), from_file(x))
        err = (F.softmax(in_memory(x), -1) - F.softmax(ckpt.model(x), -1)).abs().max()
    assert err < 0.05  # and close to the float model
    # the presets of the newer block types run too, as their files do
    for name in ("Q2_K", "IQ4_XS"):
        in_memory = quantized_as_preset(ckpt.model, ckpt.tokenizer, name)
        path = export.write_gguf(load_model(src).model, ckpt.tokenizer, tmp_path / f"{name}.gguf", name)
        with torch.inference_mode():
            assert torch.equal(in_memory(x), load_gguf_as_stored(path, torch.float32)[0](x))


@native
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("wrong-tensor", "the importance matrix has blk.7.attn_q.weight, which this model does not"),
        ("wrong-columns", "the importance matrix has 128 columns for blk.0.attn_q.weight, the model 256"),
        ("corrupt", "not an importance matrix (GGUF or .dat)"),
        ("truncated-gguf", "imatrix.gguf"),
        ("a-model", "is a GGUF file but no importance matrix"),
        ("no-block-fits", "Q4_K_M: no matrix of this model has rows that q4_K or its fallback can hold"),
        ("target-exists", "already exists: choose a new file name"),
        ("target-folder-is-a-file", "cannot write"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys, case: str, message: str) -> None:
    src = run(
        tmp_path,
        **({"n_embd": 40, "d_ff": 40, "n_head": 4, "n_kv_head": 2} if case == "no-block-fits" else {}),
    )
    good = ImportanceMatrix(datasets=["x"], chunk_count=1, chunk_size=16)
    good.add("blk.0.attn_q.weight", np.ones(256, np.float32), 16)
    target = tmp_path / "out" / "m.gguf"
    imatrix = tmp_path / "imatrix.gguf"
    if case == "wrong-tensor":
        good.add("blk.7.attn_q.weight", np.ones(256, np.float32), 16)
    if case == "wrong-columns":
        good.sums["blk.0.attn_q.weight"] = np.ones(128, np.float32)
    write_imatrix(good, imatrix)
    if case == "corrupt":
        imatrix = tmp_path / "imatrix.dat"
        imatrix.write_bytes(struct.pack("<ii", 1, 5000) + b"x" * 40)
    if case == "truncated-gguf":
        imatrix.write_bytes(imatrix.read_bytes()[:100])
    if case == "a-model":
        export.export_gguf(src, imatrix := tmp_path / "model.gguf", "f16")
    if case == "target-exists":
        target.parent.mkdir()
        target.write_bytes(b"keep")
    if case == "target-folder-is-a-file":
        (tmp_path / "out").write_bytes(b"a file")
    argv = ["export", str(src), str(target), "--format", "gguf", "--dtype", "Q4_K_M"]
    code, _, err = run_cli([*argv, *([] if case == "no-block-fits" else ["--imatrix", str(imatrix)])], capsys)
    assert_one_line_error(code, err, message)
    written = [
        p
        for p in tmp_path.rglob("*")
        if p.name.startswith((".m.gguf", "m.gguf")) and p.read_bytes() != b"keep"
    ]
    assert written == []


def test_calibration_and_imatrix_refusals(tmp_path: Path, capsys, monkeypatch) -> None:
    src = run(tmp_path)
    texts = {"empty.txt": b"  \n", "latin1.txt": "caf\xe9 ".encode("latin-1") * 40, "short.txt": b"the cat"}
    for name, data in texts.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "calib.txt").write_text(TEXT)
    bad = ImportanceMatrix(datasets=["x"], chunk_count=1, chunk_size=16)
    bad.add("blk.0.attn_q.weight", np.full(256, np.inf, np.float32), 16)
    write_imatrix(bad, tmp_path / "inf.gguf")
    monkeypatch.chdir(tmp_path)
    cases = [
        (["imatrix", str(src), "empty.txt"], "the calibration text is empty"),
        (["imatrix", str(src), "latin1.txt"], "a calibration text must be UTF-8 text"),
        (["imatrix", str(src), "short.txt", "--context", "32"], "a window needs 32"),
        (["imatrix", str(src), "calib.txt", "--context", "4096"], "exceeds the model's block size 32"),
        (
            ["export", str(src), "o.gguf", "--format", "gguf", "--imatrix", "inf.gguf"],
            "holds a non-finite value",
        ),
        (["export", str(src), "o", "--imatrix", "calib.txt"], "--imatrix applies to --format gguf only"),
    ]
    for argv, message in cases:
        code, _, err = run_cli([*argv, *(["--out", "i.gguf"] if argv[0] == "imatrix" else [])], capsys)
        assert_one_line_error(code, err, message)
    assert (
        not list(tmp_path.glob("i.gguf"))
        and not list(tmp_path.glob("o*"))
        and not list(tmp_path.glob(".*lmtmp"))
    )


@native
def test_quantize_preset_refusals(tmp_path: Path, capsys, monkeypatch) -> None:
    src = run(tmp_path)
    code, _, err = run_cli(
        ["sample", str(src), "-p", "the", "--max-new-tokens", "2", "--quantize", "Q2_K"], capsys
    )
    assert code == 0, err  # every preset's blocks run on the kernels
    code, _, err = run_cli(
        ["sample", str(src), "-p", "the", "--max-new-tokens", "2", "--quantize", "Q9_K"], capsys
    )
    assert_one_line_error(code, err, "invalid quantize 'Q9_K': choose one of none, int8, int4, q8_0, q4_0")
    try:
        monkeypatch.setenv("LMCLI_NATIVE", "0")
        ops._load.cache_clear()
        argv = ["sample", str(src), "-p", "the", "--max-new-tokens", "2", "--quantize", "q4_k_m"]
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(
            code, err, "--quantize Q4_K_M needs lmcli's native kernels, which are not available"
        )
        code, _, err = run_cli(
            ["export", str(src), str(tmp_path / "k.gguf"), "--format", "gguf", "--dtype", "Q4_K_M"], capsys
        )
        assert_one_line_error(code, err, "writing q4_K, q6_K blocks needs lmcli's native library")
        assert not (tmp_path / "k.gguf").exists()
    finally:
        ops._load.cache_clear()
