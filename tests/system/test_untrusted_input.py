"""A run folder is untrusted input when read: people share them.

A crafted ``config.json`` (huge sizes, with its checksum in ``meta.json`` recomputed or with no
``meta.json`` at all) must be refused in one line before anything of its size is allocated; paths
stored in a run's config never choose where lmcli writes; ``lmcli verify`` checks a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    FAST_TRAIN_ARGS,
    TINY_TEXT,
    MiB,
    assert_one_line_error,
    craft,
    make_run,
    run_cli,
    run_measured,
    tiny_model,
)

from lmcli.formats.sources import load_checkpoint


@pytest.mark.slow
def test_crafted_configs_are_refused_before_any_allocation(tmp_path: Path) -> None:
    """Today: `eval` grows to tens of GB, `sample` builds 20,000 layers, a huge block size asks
    for terabytes. Each must be one line, exit 2, in well under a second, and a peak RSS far
    below the weights' size; a genuine load's peak stays near one copy of the weights."""
    big = make_run(tmp_path / "big", n_layer=4, n_embd=256, n_head=4)  # 3.2M parameters
    weights_bytes = (big / "last" / "model.safetensors").stat().st_size
    base = make_run(tmp_path / "base")
    bases = {p: make_run(tmp_path / p, position=p) for p in ("sinusoidal", "rope", "alibi")}
    cases = {  # name: (run to start from, config changes, recompute the checksum)
        "wide and deep, checksum recomputed": (base, {"n_layer": 2000, "n_embd": 2048}, True),
        "20,000 layers, no meta.json": (base, {"n_layer": 20000}, False),
        "huge context and width": (bases["sinusoidal"], {"block_size": 10**8, "n_embd": 32768}, True),
        "sinusoidal table of a huge context": (bases["sinusoidal"], {"block_size": 10**8}, True),
        "rotary tables of a huge context": (bases["rope"], {"block_size": 10**9}, True),
        "ALiBi bias of a huge context": (bases["alibi"], {"block_size": 10**9}, True),
    }
    runs = []
    for i, (start, model, meta) in enumerate(cases.values()):
        run = craft(shutil.copytree(start, tmp_path / f"evil{i}"), model, meta=meta)
        runs.append(run / "last")
    # the first three import what loading and the CLI need (an ALiBi model's check computes its
    # full-context bias on the meta device: torch's Python meta kernels, imported once)
    commands = [["load", str(base)], ["verify", str(base)], ["load", str(bases["alibi"])], ["load", str(big)]]
    commands += [
        ["eval", str(r)] if i % 2 else ["sample", str(r), "--max-new-tokens", "1"] for i, r in enumerate(runs)
    ]
    _, _, _, genuine, *crafted = run_measured(commands)
    print(json.dumps({"weights_bytes": weights_bytes, "genuine": genuine, "crafted": crafted}, indent=1))

    assert genuine["code"] == 0, genuine["err"]
    # one copy of the weights (today: a random model, then the loaded tensors beside it)
    assert genuine["peak"] < weights_bytes + 6 * MiB, (genuine["peak"], weights_bytes)
    for name, result in zip(cases, crafted, strict=True):
        lines = [ln for ln in result["err"].splitlines() if ln.strip()]
        assert result["code"] == 2 and len(lines) == 1, (name, result)
        assert lines[0].startswith("error: weights ") and "Traceback" not in result["err"], (name, result)
        assert result["seconds"] < 2.0, (name, result["seconds"])  # well under 1 s when idle
        assert result["peak"] < 16 * MiB, (name, result["peak"])


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rope", "alibi"])
@pytest.mark.parametrize("tie", [True, False])
def test_a_loaded_model_computes_what_was_saved(tmp_path: Path, position: str, tie: bool) -> None:
    """Built on the meta device and materialized from the weights: position tables computed
    again, the head still tied to the embedding, nothing left on the meta device."""
    run = make_run(tmp_path / "run", position=position, tie_embeddings=tie)
    torch.manual_seed(0)
    original = tiny_model(None, 0, block_size=32, position=position, tie_embeddings=tie)
    model = load_checkpoint(run).model
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert (model.lm_head.weight is model.wte.weight) == tie
    assert len(list(model.parameters())) == len(list(original.parameters()))
    idx = torch.randint(0, original.config.vocab_size, (2, 32))
    with torch.no_grad():
        assert torch.equal(model(idx), original(idx))


def test_resume_never_writes_to_a_stored_cache_dir(tmp_path: Path, capsys, monkeypatch) -> None:
    """A crafted `cache_dir` (and `out`) in a shared run's config: resume writes the token
    files into this machine's cache, nothing into the stored folders."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    code, _, err = run_cli(["train", "c.txt", *FAST_TRAIN_ARGS, "--max-steps", "2", "--out", "run"], capsys)
    assert code == 0, err
    elsewhere, other_out = tmp_path / "victim-cache", tmp_path / "victim-out"
    craft(tmp_path / "run", train={"cache_dir": str(elsewhere), "out": str(other_out)})
    code, _, err = run_cli(["train", "--resume", "run", "--max-steps", "4"], capsys)
    assert code == 0, err
    assert not elsewhere.exists() and not other_out.exists()
    assert any(Path(os.environ["LMCLI_CACHE"]).glob("tokens-*/shard-*.bin"))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["cache_dir"] is None


def test_a_linked_checkpoint_file_is_refused(tmp_path: Path, capsys) -> None:
    """A tokenizer.json that is a link (its target's checksum recorded) is not followed."""
    run = make_run(tmp_path / "run")
    outside = tmp_path / "outside.json"
    shutil.move(run / "last" / "tokenizer.json", outside)
    (run / "last" / "tokenizer.json").symlink_to(outside)
    code, _, err = run_cli(["sample", str(run / "last"), "--max-new-tokens", "1"], capsys)
    assert_one_line_error(code, err, "is a symbolic link")


def test_verify_prints_one_line_per_checkpoint(tiny_run: Path, capsys) -> None:
    code, out, err = run_cli(["verify", str(tiny_run)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and all(ln.startswith("ok  ") and "checksums match" in ln for ln in lines)
    assert "best" in lines[0] and "last" in lines[1]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda run: craft(run, {"n_layer": 3}), "do not fit the model config"),
        (lambda run: craft(run, {"n_embd": 64}, meta=False), "no checkpoint with meta.json"),
        (lambda run: (run / "best" / "tokenizer.json").unlink(), "missing tokenizer.json"),
        (lambda run: (run / "last" / "x").symlink_to("/etc/passwd"), "is a symbolic link"),
        (lambda run: (run / "best" / "model.safetensors").write_bytes(b"\0" * 64), "checksum mismatch"),
        (lambda run: (run / "best" / "config.json").write_text("[1]"), "corrupt (checksum mismatch)"),
    ],
)
def test_verify_names_the_first_problem(tiny_run: Path, capsys, damage, message: str) -> None:
    damage(tiny_run)
    code, _, err = run_cli(["verify", str(tiny_run)], capsys)
    assert_one_line_error(code, err, message)


@pytest.mark.parametrize(
    "padded, model, message",
    [
        (False, {"vocab_multiple": -64}, "vocab-multiple must be in [0, 1024], got -64"),
        (False, {"vocab_multiple": 10**12}, "vocab-multiple must be in [0, 1024], got 1000000000000"),
        (False, {"vocab_multiple": "lots"}, "invalid vocab-multiple 'lots'"),
        (False, {"vocab_multiple": 64}, "(vocabulary 25 padded to 64 rows (vocab-multiple 64) x n-embd 32, "),
        (
            True,
            {"vocab_multiple": 1},
            "(vocabulary 25 x n-embd 32, the weights hold wte.weight of shape (64, 32))",
        ),
    ],
    ids=["negative", "absurd", "text", "claims-padding", "hides-padding"],
)
def test_a_shared_config_with_a_bad_vocab_multiple_is_one_line(
    tmp_path: Path, capsys, padded: bool, model: dict, message: str
) -> None:
    """A shared run folder whose vocab-multiple is out of range, or disagrees with the rows its
    weights hold (checksum recomputed): every command that reads it says so in one line."""
    run = craft(make_run(tmp_path / "run", **({"vocab_multiple": 64} if padded else {})), model)
    (tmp_path / "corpus.txt").write_text(TINY_TEXT)
    commands = [
        ["sample", str(run), "--max-new-tokens", "1"],
        ["eval", str(run), str(tmp_path / "corpus.txt")],
        ["verify", str(run)],
        ["export", str(run), str(tmp_path / "hf")],
        ["train", "--resume", str(run), "--max-steps", "1", "-q"],
    ]
    for argv in commands:
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, message)
    assert not (tmp_path / "hf").exists()


def test_verify_catches_a_crafted_trainer_state(tmp_path: Path, capsys) -> None:
    """A pickle that would run code, with its checksum recomputed: refused, never executed."""
    import pickle

    run = make_run(tmp_path / "run")
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    state = run / "last" / "trainer_state.pt"
    state.write_bytes(pickle.dumps(Evil()))
    meta = json.loads((run / "last" / "meta.json").read_text())
    meta["sha256"]["trainer_state.pt"] = hashlib.sha256(state.read_bytes()).hexdigest()
    (run / "last" / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_cli(["verify", str(run)], capsys)
    assert_one_line_error(code, err, "cannot read trainer state")
    assert not marker.exists()
