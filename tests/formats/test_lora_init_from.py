"""LoRA on a Hugging Face folder read by --init-from: a Llama-shaped model (SwiGLU, so the gate
projection is a target too), loaded back as base + adapters, and a changed base refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from families import hf_folder  # noqa: E402
from helpers import (  # noqa: E402
    TINY_TEXT,
    assert_float32_close,
    assert_one_line_error,
    run_cli,
)
from safetensors.torch import load_file, save_file  # noqa: E402

from lmcli.formats.checkpoint import ADAPTERS  # noqa: E402
from lmcli.formats.hf.load import load_hf_folder  # noqa: E402
from lmcli.formats.sources import load_checkpoint, load_model  # noqa: E402


def test_lora_on_a_hugging_face_folder_loads_as_base_plus_adapters(tmp_path: Path, capsys) -> None:
    folder = hf_folder(tmp_path, "llama-gqa-untied-llama3")
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    run = tmp_path / "lora"
    argv = [
        *("train", str(tmp_path / "c.txt"), "--init-from", str(folder), "-o", str(run)),
        *("--lora-rank", "2", "--lora-targets", "qkv,gate,mlp_out", "--lora-train-embeddings"),
        *("--cache-dir", str(tmp_path / "cache"), "--max-steps", "3", "--batch-size", "2", "-q"),
    ]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    reference = json.loads((run / "last" / "base.json").read_text())
    assert reference["path"] == str(folder.resolve()) and list(reference["sha256"]) == ["model.safetensors"]
    stored = load_file(str(run / "last" / ADAPTERS))
    # the untied head and the embedding trained too; every layer's gate has adapters
    assert {"wte.weight", "lm_head.weight", "h.1.mlp.c_gate.lora_b"} <= set(stored)
    adapted = load_checkpoint(run, merge=False).model
    idx = torch.randint(0, adapted.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted(idx)
        base = load_hf_folder(folder)[0](idx)
        merged = load_model(run).model(idx)
    assert (expected - base).abs().max() > 1e-4
    assert_float32_close(merged, expected, adapted.config)  # merged weights: other sums

    weights = load_file(str(folder / "model.safetensors"))  # the base folder is saved anew
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] = weights[name] * 1.01
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli(["sample", str(run), "--max-new-tokens", "2"], capsys)
    assert_one_line_error(code, err, f"the base model {folder.resolve()} changed since LoRA run")
