"""Gemma 3, Qwen3 and SmolLM3 folders beyond what every family runs (``test_families.py``): the
published (transformers 4) config.json dialect reads as the transformers 5 one, the decoders'
caches past the sliding window, beam size 1, the chat template, a multimodal folder's text tower."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

from families import WINDOW, hf_folder  # noqa: E402
from helpers import (  # noqa: E402
    assert_float32_close,
    run_cli,
)

from lmcli.config.commands import BeamConfig, SampleConfig  # noqa: E402
from lmcli.formats.hf.load import load_hf_folder  # noqa: E402
from lmcli.formats.sources import load_checkpoint  # noqa: E402
from lmcli.generate.beam import beam_search  # noqa: E402
from lmcli.generate.decoding import prefill  # noqa: E402
from lmcli.generate.sampling import generate  # noqa: E402
from lmcli.model.fastpath import inference  # noqa: E402
from lmcli.model.quant import quantize  # noqa: E402
from lmcli.text import chat_template  # noqa: E402

WINDOWED = ["gemma3-window-scaled", "qwen3-window-untied", "smollm3-nope-window"]


def hf_model(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def as_published(folder: Path, name: str) -> None:
    """Rewrite ``folder``'s config.json in the transformers 4 keys its family was published with."""
    path = folder / "config.json"
    data = json.loads(path.read_text())
    theta = data["rope_parameters"].get("rope_theta")
    del data["layer_types"], data["rope_parameters"]
    if name.startswith("gemma3"):  # layers 1, 2 local, 3 global; the global layers' scaling
        data.update(
            rope_theta=100000.0,
            rope_local_base_freq=100.0,
            sliding_window_pattern=3,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        )
    else:  # qwen3: the layers from max_window_layers on are local
        data.update(rope_theta=theta, rope_scaling=None)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("name", ["gemma3-window-scaled", "qwen3-window-untied"])
def test_the_published_config_dialect_reads_as_transformers_5_writes_it(tmp_path: Path, name: str) -> None:
    folder = hf_folder(tmp_path, name)
    now, _ = load_hf_folder(folder)
    theirs = hf_model(folder)
    as_published(folder, name)
    before, _ = load_hf_folder(folder)
    assert before.config == now.config
    assert before.config.sliding_window == WINDOW and before.config.layer_pattern in ("LLG", "GL")
    idx = torch.randint(0, now.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_float32_close(before(idx), theirs(idx).logits, before.config)
        assert_float32_close(before(idx), hf_model(folder)(idx).logits, before.config)  # as it reads them


@pytest.mark.parametrize("name", WINDOWED)
def test_decoding_past_the_window_keeps_the_window_and_the_logits(tmp_path: Path, name: str) -> None:
    model, tok = load_hf_folder(hf_folder(tmp_path, name))
    ids = torch.randint(0, tok.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), inference(model):
        full = model(ids)[0]
        cache, first = prefill(model, [ids[0, :6].tolist()], tok.pad_id, window_slack=0)
        steps = [first[0]] + [model(ids[:, t : t + 1], cache)[0, -1] for t in range(6, 47)]
    assert_float32_close(torch.stack(steps), full[5:47], model.config)
    cfg = model.config
    local = sum(cfg.is_local(i) for i in range(cfg.n_layer))
    assert cache.ring is not None and cache.ring.k.shape[0] == local and cache.ring.k.size(3) == WINDOW
    assert cache.k.size(0) == cfg.n_layer - local


@pytest.mark.parametrize("name", WINDOWED)
def test_beam_of_one_is_greedy_past_the_window(tmp_path: Path, name: str) -> None:
    model, tok = load_hf_folder(hf_folder(tmp_path, name))
    prompt = [tok.bos_id if tok.bos_id is not None else tok.eos_id, *tok.encode("the cat sat")]
    greedy = generate(model, tok, [prompt], SampleConfig(temperature=0, max_new_tokens=24))[0].ids
    beam = beam_search(
        model, [prompt], BeamConfig(beam_size=1, max_new_tokens=24), eos_id=tok.eos_id, pad_id=tok.pad_id
    )
    assert len(greedy) > 2 * WINDOW and beam[0][0].ids == greedy[: len(beam[0][0].ids)]


def test_gemma_chat_turns_are_transformers(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path, "gemma3-window-scaled")
    _, tok = load_hf_folder(folder)
    messages = [{"role": "user", "content": "the cat sat"}]
    ours = chat_template.encode(messages, tok.chat_template, tok)
    theirs = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours == list(theirs) and tok.token(ours[1]) == "<start_of_turn>"


def multimodal_folder(tmp: Path) -> Path:
    """A tiny Gemma3ForConditionalGeneration (the text tower of ``gemma3-window-scaled``, a
    one-layer SigLIP vision tower) saved by transformers, with the text folder's tokenizer."""
    text = hf_folder(tmp, "gemma3-window-scaled")
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig.from_pretrained(text),
        vision_config=vision,
        mm_tokens_per_image=4,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    folder = tmp / "gemma3-multimodal"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((text / name).read_text())
    return folder


def as_published_multimodal(folder: Path) -> None:
    """Rewrite a multimodal folder as the hub's were published: transformers 4's tensor names,
    a text_config naming only what differs from the defaults, in transformers 4's keys."""
    from safetensors.torch import load_file, save_file

    renames = (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("lm_head.", "language_model.lm_head."),
    )
    state = load_file(str(folder / "model.safetensors"))
    renamed = {}
    for key, value in state.items():
        new = next((b + key[len(a) :] for a, b in renames if key.startswith(a)), key)
        renamed[new] = value
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    data = json.loads((folder / "config.json").read_text())
    text = data["text_config"]
    for key in ("layer_types", "rope_parameters", "rms_norm_eps", "tie_word_embeddings"):
        text.pop(key, None)
    text.update(
        rope_theta=100000.0,
        rope_local_base_freq=100.0,
        sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    (folder / "config.json").write_text(json.dumps(data))


def test_a_multimodal_gemma_folder_is_read_as_its_text_tower(tmp_path: Path) -> None:
    folder = multimodal_folder(tmp_path)
    ours, tok = load_hf_folder(folder)
    text, _ = load_hf_folder(tmp_path / "gemma3-window-scaled")
    assert ours.config == text.config
    idx = torch.randint(0, tok.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder).eval()(idx).logits
        assert_float32_close(ours(idx), theirs, ours.config)
        as_published_multimodal(folder)
        again, _ = load_hf_folder(folder)
        assert again.config == ours.config
        assert_float32_close(again(idx), theirs, ours.config)


@pytest.mark.parametrize("name", WINDOWED)
def test_quantize_sft_full_and_lora_and_a_draft_on_each_family(tmp_path: Path, name: str, capsys) -> None:
    """What a user does with a model, in one line each, past the window: ``--quantize int8/int4``
    (the quantized model decodes through the window's ring as its full forward computes, up to
    the int8 kernels' activation rounding; the quantization error itself is test_quant's), SFT
    from the folder (full and LoRA, with the folder's chat template), and the model drafting for
    itself (greedy text as without a draft)."""
    folder = hf_folder(tmp_path, name)
    _, tok = load_hf_folder(folder)
    ids = torch.randint(0, tok.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    for mode in ("int8", "int4"):
        model = quantize(load_hf_folder(folder)[0], mode, 32)
        with torch.no_grad(), inference(model):
            full = model(ids)[0]
            cache, first = prefill(model, [ids[0, :6].tolist()], tok.pad_id, window_slack=0)
            steps = [first[0]] + [model(ids[:, t : t + 1], cache)[0, -1] for t in range(6, 39)]
        assert cache.ring is not None
        # float32 rounding, but for the native kernels' int8 activations (32 values a scale): a
        # value that the two routes round to either side of a step moves a logit by up to ~1%
        # (a window computed wrong moves them by 100%)
        assert (torch.stack(steps) - full[5:39]).abs().max() <= 0.02 * full.abs().max(), mode
    sample = [
        "sample",
        str(folder),
        "-p",
        "the cat",
        "--temperature",
        "0",
        "--max-new-tokens",
        "20",
        "--json",
    ]
    code, out, err = run_cli(sample, capsys)
    assert code == 0, err
    plain = json.loads(out)["tokens"]
    for mode in ("int8", "int4"):
        code, out, err = run_cli([*sample, "--quantize", mode], capsys)
        assert code == 0 and json.loads(out)["tokens"], err
    code, out, err = run_cli([*sample, "--draft", str(folder), "--draft-tokens", "3"], capsys)
    assert code == 0, err
    assert json.loads(out)["tokens"] == plain and len(plain) > WINDOW
    rows = [{"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat."}]}]
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 12))
    for extra in ([], ["--lora-rank", "2"]):
        run = tmp_path / f"sft{len(extra)}"
        argv = ["train", "--task", "sft", str(tmp_path / "chats.jsonl"), "--init-from", str(folder)]
        argv += ["-o", str(run), "--max-steps", "2", "--batch-size", "2", "--eval-interval", "2"]
        code, _, err = run_cli([*argv, "--cache-dir", str(tmp_path / "c"), *extra, "-q"], capsys)
        assert code == 0, err
        tuned = load_checkpoint(run)  # LoRA: merged into the base
        assert tuned.model_config == load_hf_folder(folder)[0].config
        assert tuned.tokenizer.chat_template == tok.chat_template
