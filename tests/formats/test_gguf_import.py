"""GGUF in: files written by the ``gguf`` package itself (``gguf_files.py``, nothing of lmcli's
exporter), every tensor type lmcli reads, the three architectures; the tokenizer rebuilt from the
metadata; a Hugging Face folder through GGUF and back; every command on a GGUF file; bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from families import VARIANTS, hf_folder  # noqa: E402
from gguf_files import KINDS, TEXTS, field, reference_logits, source_tokenizer, write_gguf_model  # noqa: E402
from helpers import TINY_TEXT, assert_one_line_error, make_run, run_cli  # noqa: E402

from lmcli.formats.export import presets  # noqa: E402
from lmcli.formats.gguf.load import read_gguf_header  # noqa: E402
from lmcli.formats.gguf.vocab import gguf_vocab  # noqa: E402
from lmcli.formats.sources import load_model  # noqa: E402
from lmcli.text.tokenizer import Tokenizer  # noqa: E402

ARCHS = ("llama", "qwen2", "gpt2")
TEXT = "the cat sat on the mat. 12 birds sang, didn't they?\n"


def logits(ckpt, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.model(torch.tensor([ids]))[0].double()


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_a_float_reference_of_the_dequantized_tensors(
    tmp_path: Path, arch: str, kind: str
) -> None:
    path = write_gguf_model(tmp_path / "m.gguf", arch, kind, tied=KINDS.index(kind) % 2 == 1)
    ckpt = load_model(path, dtype=torch.float32)
    assert ckpt.model_config.tie_embeddings == (KINDS.index(kind) % 2 == 1)
    ids = ckpt.tokenizer.with_bos(ckpt.tokenizer.encode(TEXT))
    ref = reference_logits(path, ids)  # gguf's own dequantization, a float64 forward of the file
    ours = logits(ckpt, ids)
    assert ref.abs().max() > 3  # logits that tell a wrong layout from a right one
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_weights_as_stored_memory_mapped_where_the_type_allows(tmp_path: Path) -> None:
    header = read_gguf_header(write_gguf_model(tmp_path / "m.gguf", "llama", "F32"))
    t = header.tensors["blk.0.ffn_up.weight"]
    assert t.dequantized().untyped_storage().data_ptr() == t.data.ctypes.data  # a view of the file
    for kind, dtype in {"F16": torch.float16, "BF16": torch.bfloat16, "Q4_K": torch.float32}.items():
        path = write_gguf_model(tmp_path / f"{kind}.gguf", "llama", kind)
        assert load_model(path).model.h[0].mlp.c_fc.weight.dtype == dtype  # as stored; dequantized: f32
    q8 = read_gguf_header(write_gguf_model(tmp_path / "q8.gguf", "llama", "Q8_0")).tensors
    assert q8["blk.0.ffn_up.weight"].quantized and q8["blk.0.ffn_up.weight"].rows().shape == (512, 8 * 34)


def test_a_learned_position_table_in_blocks_runs_as_stored(tmp_path: Path, capsys, monkeypatch) -> None:
    """A GPT-2-shaped q8_0 file whose position table is in blocks too (lmcli's exports before it
    followed llama-quantize, which keeps the table as it is, wrote such files): run as stored it
    stays a table, looked up (it became a linear layer: "missing positions.wpe.weight", then a
    shape error), and the logits are those of the dequantized file's."""
    make_run(tmp_path / "run", kind="byte", n_layer=2)
    gguf = tmp_path / "m.gguf"
    monkeypatch.setattr(
        presets, "quantizable", lambda name, shape: len(shape) >= 2 and name.endswith("weight")
    )
    code, _, err = run_cli(
        ["export", str(tmp_path / "run"), "--format", "gguf", "--dtype", "q8_0", "-o", str(gguf)], capsys
    )
    assert code == 0, err
    assert read_gguf_header(gguf).tensors["position_embd.weight"].quantized
    stored, plain = load_model(gguf, as_stored=True), load_model(gguf, dtype=torch.float32)
    ids = plain.tokenizer.with_bos(plain.tokenizer.encode(TEXT))[:32]
    ours, ref = logits(stored, ids), logits(plain, ids)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0.02 * ref.abs().max().item())  # q8 activations


# ----------------------------------------------------------------------------- the tokenizer


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_the_tokenizer_rebuilt_from_metadata_encodes_as_its_source(tmp_path: Path, pre: str) -> None:
    source = source_tokenizer(pre)
    path = write_gguf_model(tmp_path / "m.gguf", "llama", "F32", tok=source, pre=pre, add_bos=None)
    tok = read_gguf_header(path).tokenizer
    source.encode_special_tokens = True  # lmcli reads special-token text in a prompt as text
    for text in TEXTS:
        assert tok.encode(text) == source.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == source.token_to_id("<|im_end|>") and tok.bos_id == source.token_to_id(
        "<|endoftext|>"
    )
    assert tok.add_bos == (pre == "llama-bpe")  # llama.cpp's default when the file does not say
    assert "<|im_start|>" in tok.chat_template
    # and out again: the source's pre-tokenizer by its GGUF name, the rebuilt one's too
    named = Tokenizer(source, {"eos": "<|im_end|>"})
    assert gguf_vocab(named, source.get_vocab_size(), gguf.TokenType).pre == pre
    again = gguf_vocab(tok, source.get_vocab_size() + 4, gguf.TokenType)
    assert (again.pre, again.add_bos, again.merges) == (
        pre,
        pre == "llama-bpe",
        field(gguf.GGUFReader(path), "tokenizer.ggml.merges"),
    )


@pytest.mark.parametrize("add_bos", [True, False])
def test_add_bos_token_is_followed_by_every_prompt(tmp_path: Path, add_bos: bool, capsys) -> None:
    path = write_gguf_model(tmp_path / "m.gguf", "llama", "Q8_0", add_bos=add_bos, pre="llama-bpe")
    tok = read_gguf_header(path).tokenizer
    assert tok.add_bos is add_bos
    code, out, err = run_cli(
        ["sample", str(path), "-p", "the cat", "--max-new-tokens", "2", "--json", "--temperature", "0"],
        capsys,
    )
    assert code == 0, err
    record = json.loads(out)
    ckpt = load_model(path)
    prompt = ckpt.tokenizer.with_bos(ckpt.tokenizer.encode("the cat"))
    assert (prompt[0] == tok.bos_id) is add_bos
    with torch.no_grad():  # the first token is the greedy choice after exactly that prompt
        assert record["tokens"][0] == int(ckpt.model(torch.tensor([prompt]))[0, -1].argmax())


# ----------------------------------------------------------------------------- HF folder -> GGUF -> lmcli

ROUND_TRIP = ["gpt2", "llama-tied", "mistral-gqa-window", "qwen2-plain"]


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_hf_folder_to_gguf_and_back(tmp_path: Path, name: str, capsys, monkeypatch) -> None:
    cls, fields, specials, roles, extra = VARIANTS["qwen2-gqa-bias-yarn"]
    fields = {k: v for k, v in fields.items() if k != "rope_scaling"}
    monkeypatch.setitem(VARIANTS, "qwen2-plain", (cls, fields, specials, roles, extra))
    folder = hf_folder(tmp_path, name)
    code, out, err = run_cli(
        ["export", str(folder), str(tmp_path / "m.gguf"), "--format", "gguf", "--dtype", "f32"], capsys
    )
    assert code == 0, err
    path = tmp_path / "m.gguf"
    reader = gguf.GGUFReader(path)
    src = load_model(folder)
    assert field(reader, "general.name") == name  # the source folder's, no intermediate's
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert field(reader, "tokenizer.ggml.add_bos_token") is src.tokenizer.add_bos is False  # as the source
    back = load_model(path)
    ids = src.tokenizer.encode(TEXT)
    assert back.tokenizer.encode(TEXT) == ids and back.tokenizer.add_bos is False
    assert (back.tokenizer.bos_id, back.tokenizer.eos_id) == (src.tokenizer.bos_id, src.tokenizer.eos_id)
    assert back.tokenizer.chat_template == src.tokenizer.chat_template
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        hf = theirs(torch.tensor([ids])).logits[0].double()
    torch.testing.assert_close(logits(back, ids), logits(src, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference_logits(path, ids), hf, rtol=1e-4, atol=1e-4)  # from GGUF's side
    code, out, err = run_cli(["verify", str(folder)], capsys)
    assert code == 0 and out.startswith(f"ok  {folder}: Hugging Face"), err
    code, out, _ = run_cli(["verify", str(path)], capsys)
    arch = "gpt2" if name == "gpt2" else "llama"  # lmcli writes rotary models as llama.cpp's llama
    assert code == 0 and out.startswith(f"ok  {path}: GGUF {arch} file (F32)")


# ----------------------------------------------------------------------------- every command


def test_every_command_reads_a_gguf_file(tmp_path: Path, capsys, monkeypatch, request) -> None:
    # torch's products on the dequantized file, to compare exactly with the exported folder (the
    # native kernels' own run of GGUF files: tests/model/test_native_gguf.py)
    from lmcli.model.native import ops

    monkeypatch.setenv("LMCLI_NATIVE", "0")
    ops._load.cache_clear()
    request.addfinalizer(ops._load.cache_clear)  # the next test loads the kernels again
    path = write_gguf_model(tmp_path / "m.gguf", "qwen2", "Q8_0", tied=True)
    (tmp_path / "t.txt").write_text(TEXT * 4)
    # export to Hugging Face: transformers computes the file's logits
    code, _, err = run_cli(["export", str(path), str(tmp_path / "hf"), "--format", "hf"], capsys)
    assert code == 0, err
    ids = load_model(path).tokenizer.encode(TEXT)
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(hf.double(), reference_logits(path, ids), rtol=1e-4, atol=1e-3)
    # sample, eval and beam give what they give on the exported folder
    for argv in (
        ["sample", "-p", "the cat", "--temperature", "0", "--max-new-tokens", "6", "--json"],
        ["eval", str(tmp_path / "t.txt"), "--json", "--context", "32"],
        ["beam", "-p", "the cat", "--beam-size", "2", "--max-new-tokens", "4", "--json"],
    ):
        outs = []
        for source in (path, tmp_path / "hf"):
            code, out, err = run_cli([argv[0], str(source), *argv[1:]], capsys)
            assert code == 0, err
            outs.append(out)
        if argv[0] == "eval":
            a, b = (json.loads(o.splitlines()[-1]) for o in outs)
            assert a["tokens"] == b["tokens"] and a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-5)
        else:
            a, b = (json.loads(o.splitlines()[0]) for o in outs)
            if argv[0] == "beam":
                a, b = ({"tokens": [h["tokens"] for h in r["hypotheses"]]} for r in (a, b))
            assert a["tokens"] == b["tokens"] and a["tokens"]
    # chat renders the file's own chat template
    from lmcli.config.commands import SampleConfig
    from lmcli.generate.chat import ChatSession

    session = ChatSession.from_checkpoint(load_model(path), SampleConfig(max_new_tokens=3))
    session.load([{"role": "user", "content": "hi"}])
    assert session.tokenizer.decode(session.prompt_ids(), skip_special_tokens=False).startswith(
        "<|im_start|>user\nhi"
    )
    code, out, err = run_cli(
        ["chat", str(path), "--json", "--max-new-tokens", "3"],
        capsys,
        '{"messages": [{"role": "user", "content": "hi"}]}',
        monkeypatch,
    )
    assert code == 0, err
    reply = json.loads(out)
    assert reply["usage"] == {"prompt_tokens": len(session.prompt_ids()), "completion_tokens": 3}
    # train from it, with a shorter context than the file's 64 tokens: applied and stored
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    argv = [
        *("train", str(tmp_path / "c.txt"), "--init-from", str(path), "-o", str(tmp_path / "ft")),
        *("--block-size", "16", "--max-steps", "2", "--batch-size", "2", "-q"),
        *("--cache-dir", str(tmp_path / "cache"), "--eval-interval", "2", "--eval-batches", "1"),
    ]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    stored = json.loads((tmp_path / "ft" / "last" / "config.json").read_text())["model"]
    assert stored["block_size"] == 16 and stored["qkv_bias"] and stored["tie_embeddings"]


# ----------------------------------------------------------------------------- bad files


def truncated(tmp: Path, keep: float) -> Path:
    path = write_gguf_model(tmp / "whole.gguf", "llama", "Q4_0")
    data = path.read_bytes()
    out = tmp / f"cut-{keep}.gguf"
    out.write_bytes(data[: int(len(data) * keep)])
    return out


def moved(tmp: Path, index: int, to: int, plus: int) -> Path:
    """A file whose tensor number ``index`` has its data at tensor ``to``'s offset plus ``plus``
    bytes (a crafted tensor table)."""
    path = write_gguf_model(tmp / "moved.gguf", "llama", "Q4_0")
    reader = gguf.GGUFReader(path, "r+")
    offsets = [t.field.parts[-1] for t in reader.tensors]  # views of the file's map: written through
    offsets[index][0] = offsets[to][0] + plus
    del reader, offsets
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda t: write_gguf_model(t / "m.gguf", "mamba", "F32"), "unsupported GGUF architecture 'mamba'"),
        (lambda t: write_gguf_model(t / "m.gguf", "llama", "Q1_0"), "is Q1_0, a type lmcli does not read"),
        (lambda t: truncated(t, 0.9), "truncated or damaged"),
        (lambda t: truncated(t, 0.01), "truncated or damaged"),
        (
            lambda t: write_gguf_model(t / "m.gguf", "llama", "F32", tokenizer_model="bert"),
            "unsupported GGUF tokenizer model 'bert'",
        ),
        (
            lambda t: write_gguf_model(t / "m.gguf", "llama", "F32", pre="tekken"),
            "unsupported GGUF pre-tokenizer",
        ),
        (lambda t: moved(t, 1, 1, 16), "not a multiple of general.alignment (32)"),
        (lambda t: moved(t, 1, 0, 0), "the data of tensors token_embd.weight and output_norm.weight overlap"),
    ],
    ids=[
        "architecture",
        "tensor-type",
        "truncated-data",
        "truncated-header",
        "tokenizer-model",
        "pre-tokenizer",
        "misaligned",
        "overlapping",
    ],
)
def test_a_bad_gguf_file_is_one_line(tmp_path: Path, capsys, make, message: str) -> None:
    path = make(tmp_path)
    for command in (["sample", str(path), "--max-new-tokens", "1"], ["verify", str(path)]):
        code, _, err = run_cli(command, capsys)
        assert_one_line_error(code, err, message)


def test_verify_notes_a_vocab_size_the_embedding_does_not_have(tmp_path: Path, capsys) -> None:
    """llama.cpp sizes the vocabulary by its tokens (the embedding must have as many rows) and
    reads ``llama.vocab_size`` only without a tokenizer: lmcli reads the rows; verify says so."""
    path = write_gguf_model(tmp_path / "m.gguf", "llama", "Q8_0", extra=lambda w: w.add_vocab_size(100_000))
    rows = gguf.GGUFReader(path).get_tensor(0).shape[-1]
    code, out, err = run_cli(["verify", str(path)], capsys)
    assert code == 0, err
    assert f"note: llama.vocab_size says 100000 tokens, token_embd.weight has {rows:,} rows: the rows" in out
    assert load_model(path).model.config.vocab_size == rows


def test_a_pre_tokenizer_gguf_cannot_name_is_refused_on_export(tmp_path: Path, capsys) -> None:
    from tokenizers import pre_tokenizers

    folder = hf_folder(tmp_path, "llama-tied")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = json.loads(pre_tokenizers.Whitespace().__getstate__())
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    capsys.readouterr()  # transformers' progress bar
    code, _, err = run_cli(["export", str(folder), str(tmp_path / "x.gguf"), "--format", "gguf"], capsys)
    assert_one_line_error(
        code, err, "GGUF export supports byte-level BPE tokenizers with the pre-tokenizer of"
    )
    assert not (tmp_path / "x.gguf").exists()


def test_serve_reads_a_gguf_file_with_its_chat_template_and_bos_rule(tmp_path: Path) -> None:
    """Completions follow the file's add_bos_token (false here), chat completions its template:
    each equals lmcli sample's greedy tokens on the same prompt ids."""
    import httpx2 as httpx

    from lmcli.config.commands import SampleConfig, ServeConfig
    from lmcli.generate.sampling import generate
    from lmcli.serve.server import running

    path = write_gguf_model(tmp_path / "m.gguf", "qwen2", "Q8_0", add_bos=False)
    ckpt = load_model(path)
    tok = ckpt.tokenizer
    greedy = SampleConfig(temperature=0, max_new_tokens=4)
    from lmcli.text.chat_template import encode, template_of

    chat_ids = encode([{"role": "user", "content": "hi"}], template_of(ckpt), tok)
    assert tok.decode(chat_ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"
    with running(ckpt, ServeConfig(port=0, grace=1)) as (url, _):
        body = {"prompt": "the cat", "max_tokens": 4, "temperature": 0, "logprobs": 0}
        done = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        expected = generate(ckpt.model, tok, [tok.encode("the cat")], greedy)[0]  # no <bos> first
        assert done["choices"][0]["text"] == expected.text
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        done = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        assert (
            done["choices"][0]["message"]["content"] == generate(ckpt.model, tok, [chat_ids], greedy)[0].text
        )
        assert done["usage"]["prompt_tokens"] == len(chat_ids)
