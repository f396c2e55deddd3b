"""``lmcli eval MODEL TEXT --kl-divergence REFERENCE`` against a hand computation: per-token KL
of the reference's next-token distribution to the model's, its mean, median and percentiles
(linear between sorted values, as llama-perplexity's), top-1 agreement and the perplexity ratio;
the CLI's JSON; and its refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, run_cli, tiny_model, tiny_tokenizer, train_config

from lmcli.eval.divergence import divergence, text_ids
from lmcli.formats.checkpoint import save_checkpoint

TEXT = "a quick brown fox jumps over the lazy dog; then it naps in the sun. " * 4


def hand(model: torch.nn.Module, reference: torch.nn.Module, ids: list[int]) -> dict[str, float]:
    """The report's figures for one window holding all of ``ids`` (the first predicts nothing)."""
    x = torch.tensor([ids[:-1]])
    with torch.no_grad():
        p = model(x)[0].double().softmax(-1).numpy()  # (T, V)
        q = reference(x)[0].double().softmax(-1).numpy()
    kld = (q * (np.log(q) - np.log(p))).sum(-1)
    y = np.array(ids[1:])
    nll, nll_ref = -np.log(p[np.arange(len(y)), y]).sum(), -np.log(q[np.arange(len(y)), y]).sum()
    s = np.sort(kld)
    k = 0.99 * (len(s) - 1)
    p99 = s[int(k)] + (k - int(k)) * (s[int(k) + 1] - s[int(k)])
    n = len(y)
    return {
        "tokens": n,
        "kld_mean": kld.mean(),
        "kld_median": (s[n // 2] + s[n // 2 - 1]) / 2 if n % 2 == 0 else s[n // 2],
        "kld_p99": p99,
        "kld_max": s[-1],
        "top1_agreement": float((p.argmax(-1) == q.argmax(-1)).mean()),
        "perplexity": math.exp(nll / n),
        "reference_perplexity": math.exp(nll_ref / n),
        "perplexity_ratio": math.exp((nll - nll_ref) / n),
    }


def test_divergence_equals_a_hand_computation() -> None:
    tok = tiny_tokenizer(TEXT, "char")
    model, reference = (
        tiny_model(tok.vocab_size, seed=1, block_size=512),
        tiny_model(tok.vocab_size, seed=2, block_size=512),
    )
    ids = [i for chunk in text_ids(tok, [TEXT]) for i in chunk]
    context = len(ids) - 1  # one window: every token but the first scored once
    found = divergence(model, reference, [ids], context, context, batch_size=1).report()
    want = hand(model, reference, ids)
    for key, value in want.items():
        assert found[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key  # (float32 logits)
    # 64-token windows (the last one shorter) in batches of 3, padded, score as one by one
    windowed = divergence(model, reference, [ids], 64, 64, batch_size=3).report()
    assert windowed == pytest.approx(
        divergence(model, reference, [ids], 64, 64, batch_size=1).report(), rel=1e-5
    )
    assert windowed["tokens"] == found["tokens"] and windowed["kld_mean"] != found["kld_mean"]  # less context


def run(tmp: Path, seed: int, kind: str = "char") -> Path:
    tok = tiny_tokenizer(TEXT, kind)
    model = tiny_model(tok.vocab_size, seed=seed, block_size=64)
    save_checkpoint(tmp / f"run{seed}" / "last", model, train_config(), tok, meta={"step": 0})
    return tmp / f"run{seed}"


def test_cli_reports_json_and_refuses_bad_input(tmp_path: Path, capsys) -> None:
    a, b = run(tmp_path, 1), run(tmp_path, 2)
    (tmp_path / "t.txt").write_text(TEXT)
    code, out, _ = run_cli(
        ["eval", str(a), str(tmp_path / "t.txt"), "--kl-divergence", str(b), "--json"], capsys
    )
    report = json.loads(out)
    assert code == 0 and report["reference"] == str(b) and report["tokens"] == len(TEXT)
    assert 0 < report["kld_median"] <= report["kld_p99"] <= report["kld_max"]
    assert report["perplexity_ratio"] == pytest.approx(report["perplexity"] / report["reference_perplexity"])
    code, out, _ = run_cli(["eval", str(a), str(tmp_path / "t.txt"), "--kl-divergence", str(b)], capsys)
    assert code == 0 and "top-1 agreement" in out and "KL divergence  mean" in out
    other = run(tmp_path, 3, kind="byte")
    for argv, message in [
        ([str(tmp_path / "t.txt"), "--kl-divergence", str(other)], "has another tokenizer than the model"),
        (["--kl-divergence", str(b)], "--kl-divergence: give the text to compare the models on"),
        ([str(tmp_path / "t.txt"), "--kl-divergence", str(b), "--per-line"], "--kl-divergence compares"),
    ]:
        code, _, err = run_cli(["eval", str(a), *argv], capsys)
        assert_one_line_error(code, err, message)
