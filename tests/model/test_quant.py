"""Weight-only quantized inference (``lmcli.model.quant``): the products equal a float64 reference of the
dequantized weights, decoding through the CPU fast path calls them, and the commands take
``--quantize``.

Bounds, stated once: the CPU kernels multiply bfloat16 activations (8 significant bits), so a
quantized layer's output is within ~1% of the exact product by its quantized weights; on a tiny
model with clear greedy margins the int8 tokens equal the reference's exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import FAST_TRAIN_ARGS, assert_one_line_error, tiny_model, tiny_tokenizer
from helpers import dequantized_reference as reference
from helpers import run_cli as run

from lmcli.config.commands import SampleConfig
from lmcli.generate.sampling import generate
from lmcli.model import fastpath
from lmcli.model.kv_cache import KVCache
from lmcli.model.native import ops
from lmcli.model.quant import (
    BlockEmbedding,
    BlockLinear,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantLinear,
    quantize,
)

LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_head=4, n_kv_head=2, n_embd=64)
# on a CPU with lmcli's native kernels, int8/int4 are GGUF's q8_0/q4_0 blocks (BlockLinear); else
# torch's layouts (CI runs the suite both ways)
NATIVE = ops.available()
# |quantized - reference| over the reference's largest |logit|: bfloat16 activations (torch's
# kernels) or int8 ones per 32 values (the native kernels: 7 bits under each block's largest,
# about twice bfloat16's error; their exact products are tested in test_native*.py)
LOGIT_BOUND = 0.04 if NATIVE else 0.02
INT8, INT4 = (BlockLinear, BlockLinear) if NATIVE else (Int8Linear, Int4Linear)


def spread(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight drawn for unit-variance products, so logits spread and greedy margins are clear."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if p.dim() == 1 else noise / p.size(1) ** 0.5)
    return model


def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Tokens chosen by argmax over the full forward (no cache), and the logits of each choice."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            last = model(torch.tensor([ids]))[0, -1]
            logits.append(last)
            ids.append(int(last.argmax()))
    return ids[len(prompt) :], torch.stack(logits)


def test_int8_greedy_tokens_equal_a_float64_reference_of_the_int8_weights() -> None:
    tok = tiny_tokenizer()
    # a model whose greedy margins are clear for the weights as rounded (q8_0 blocks where native)
    model = quantize(spread(tiny_model(tok.vocab_size, **LLAMA), seed=1 if NATIVE else 0), "int8")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(
        type(m) is (INT8 if m.in_features % 32 == 0 else Int8Linear) for m in layers
    )  # q8_0: whole blocks
    if NATIVE:  # tied: the embedding looks its rows up in the head's q8_0 blocks
        assert isinstance(model.wte, BlockEmbedding) and model.wte.table is model.lm_head
        assert {m.fmt for m in model.modules() if isinstance(m, BlockLinear)} == {"q8_0"}
    else:
        assert isinstance(model.wte, Int8Embedding) and model.lm_head.qweight is model.wte.qweight  # tied
    prompt = [tok.bos_id, *tok.encode("the cat")]
    expected, ref_logits = greedy(reference(model), prompt, 16)
    margins = ref_logits.topk(2).values
    assert (margins[:, 0] - margins[:, 1]).min() > 0.05  # the comparison below is meaningful
    got = generate(model, tok, [prompt], SampleConfig(temperature=0, max_new_tokens=16, min_new_tokens=16))
    assert got[0].ids == expected
    _, logits = greedy(model, prompt, 16)
    bound = LOGIT_BOUND * ref_logits.abs().max()
    assert (logits.double() - ref_logits).abs().max() <= bound


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_logits_are_within_the_bound_of_the_dequantized_reference(group_size: int) -> None:
    tok = tiny_tokenizer()
    model = quantize(spread(tiny_model(tok.vocab_size, **{**LLAMA, "d_ff": 128})), "int4", group_size)
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert kinds["h.0.attn.c_attn"] is INT4 and kinds["h.0.mlp.c_proj"] is INT4
    assert type(model.lm_head) is INT8  # the vocabulary head stays int8
    if NATIVE:
        assert model.h[0].mlp.c_proj.fmt == "q4_0" and model.lm_head.fmt == "q8_0"
    idx = torch.randint(0, tok.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, ref = model(idx).double(), reference(model)(idx)
    assert (got - ref).abs().max() <= LOGIT_BOUND * ref.abs().max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_one_token_step_calls_the_quantized_products_and_equals_the_full_forward(
    mode: str, monkeypatch
) -> None:
    monkeypatch.setenv("LMCLI_NATIVE_LAYER", "0")  # the per-operation step (one call: test_native_layer)
    model = quantize(tiny_model(**{**LLAMA, "d_ff": 128}), mode, 32)
    calls = []
    for cls in (Int8Linear, Int4Linear, BlockLinear):
        product = cls.product
        monkeypatch.setattr(cls, "product", lambda self, x, f=product: calls.append(self) or f(self, x))
    idx = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), fastpath.inference(model):
        assert model.fast_step is not None
        assert not any(type(m).__name__ == "PackingLinear" for m in model.modules())  # nothing packed again
        full = model(idx)
        cache = KVCache.for_model(model, 2)
        model(idx[:, :11], cache)
        calls.clear()
        step = model(idx[:, 11:], cache)  # the fast step
    assert len(calls) == 5 * model.config.n_layer + 1  # q/k/v, out, gate, up, down per layer; the head
    torch.testing.assert_close(step[:, 0], full[:, -1], rtol=1e-4, atol=1e-4)


def test_quantizing_twice_or_an_unknown_group_size_is_refused() -> None:
    from lmcli.errors import LmcliError

    model = quantize(tiny_model(**LLAMA), "int8")
    with pytest.raises(LmcliError, match="quantized already"):
        quantize(model, "int8")
    with pytest.raises(LmcliError, match="group-size"):
        quantize(tiny_model(**LLAMA), "int4", 48)


@pytest.mark.slow
def test_eval_quantize_int8_perplexity_is_within_one_percent_of_float32(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    from helpers import TINY_TEXT

    corpus.write_text(TINY_TEXT)
    run_dir = tmp_path / "run"
    args = [
        "train",
        str(corpus),
        "--out",
        str(run_dir),
        *FAST_TRAIN_ARGS,
        "--n-embd",
        "32",
        "--max-steps",
        "30",
    ]
    assert run(args, capsys)[0] == 0
    scores = {}
    for mode in ("none", "int8"):
        code, out, err = run(["eval", str(run_dir), str(corpus), "--json", "--quantize", mode], capsys)
        assert code == 0, err
        scores[mode] = json.loads(out)["perplexity"]
    assert scores["none"] < 20  # trained: the tolerance below means something
    assert abs(scores["int8"] / scores["none"] - 1) < 0.01


def test_sample_json_records_carry_speeds_and_quantize_and_threads_flags_work(tiny_run: Path, capsys) -> None:
    argv = ["sample", str(tiny_run), "-p", "the", "--json", "--max-new-tokens", "6", "--min-new-tokens", "6"]
    for extra in ([], ["--quantize", "int8", "--threads", "1"], ["--quantize", "int4", "--group-size", "32"]):
        code, out, err = run([*argv, *extra], capsys)
        assert code == 0, err
        record = json.loads(out)
        assert record["prefill_tokens_per_s"] > 0 and record["decode_tokens_per_s"] > 0
        assert len(record["tokens"]) == 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sample", "RUN", "--threads", "2000"], "--threads 2000 is more than the"),
        (["sample", "RUN", "--quantize", "int2"], "invalid quantize 'int2'"),
        (["eval", "RUN", "--quantize", "int4", "--group-size", "48"], "group-size must be one of"),
        (["train", "--quantize", "int8"], "No such option: --quantize"),
    ],
)
def test_bad_threads_and_quantize_options_are_one_line_errors(
    tiny_run: Path, capsys, argv: list[str], message: str
) -> None:
    if "--threads" in argv:
        import os

        if (os.cpu_count() or 1) >= 2000:
            pytest.skip("this machine has 2000 CPUs")
    code, _, err = run([str(tiny_run) if a == "RUN" else a for a in argv], capsys)
    assert_one_line_error(code, err, message)
