"""Issue 40, findings 6-10 (docs/bad-inputs.md rows 400-): a resume that would train another run,
a `tokenize` retried after a failure, unsatisfiable JSON schemas, NaN or empty GGUF files,
export into a read-only folder, bad task rows, and an MFU above 100%."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import httpx2 as httpx
import jsonschema
import numpy as np
import pytest
import torch
from helpers import (
    FAST_TRAIN_ARGS,
    TINY_TEXT,
    assert_one_line_error,
    make_run,
    rechecksum,
    run_cli,
    tiny_tokenizer,
)

import lmcli.train.mfu
from lmcli.cli.app import main
from lmcli.data import tokenize as tokenize_module
from lmcli.generate.constrain import Constraint, ConstraintError, GrammarMask, Grammars
from lmcli.generate.schemas import no_finite_value
from lmcli.train.mfu import PROBE_RAISED, MfuBasis

# ----------------------------------------------------------------------------- 6: resume


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An lm run from scratch (c.txt), a second copy of it, and an sft run ``--init-from`` the
    first: tiny models, 2 steps each."""
    tmp = tmp_path_factory.mktemp("runs")
    (tmp / "c.txt").write_text(TINY_TEXT)
    (tmp / "d.txt").write_text(TINY_TEXT.upper())
    rows = [{"prompt": "the cat", "response": "sat on the mat."}] * 20
    (tmp / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fast = [*FAST_TRAIN_ARGS, "--block-size", "48", "--max-steps", "2", "--cache-dir", str(tmp / "cache")]
    for argv in (
        ["train", str(tmp / "c.txt"), "--out", str(tmp / "lm"), *fast],
        ["train", "--task", "sft", str(tmp / "sft.jsonl"), "--init-from", str(tmp / "lm")]
        + ["--out", str(tmp / "sft"), *fast],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
            raise SystemExit(0)
        assert info.value.code in (0, None), argv
    shutil.copytree(tmp / "lm", tmp / "lm2")
    return {"tmp": tmp, "lm": tmp / "lm", "lm2": tmp / "lm2", "sft": tmp / "sft"}


def config_of(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())["train"]


@pytest.mark.parametrize(
    "run, argv, message",
    [
        (  # the issue's case: an sft run resumed as lm, from another base, on another corpus
            "sft",
            ["--task", "lm", "{tmp}/c.txt", "--init-from", "{lm2}"],
            "--task lm: {sft} is a --task sft run, and a resume keeps its task "
            "(to train it as lm: a new run with --init-from {sft})",
        ),
        (  # the reverse: it said "cannot resume a run trained with --optimizer muon ..."
            "lm",
            ["--task", "sft", "{tmp}/sft.jsonl"],
            "--task sft: {lm} is a --task lm run, and a resume keeps its task",
        ),
        (
            "sft",
            ["--init-from", "{lm2}"],
            "--init-from {lm2}: {sft} was started from {lm}, and a resume keeps its base",
        ),
        ("lm", ["--init-from", "{sft}"], "--init-from {sft}: {lm} was trained from scratch"),
        (
            "lm",
            ["{tmp}/d.txt"],
            "the corpus {tmp}/d.txt: {lm} trained with the corpus {tmp}/c.txt; give --allow-new-data",
        ),
        ("lm", ["--val-fraction", "0.5"], "--val-fraction 0.5: {lm} trained with --val-fraction 0.1"),
        (
            "lm",
            ["--tokenizer", "byte"],
            "--tokenizer byte: {lm} has its own tokenizer, and a resume keeps it: drop --tokenizer",
        ),
        ("lm", ["--allow-new-data", "--task", "sft"], "--task sft: {lm} is a --task lm run"),
    ],
    ids=["sft-as-lm", "lm-as-sft", "other-base", "a-base-added", "corpus", "val-split", "tokenizer", "allow"],
)
def test_a_resume_that_would_train_another_run_is_refused_naming_the_flag(
    runs: dict[str, Path], capsys, run: str, argv: list[str], message: str
) -> None:
    """Row 400: each refused in one line before anything is written; the run's config unchanged."""
    names = {k: str(v) for k, v in runs.items()}
    before = (runs[run] / "config.json").read_text()
    argv = [a.format(**names) for a in argv]
    code, _, err = run_cli(["train", "--resume", names[run], *argv, "--max-steps", "3", "-q"], capsys)
    assert_one_line_error(code, err, message.format(**names))
    assert (runs[run] / "config.json").read_text() == before
    assert json.loads((runs[run] / "last" / "meta.json").read_text())["step"] == 2


def test_a_resume_keeps_its_data_unless_allowed(runs: dict[str, Path], capsys, tmp_path: Path) -> None:
    """The run's own corpus given again (by a relative path) resumes; another one resumes with
    ``--allow-new-data`` only, and the run's config then records it."""

    run = tmp_path / "lm"
    shutil.copytree(runs["lm"], run)
    cwd = os.getcwd()
    os.chdir(runs["tmp"])
    try:
        code, _, err = run_cli(["train", "--resume", str(run), "c.txt", "--max-steps", "3", "-q"], capsys)
    finally:
        os.chdir(cwd)
    assert code == 0, err
    d = str(runs["tmp"] / "d.txt")
    code, _, err = run_cli(["train", "--resume", str(run), d, "--max-steps", "4", "-q"], capsys)
    assert_one_line_error(code, err, "give --allow-new-data to resume on other (or moved) data")
    argv = ["train", "--resume", str(run), d, "--allow-new-data", "--max-steps", "4", "-q"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert config_of(run)["corpus"] == [d]
    assert json.loads((run / "last" / "meta.json").read_text())["step"] == 4


def test_allow_new_data_without_resume_is_refused(tmp_path: Path, capsys) -> None:
    """The flag would be ignored by a new run: said, not silently dropped; nothing is written."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("to be or not to be\n" * 50)
    argv = ["train", str(corpus), "--allow-new-data", "--out", str(tmp_path / "run"), "--max-steps", "1"]
    code, _, err = run_cli([*argv, "-q"], capsys)
    assert_one_line_error(code, err, "--allow-new-data is for --resume")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- 7: tokenize retries


def tokenize(capsys, corpus: Path, out: Path, *extra: str) -> tuple[int, str]:
    argv = ["tokenize", str(corpus), "--out", str(out), "--tokenizer", "byte", "--shard-tokens", "500"]
    code, _, err = run_cli([*argv, *extra, "-q"], capsys)
    return code, err


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """What a token folder holds, file by file (the plan and index name the corpus's path)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".bin", ".docs")}


def rows(n: int, bad: int | None = None) -> str:
    lines = [{"text": f"the cat sat on the mat {i}"} for i in range(n)]
    if bad is not None:
        lines[bad] = {"txt": "no text column"}
    return "".join(json.dumps(r) + "\n" for r in lines)


def test_a_tokenize_that_failed_on_a_bad_row_never_blocks_the_fixed_retry(tmp_path: Path, capsys) -> None:
    """Row 401: a bad row, after shards were finished or before: the fixed corpus tokenizes
    into the same --out, and the folder equals one tokenized at once; no .lock is left."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(rows(200))
    code, err = tokenize(capsys, corpus, tmp_path / "clean")
    assert code == 0, err
    for bad, out in ((1, tmp_path / "o1"), (150, tmp_path / "o2")):
        corpus.write_text(rows(200, bad))
        code, err = tokenize(capsys, corpus, out)
        assert_one_line_error(code, err, f'c.jsonl:{bad + 1}: expected a "text" field (found: txt)')
        if bad == 1:  # nothing finished: nothing left, not even the folder
            assert not out.exists()
        else:
            assert (out / "shard-00000.bin").exists() and not (out / ".lock").exists()
        corpus.write_text(rows(200))
        code, err = tokenize(capsys, corpus, out)
        assert code == 0, err
        assert folder_bytes(out) == folder_bytes(tmp_path / "clean")
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_a_tokenize_on_a_full_disk_is_retried_keeping_its_finished_shards(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Row 401: the disk fills at the third shard; the same command then keeps the two finished
    shards and ends with the folder an uninterrupted run writes; another corpus may start over."""

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(rows(200))
    code, err = tokenize(capsys, corpus, tmp_path / "clean")
    assert code == 0, err
    commit = tokenize_module.ShardSink.commit

    def full_at_the_third(self, position: int) -> None:
        if self.index == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        commit(self, position)

    for out in (tmp_path / "same", tmp_path / "other"):
        monkeypatch.setattr(tokenize_module.ShardSink, "commit", full_at_the_third)
        code, err = tokenize(capsys, corpus, out)
        assert_one_line_error(code, err, f"cannot write tokens in {out}: No space left on device")
        monkeypatch.setattr(tokenize_module.ShardSink, "commit", commit)
        assert not (out / ".lock").exists() and (out / "shard-00001.bin").exists()
        if out.name == "same":
            code, err = tokenize(capsys, corpus, out)
            assert code == 0 and "resuming, 2 finished shard(s) kept" in err, err
            assert folder_bytes(out) == folder_bytes(tmp_path / "clean")
        else:  # the failed run's corpus changed meanwhile: its shards are redone, not refused
            other = tmp_path / "d.jsonl"
            other.write_text(rows(100))
            code, err = tokenize(capsys, other, out)
            assert code == 0, err
            assert json.loads((out / "index.json").read_text())["corpus"].endswith("d.jsonl")


# ----------------------------------------------------------------------------- 8: unsatisfiable schemas

ENDLESS = [  # each admits no finite JSON value (the grammar library failed on them while decoding)
    ({"$ref": "#"}, "#"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#/$defs/a"),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "#"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
]


def endless(ref: str) -> str:
    return f"no finite JSON value satisfies it ($ref {ref!r} recurses without end)"


FINITE = [  # recursion with a way out: satisfiable, taken (with a value of each)
    ({"type": "object", "properties": {"x": {"$ref": "#"}}}, '{"x": {}}'),
    (
        {
            "type": "object",
            "properties": {"x": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["x"],
        },
        '{"x": {"x": null}}',
    ),
    ({"type": "array", "items": {"$ref": "#"}}, "[[], [[]]]"),
    ({"properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "7"),  # no type: a number is one
]


@pytest.mark.parametrize("schema, ref", ENDLESS, ids=["self", "mutual", "required-self", "min-items"])
def test_an_endless_schema_is_refused_in_one_short_line(schema: dict, ref: str) -> None:
    """Row 402, at the root of the constraint (sample, chat, serve share ``Grammars``)."""

    reason = no_finite_value(schema)
    assert reason == endless(ref)
    with pytest.raises(ConstraintError) as info:
        Grammars(tiny_tokenizer(kind="byte")).compile(Constraint.json_schema(schema))
    assert str(info.value) == f"invalid JSON schema: {reason}"


@pytest.mark.parametrize("schema, value", FINITE)
def test_a_recursive_schema_with_a_way_out_compiles_and_takes_its_values(schema: dict, value: str) -> None:
    """The check refuses only what it proves empty: each of these compiles, and its mask lets
    a value of it through to the end (the value valid, checked by jsonschema)."""

    jsonschema.validate(json.loads(value), schema)
    assert no_finite_value(schema) is None
    tok = tiny_tokenizer(kind="byte")
    mask = Grammars(tok).processor(Constraint.json_schema(schema))
    for token in tok.encode(value):
        allowed = GrammarMask.apply(torch.zeros(1, tok.vocab_size), [mask])[0] > -1e9
        assert allowed[token], (value, tok.decode([token]))
        mask.accept(token)
    assert mask.complete


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny byte-level model served on 127.0.0.1 (its URL)."""
    pytest.importorskip("uvicorn")

    from lmcli.config.commands import ServeConfig
    from lmcli.formats.sources import load_model
    from lmcli.serve.server import running

    run = make_run(tmp_path_factory.mktemp("serve") / "run", kind="byte", block_size=512)
    with running(load_model(run), ServeConfig(port=0, max_batch=4, max_queue=4, grace=2)) as (url, _):
        yield url


def chat(url: str, **body):

    messages = [{"role": "user", "content": "hi"}]
    return httpx.post(
        url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **body}, timeout=60
    )


def assert_400(response, param: str, message: str) -> None:
    """A 400 naming ``param``, its message one short line (no parser state of the library)."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert len(error["message"]) < 200 and "\n" not in error["message"] and "<state>" not in error["message"]


@pytest.mark.parametrize("schema, ref", ENDLESS, ids=["self", "mutual", "required-self", "min-items"])
def test_an_endless_schema_is_a_400_in_serve_naming_its_param(served: str, schema: dict, ref: str) -> None:
    """Row 402: in response_format, and in a tool's parameters when a call is required (a
    500 with the library's parser state before); the server answers the next request."""
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert_400(chat(served, response_format=response_format), "response_format", endless(ref))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"} | schema}}]
    if schema.get("type", "object") == "object":
        r = chat(served, tools=tools, tool_choice="required")
        assert_400(r, "tools", "tools[0].function.parameters: no finite JSON value satisfies it ($ref ")
    assert chat(served).status_code == 200


def test_a_json_schema_format_without_a_schema_is_a_400(served: str) -> None:
    """Row 403 (it was a 200, decoded as any JSON object)."""
    r = chat(served, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert_400(r, "response_format", 'response_format.json_schema has no "schema"')


def test_an_endless_schema_is_one_line_in_sample(tmp_path: Path, capsys) -> None:
    """Row 402 in the CLI: one line, exit 2 (it printed ~600 characters of parser state)."""

    run = make_run(tmp_path / "run", kind="byte")
    for i, (schema, ref) in enumerate(ENDLESS):
        (tmp_path / f"s{i}.json").write_text(json.dumps(schema))
        argv = [
            "sample",
            str(run),
            "-p",
            "",
            "--json-schema",
            str(tmp_path / f"s{i}.json"),
            "--max-new-tokens",
            "8",
        ]
        code, out, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, f"invalid JSON schema: {endless(ref)}")
        assert out == "" and len(err) < 200


# ----------------------------------------------------------------------------- 9: smaller ones

LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False)


def gguf_of(tmp: Path, name: str, dtype: str, capsys) -> Path:
    """A GGUF file lmcli exports from a tiny byte-level Llama run."""

    run = make_run(tmp / f"{name}-run", kind="byte", **LLAMA)
    out = tmp / f"{name}.gguf"
    code, _, err = run_cli(["export", str(run), str(out), "--format", "gguf", "--dtype", dtype], capsys)
    assert code == 0, err
    return out


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_a_gguf_with_nan_weights_fails_verify_and_eval(tmp_path: Path, capsys, dtype: str) -> None:
    """Row 404: one NaN (a value of an F32 tensor, the scale of a Q8_0 block): verify names the
    tensor (it said "ok"); eval refuses its nan score (it printed "bits per byte nan")."""
    gguf = pytest.importorskip("gguf")

    path = gguf_of(tmp_path, "m", dtype, capsys)
    (tmp_path / "t.txt").write_text(TINY_TEXT[:200])
    code, out, err = run_cli(["verify", str(path)], capsys)
    assert code == 0 and out.startswith("ok "), err
    reader = gguf.GGUFReader(path, "r+")
    tensor = next(
        t for t in reader.tensors if t.name.startswith("blk.1.") and t.tensor_type.name == dtype.upper()
    )
    if dtype == "f32":
        tensor.data.reshape(-1)[7] = np.nan
    else:  # a Q8_0 block: a float16 scale, then 32 int8 values
        tensor.data.reshape(-1)[34:36] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    reader.data.flush()
    name = tensor.name
    del reader, tensor
    code, _, err = run_cli(["verify", str(path)], capsys)
    assert_one_line_error(code, err, f"{path} holds NaN or infinite weights ({name})")
    code, _, err = run_cli(["eval", str(path), str(tmp_path / "t.txt")], capsys)
    assert_one_line_error(code, err, f"{path} gives a loss of nan on 1 file(s)")
    assert f"lmcli verify {path} checks its weights" in err


@pytest.mark.parametrize("source", ["run", "hf"])
def test_a_checkpoint_or_hf_folder_with_nan_weights_fails_verify(tmp_path: Path, capsys, source: str) -> None:
    """Row 404 for safetensors: an lmcli checkpoint (its checksum recomputed, as whoever edits it
    can) or a Hugging Face folder with one NaN in a block's weight: verify names the tensor
    (it said "ok"); the scan reads a few rows at a time."""
    from safetensors.torch import load_file, save_file

    from lmcli.formats import verify

    run = make_run(tmp_path / "run", kind="byte", **LLAMA)
    path = run / "last"
    if source == "hf":
        path = tmp_path / "hf"
        code, _, err = run_cli(["export", str(run), str(path)], capsys)
        assert code == 0, err
    file = path / "model.safetensors"
    code, out, err = run_cli(["verify", str(path)], capsys)
    assert code == 0 and out.startswith("ok "), err
    state = load_file(file)
    name = next(k for k in state if ".1." in k and state[k].dim() == 2)
    state[name][-1, -1] = float("nan")  # the last value: past the first chunk of rows below
    save_file(state, file, metadata={"format": "pt"})
    if source == "run":
        rechecksum(file)
    code, _, err = run_cli(["verify", str(path)], capsys)
    assert_one_line_error(code, err, f"{path} holds NaN or infinite weights ({name})")
    assert verify.nonfinite_safetensors([file], chunk=2 * state[name].shape[1]) == name


SCANNED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


@pytest.mark.parametrize("kind", SCANNED)
def test_the_nan_scan_reads_a_quantized_block_by_its_scales_as_dequantizing_would(kind: str) -> None:
    """Row 404's scan of quantized tensors reads only each block's float16 scales: on blocks of
    random bytes, with finite scales and then one NaN or infinite scale, it finds what gguf's
    own dequantizer finds (so the table of where the scales are is the file format's)."""
    gguf = pytest.importorskip("gguf")
    from lmcli.formats.gguf.load import GgufTensor
    from lmcli.formats.verify import BLOCK_SCALES, nonfinite_tensor

    offsets = BLOCK_SCALES[kind]
    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rng = np.random.default_rng(0)
    rows, per_row = 6, 2  # blocks of a row
    data = rng.integers(0, 256, (rows, per_row * size), dtype=np.uint8)
    for o in offsets:
        data.reshape(-1, size)[:, o : o + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    tensor = GgufTensor("w", kind, (rows, per_row * values), data)
    assert torch.isfinite(tensor.dequantized()).all() and nonfinite_tensor({"w": tensor}) is None
    for bad in (np.nan, np.inf):
        for o in offsets:
            spoiled = data.copy()
            spoiled.reshape(-1, size)[7, o : o + 2] = np.frombuffer(np.float16(bad).tobytes(), np.uint8)
            tensor = GgufTensor("w", kind, (rows, per_row * values), spoiled)
            with np.errstate(invalid="ignore", over="ignore"):
                assert not torch.isfinite(tensor.dequantized()).all()
            assert nonfinite_tensor({"w": tensor}, chunk=4) == "w"


def test_a_gguf_of_empty_tokens_is_refused_by_verify_and_sample(tmp_path: Path, capsys, monkeypatch) -> None:
    """Row 405: its tokens all empty text (sample printed nothing, verify said "ok")."""
    gguf = pytest.importorskip("gguf")
    add_token_list = gguf.GGUFWriter.add_token_list
    monkeypatch.setattr(
        gguf.GGUFWriter, "add_token_list", lambda w, tokens: add_token_list(w, [""] * len(tokens))
    )
    path = gguf_of(tmp_path, "empty", "f32", capsys)
    monkeypatch.undo()
    for argv in (["verify", str(path)], ["sample", str(path), "-p", "the", "--max-new-tokens", "4"]):
        code, out, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, f"{path}: 256 of its 261 tokens are empty text (the first: id 5)")
        assert out == ""


def test_export_into_a_read_only_folder_names_the_folder(tmp_path: Path, capsys, monkeypatch) -> None:
    """Row 406: the folder that refuses the output is named, never the temporary name beside it
    (``imm/.hf.19134.f4yoxv1x.lmtmp``). As root a read-only mode does not stop writes: there the
    kernel's answer to an immutable folder is given to tempfile's calls instead."""

    run = make_run(tmp_path / "run", kind="byte", **LLAMA)
    imm = tmp_path / "imm"
    imm.mkdir()
    imm.chmod(0o555)
    if os.access(imm, os.W_OK):  # root
        for name in ("mkdtemp", "mkstemp"):
            real = getattr(tempfile, name)

            def refuse(*args, _real=real, **kwargs):
                if Path(kwargs.get("dir", "")) == imm:
                    raise PermissionError(errno.EPERM, "Operation not permitted", str(imm / ".x.1.y.lmtmp"))
                return _real(*args, **kwargs)

            monkeypatch.setattr(tempfile, name, refuse)
    try:
        for fmt, out in (("hf", imm / "hf"), ("gguf", imm / "m.gguf"), ("lmcli", imm / "ck")):
            code, _, err = run_cli(["export", str(run), str(out), "--format", fmt], capsys)
            assert_one_line_error(
                code, err, f"cannot write {out}: its folder {imm} is read-only or immutable"
            )
            assert ".lmtmp" not in err
    finally:
        imm.chmod(0o755)
    assert list(imm.iterdir()) == []


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"ctx_a": "a man", "ctx_b": "sits", "endings": ["a", "b", "c", "d"], "label": "x"},
            "t.jsonl:1: HellaSwag label 'x' is not the index of one of its 4 endings (0 to 3)",
        ),
        (
            {"ctx_a": "a man", "ctx_b": "sits", "endings": ["a", "b", "c", "d"], "label": 4},
            "t.jsonl:1: HellaSwag label 4 is not the index of one of its 4 endings (0 to 3)",
        ),
        (
            {"question": "why?", "choices": {"text": ["yes", "no"], "label": ["A"]}, "answerKey": "A"},
            "t.jsonl:1: an ARC row with 2 choice texts and 1 labels: one label a text",
        ),
        (
            {"question": "why?", "choices": {"text": ["yes", "no"], "label": ["A", "A"]}, "answerKey": "A"},
            "t.jsonl:1: an ARC row whose labels repeat (['A', 'A'])",
        ),
    ],
    ids=["hellaswag-text-label", "hellaswag-out-of-range", "arc-2-texts-1-label", "arc-repeated-labels"],
)
def test_a_bad_hellaswag_or_arc_row_is_named(tmp_path: Path, capsys, row: dict, message: str) -> None:
    """Row 407: the row and its label named (it said "context must be text, got None"; the ARC
    row was taken with 2 choices)."""

    run = make_run(tmp_path / "run")
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    code, _, err = run_cli(["eval", str(run), "--task", str(tmp_path / "t.jsonl")], capsys)
    assert_one_line_error(code, err, message)


# ----------------------------------------------------------------------------- 10: MFU


def test_a_probed_peak_is_raised_by_what_the_run_achieves() -> None:
    """Row 408: a CPU's measured peak is a lower bound: a rate above it raises it (MFU 1, then
    relative to the run's best); a datasheet's or --peak-tflops' peak is taken as given."""

    probed = MfuBasis(flops_per_token=1e6, peak_tflops=1e-6, peak_source="float32 matmul", probed=True)
    assert probed.of(tokens_per_s=0.5) == pytest.approx(0.5)  # 0.5e6 FLOP/s of a 1e6 peak
    assert probed.of(tokens_per_s=4.0) == pytest.approx(1.0)  # 4e6 FLOP/s: the probe was too low
    assert probed.peak_tflops == pytest.approx(4e-6) and probed.peak_source == PROBE_RAISED
    assert probed.of(tokens_per_s=2.0) == pytest.approx(0.5)
    given = MfuBasis(flops_per_token=1e6, peak_tflops=1e-6, peak_source="--peak-tflops")
    assert given.of(tokens_per_s=4.0) == pytest.approx(4.0) and given.peak_tflops == 1e-6


def test_mfu_on_the_cpu_never_passes_100_percent(tmp_path: Path, capsys, monkeypatch) -> None:
    """Row 408 end to end: a probe far below the CPU's speed (the Multi30k recipe showed
    110.7%) leaves every logged MFU at most 1, and the best of them 1."""

    monkeypatch.setattr(lmcli.train.mfu, "measured_cpu_tflops", lambda: 1e-9)  # 1 kFLOP/s
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    argv = ["train", str(tmp_path / "c.txt"), "--out", str(tmp_path / "run"), *FAST_TRAIN_ARGS]
    code, _, err = run_cli([*argv, "--max-steps", "6", "--log-interval", "1", "--device", "cpu"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    mfus = [r["mfu"] for r in records if r.get("mfu") is not None]
    assert len(mfus) == 6 and max(mfus) == pytest.approx(1.0) and all(0 < m <= 1.0 + 1e-12 for m in mfus)


def test_a_config_file_that_would_change_the_run_is_named_by_its_key(runs: dict[str, Path], capsys) -> None:
    """Row 400 through ``--config``: the key is named (a flag overrides the file as ever)."""
    config = runs["tmp"] / "other.toml"
    config.write_text('task = "sft"\n')
    argv = ["train", "--resume", str(runs["lm"]), "--config", str(config), "--max-steps", "3", "-q"]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, f"task = 'sft' (config file): {runs['lm']} is a --task lm run")
