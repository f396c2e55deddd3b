"""bench/bench_quant_quality.py's scoring of lmcli's side: the decoding-step and whole-window NLL
against a plain cross entropy of the model's logits, and the table's ratios."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bench import bench_quant_quality as quality
from lmcli.config.model import ModelConfig
from lmcli.model.quant import quantize
from lmcli.model.transformer import Transformer


def tiny_llama() -> Transformer:
    cfg = ModelConfig(
        vocab_size=97, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, d_ff=128,
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def test_step_and_window_nll_are_the_cross_entropy_of_the_logits() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)[:, :-1].double()  # (3, 15, V): each token predicts the next
    expected = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()
    got = quality.lmcli_nll(model, ids.tolist())
    assert math.isclose(got["window"], expected, rel_tol=1e-6)
    assert math.isclose(got["step"], expected, rel_tol=1e-5)  # the KV-cache steps agree


def test_quantized_steps_score_close_to_the_float_model() -> None:
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2)).tolist()
    reference = quality.lmcli_nll(tiny_llama(), ids)["window"]
    got = quality.lmcli_nll(quantize(tiny_llama(), "int8"), ids)
    assert abs(got["step"] - reference) < 0.02 and abs(got["window"] - reference) < 0.02


def test_rows_pair_each_path_with_its_file_and_llama_cpp() -> None:
    products = "quantized products: native kernels, x; blocks q8_0"
    results = {
        "fp32": {"step": 2.0, "window": 2.0, "products": "float", "dequantized": None},
        "int8": {"step": 2.001, "window": 2.001, "products": products},
        "lmcli f32": {"step": 2.0, "window": 2.0, "products": "float", "dequantized": 2.0},
        "lmcli q8_0": {"step": 2.001, "window": 2.001, "products": products, "dequantized": 2.0},
        "llama.cpp Q4_K_M": {"step": 2.05, "window": 2.05, "products": "q4_K", "dequantized": 2.0},
    }
    llama = {name: {"nll": 2.0, "tokens": 10} for name in ("lmcli f32", "lmcli q8_0", "llama.cpp Q4_K_M")}
    rows = {r.name: r for r in quality.quality_rows(results, llama, math.exp(2.0))}
    assert rows["perplexity vs dequantized, int8"].peer_name == "lmcli q8_0 dequantized"
    assert rows["perplexity vs llama.cpp, int8"].valid  # e^0.001: 0.1% off
    assert not rows["perplexity vs llama.cpp, llama.cpp Q4_K_M"].valid  # e^0.05: 5% off
    assert not rows["perplexity vs dequantized, llama.cpp Q4_K_M"].meets_goal
    # int4 without the native kernels holds torch's int4, no file's blocks: no row for it
    results["int4"] = {"step": 2.0, "window": 2.0, "products": "quantized products: torch (int4 kernels)"}
    assert not any("int4" in r.name for r in quality.quality_rows(results, llama, math.exp(2.0)))
    table = quality.markdown(results, llama, {"text": "t", "steps": 1, "train_s": 1.0})
    assert "| int4 (torch kernels: no file) |" in table and "| llama.cpp Q4_K_M | 7.768 |" in table
