"""Issue 27 against model files: crafted Hugging Face folders, LoRA runs and GGUF files, full disks.

Rows: 3 (config sizes not bounded), 4 (a LoRA rank allocates before shapes are checked), 8 (bad
config values, an I32 tensor, a bad weight_map, rank 0, nested JSON, full disks), 9 (shards
outside the folder), 10 (verify misses broken LoRA runs, reads no HF folder or GGUF file),
12 (a GGUF export on a full disk), and the minor ones (messages, ``average``, ``base.json``).
A crafted file is refused in one line, exit 2, before an allocation of its claimed size: the
peak RSS of each refusal is measured in a process under a memory limit (``run_measured``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    MiB,
    assert_one_line_error,
    make_run,
    rechecksum,
    run_cli,
    run_measured,
    tiny_tokenizer,
    train_config,
)
from safetensors.torch import load_file, save_file

from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.export.hf import export_hf
from lmcli.formats.lora_base import base_reference
from lmcli.formats.sources import load_checkpoint
from lmcli.model.lora import add_adapters

LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False)


def hf(tmp: Path, name: str = "hf", **config) -> Path:
    """A Hugging Face folder (Llama unless told otherwise) exported from a tiny run."""
    run = make_run(tmp / f"{name}-run", kind="byte", **{**LLAMA, **config})
    return export_hf(run, tmp / name)


def edit(file: Path, **changes) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def refused_within_bounds(
    cases: list[tuple[list[str], str]], weights: int, warmup: list[list[str]], **limits
) -> None:
    """Each command is one line holding its message, exit 2, within 5 s, its peak RSS under
    1.3 x the weights + 64 MB (the issue's bound), all in one process that ran ``warmup``
    first (the same commands on genuine files: what a command imports is not the crafted
    file's cost). ``limits``: ``run_measured``'s."""
    results = run_measured(warmup + [argv for argv, _ in cases], **limits)
    assert all(r["code"] == 0 for r in results[: len(warmup)]), results[: len(warmup)]
    for (argv, message), result in zip(cases, results[len(warmup) :], strict=True):
        lines = [ln for ln in result["err"].splitlines() if ln.strip() and not ln.startswith("warning:")]
        assert result["code"] == 2 and len(lines) == 1 and message in lines[0], (argv, result)
        assert "Traceback" not in result["err"], (argv, result)
        assert result["seconds"] < 5 and result["peak"] < 1.3 * weights + 64 * MiB, (argv, result)


# ----------------------------------------------------------------------------- 3: config sizes


SIZES = [  # row 3: a context of 10^8 took 22.7 GB, 10^6 layers 6 GB and minutes
    ({"max_position_embeddings": 5 * 10**7}, "bytes of position tables and masks, more than the weights'"),
    ({"max_position_embeddings": 10**8}, "max_position_embeddings must be in [1, 67108864], got 100000000"),
    ({"num_hidden_layers": 4000}, "layers in config.json: 4000, blocks in the weights: 2"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers must be in [1, 4096], got 1000000"),
    (
        {"hidden_size": 8192, "num_attention_heads": 64, "head_dim": None},
        "the weights hold wte.weight of shape",
    ),
]


@pytest.mark.slow
def test_hf_config_sizes_are_checked_against_the_weights_before_anything_is_built(tmp_path: Path) -> None:
    """Row 3: each crafted Llama folder (and a GPT-2 one with 10^7 learned positions) is one
    line before anything of the config's size is allocated."""
    genuine = hf(tmp_path)
    weights = (genuine / "model.safetensors").stat().st_size
    cases = []
    for i, (changes, message) in enumerate(SIZES):
        folder = shutil.copytree(genuine, tmp_path / f"crafted-{i}")
        edit(folder / "config.json", **changes)
        cases.append((["sample", str(folder), "--max-new-tokens", "1"], message))
    gpt2 = hf(tmp_path, "gpt2", position="learned", norm="layernorm", mlp="gelu", bias=True)
    crafted = shutil.copytree(gpt2, tmp_path / "crafted-gpt2")
    edit(crafted / "config.json", n_positions=10**7)
    cases.append((["verify", str(crafted)], "wpe.weight has shape (32, 32), config expects"))
    warmup = [["sample", str(genuine), "--max-new-tokens", "1"], ["verify", str(gpt2)]]
    refused_within_bounds(cases, weights, warmup)


# ----------------------------------------------------------------------------- 8: config values


def sharded(folder: Path, weight_map: object) -> None:
    """The folder's weights as a shard named by an index holding ``weight_map``."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def int_tensor(folder: Path) -> None:
    state = load_file(str(folder / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: edit(f / "config.json", hidden_size="64"), "hidden_size must be an integer, got '64'"),
        (
            lambda f: edit(f / "config.json", num_attention_heads=0),
            "num_attention_heads must be in [1, 4096], got 0",
        ),
        (
            lambda f: edit(f / "config.json", rope_scaling={"rope_type": "linear", "factor": "big"}),
            "rope_scaling.factor must be a number, got 'big'",
        ),
        (lambda f: edit(f / "config.json", rope_scaling="linear"), "rope_scaling must be a table"),
        (lambda f: edit(f / "config.json", rope_scaling=["linear", 2]), "rope_scaling must be a table"),
        (
            lambda f: edit(f / "config.json", max_position_embeddings=10**12),
            "max_position_embeddings must be in",
        ),
        (
            lambda f: edit(f / "config.json", architectures="LlamaForCausalLM"),
            "architectures must be a list of names",
        ),
        (int_tensor, "ln_f.weight is I32, expected one of F32"),
        (lambda f: sharded(f, ["model-00001-of-00001.safetensors"]), "weight_map must be a table"),
        (lambda f: sharded(f, 7), "weight_map must be a table"),
        (lambda f: (f / "config.json").write_text("[" * 100_000), "cannot read"),
    ],
    ids=[
        "width-text",
        "heads-0",
        "factor-text",
        "rope-text",
        "rope-list",
        "context-1e12",
        "architectures-text",
        "int32",
        "map-list",
        "map-int",
        "nested",
    ],
)
def test_bad_hf_values_are_one_line_not_internal_errors(tmp_path: Path, capsys, damage, message: str) -> None:
    """Row 8 (and the minor 'unsupported architecture 'L''): every config.json value is checked
    by one schema before use."""
    folder = hf(tmp_path)
    damage(folder)
    code, _, err = run_cli(["sample", str(folder), "--max-new-tokens", "1"], capsys)
    if message == "cannot read":  # not JSON at all: not a Hugging Face folder, nor a run
        assert code == 2 and "internal error" not in err, err
        return
    assert_one_line_error(code, err, message)


def test_verify_on_deeply_nested_json_is_one_line(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    (run / "last" / "config.json").write_text("[" * 100_000)
    rechecksum(run / "last" / "config.json")
    code, _, err = run_cli(["verify", str(run / "last")], capsys)
    assert_one_line_error(code, err, "nested too deeply")


# ----------------------------------------------------------------------------- 9: shard paths
@pytest.mark.slow
def test_weights_outside_the_folder_are_refused_unopened(tmp_path: Path) -> None:
    """Row 9: an index naming ``../x`` or an absolute path loaded weights from there
    (``/etc/passwd`` was opened): a FIFO outside the folder would hang the reader that opens
    it, another model's weights named by an absolute path would load silently. Minor: a FIFO
    in place of model.safetensors was "has no model.safetensors"; a link out is refused too."""
    genuine = hf(tmp_path)
    other = hf(tmp_path, "other")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "x.safetensors")
    names = list(load_file(str(genuine / "model.safetensors")))
    cases = []
    for i, shard in enumerate(("../outside/x.safetensors", str(other / "model.safetensors"), "/etc/passwd")):
        folder = shutil.copytree(genuine, tmp_path / f"index-{i}")
        sharded(folder, dict.fromkeys(names, shard))
        cases.append((["sample", str(folder), "--max-new-tokens", "1"], "outside the folder"))
    for target, message in ((None, "is not a regular file"), ("/etc/passwd", "leads outside")):
        folder = shutil.copytree(genuine, tmp_path / f"weights-{message[:5]}")
        (folder / "model.safetensors").unlink()
        if target is None:
            os.mkfifo(folder / "model.safetensors")
        else:
            (folder / "model.safetensors").symlink_to(target)
        cases.append((["sample", str(folder), "--max-new-tokens", "1"], message))
    weights = (genuine / "model.safetensors").stat().st_size
    refused_within_bounds(cases, weights, [["sample", str(genuine), "--max-new-tokens", "1"]], timeout=60)


# ----------------------------------------------------------------------------- 4, 10: LoRA runs


@pytest.fixture
def lora_run(tmp_path: Path) -> Path:
    """A LoRA run of rank 2 on a tiny base run (its adapters drawn, not trained)."""
    base = make_run(tmp_path / "base")
    ckpt = load_checkpoint(base)
    cfg = train_config(init_from=str(base), lora_rank=2)
    model = add_adapters(ckpt.model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_b"):
                p.normal_()
    for name in ("last", "best"):
        save_checkpoint(
            tmp_path / "lora" / name, model, cfg, ckpt.tokenizer, meta={"step": 1}, base=base_reference(base)
        )
    return tmp_path / "lora"


def set_rank(run: Path, rank: int) -> None:
    for name in ("last", "best"):
        config = run / name / "config.json"
        data = json.loads(config.read_text())
        data["train"]["lora_rank"] = rank
        config.write_text(json.dumps(data))
        rechecksum(config)


@pytest.mark.slow
def test_a_lora_rank_is_checked_against_the_adapters_before_allocating(lora_run: Path) -> None:
    """Rows 4, 8, 10: rank 300,000 took 2.56 GB, 10^9 an attempted 256 GB, 0 a
    ZeroDivisionError; `verify` called all of them ok."""
    ranks = {
        300_000: "rank 2 (h.0.attn.c_attn.lora_a of shape (2, 32)), the run's config says lora-rank 300000",
        10**9: "the run's config says lora-rank 1000000000",
        0: "the run's config says lora-rank 0",
        4: "the run's config says lora-rank 4",
    }
    cases = []
    for rank, message in ranks.items():
        run = shutil.copytree(lora_run, lora_run.parent / f"rank-{rank}")
        set_rank(run, rank)
        cases += [(["sample", str(run), "--max-new-tokens", "1"], message), (["verify", str(run)], message)]
    weights = (lora_run.parent / "base" / "last" / "model.safetensors").stat().st_size
    warmup = [["sample", str(lora_run), "--max-new-tokens", "1"], ["verify", str(lora_run)]]
    refused_within_bounds(cases, weights, warmup)


def test_a_lora_rank_above_the_layers_it_adapts_is_refused_before_allocating(tmp_path: Path, capsys) -> None:
    """Row 4: training with --lora-rank 10^9 attempted a 256 GB allocation."""
    base = make_run(tmp_path / "base")
    (tmp_path / "c.txt").write_text("the cat sat on the mat.\n" * 40)
    argv = ["train", str(tmp_path / "c.txt"), "--init-from", str(base), "--lora-rank", str(10**9)]
    code, _, err = run_cli([*argv, "--max-steps", "1", "--out", str(tmp_path / "out"), "-q"], capsys)
    assert_one_line_error(code, err, "lora-rank 1000000000 is larger than the layers it adapts allow")
    assert not (tmp_path / "out").exists()


def test_verify_checks_a_lora_runs_adapters(lora_run: Path, capsys) -> None:
    """Row 10: adapters whose lora_b has other rows (checksum recomputed) were "ok"."""
    code, out, err = run_cli(["verify", str(lora_run)], capsys)
    assert code == 0 and out.count("ok  ") == 2, err
    adapters = lora_run / "last" / "adapters.safetensors"
    state = load_file(str(adapters))
    state["h.1.mlp.c_fc.lora_b"] = torch.zeros(64, 2)
    save_file(state, str(adapters))
    rechecksum(adapters)
    code, _, err = run_cli(["verify", str(lora_run)], capsys)
    assert_one_line_error(
        code, err, "h.1.mlp.c_fc.lora_b has shape (64, 2), the run's LoRA settings expect (128, 2)"
    )


def test_a_relative_base_path_is_read_from_the_run_folder(
    lora_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Minor: a relative path in base.json resolved against the working directory."""
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(lora_run, moved / "lora")
    shutil.move(tmp_path / "base", moved / "lora" / "base")
    for name in ("last", "best"):
        path = moved / "lora" / name / "base.json"
        edit(path, path="base/last")
        rechecksum(path)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["sample", str(moved / "lora"), "-p", "the", "--max-new-tokens", "3"], capsys)
    assert code == 0, err


# ----------------------------------------------------------------------------- 10: HF folders, GGUF files


def test_verify_checks_hf_folders_and_gguf_files(tmp_path: Path, capsys) -> None:
    """Row 10: an HF folder was "config.json has no model config"; GGUF files were not read."""
    folder = hf(tmp_path)
    code, out, err = run_cli(["verify", str(folder)], capsys)
    assert code == 0 and out.startswith(f"ok  {folder}: Hugging Face llama folder"), err
    gguf_file = tmp_path / "m.gguf"
    code, _, err = run_cli(["export", str(tmp_path / "hf-run"), str(gguf_file), "--format", "gguf"], capsys)
    assert code == 0, err
    code, out, err = run_cli(["verify", str(gguf_file)], capsys)
    assert code == 0 and out.startswith(
        f"ok  {gguf_file}: GGUF llama file (F16, F32), tensors fit its metadata"
    ), err
    edit(folder / "config.json", intermediate_size=48)
    code, _, err = run_cli(["verify", str(folder)], capsys)
    assert_one_line_error(code, err, "config expects")


# ----------------------------------------------------------------------------- 8, 12: full disks
@pytest.mark.slow
def test_an_export_that_cannot_be_written_whole_names_its_output_and_leaves_nothing(tmp_path: Path) -> None:
    """Rows 8 and 12: a full disk was "internal error: SafetensorError" (hf, lmcli) and "error:
    11264 requested and 4432 written" (gguf). Simulated with a file-size limit (``ulimit -f``):
    each write past it fails as a write to a full disk does."""
    run = make_run(tmp_path / "run", kind="byte", n_embd=64)
    out = tmp_path / "out"
    out.mkdir()
    targets = [out / f"model-{fmt}" for fmt in ("gguf", "hf", "lmcli")]
    commands = [["export", str(run), str(t), "--format", t.name[6:]] for t in targets]
    for target, result in zip(targets, run_measured(commands, file_size=20_000), strict=True):
        lines = [ln for ln in result["err"].splitlines() if ln.strip()]
        assert result["code"] == 2 and lines == [lines[0]], result
        assert lines[0].startswith(f"error: cannot write {target}: File too large"), result
    assert list(out.iterdir()) == []


# ----------------------------------------------------------------------------- minor: outputs, average


def test_export_to_a_file_or_a_dangling_link_says_so(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run", kind="byte")
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(["export", str(run), str(tmp_path / "file"), "--format", "lmcli"], capsys)
    assert_one_line_error(code, err, "is a file, not a folder")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    code, _, err = run_cli(["export", str(run), str(tmp_path / "link")], capsys)
    assert_one_line_error(code, err, f"{tmp_path / 'link'} is a symbolic link")
    assert ".lmtmp" not in err


def step_run(tmp: Path) -> Path:
    """A run folder with three step-N checkpoints of one tiny model."""
    run = make_run(tmp / "run")
    for step in (1, 2, 3):
        shutil.copytree(run / "last", run / f"step-{step:07d}")
    return run


def test_average_refuses_other_tokenizers_nan_weights_and_linked_steps(tmp_path: Path, capsys) -> None:
    """Minor: they were mixed, averaged into NaN, and skipped, each silently."""
    run = step_run(tmp_path)
    other = run / "step-0000002"
    tiny_tokenizer("ABCDEFGHIJKLMNOPQRST" * 30).save(other / "tokenizer.json")  # 25 tokens too: loads
    rechecksum(other / "tokenizer.json")
    code, _, err = run_cli(["average", str(run), "--last", "3"], capsys)
    assert_one_line_error(code, err, "has another tokenizer than")

    run = step_run(tmp_path / "nan")
    weights = run / "step-0000003" / "model.safetensors"
    state = load_file(str(weights))
    state["ln_f.weight"][0] = float("nan")
    save_file(state, str(weights), metadata={"format": "pt"})
    rechecksum(weights)
    code, _, err = run_cli(["average", str(run), "--last", "3"], capsys)
    assert_one_line_error(code, err, "holds NaN or infinite weights (ln_f.weight)")

    run = step_run(tmp_path / "linked")
    shutil.move(run / "step-0000003", tmp_path / "elsewhere")
    (run / "step-0000003").symlink_to(tmp_path / "elsewhere")
    code, _, err = run_cli(["average", str(run), "--last", "2"], capsys)
    assert_one_line_error(code, err, "step-0000003 is a symbolic link")


@pytest.mark.slow
def test_a_crafted_gguf_is_refused_before_anything_is_built(tmp_path: Path, capsys) -> None:
    """Row 10 and the GGUF header-before-build check (``formats/gguf/check.py``), on files the
    ``gguf`` package wrote: metadata sizes the tensors do not hold, a truncated file, and an
    array of 2 million elements (``gguf.GGUFReader`` takes ~1.5 GB and 20 s to open it)."""
    gguf = pytest.importorskip("gguf")
    run = make_run(tmp_path / "run", kind="byte", **LLAMA)
    good = tmp_path / "good.gguf"
    code, _, err = run_cli(["export", str(run), str(good), "--format", "gguf", "--dtype", "q8_0"], capsys)
    assert code == 0, err
    cases = {
        "llama.context_length": (10**9, "llama.context_length must be in [1, 67108864], got 1000000000"),
        "llama.block_count": (4000, "block_count 4000, blocks in the file: 2"),
        "llama.embedding_length": (4096, "llama.rope.dimension_count 16 is not the head size 2048"),
    }
    for key, (value, message) in cases.items():
        crafted = shutil.copy(good, tmp_path / f"{key}.gguf")
        reader = gguf.GGUFReader(crafted, "r+")
        field = reader.fields[key]
        field.parts[field.data[0]][0] = value
        del reader
        code, _, err = run_cli(["verify", str(crafted)], capsys)
        assert_one_line_error(code, err, message)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-100])
    code, _, err = run_cli(["verify", str(truncated)], capsys)
    assert_one_line_error(code, err, "runs past the end of the file")
    writer = gguf.GGUFWriter(str(tmp_path / "arrays.gguf"), "llama")
    writer.add_array("crafted.tokens", ["x"] * 2_000_000)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    start = time.perf_counter()
    code, _, err = run_cli(["verify", str(tmp_path / "arrays.gguf")], capsys)
    assert_one_line_error(code, err, "has no")  # no vocabulary size: scanned, then refused
    assert time.perf_counter() - start < 5
