"""Issue 40, findings 1-5: inputs whose cost must stay bounded, and inputs that must be one line.

Each crafted input is built here, scaled down from the issue's repro to a size whose cost before
the fix already showed (hundreds of MB), and measured in a fresh process (``run_measured``: peak
RSS and seconds, under an address-space limit), after the same command on a genuine input.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    FAST_TRAIN_ARGS,
    TINY_TEXT,
    assert_one_line_error,
    make_run,
    run_cli,
    run_measured,
    tiny_model,
    tiny_tokenizer,
)

from lmcli.data.corpus import read_lines
from lmcli.data.token_shards import file_check
from lmcli.eval.downstream.scoring import ROWS, Group, score_groups
from lmcli.eval.perplexity import LONG_LINE, evaluate_lines, score_ids

sys.path.insert(0, str(Path(__file__).parents[1] / "formats"))  # gguf_files, as tests/formats has it
MB = 1 << 20
GREEDY = ["--temperature", "0"]
DEVICE = "it is a device, not a regular file"


def peaks(results: list[dict]) -> list[float]:
    return [r["peak"] / MB for r in results]


# ----------------------------------------------------------------------------- 1. GGUF metadata


@pytest.mark.slow
def test_gguf_metadata_lmcli_does_not_read_costs_nothing(tmp_path: Path) -> None:
    """Row 300: arrays and keys lmcli does not read are skipped, never materialized. At these
    sizes ``gguf.GGUFReader`` took ~250 MB and seconds more than the plain file (1,000,030
    elements: 1 GB, 15 s)."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf_model

    def junk(w) -> None:
        w.add_array("junk.bytes", bytes(250_000))  # uint8
        w.add_array("junk.strings", [""] * 100_000)
        for i in range(20_000):
            w.add_uint32(f"junk.key{i}", i)

    good = write_gguf_model(tmp_path / "good.gguf", "llama", "Q8_0")
    crafted = write_gguf_model(tmp_path / "crafted.gguf", "llama", "Q8_0", extra=junk)
    sample = ["sample", "-p", "the", "--max-new-tokens", "3", "--temperature", "0"]
    commands = [["verify", str(good)], ["verify", str(good)], ["verify", str(crafted)]]
    commands += [[sample[0], str(good), *sample[1:]], [sample[0], str(crafted), *sample[1:]]]
    results = run_measured(commands)
    assert [r["code"] for r in results] == [0] * 5, [r["err"] for r in results]
    _, good_verify, crafted_verify, good_sample, crafted_sample = peaks(results)
    assert crafted_verify < good_verify + 30, peaks(results)
    assert crafted_sample < good_sample + 30, peaks(results)
    assert results[2]["seconds"] < results[1]["seconds"] + 3


def test_gguf_tensors_read_by_offset_are_the_files_values(tmp_path: Path) -> None:
    """The tensor table of the bounded scan, read from a memory map by offset, holds what
    ``gguf``'s own reader reads (every type: dequantized by ``gguf``'s quants)."""
    gguf = pytest.importorskip("gguf")
    from gguf_files import write_gguf_model

    from lmcli.formats.gguf.load import read_gguf_header

    for kind in ("F32", "F16", "BF16", "Q8_0", "Q4_K"):
        path = write_gguf_model(tmp_path / f"{kind}.gguf", "llama", kind)
        ours = read_gguf_header(path).tensors
        theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
        assert set(ours) == set(theirs)
        for name, t in theirs.items():
            expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
            got = ours[name].dequantized(torch.float32)
            assert got.shape == tuple(reversed(t.shape.tolist()))
            torch.testing.assert_close(got, expected.reshape(got.shape), rtol=0, atol=0)


# ----------------------------------------------------------------------------- 2. long lines


@pytest.mark.slow
def test_a_long_prompt_is_cut_before_it_is_tokenized(tmp_path: Path, capsys) -> None:
    """Rows 38/301: a 2 MB prompt line in `sample --prompt-file` and `beam --input` costs what
    its usable end costs (before: ~800 MB, the whole line tokenized), and decodes as that end."""
    run = make_run(tmp_path / "run")
    line = (TINY_TEXT.replace("\n", " ") * 1100)[: 2 * MB]
    (tmp_path / "long.txt").write_text(line + "\n")
    (tmp_path / "tail.txt").write_text(line[-2000:] + "\n")
    commands = [
        [kind, str(run), flag, str(tmp_path / name), "--max-new-tokens", "8", *greedy]
        for name in ("tail.txt", "tail.txt", "long.txt")  # the first two load what any run loads
        for kind, flag, greedy in (("sample", "--prompt-file", GREEDY), ("beam", "--input", []))
    ]
    results = run_measured(commands)
    assert [r["code"] for r in results] == [0] * 6, [r["err"] for r in results]
    assert all("longer than the context were cut" in r["err"] for r in results)
    *_, tail_sample, tail_beam, long_sample, long_beam = peaks(results)
    assert long_sample < tail_sample + 25 and long_beam < tail_beam + 25, peaks(results)
    outputs = [run_cli(argv, capsys)[1] for argv in commands[2:]]  # the same text as the line's end
    assert outputs[0][-60:] == outputs[2][-60:] and outputs[1] == outputs[3]


@pytest.mark.parametrize("end", [True, False], ids=["end", "beginning"])
def test_a_long_line_is_read_as_the_part_kept(tmp_path: Path, end: bool) -> None:
    """Row 301: ``read_lines(keep=...)`` gives each line as the plain reading cut to its kept
    part, whatever the line breaks (CRLF, empty lines, none at the end), holding no more."""
    big = "x" * (3 << 20) + "yz\r"
    for text in ("a\nbb\r\n\n" + big + "\nlast", "\n", "", "one", big + "\n\n"):
        path = tmp_path / "lines.txt"
        path.write_bytes(text.encode())
        expected = [line[-5:] if end else line[:5] for line in read_lines(path)]
        assert read_lines(path, keep=5, end=end) == expected


def test_eval_per_line_scores_a_long_line_as_a_stream() -> None:
    """Rows 71/302: a line longer than ``LONG_LINE`` is tokenized and scored piece by piece (a
    10 MB line took 4 GB): its record is the one the whole line's ids give."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size)
    long = (TINY_TEXT.replace("\n", " ") * 40)[: LONG_LINE + 5000]
    score = evaluate_lines(model, tok, ["the cat sat.", long, "a bird"], context=48)
    record = score.lines[1]
    ids = [*tok.with_bos(tok.encode(long)), tok.eos_id]
    count, nll = score_ids(model, ids, 48, 48)
    assert record["tokens"] == count == len(ids) - 1
    assert math.isclose(record["nll"], nll, rel_tol=1e-5)


@pytest.mark.slow
def test_eval_per_line_memory_is_flat_in_the_line_length(tmp_path: Path) -> None:
    """Row 302: a 400,000-character line (before: ~160 MB more than a short one) costs no more
    than a short file of the same text does."""
    run = make_run(tmp_path / "run")
    text = (TINY_TEXT.replace("\n", " ") * 200)[:400_000]
    (tmp_path / "short.txt").write_text(TINY_TEXT)
    (tmp_path / "long.txt").write_text(text + "\n")
    names = ("short.txt", "short.txt", "long.txt")  # the first loads what any eval loads
    commands = [["eval", str(run), str(tmp_path / name), "--per-line"] for name in names]
    results = run_measured(commands)
    assert [r["code"] for r in results] == [0, 0, 0], [r["err"] for r in results]
    _, short, long = peaks(results)
    assert long < short + 25, peaks(results)


# ----------------------------------------------------------------------------- 3. devices and FIFOs


@pytest.mark.slow
def test_devices_and_fifos_are_refused_before_reading(tmp_path: Path, capsys) -> None:
    """Row 303: each reader refuses a device or a FIFO in one line, at once (before: 2.2-2.5 GB
    in 3-4 s from /dev/zero; a FIFO hung)."""
    run = make_run(tmp_path / "run")
    fifo, text = tmp_path / "fifo.gguf", tmp_path / "text.txt"
    os.mkfifo(fifo)
    text.write_text(TINY_TEXT)
    cases = [
        (["sample", str(run), "-p", "x", "--json-schema", "/dev/zero"], f"JSON schema /dev/zero: {DEVICE}"),
        (["sample", str(run), "-p", "x", "--grammar", "/dev/zero"], f"grammar /dev/zero: {DEVICE}"),
        (["eval", str(run), "--task", "/dev/zero"], f"/dev/zero: {DEVICE}"),
        (["train", "--config", "/dev/zero"], f"config file /dev/zero: {DEVICE}"),
        (["beam", str(run), "--input", "/dev/zero"], f"/dev/zero: {DEVICE}"),
        (["sample", str(run), "--prompt-file", str(fifo)], "fifo.gguf: it is a FIFO, not a regular file"),
        (["sample", str(fifo), "-p", "x"], "fifo.gguf: it is a FIFO, not a regular file"),
        (["train", str(fifo), *FAST_TRAIN_ARGS], "fifo.gguf: it is a FIFO, not a regular file"),
        (["train", str(text), "--tokenizer", str(fifo), *FAST_TRAIN_ARGS], "tokenizer " + str(fifo)),
    ]
    results = run_measured([argv for argv, _ in cases], timeout=120)
    for (argv, message), r in zip(cases, results, strict=True):
        assert_one_line_error(r["code"], r["err"], message)
        assert r["peak"] < 256 * MB and r["seconds"] < 10, (argv, r)  # /dev/zero read: GBs


@pytest.mark.slow
def test_a_token_folder_whose_index_is_a_fifo_is_one_line(tmp_path: Path, capsys) -> None:
    """Row 303: `train` and `tokenize --out` on a token folder whose index.json is a FIFO."""
    folder = tokenized(tmp_path, capsys)
    (folder / "index.json").unlink()
    os.mkfifo(folder / "index.json")
    corpus = tmp_path / "rows.jsonl"
    cases = [
        (["train", str(folder), *FAST_TRAIN_ARGS, "--out", str(tmp_path / "r")], "index.json: it is a FIFO"),
        (["tokenize", str(corpus), "--out", str(folder)], "index.json: it is a FIFO"),
    ]
    results = run_measured([argv for argv, _ in cases], timeout=120)
    for (_, message), r in zip(cases, results, strict=True):
        assert_one_line_error(r["code"], r["err"], message)


# ----------------------------------------------------------------------------- 4. eval --task choices


def test_task_choices_are_bounded_per_row(tmp_path: Path, capsys) -> None:
    """Row 304: a row of more than 1,024 choices is one line (before: 500,000 choices took
    5 GB)."""
    run = make_run(tmp_path / "run")
    choices = [f"c{i}" for i in range(1025)]
    task = tmp_path / "many.jsonl"
    task.write_text(json.dumps({"context": "the cat", "choices": choices, "answer": 0}) + "\n")
    code, _, err = run_cli(["eval", str(run), "--task", str(task)], capsys)
    assert_one_line_error(code, err, "many.jsonl:1: 1,025 choices (a row has at most 1,024)")


def test_many_choices_are_scored_in_bounded_parts_as_one_forward_each_would() -> None:
    """Row 304: a group of more continuations than ``ROWS`` is scored in parts; each
    continuation's log-likelihood is the one a plain forward of context + continuation gives."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size)
    context = [tok.bos_id, *tok.encode("the cat sat on")]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4, (ROWS + 40,), generator=g).tolist()
    conts = [torch.randint(5, tok.vocab_size, (n,), generator=g).tolist() for n in lengths]
    groups = [Group(context, conts), Group(context[:3], conts[:5])]
    scored = score_groups(model, groups, batch_size=4)
    assert [len(s) for s in scored] == [ROWS + 40, 5]
    for i in (0, 1, ROWS - 1, ROWS, ROWS + 39):
        ids = torch.tensor([context + conts[i]])
        with torch.no_grad():
            logp = model(ids[:, :-1]).float().log_softmax(-1)[0, len(context) - 1 :]  # (len(cont), V)
        expected = logp.gather(1, torch.tensor(conts[i])[:, None]).sum().item()
        assert math.isclose(scored[0][i][0], expected, rel_tol=1e-4, abs_tol=1e-4)


# ----------------------------------------------------------------------------- 5. no internal error


def tokenized(tmp_path: Path, capsys) -> Path:
    rows = [{"text": TINY_TEXT[i * 101 : i * 101 + 300]} for i in range(15)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tokens"
    args = ["tokenize", str(tmp_path / "rows.jsonl"), "--out", str(out), "--cache-dir", str(tmp_path / "c")]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    return out


def rewrite_shard(folder: Path, ids: np.ndarray, dtype: str | None = None) -> None:
    """Shard 0 holds ``ids`` and index.json's records agree with it (as a crafted folder's would)."""
    index = json.loads((folder / "index.json").read_text())
    record = index["shards"][0]
    ids.tofile(folder / f"{record['name']}.bin")
    record["n_tokens"] = len(ids)
    record["check"]["bin"] = file_check(folder / f"{record['name']}.bin")
    (folder / f"{record['name']}.json").write_text(json.dumps(record))
    if dtype is not None:
        index["dtype"] = dtype
    (folder / "index.json").write_text(json.dumps(index))


def shard_ids(folder: Path) -> np.ndarray:
    record = json.loads((folder / "index.json").read_text())["shards"][0]
    return np.fromfile(folder / f"{record['name']}.bin", dtype=np.uint16)


@pytest.mark.slow
def test_a_token_folder_that_does_not_fit_its_tokenizer_is_one_line(tmp_path: Path, capsys) -> None:
    """Row 305: a replaced tokenizer.json, ids outside the vocabulary, a dtype that lies."""
    folder = tokenized(tmp_path, capsys)
    args = [*FAST_TRAIN_ARGS, "--max-steps", "2"]
    own = json.loads((folder / "tokenizer.json").read_text())
    tiny_tokenizer(TINY_TEXT + "xyz").save(folder / "tokenizer.json")
    code, _, err = run_cli(["train", str(folder), *args, "--out", str(tmp_path / "r1")], capsys)
    assert_one_line_error(code, err, "its tokenizer.json is not the tokenizer its tokens were made with")
    (folder / "tokenizer.json").write_text(json.dumps(own))
    vocab = len(own["model"]["vocab"])
    ids = shard_ids(folder)
    rewrite_shard(folder, np.full(len(ids), vocab + 7, dtype=np.uint16))
    code, _, err = run_cli(["train", str(folder), *args, "--out", str(tmp_path / "r2")], capsys)
    assert_one_line_error(code, err, f"holds token id {vocab + 7}, outside the vocabulary of {vocab}")
    rewrite_shard(folder, ids[: len(ids) // 2 * 2].view(np.uint32), dtype="uint32")
    code, _, err = run_cli(["train", str(folder), *args, "--out", str(tmp_path / "r3")], capsys)
    assert_one_line_error(code, err, "index.json says uint32, but a vocabulary of")


DEEP = "[" * 100_000


@pytest.mark.slow
@pytest.mark.parametrize(
    "row, message",
    [
        ('{"text": "bad \\ud800"}', 'rows.jsonl:2: "text" holds a lone surrogate (U+D800): not text'),
        ('{"text": ' + DEEP + "}", "rows.jsonl:2: not a JSON object (nested too deeply)"),
    ],
    ids=["surrogate", "deep"],
)
def test_a_bad_corpus_row_is_one_line_in_every_command(
    tmp_path: Path, capsys, row: str, message: str
) -> None:  # noqa: E501
    """Row 306: a lone surrogate or JSON nested 100,000 deep in a JSONL corpus: `tokenize`,
    `train` and `eval FILE` name the row (before: UnicodeEncodeError, RecursionError)."""
    run = make_run(tmp_path / "run")
    corpus = tmp_path / "rows.jsonl"
    corpus.write_text(json.dumps({"text": TINY_TEXT}) + "\n" + row + "\n")
    cache = ["--cache-dir", str(tmp_path / "c")]
    for argv in (
        ["tokenize", str(corpus), "--out", str(tmp_path / "t"), *cache],
        ["train", str(corpus), *FAST_TRAIN_ARGS, "--out", str(tmp_path / "r"), *cache],
        ["eval", str(run), str(corpus)],
    ):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, message)


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"context": "the \\ud800", "choices": ["a", "b"], "answer": 0}', "t.jsonl:1: context holds a lone"),
        ('{"context": "the", "choices": ["a", "\\udfff"], "answer": 0}', "t.jsonl:1: choice 1 holds a lone"),
        (DEEP, "t.jsonl:1: not a JSON object (nested too deeply)"),
    ],
    ids=["context", "choice", "deep"],
)
def test_a_bad_task_row_is_one_line(tmp_path: Path, capsys, row: str, message: str) -> None:
    """Row 306: an `eval --task` row with a lone surrogate (before: TypeError in the tokenizer)
    or nested 100,000 deep (before: RecursionError)."""
    run = make_run(tmp_path / "run")
    (tmp_path / "t.jsonl").write_text(row + "\n")
    code, _, err = run_cli(["eval", str(run), "--task", str(tmp_path / "t.jsonl")], capsys)
    assert_one_line_error(code, err, message)


def test_a_token_folder_whose_index_is_nested_deeply_is_one_line(tmp_path: Path, capsys) -> None:
    """Row 306: index.json nested 100,000 deep (before: RecursionError)."""
    folder = tokenized(tmp_path, capsys)
    index = json.loads((folder / "index.json").read_text())
    index["junk"] = "@"
    (folder / "index.json").write_text(json.dumps(index).replace('"@"', DEEP))
    code, _, err = run_cli(["train", str(folder), *FAST_TRAIN_ARGS, "--out", str(tmp_path / "r")], capsys)
    assert_one_line_error(code, err, "damaged (its index.json is missing or unreadable)")
